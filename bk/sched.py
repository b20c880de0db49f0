"""Per-thread scheduler hints: a shorter CPU time slice for latency-critical loops.

Theory of operation. Linux's fair scheduler (EEVDF, 6.6+) gives every runnable
thread a virtual deadline one time slice after it became eligible, and runs the
eligible thread whose deadline is earliest. The slice is ~0.75 ms times
1 + log2(cores) by default (1.4 ms on two cores): a thread that wakes while
another runs its slice may wait that long for a core, longer than a group
commit. Since 6.12 a thread may ask for its own slice (``sched_setattr``,
``SCHED_OTHER``, ``sched_runtime`` = the slice in ns, clamped by the kernel to
0.1-100 ms; no privilege needed): a shorter slice gives it earlier deadlines, so
it is picked sooner when it wakes and may preempt the running thread. It gets
no more CPU than its fair share (its weight is unchanged), it runs in shorter
turns.

:func:`request_slice` asks for the calling thread only: the request carries
``SCHED_FLAG_RESET_ON_FORK``, so threads and processes it starts later get the
kernel's default (a flusher or compaction thread started by a shard worker keeps
its long slice; a negative nice is not passed on either, as with any
reset-on-fork). Where the kernel cannot take the hint (not Linux, no
``sched_setattr``, a kernel before 6.12 that ignores ``sched_runtime`` for fair
threads, a seccomp filter, a real-time policy) nothing changes and nothing is
raised: a hint is never worth failing a service for. What it buys and costs
(shorter waits for a core, more wake-ups and CPU per entry) is measured in
docs/performance-log.md, "Scheduling"; it is off unless ``ioThreadSliceMicros`` is set.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform

log = logging.getLogger(__name__)

SCHED_OTHER, SCHED_BATCH = 0, 3
SCHED_FLAG_RESET_ON_FORK = 0x01
_MIN_NS, _MAX_NS = 100_000, 100_000_000          # the kernel's clamp of a custom slice


class _Attr(ctypes.Structure):
    # struct sched_attr, SCHED_ATTR_SIZE_VER0 (48 bytes): all that a fair thread uses
    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32),
                ("sched_flags", ctypes.c_uint64), ("sched_nice", ctypes.c_int32),
                ("sched_priority", ctypes.c_uint32), ("sched_runtime", ctypes.c_uint64),
                ("sched_deadline", ctypes.c_uint64), ("sched_period", ctypes.c_uint64)]


# (sched_setattr, sched_getattr) per machine; elsewhere the hint is a no-op
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275), "arm64": (274, 275),
             "riscv64": (274, 275)}
_NUMBERS = _SYSCALLS.get(platform.machine()) if os.name == "posix" else None
_libc = None


def _syscall(nr: int, *args) -> int:
    """Run a raw syscall: 0, or the errno it failed with."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        if _libc.syscall(ctypes.c_long(nr), *args) == 0:
            return 0
    except (OSError, AttributeError):           # no C library to call it through
        return errno.ENOSYS
    return ctypes.get_errno() or errno.EINVAL


def _get(tid: int) -> _Attr | None:
    if _NUMBERS is None:
        return None
    attr = _Attr()
    err = _syscall(_NUMBERS[1], ctypes.c_int(tid), ctypes.byref(attr),
                   ctypes.c_uint(ctypes.sizeof(attr)), ctypes.c_uint(0))
    return None if err else attr


def current_slice(tid: int = 0) -> int | None:
    """The time slice of thread ``tid`` (0: the calling thread) in microseconds,
    or None where the kernel does not report one."""
    attr = _get(tid)
    if attr is None or attr.sched_policy not in (SCHED_OTHER, SCHED_BATCH):
        return None
    return attr.sched_runtime // 1000 or None


def request_slice(micros: int) -> int | None:
    """Ask for a time slice of ``micros`` us for the calling thread (0: ask nothing,
    the thread keeps its slice). Returns the slice in effect (us), None where
    nothing was applied; never raises."""
    return set_slice(0, micros) if micros > 0 else None


def set_slice(tid: int, micros: int) -> int | None:
    """Set the time slice of thread ``tid`` (0: the calling thread; another one
    needs the same user or CAP_SYS_NICE) to ``micros`` us, 0: back to the
    kernel's default. Returns the slice in effect (us), None where nothing was
    applied; never raises."""
    attr = _get(tid)
    if attr is None or attr.sched_policy not in (SCHED_OTHER, SCHED_BATCH):
        return None                          # real-time threads have no fair slice
    want = min(max(int(micros) * 1000, _MIN_NS), _MAX_NS) if micros > 0 else 0
    attr.size = ctypes.sizeof(attr)
    attr.sched_flags = SCHED_FLAG_RESET_ON_FORK
    attr.sched_runtime = want
    # the same nice and policy as read: an unprivileged thread may not lower its nice
    err = _syscall(_NUMBERS[0], ctypes.c_int(tid), ctypes.byref(attr), ctypes.c_uint(0))
    if err:
        log.debug("sched_setattr(%d, slice %d us) refused: %s", tid, micros, os.strerror(err))
        return None
    got = current_slice(tid)
    if got is None or (want and got * 1000 != want):
        return None                          # a kernel that ignores sched_runtime here
    return got
