"""A journal's ``fdatasync`` run by the kernel, its completion signalled on an eventfd.

Theory of operation
-------------------
The shard worker's group commit hands each group's ``fdatasync`` to a sync
thread, so that the loop goes on reading during the sync. That thread is a
Python thread: per group it is woken, takes the GIL after the wake, after
``fdatasync`` and after telling the loop through a pipe, each a chance of a
forced switch of the busy loop (~5 voluntary context switches and 30-60 µs of
the process's CPU per group on the project's VM). Linux AIO can do the same
without a thread of ours: ``io_submit`` of an ``IOCB_CMD_FDSYNC`` makes the
kernel run ``vfs_fsync(file, datasync=1)`` (what ``fdatasync`` runs) on a
worker of its own, and ``IOCB_FLAG_RESFD`` makes the completion bump an
eventfd the loop's epoll watches; the loop then reaps the result with
``io_getevents`` (0, or minus the errno ``fdatasync`` would have raised).
Measured against the thread hand-off in one process with 0.3 ms of Python per
cycle (32 KiB groups): ~1 voluntary switch and 7-12 µs of the process's CPU
per group against ~5 and 30-58 µs, the kernel's worker 15-25 µs. Linux
queues the request on the *submitting CPU's* workqueue, so its kworker is
woken on the loop's core and usually preempts the loop on its way out of
``io_submit``: a profile of a busy loop shows that wait inside :meth:`submit`
(15% of its samples), not the ``ctypes`` call (~0.5 µs of conversion; see
docs/performance-log.md, "The AIO sync's submit").

The same context submits the journal's direct writes (``journalDirectWrites``:
``IOCB_CMD_PWRITEV`` with ``RWF_DSYNC``, see ``bk.bookie.journal``), whose
result is the bytes written. The durability rule does not change: a group is
answered only once its completion is reaped with a result of 0 (a write: all
its bytes). A wait for a completion can be bounded (``reap``'s ``timeout``,
``close``'s): a close never hangs on a request the kernel does not complete;
it then leaves the context in place, as the kernel may still read the
request's memory. At most one request is in flight (the
worker's rule), so one ``iocb`` and one event buffer are reused. The syscalls
go through ``ctypes`` (no stdlib binding exists); only the architectures
whose syscall numbers are listed here use it, and :func:`open_context`
returns None wherever AIO is missing or refused (the worker keeps its sync
thread then); a refused ``io_submit`` (EINVAL: a filesystem without AIO
fsync) makes the worker drop AIO for good. ``journalSyncThroughAio=false``
keeps the thread always.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

# io_setup, io_destroy, io_getevents, io_submit
_NR = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
IOCB_CMD_FDSYNC = 3
IOCB_CMD_PWRITEV = 8
IOCB_FLAG_RESFD = 1
RWF_DSYNC = 2


class _Iocb(ctypes.Structure):       # struct iocb, 64 bytes, little-endian layout
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32),
                ("rw_flags", ctypes.c_int32), ("opcode", ctypes.c_uint16),
                ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64),
                ("offset", ctypes.c_int64), ("reserved2", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Event(ctypes.Structure):      # struct io_event
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64),
                ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


class AioSync:
    """One in-flight ``fdatasync`` (or direct write) at a time through Linux AIO; :attr:`fd` is the
    eventfd to watch (readable once the request completed). One thread only."""

    def __init__(self, nr: tuple, libc):
        self._setup, self._destroy, self._getevents, self._submit_nr = nr
        self._syscall = libc.syscall
        self._ctx = ctypes.c_ulong(0)
        if self._syscall(self._setup, 1, ctypes.byref(self._ctx)) != 0:
            raise OSError(ctypes.get_errno(), "io_setup failed")
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._cb = _Iocb()
        self._cb.opcode = IOCB_CMD_FDSYNC
        self._cb.flags = IOCB_FLAG_RESFD
        self._cb.resfd = self.fd
        self._cbs = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(self._cb))
        self._ev = (_Event * 1)()
        self._now = (ctypes.c_long * 2)(0, 0)      # a timespec of zero: do not wait
        self._iov = None
        self.busy = False

    def submit(self, fd: int) -> None:
        """Begin ``fdatasync(fd)``; OSError if the kernel refused the request. The
        descriptor must stay open until :meth:`reap` returned its result."""
        cb = self._cb
        cb.fildes = fd
        if cb.opcode != IOCB_CMD_FDSYNC:
            cb.opcode, cb.rw_flags, cb.buf, cb.nbytes, cb.offset = IOCB_CMD_FDSYNC, 0, 0, 0, 0
            self._iov = None
        if self._syscall(self._submit_nr, self._ctx, 1, self._cbs) != 1:
            e = ctypes.get_errno()
            raise OSError(e, f"io_submit of fdatasync failed: {os.strerror(e)}")
        self.busy = True

    def submit_write(self, fd: int, chunks, offset: int) -> None:
        """Begin ``pwritev2(fd, chunks, offset, RWF_DSYNC)``: ``chunks`` are
        ``(address, view)`` pairs (the journal's direct writes: an ``O_DIRECT``
        descriptor, whole blocks from aligned memory, durable when it completes).
        The memory and the descriptor must stay as they are until :meth:`reap`
        returned the result (the bytes written, or a negative errno)."""
        iov = (_Iovec * len(chunks))()
        for i, (addr, view) in enumerate(chunks):
            iov[i].base = addr
            iov[i].len = len(view)
        self._iov = iov                # alive while the kernel reads it
        cb = self._cb
        cb.fildes = fd
        cb.opcode = IOCB_CMD_PWRITEV
        cb.rw_flags = RWF_DSYNC
        cb.buf = ctypes.addressof(iov)
        cb.nbytes = len(chunks)
        cb.offset = offset
        if self._syscall(self._submit_nr, self._ctx, 1, self._cbs) != 1:
            e = ctypes.get_errno()
            raise OSError(e, f"io_submit of a direct write failed: {os.strerror(e)}")
        self.busy = True

    def reap(self, wait: bool = False, timeout: float | None = None):
        """The completed request's result: None if it has not completed (without
        ``wait``, or when ``timeout`` seconds of waiting ran out), else 0 or a
        negative errno (as ``fdatasync`` fails), or a direct write's byte count."""
        if not wait:
            try:
                os.eventfd_read(self.fd)     # (level-triggered: always drained)
            except BlockingIOError:
                return None
        if not self.busy:
            return None
        if wait:       # the eventfd stays set: the loop's next reap drains it
            if timeout is None:
                ts = None
            else:
                ts = (ctypes.c_long * 2)(int(timeout), int(timeout % 1 * 1e9))
            n = self._syscall(self._getevents, self._ctx, 1, 1, self._ev, ts)
        else:
            n = self._syscall(self._getevents, self._ctx, 0, 1, self._ev, self._now)
        if n < 0:
            e = ctypes.get_errno()
            if e == errno.EINTR:
                return None if not wait else self.reap(wait, timeout)
            raise OSError(e, f"io_getevents failed: {os.strerror(e)}")
        if n == 0:
            return None
        self.busy = False
        return self._ev[0].res

    def close(self, timeout: float | None = None) -> bool:
        """Release the context and the eventfd, after the request in flight (its
        result dropped: whoever needs it reaps it first). With ``timeout``, a
        request still in flight after that many seconds leaves both in place for
        good (``io_destroy`` would wait for it; the kernel may still read its
        memory) and this returns False; True once released."""
        if self.fd < 0:
            return True
        if self.busy:
            try:
                self.reap(wait=True, timeout=timeout)
            except OSError:
                pass
            if self.busy and timeout is not None:
                return False
        self._syscall(self._destroy, self._ctx)
        os.close(self.fd)
        self.fd = -1
        return True


def open_context() -> AioSync | None:
    """An :class:`AioSync`, or None where Linux AIO is not there to use."""
    nr = _NR.get(platform.machine())
    if nr is None or not hasattr(os, "eventfd"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        return AioSync(nr, libc)
    except (OSError, AttributeError):
        return None
