"""Bookie connections, driven by one I/O thread per client.

Theory of operation
-------------------
:class:`IOLoop` owns an epoll loop (:class:`_Poller`; a ``selectors``
selector where there is no epoll) over every bookie connection of one
:class:`bk.BookKeeper`. Other threads never touch a socket: they hand work to
the loop with :meth:`IOLoop.call_soon` (a deque plus a wake-up eventfd that is
only written when the loop is asleep, watched edge-triggered so that the
loop never reads it back) and the loop runs it. Everything that
reacts to replies (acknowledging adds, retrying reads on the next replica,
starting ensemble changes) therefore runs on this one thread and needs no
locks. No other thread may touch a connection: ``Connection._connect``
refuses to run elsewhere (a recovery that connected from its own thread made
the loop see a socket before its fd map did, and die of the KeyError in a
soak). An event of an fd no connection holds is dropped anyway and the fd no
longer watched (:meth:`IOLoop._known`), a guard that costs nothing until it
fires.

A :class:`Connection` is one TCP stream to one shard of one bookie. It
pipelines: every request has a request id, ``inflight`` maps it to the request
object, whose ``on_reply(conn, msg)`` or ``on_error(conn, exc)`` the loop calls
exactly once. The same encoded frame may be sent on several connections (an
entry goes to its whole write quorum), which is why request ids come from one
counter per loop. A broken connection fails all of its requests with
:class:`BookieUnavailableError` and reconnects lazily on the next request.

Adds are not requests by id: a write handle hands a connection its adds with
:meth:`Connection.send_adds`, and the connection keeps them by (ledger,
entry) in ``adds`` until the bookie acknowledges or refuses each (a broken
connection fails them all). When the loop writes a connection, the adds queued
on it since its last write are coalesced: to a bookie that announced
``FEATURE_ADD_BATCH`` at HELLO (and with ``frameBatching`` on) as ADD_BATCH
frames of up to ``BATCH_BYTES`` / ``BATCH_ENTRIES``, grouped by master key;
otherwise as one single ADD frame per entry. Each entry is two buffers made
once when it was signed (its record head and the caller's payload), joined
with the frame's head into one bytes object per frame by
:func:`record_frames`. When every bookie of the ensemble gets every entry
(E == Qw), the handle does that once per drain and every connection sends
the very same frames: request ids come from the loop's one counter, so one
frame may carry the same id to three bookies (acknowledgements of adds are
matched by ledger and entry, not by id). The encoding is done once per write
quorum, not once per bookie, the kernel gets one buffer per frame, and a TLS
connection encrypts the frame as it is (with a head of its own it joined head
and records again, a copy of every entry per bookie). Otherwise (striped
write sets, resends) each connection builds its own. The
bookie answers a group commit with one group acknowledgement per connection
(runs of entries, plus per-entry errors): the loop takes each run's entries
off the connection (a ``dict.pop`` per entry, iterated in C) and confirms
the run in its handle as one range, an OR into the bitset of that bookie's
slot (``bk.client.ledger``), with no Python step per entry; it then advances
each handle it touched once. An acknowledgement of one entry of one ledger
(all of them, for blocking adds) takes a path without those loops. Everything a write produces goes out with ``sendmsg`` of the buffers as
they are (at most ``_IOV`` per call), not joined again per connection; what
the socket does not take waits in ``wq``. Replies are received
with ``recv_into`` the connection's reusable :class:`protocol.FrameBuffer`
and decoded in place.

Per-request timeouts: requests sent with a timeout are remembered by request
id in an insertion-ordered map per timeout value (deadlines of one timeout
value are monotone, so expiry is a peek at its head), holding only the
deadline and the connection; a request that completes or fails leaves it at
once, so nothing (least of all a read's payload) is kept alive until its
deadline. Adds use no per-request timer: write handles watch the age of their
oldest pending add instead (see ``bk.client.ledger``).

Ending: ``close()`` hands the loop its shutdown (:meth:`IOLoop._shutdown`),
or the I/O thread dies of an unexpected exception (:meth:`IOLoop._die`).
Either way every piece of work waiting on the loop ends at once with one
error: :class:`ClientClosedError` (a :class:`BookieUnavailableError`) after a
close, a :class:`BKError` naming the cause after a death; never at its own
deadline. From the shutdown on, work that reaches an idle connection fails
there instead of connecting (:meth:`Connection._start`), ``call_soon`` from
another thread raises (so a read, ``request()``, long poll or recovery step
begun after the close fails in its caller), and the connections fail every
request, add and read they hold. When the loop has left its last pass,
:meth:`IOLoop._end` fails the write handles, then runs every task still
handed over (they fail at their first send) and what those hand over in
turn, then fails what any connection still holds. A task appended after that
drain began is taken back by its own ``call_soon``, which raises: a task is
either run by the drain or refused to its caller, never left in a queue
nobody reads. A forked child's copy of a closed client stays closed, and a
child's ``close()`` ends the child's own loop. Nothing waits on a thread that
is gone. :meth:`IOLoop.stop` returns only once the thread has ended (with
every connection's socket and the poller closed), however long its last pass
takes (an add callback that blocks; a CPU-starved host), saying so in the log
while it waits; a join bounded at 5 s let ``close()`` return with the
shutdown still running. The eventfd that wakes the loop outlives it until the
loop is garbage (see :class:`_Waker`).

TLS and identities (``bk.security``): with a TLS context the HELLO asks for
START_TLS; after its answer the connection wraps its socket and runs the
client side of the handshake in this loop (state HANDSHAKE), then sends AUTH
with the token, if any (state AUTH), and is READY once AUTH is answered; a
bookie that announced ``FEATURE_AUTH`` gets AUTH after a plaintext HELLO.
The connect timeout covers all of it. A failure on the way is a
:class:`SecurityError` naming the bookie and the reason, never a fallback to
plaintext. TLS runs through memory BIOs (:class:`bk.security.tls.TLSStream`):
the socket is read in the same large chunks as a plaintext one and decrypted
from memory, and a write encrypts everything queued (full 16 KiB records) and
sends the ciphertext with one ``sendmsg``, as a plaintext write does. The loop
writes its dirty connections whole, one after another. Encrypting and sending
in bounded turns across them (64 KiB each, so that after a burst the oldest
frames reach every bookie of the quorum first) was measured at 30,000 TLS
adds/s and did not move p99 (issue 21): the I/O thread's time in ``SSLObject.write``
and ``sendmsg`` is mostly waiting to take the GIL back from application threads
(both calls release it), about 0.1 ms per call, not encryption (~0.4 us per
KiB), and more turns mean more such calls. A shorter GIL switch interval did
not move it either.

Fork safety: a child process (multiprocessing, PySpark) must not share the
parent's sockets or thread. ``os.register_at_fork`` marks every loop, and the
next use in the child starts afresh with new sockets and a new thread.
"""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import logging
import os
import select
import selectors
import socket
import ssl
import sys
import threading
import time
import traceback
import weakref

from bk import protocol, sched
from bk.errors import (BKError, BookieUnavailableError, ClientClosedError, ProtocolError,
                       SecurityError, TimeoutError, error_for_status)
from bk.security import PLAINTEXT, tls
from bk.util import parse_host_port

log = logging.getLogger("bk.client")

IDLE, CONNECTING, HELLO, READY, HANDSHAKE, AUTH = range(6)
_SETUP = (CONNECTING, HELLO, HANDSHAKE, AUTH)
_EV_R = selectors.EVENT_READ
_EV_RW = selectors.EVENT_READ | selectors.EVENT_WRITE
# What _Poller.select reports, as epoll's bits (the same numbers where there is
# no epoll): readable (or an error to read), writable.
_IN, _OUT = 1, 4
_READABLE = ~_OUT
_WRITABLE = ~_IN
_UNKNOWN = object()         # IOLoop._known: an fd no connection holds
_RECV = 1 << 18
_FAIL_FAST_SEC = 0.1
_STOP_WARN = 5.0               # IOLoop.stop: how often it says it still waits for the thread
_IOV = 1000                    # buffers per sendmsg (IOV_MAX is 1024)
BATCH_BYTES = 1 << 20          # records per ADD_BATCH frame, at most (and the frame limit)
BATCH_ENTRIES = 1000
_ADD_BATCH = protocol.ADD_BATCH
_ADD = protocol.ADD
_NONES = itertools.repeat(None)

_loops: "weakref.WeakSet[IOLoop]" = weakref.WeakSet()


def _closed_error() -> ClientClosedError:
    return ClientClosedError("client is closed")


def closed_error_among(errors):
    """The first ClientClosedError of ``errors`` (exceptions, or None), or None:
    a call whose requests failed because the client closed raises that, not
    "no bookie answered" (nor retries)."""
    for e in errors:
        if isinstance(e, ClientClosedError):
            return e
    return None


def _after_fork_in_child():
    for loop in list(_loops):
        loop._forked = True
        # a lock some parent thread held at the fork (the loop's last drain
        # pops under it) would be held forever here: the child's is its own
        loop._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _record_bufs(ops, limit):
    """``ops`` cut into frames' worth: ``[(count, nbytes, buffers)]``, each of at
    most BATCH_ENTRIES records and ``limit`` bytes (an op larger than ``limit``
    alone); ``buffers[0]`` is left free for the frame's head. A plain loop: on
    3.11 it costs less per op than gathering the same buffers with
    map/attrgetter/chain (150 against 215-250 ns per op, measured)."""
    out = []
    bufs = [None]
    add = bufs.append
    count = nbytes = 0
    for op in ops:
        w = op.wlen
        if count and (count >= BATCH_ENTRIES or nbytes + w > limit):
            out.append((count, nbytes, bufs))
            bufs = [None]
            add = bufs.append
            count = nbytes = 0
        add(op.head)
        add(op.data)
        count += 1
        nbytes += w
    if count:
        out.append((count, nbytes, bufs))
    return out


def record_frames(ops, limit, key, rids):
    """``ops`` (of one master key and flags: ``key``) as whole ADD_BATCH frames,
    each one bytes object (head and records joined once). Made once per drain
    for a whole write quorum: request ids come from the loop's one counter
    (``rids``), so every bookie's connection can send the very same frame, and
    a TLS connection encrypts it as it is (no join of its own)."""
    mk, flags = key
    head = protocol.add_batch_head
    frames = []
    for count, nbytes, bufs in _record_bufs(ops, limit):
        bufs[0] = head(next(rids), mk, flags, count, nbytes)
        frames.append(b"".join(bufs))
    return frames


class _LedgerAdds(dict):
    """The adds of one ledger outstanding on one connection: entry id -> op, or
    the list of ops of one entry sent by several handles (a writer and a
    recovery of the ledger in one client), oldest first. ``owner`` is the one
    handle whose ops it holds, or None once another handle's ops or a second
    send of an entry came (until it empties): a group acknowledgement's run
    is then confirmed op by op instead of as one range."""

    __slots__ = ("owner",)


class _Waker:
    """How other threads wake the I/O loop out of ``select``: an eventfd, or a
    socketpair where there is no eventfd (a send and a recv per wake-up: 2.0-2.3
    us of CPU against 0.7-0.8 for the eventfd's write and read, measured). Under
    epoll the eventfd is registered edge-triggered (``_Poller``): every write
    reports it once, and the loop never reads it (``edge``), which saves the
    woken loop a syscall, itself a release of the GIL, per wake-up. (Its counter
    only grows: 2**64 - 2 writes are centuries of wake-ups.) A blocking add wakes
    the loop once per entry, a burst of adds once. The eventfd outlives the
    loop's stop, until the waker is garbage (:meth:`__del__`)."""

    __slots__ = ("fd", "_r", "_w", "edge")

    def __init__(self):
        self.edge = False        # set by _Poller when it watches the eventfd edge-triggered
        if hasattr(os, "eventfd"):
            self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._r = self._w = None
        else:
            self._r, self._w = socket.socketpair()
            self._r.setblocking(False)
            self._w.setblocking(False)
            self.fd = self._r.fileno()

    def wake(self):
        try:
            if self._w is None:
                if self.fd >= 0:        # (closed only after a fork: see __del__)
                    os.eventfd_write(self.fd, 1)
            else:
                self._w.send(b"\0")
        except OSError:          # full (the loop is awake anyway) or closed
            pass

    def drain(self):
        if self.edge:
            return
        try:
            if self._r is None:
                os.eventfd_read(self.fd)
            else:
                self._r.recv(4096)
        except OSError:
            pass

    def close(self):
        if self._r is None:
            fd, self.fd = self.fd, -1
            if fd >= 0:
                os.close(fd)
        else:
            self._r.close()
            self._w.close()

    def __del__(self):
        # A stopped loop's eventfd is closed only here, once no thread can wake
        # it: a thread that saw the loop asleep may be between its look at
        # ``fd`` and its write when the loop stops, and a number closed under
        # it could belong to another file by then (another client's socket:
        # eight bytes in a bookie's stream). (The socketpair closes itself.)
        if self._r is None and self.fd >= 0:
            try:
                os.close(self.fd)
            except Exception:       # OSError; at interpreter exit, os may be gone
                pass
            self.fd = -1


class _Poller:
    """The loop's epoll, registered like a ``selectors`` selector (EVENT_READ,
    EVENT_WRITE, data). The loop calls :attr:`poll` (``epoll.poll`` itself:
    ``(fd, mask)`` pairs, test ``mask`` with _READABLE / _WRITABLE) and finds
    each fd's data in :attr:`data`. ``selectors`` wraps each ready fd in a key
    and converts its mask in Python: 2.9-3.9 against 1.8-1.9 us a pass with
    three sockets ready (measured). The loop takes every ready fd's data at
    once, before handling any (one handled may close another, whose number a
    new socket may take). The waker's eventfd is watched
    edge-triggered (see :class:`_Waker`). Where there is no epoll, a
    ``selectors`` selector behind the same names."""

    __slots__ = ("_ep", "_sel", "data", "poll")

    def __init__(self, waker):
        self.data: dict[int, object] = {waker.fd: None}      # fd -> data
        if hasattr(select, "epoll"):
            self._ep = ep = select.epoll()
            self._sel = None
            self.poll = ep.poll
            if waker._r is None:                 # an eventfd: edge-triggered, never read
                ep.register(waker.fd, select.EPOLLIN | select.EPOLLET)
                waker.edge = True
            else:
                ep.register(waker.fd, select.EPOLLIN)
        else:
            self._ep = None
            self._sel = sel = selectors.DefaultSelector()
            sel.register(waker.fd, _EV_R)
            mask = self._mask

            def poll(timeout):
                return [(key.fd, mask(ev)) for key, ev in sel.select(timeout)]
            self.poll = poll

    @staticmethod
    def _mask(events: int) -> int:
        return (_IN if events & _EV_R else 0) | (_OUT if events & selectors.EVENT_WRITE else 0)

    def register(self, sock, events: int, data) -> None:
        fd = sock.fileno()
        if self._ep is None:
            self._sel.register(fd, events)
        else:
            self._ep.register(fd, self._mask(events))
        self.data[fd] = data

    def modify(self, sock, events: int, data) -> None:
        fd = sock.fileno()
        if self._ep is None:
            self._sel.modify(fd, events)
        else:
            self._ep.modify(fd, self._mask(events))
        self.data[fd] = data

    def unregister(self, sock) -> None:
        """Stop watching ``sock`` (before it is closed). KeyError if it is not
        registered (or already closed). Once its map entry is gone no error
        comes out: the caller (``Connection._fail``) must go on to close the
        socket and fail its requests. (An epoll that no longer holds the fd
        raised OSError here once, out of ``_fail``, which left the socket open
        and its requests pending, and killed the I/O thread from ``_tick``.)"""
        fd = sock.fileno()
        del self.data[fd]
        try:
            if self._ep is None:
                self._sel.unregister(fd)
            else:
                self._ep.unregister(fd)
        except (KeyError, OSError):
            pass

    def forget(self, fd: int) -> None:
        """Stop watching ``fd``, which no connection holds (no error if it is
        closed or was not registered)."""
        try:
            if self._ep is None:
                self._sel.unregister(fd)
            else:
                self._ep.unregister(fd)
        except (KeyError, ValueError, OSError):
            pass

    def close(self) -> None:
        (self._sel if self._ep is None else self._ep).close()


class Call:
    """A generic request/response (everything but the add hot path).

    ``callback(call)`` (if given) runs on the I/O thread when it completes;
    :meth:`wait` blocks another thread until then. ``reply`` is the response
    list, ``error`` the exception, ``conn`` the connection that answered.
    """

    __slots__ = ("frame", "callback", "reply", "error", "conn", "_event", "tag")

    def __init__(self, frame: bytes, callback=None, tag=None):
        self.frame = frame
        self.callback = callback
        self.reply = None
        self.error = None
        self.conn = None
        self.tag = tag
        self._event = threading.Event()

    def on_reply(self, conn, msg):
        self.conn = conn
        self.reply = msg
        self._finish()

    def on_error(self, conn, exc):
        self.conn = conn
        self.error = exc
        self._finish()

    def _finish(self):
        self._event.set()
        cb = self.callback
        if cb is not None:
            cb(self)

    @property
    def done(self) -> bool:
        return self._event.is_set()

    @property
    def status(self):
        return None if self.reply is None else self.reply[2]

    def wait(self, timeout=None) -> bool:
        return self._event.wait(timeout)


class DeadConnection:
    """Stands in for a bookie that cannot be located: every request fails at once."""

    state = IDLE

    def __init__(self, loop, bookie_id, reason):
        self.loop = loop
        self.bookie_id = bookie_id
        self.shard = None
        self.reason = reason

    def send(self, rid, req, frame, timeout=None):
        exc = BookieUnavailableError(f"bookie {self.bookie_id} is unavailable: {self.reason}")
        self.loop.call_soon(req.on_error, self, exc)

    def send_adds(self, ops, frames=None):
        exc = BookieUnavailableError(f"bookie {self.bookie_id} is unavailable: {self.reason}")
        for op in ops:
            self.loop.call_soon(op.on_error, self, exc)

    def send_featured(self, feature, rid, req, frame, timeout=None):
        self.send(rid, req, frame, timeout)

    def forget_adds(self, lid):
        pass

    def __repr__(self):
        return f"<DeadConnection {self.bookie_id}: {self.reason}>"


class Connection:
    """One pipelined stream to one shard of one bookie (used on the I/O thread only)."""

    __slots__ = ("loop", "bookie_id", "shard", "addr", "state", "sock", "inflight",
                 "queued", "out", "wq", "fb", "dirty", "num_shards", "down_until",
                 "adds", "addq", "features", "waiting", "_connect_deadline", "_wants_write",
                 "tls", "role", "__weakref__")

    def __init__(self, loop, bookie_id, shard, addr):
        self.loop = loop
        self.bookie_id = bookie_id
        self.shard = shard
        self.addr = addr
        self.state = IDLE
        self.sock = None
        self.inflight = {}
        self.queued = []
        self.out = []
        self.wq = []             # buffers the socket has not taken yet
        self.adds = {}           # ledger -> {entry: op, or a list of ops (two handles)}
        self.addq = []           # (ops, frames or None) to send at the next write
        self.features = 0        # what the bookie announced at HELLO
        self.waiting = []        # send_featured requests until HELLO tells the features
        self.fb = None
        self.dirty = False
        self.num_shards = None
        self.down_until = 0.0
        self._connect_deadline = 0.0
        self._wants_write = False
        self.tls = None          # a tls.TLSStream once START_TLS began
        self.role = None         # what the bookie's AUTH answer named

    def __repr__(self):
        return f"<Connection {self.bookie_id}/{self.shard} state={self.state}>"

    # --- sending (I/O thread) ----------------------------------------------
    def send(self, rid, req, frame, timeout=None):
        """Send ``frame`` (request id ``rid``); ``req`` gets the reply or the error."""
        self.inflight[rid] = req
        if timeout is not None:
            self.loop._track(timeout, self, rid)
        if self.state == READY:
            self.out.append(frame)
            if not self.dirty:
                self.dirty = True
                self.loop._dirty.append(self)
            return
        self.queued.append(frame)
        if self.state == IDLE:
            self._start()

    def send_adds(self, ops, frames=None):
        """Send the adds ``ops`` (PendingAdd objects of one handle); each op's
        ``on_reply(conn, msg)`` / ``on_error(conn, exc)`` gets its outcome here.
        ``frames``: the same ops already encoded by :func:`record_frames` (made
        once for a whole write quorum), sent as they are to a bookie that takes
        batches."""
        h = ops[0].handle
        lid = h._lid
        d = self.adds.get(lid)
        if d is None:
            d = self.adds[lid] = _LedgerAdds()
            d.owner = h
        elif d.owner is not h:
            d.owner = None
        # (a loop: on 3.11 it costs less than d.update(zip(map(...))), measured,
        # and less than one {entry: op} map per drain that each connection
        # takes with update() after an isdisjoint() check: 540-560 against
        # 665-755 ns per entry for three connections, client11)
        setdefault = d.setdefault
        for op in ops:
            prev = setdefault(op.entry_id, op)
            if prev is not op:          # the same entry of another handle (a recovery)
                d.owner = None
                if prev.__class__ is list:
                    if op not in prev:
                        prev.append(op)
                else:
                    d[op.entry_id] = [prev, op]
        self.addq.append((ops, frames))
        if self.state == READY:
            if not self.dirty:
                self.dirty = True
                self.loop._dirty.append(self)
        elif self.state == IDLE:
            self._start()

    def send_featured(self, feature, rid, req, frame, timeout=None):
        """Send a request that needs ``feature`` of the bookie (e.g. READ_RANGE);
        a bookie without it never sees it: ``req.unsupported(conn)`` runs instead
        (once HELLO told, if the connection is not up yet)."""
        if self.state == READY:
            if self.features & feature:
                self.send(rid, req, frame, timeout)
            else:
                req.unsupported(self)
            return
        self.waiting.append((feature, rid, req, frame, timeout))
        if self.state == IDLE:
            self._start()

    def forget_adds(self, lid):
        """A write handle replaced this bookie: stop holding the adds of ledger
        ``lid`` (queued or awaiting confirmation). A connection then left with
        nothing to wait for but bytes the socket has not taken (a peer that stopped
        reading: a silent partition) is closed, so that what it buffered is freed
        rather than held until TCP gives up, many minutes later."""
        self.adds.pop(lid, None)
        if self.addq:
            self.addq = [(ops, fr) for ops, fr in self.addq if ops[0].handle._lid != lid]
        if self.sock is not None and (self.wq or self.tls is not None and self.tls.backlog) \
                and not self.adds and not self.inflight:
            self._fail(BookieUnavailableError(
                f"bookie {self.bookie_id}: connection closed, its writer replaced the "
                f"bookie while the socket was not draining"), fast=True)

    def _take_add(self, d, e, v):
        """``v`` is the list of ops of the same (ledger, entry): the oldest answers."""
        op = v.pop(0)
        d[e] = v[0] if len(v) == 1 else v
        return op

    def _start(self):
        """An idle connection was handed work: connect. Not once the loop ends
        (the client closed, or its thread died): the work fails here and now
        with the loop's error, as the connections the shutdown failed did.
        (Connecting then opened a socket nobody would ever read: a read moving
        on to its next replica waited out its deadline.)"""
        loop = self.loop
        if loop._refuse is not None:
            self._fail(loop._refuse(), fast=True)
        elif self.down_until and time.monotonic() < self.down_until:
            loop.call_soon(self._fail_queued_fast)
        else:
            self._connect()

    def _fail_queued_fast(self):
        if self.state == IDLE and (self.inflight or self.adds or self.waiting):
            self._fail(BookieUnavailableError(
                f"bookie {self.bookie_id} is unavailable: a connection attempt just failed"),
                fast=True)

    # --- connection setup ----------------------------------------------------
    def _connect(self):
        loop = self.loop
        if threading.get_ident() != loop._ident:
            # A socket registered from another thread is seen by the loop's poll
            # before its map entry exists (see IOLoop._known): never let it happen.
            raise RuntimeError(f"{self}: connect from thread "
                               f"{threading.current_thread().name!r}, not the client's "
                               f"I/O thread (connections are the I/O thread's alone)")
        self.state = CONNECTING
        self.fb = protocol.FrameBuffer(loop.max_frame_size)
        try:
            if self.addr is None:
                self.addr = parse_host_port(self.bookie_id)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        except (OSError, ValueError) as e:
            self._fail(BookieUnavailableError(f"cannot connect to bookie {self.bookie_id}: {e}"))
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        err = sock.connect_ex(self.addr)
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            self._fail(BookieUnavailableError(
                f"cannot connect to bookie {self.bookie_id} at {self.addr[0]}:{self.addr[1]}: "
                f"{os.strerror(err)}"))
            return
        loop.sel.register(sock, _EV_RW, self)
        self._wants_write = True
        self._connect_deadline = time.monotonic() + loop.connect_timeout
        loop._connecting.add(self)

    def _on_connected(self):
        err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._fail(BookieUnavailableError(
                f"cannot connect to bookie {self.bookie_id} at {self.addr[0]}:{self.addr[1]}: "
                f"{os.strerror(err)}"))
            return
        self.state = HELLO
        self.wq = [protocol.encode_frame(
            protocol.hello(0, -1 if self.shard is None else self.shard,
                           self.loop.security.context is not None))]
        self._write()

    def _on_hello(self, msg):
        status = msg[2]
        if status != 0:
            err = error_for_status(status, f"hello to bookie {self.bookie_id}")
            if len(msg) > 7 and msg[7]:
                err.args = (f"{err.args[0]}: {msg[7]}",)
            self._fail(err)
            return
        num_shards = msg[4] if len(msg) > 4 else None
        their_id = msg[5] if len(msg) > 5 else None
        if their_id and their_id != self.bookie_id:
            self._fail(BookieUnavailableError(
                f"bookie {self.bookie_id}: {self.addr[0]}:{self.addr[1]} is bookie {their_id}"))
            return
        self.num_shards = num_shards
        features = msg[6] if len(msg) > 6 and type(msg[6]) is int else 0
        self.features = features if self.loop.batching else 0
        if self.loop.security.context is not None:
            self._start_tls()
        elif features & protocol.FEATURE_AUTH:
            self._send_auth()
        else:
            self._ready()

    # --- TLS and AUTH (see the module's docstring) ------------------------------------
    def _start_tls(self):
        if self.loop.scratch is None:
            self.loop.scratch = bytearray(_RECV)
        try:
            self.tls = self.loop.security.stream(self.sock, self.addr[0])
        except (ssl.SSLError, ValueError) as e:
            self._fail(SecurityError(f"TLS with bookie {self.bookie_id}: {tls.reason(e)}"))
            return
        self.state = HANDSHAKE
        self._handshake()

    def _handshake(self):
        t = self.tls
        try:
            done = t.handshake()
            left = t.flush()
        except (ssl.SSLError, ssl.CertificateError, OSError, ValueError) as e:
            self._fail(SecurityError(f"TLS with bookie {self.bookie_id} failed: "
                                     f"{tls.reason(e)}"))
            return
        self._want(bool(left))
        if done:
            self._send_auth()
        elif t.eof:
            self._fail(SecurityError(f"TLS with bookie {self.bookie_id} failed: the bookie "
                                     f"closed the connection during the handshake"))

    def _want(self, write: bool):
        if write != self._wants_write:
            self._wants_write = write
            self.loop.sel.modify(self.sock, _EV_RW if write else _EV_R, self)

    def _send_auth(self):
        self.state = AUTH
        self.wq = [protocol.encode_frame(protocol.auth(0, self.loop.security.token))]
        self._write()

    def _on_auth(self, msg):
        if msg[2] != 0:
            err = error_for_status(msg[2], f"AUTH to bookie {self.bookie_id}")
            if len(msg) > 3 and msg[3]:
                err.args = (f"{err.args[0]}: {msg[3]}",)
            self._fail(err)
            return
        self.role = msg[3] if len(msg) > 3 else None
        self._ready()

    def _ready(self):
        self.state = READY
        self.down_until = 0.0
        self.loop._connecting.discard(self)
        if self.loop.health is not None:
            self.loop.health.ok(self.bookie_id)
        if self.queued or self.addq:
            self.out.extend(self.queued)
            self.queued = []
            if not self.dirty:
                self.dirty = True
                self.loop._dirty.append(self)
        if self.waiting:
            waiting, self.waiting = self.waiting, []
            for feature, rid, req, frame, timeout in waiting:
                try:
                    self.send_featured(feature, rid, req, frame, timeout)
                except Exception:
                    log.exception("request handler failed for %r", req)

    # --- I/O events ------------------------------------------------------------
    def _on_readable(self):
        fb = self.fb
        if self.tls:
            if not self._read_tls(fb):
                return
        else:
            try:
                n = self.sock.recv_into(fb.recv_buffer(_RECV), _RECV)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._fail(BookieUnavailableError(f"connection to bookie {self.bookie_id} "
                                                  f"broke: {e.strerror or e}"))
                return
            if not n:
                self._fail(BookieUnavailableError(f"bookie {self.bookie_id} closed the "
                                                  f"connection"))
                return
            fb.commit(n)
        inflight = self.inflight
        untrack = self.loop._untrack if self.loop._timeouts else None
        try:
            for msg in fb.frames():
                if self.state != READY:
                    if msg[0] == protocol.HELLO and self.state == HELLO:
                        self._on_hello(msg)
                        if self.state != READY:
                            return
                    elif msg[0] == protocol.AUTH and self.state == AUTH:
                        self._on_auth(msg)
                        if self.state != READY:
                            return
                    continue
                op = msg[0]
                if op == _ADD_BATCH:
                    self._on_add_ack(msg)
                    continue
                if op == _ADD:
                    self._on_add_reply(msg)
                    continue
                req = inflight.pop(msg[1], None)
                if req is not None:
                    if untrack is not None:
                        untrack(msg[1])
                    try:
                        req.on_reply(self, msg)
                    except Exception:
                        log.exception("reply handler failed for %r", req)
        except ProtocolError as e:
            self._fail(BookieUnavailableError(f"bad frame from bookie {self.bookie_id}: {e}"))

    def _read_tls(self, fb) -> bool:
        """Read the socket once and decrypt what it held; False if no plaintext came
        (or the connection failed)."""
        t = self.tls
        try:
            if self.state == HANDSHAKE:
                t.feed(self.loop.scratch)
                self._handshake()
                return False
            got = t.recv_into(fb, self.loop.scratch)
            if t.backlog:                # TLS itself answered something
                self._want(bool(t.flush()))
        except OSError as e:             # ssl.SSLError included: an alert of the bookie
            why = tls.reason(e)
            self._fail(SecurityError(f"bookie {self.bookie_id} refused the connection: "
                                     f"{why}") if self.state in (AUTH, HANDSHAKE) else
                       BookieUnavailableError(f"connection to bookie {self.bookie_id} "
                                              f"broke: {why}"))
            return False
        if not got:
            if t.eof:                    # (frames that came with the EOF went first)
                self._fail(SecurityError(f"bookie {self.bookie_id} closed the connection "
                                         f"at AUTH") if self.state == AUTH else
                           BookieUnavailableError(f"bookie {self.bookie_id} closed the "
                                                  f"connection"))
            return False
        return True

    def _on_add_reply(self, msg):
        """The answer to a single ADD: ``[op, rid, status, ledger, entry]``."""
        if len(msg) < 5:
            raise ProtocolError("malformed ADD answer")
        d = self.adds.get(msg[3])
        if d is None:
            return
        e = msg[4]
        op = d.pop(e, None)
        if op is None:
            return
        if op.__class__ is list:
            op = self._take_add(d, e, op)
        elif not d:
            del self.adds[msg[3]]
        try:
            op.on_reply(self, msg)
        except Exception:
            log.exception("add reply handler failed for %r", op)

    def _on_add_ack(self, msg):
        """A group acknowledgement: take every entry of its runs off this
        connection, confirm each run in its handle's bitsets (one range when the
        ledger's adds here are one handle's and the run is whole, else entry by
        entry), hand its errors to their handles, then advance each handle it
        touched once."""
        protocol.check_add_ack(msg)
        acked, errors = msg[3], msg[4]
        adds = self.adds
        if not errors and len(acked) == 3 and acked[1] == acked[2]:
            # one entry of one ledger (every acknowledgement of blocking adds):
            # no loops, no list of touched handles
            lid, e = acked[0], acked[1]
            d = adds.get(lid)
            if d is None:
                return
            h = d.owner
            if h is not None:
                if d.pop(e, None) is not None:
                    if not d:
                        del adds[lid]
                    h._confirm_run(self, e, e)
                    try:
                        h._advance()
                    except Exception:
                        log.exception("advancing %r failed", h)
                return
        touched = []
        for i in range(0, len(acked), 3):
            lid = acked[i]
            d = adds.get(lid)
            if d is None:
                continue
            first, last = acked[i + 1], acked[i + 2]
            h = d.owner
            if h is not None:
                # pop(e, None) for each e of the run, iterated in C; the ops
                # outstanding here (never a list: one handle, one send each)
                got = list(filter(None, map(d.pop, range(first, last + 1), _NONES)))
                if got:
                    if len(got) == last - first + 1:
                        h._confirm_run(self, first, last)
                    else:                   # entries this connection no longer holds
                        for op in got:
                            h._confirm_run(self, op.entry_id, op.entry_id)
                    if h not in touched:
                        touched.append(h)
            else:
                for e in range(first, last + 1):
                    op = d.pop(e, None)
                    if op is None:
                        continue
                    if op.__class__ is list:
                        op = self._take_add(d, e, op)
                    h = op.handle
                    h._confirm_run(self, e, e)
                    if h not in touched:
                        touched.append(h)
            if not d:
                del adds[lid]
        for i in range(0, len(errors), 3):
            lid, e, status = errors[i], errors[i + 1], errors[i + 2]
            d = adds.get(lid)
            op = None if d is None else d.pop(e, None)
            if op is None:
                continue
            if op.__class__ is list:
                op = self._take_add(d, e, op)
            elif not d:
                del adds[lid]
            try:
                op.on_reply(self, [_ADD, msg[1], status, lid, e])
            except Exception:
                log.exception("add reply handler failed for %r", op)
        for h in touched:
            try:
                h._advance()
            except Exception:
                log.exception("advancing %r failed", h)

    def _on_writable(self):
        if self.state == CONNECTING:
            self._on_connected()
            return
        if self.state == HANDSHAKE:
            self._handshake()
            return
        self._write()

    def _write(self):
        q = self.wq
        if self.out:
            q.extend(self.out)
            self.out = []
        if self.addq and self.state == READY:
            self._encode_adds(q)
        sock = self.sock
        if self.tls is not None:
            self._write_tls(q)
            return
        while q:
            chunk = q[:_IOV] if len(q) > _IOV else q
            try:
                n = sock.sendmsg(chunk)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self._fail(BookieUnavailableError(f"send to bookie {self.bookie_id} failed: "
                                                  f"{e.strerror or e}"))
                return
            k = len(chunk)
            if n == sum(map(len, chunk)):      # all taken (the usual case): no Python loop
                del q[:k]
                continue
            i = 0
            while i < k:
                m = len(chunk[i])
                if n < m:
                    break
                n -= m
                i += 1
            if n:
                q[i] = memoryview(q[i])[n:]
            del q[:i]
            break
        wants = bool(self.wq) or self.state == CONNECTING
        if wants != self._wants_write:
            self._wants_write = wants
            self.loop.sel.modify(self.sock, _EV_RW if wants else _EV_R, self)

    def _write_tls(self, q):
        """Encrypt the buffers of ``q`` (all of them, at once: records of 16 KiB) and
        send the ciphertext with one sendmsg; what the socket does not take waits in
        the stream's backlog."""
        t = self.tls
        try:
            if q:
                t.encrypt(q)
                q.clear()
            left = t.flush()
        except OSError as e:
            self._fail(BookieUnavailableError(f"send to bookie {self.bookie_id} failed: "
                                              f"{tls.reason(e)}"))
            return
        self._want(bool(left))

    def _encode_adds(self, q):
        """Turn the queued adds into ADD_BATCH frames (or single ADDs for a bookie
        without the feature) appended to the write queue ``q``, in the order they
        were queued. Adds queued without frames (resends, striped write sets)
        are encoded here, grouped by master key."""
        chunks, self.addq = self.addq, []
        if not self.features & protocol.FEATURE_ADD_BATCH:
            for ops, _ in chunks:
                for op in ops:
                    q.append(op.single_frame())
            return
        by_key = {}                     # (master key, flags) -> ops without frames
        for ops, frames in chunks:
            if frames is None:
                key = ops[0].handle._bkey
                same = by_key.get(key)
                if same is None:
                    by_key[key] = list(ops)
                else:
                    same += ops
                continue
            if by_key:                  # what was queued before goes first
                self._emit_plain(by_key, q)
                by_key = {}
            q += frames
        if by_key:
            self._emit_plain(by_key, q)

    def _emit_plain(self, by_key, q):
        loop = self.loop
        for key, ops in by_key.items():
            q += record_frames(ops, loop.batch_bytes, key, loop.rids)

    # --- failure ------------------------------------------------------------------
    def _fail(self, exc, fast=False):
        """Close the socket and fail every outstanding request with ``exc``."""
        if self.state in _SETUP and not fast:
            self.down_until = time.monotonic() + _FAIL_FAST_SEC
        if not fast and self.loop.health is not None:
            self.loop.health.failed(self.bookie_id)
        self.loop._connecting.discard(self)
        if self.sock is not None:
            try:
                self.loop.sel.unregister(self.sock)
            except (KeyError, ValueError):
                pass
            self.sock.close()
            self.sock = None
        self.state = IDLE
        self.tls = None
        self.wq = []
        self.out = []
        self.queued = []
        self.addq = []
        self._wants_write = False
        reqs = list(self.inflight.values())
        if self.loop._timeouts:
            for rid in self.inflight:
                self.loop._untrack(rid)
        self.inflight = {}
        for _f, _r, req, _fr, _t in self.waiting:
            reqs.append(req)
        self.waiting = []
        adds, self.adds = self.adds, {}
        for d in adds.values():
            for v in d.values():
                if v.__class__ is list:
                    reqs.extend(v)
                else:
                    reqs.append(v)
        if reqs:
            log.debug("%s failed, failing %d requests: %s", self, len(reqs), exc)
        for req in reqs:
            try:
                req.on_error(self, exc)
            except Exception:
                log.exception("error handler failed for %r", req)

    def _abandon(self):
        """After fork: drop the parent's socket without touching the stream."""
        if self.sock is not None:
            try:
                self.sock.detach()
            except OSError:
                pass
            self.sock = None


class IOLoop:
    """The I/O thread of one client. Thread-safe entry points: call_soon, call_later,
    conn, request, stop."""

    def __init__(self, max_frame_size=protocol.DEFAULT_MAX_FRAME_SIZE, connect_timeout=5.0,
                 security=None, name="bk-io", batching=True, slice_us=0):
        self.max_frame_size = max_frame_size
        # the records of one ADD_BATCH frame, at most (half the frame limit: room
        # for the head however large the bookie's limit is)
        self.batch_bytes = min(BATCH_BYTES, max_frame_size // 2)
        self.batching = batching          # use the features bookies announce (frameBatching)
        self.connect_timeout = connect_timeout
        self.security = security or PLAINTEXT   # TLS context and token (bk.security)
        self.name = name
        self.slice_us = slice_us      # bk.sched hint for the I/O thread (0: none)
        self.addresses: dict[str, tuple] = {}
        self.health = None        # a bk.client.health.BookieHealth, told of failures
        self.rids = itertools.count(1)
        self.generation = 0
        self._forked = False
        self._lock = threading.Lock()
        self._thread = None
        self._init_state()
        _loops.add(self)

    def _init_state(self):
        self.unknown_events = 0      # events of fds no connection held (see _known)
        self._ident = None           # the I/O thread's, once it runs
        self._waker = _Waker()
        self.sel = _Poller(self._waker)
        self._submit = collections.deque()
        self.scratch = None      # what TLS connections read before decrypting (made once)
        self._sleeping = False
        # The loop's end, in three steps (see "Ending" in the module's docstring):
        # _closing: other threads' tasks are refused (call_soon raises); _refuse:
        # a fresh error for each piece of work that reaches an idle connection
        # (None while the loop runs); _ended: the last drain of _submit began,
        # under _lock (call_soon takes back what it finds it did not get).
        self._closing = False
        self._stopping = False       # the loop's while ends (set by _shutdown)
        self._refuse = None
        self._ended = False
        self._conns: dict[tuple, Connection] = {}
        self._dirty: list[Connection] = []
        self._connecting: set[Connection] = set()
        # timeout value -> {rid: (deadline, conn)} in deadline order (see _track)
        self._timeouts: dict[float, collections.OrderedDict] = {}
        self._dead: BaseException | None = None     # why the I/O thread died
        self._handles: "weakref.WeakSet" = weakref.WeakSet()   # failed if it dies
        self._timers: list = []
        self._timer_seq = itertools.count()
        self._tickers: list = []
        self.now = time.monotonic()
        self.generation += 1

    # --- thread-safe API ---------------------------------------------------
    def _ensure(self):
        if self._forked:
            self._reset_after_fork()
        if self._thread is None:
            with self._lock:
                if self._thread is None and not self._closing:
                    t = threading.Thread(target=self._run, name=self.name, daemon=True)
                    self._thread = t
                    t.start()

    def _reset_after_fork(self):
        with self._lock:
            if not self._forked:
                return
            for conn in self._conns.values():
                conn._abandon()
            self._waker.close()
            try:
                self.sel.close()
            except OSError:
                pass
            self._thread = None
            self._lock = threading.Lock()
            closing = self._closing
            self._init_state()
            # a client closed (in the parent before the fork, or here) stays
            # closed: its calls fail at once, no thread starts for them
            self._closing = closing
            self._forked = False

    def call_soon(self, fn, *args):
        """Run ``fn(*args)`` on the I/O thread. Once the client is closed (or its
        I/O thread died) this raises ClientClosedError (or the thread's death)
        instead: the caller's call fails at once, and no task is queued that
        nobody would run."""
        if self._thread is None or self._forked:
            self._ensure()
        if self._closing:
            self._refused()
        item = (fn, args)
        self._submit.append(item)
        if self._ended:              # (one load: the hot path's only cost of this)
            self._take_back(item)
        if self._sleeping:
            self._wake()

    def _refused(self):
        """call_soon on a loop that ends: raise, except on the I/O thread itself,
        whose tasks (a request failing over to its next replica) still queue
        until its last drain has run them."""
        if self._ident is not None and threading.get_ident() == self._ident:
            return
        if self._dead is not None:
            raise self._death_error()
        raise ClientClosedError("the client is closed")

    def _take_back(self, item):
        """``item`` was appended after the last drain began: take it back and
        raise, unless the drain already took it (it runs there). The drain pops
        under ``_lock``, so exactly one of the two has it."""
        if threading.get_ident() == self._ident:
            return                   # the drain itself queued it: it runs there
        with self._lock:
            q = self._submit
            for i, x in enumerate(q):
                if x is item:
                    del q[i]
                    break
            else:
                return
        self._refused()

    def call_later(self, delay, fn, *args):
        """Run ``fn(*args)`` on the I/O thread after ``delay`` seconds."""
        self.call_soon(self._add_timer, time.monotonic() + delay, fn, args)

    def add_ticker(self, fn):
        """Call ``fn(now)`` on the I/O thread about every 50 ms (until it returns False)."""
        self.call_soon(self._tickers.append, fn)

    def conn(self, bookie_id: str, shard) -> Connection:
        """The connection to ``shard`` of ``bookie_id`` (created unconnected if new)."""
        if self._forked:
            self._ensure()
        key = (bookie_id, shard)
        c = self._conns.get(key)
        if c is None:
            c = self._conns.setdefault(
                key, Connection(self, bookie_id, shard, self.addresses.get(bookie_id)))
        return c

    def request(self, conn, msg_builder, *args, timeout=None, callback=None, tag=None) -> Call:
        """Send ``msg_builder(rid, *args)`` on ``conn`` from any thread; returns a Call."""
        rid = next(self.rids)
        call = Call(protocol.encode_frame(msg_builder(rid, *args)), callback, tag)
        self.call_soon(conn.send, rid, call, call.frame, timeout)
        return call

    def stop(self, timeout=None):
        """End the loop: its shutdown fails every request, add and task with
        ClientClosedError, closes every socket, then the thread exits, and this
        returns once it has (``timeout``: seconds at most, None: however long it
        takes, saying in the log every ``_STOP_WARN`` seconds what the thread is
        doing, e.g. an add callback that blocks). Called on the I/O thread itself
        (from a callback) it cannot wait: the loop ends once the callback
        returns. A loop whose thread never started (or a forked child's copy,
        whose thread is the parent's) just refuses from now on."""
        # Read under the lock _ensure starts the thread under: a thread another
        # caller is starting right now is joined once started, never before
        # (Thread.join raises then).
        with self._lock:
            t = self._thread
            if t is None or self._forked:
                self._closing = True         # no thread starts for a closed client
                return
        if self._dead is not None:
            return
        try:
            self.call_soon(self._shutdown)
        except ClientClosedError:
            pass                         # another stop() already ended it
        if t is threading.current_thread():
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = _STOP_WARN if deadline is None else min(_STOP_WARN,
                                                           deadline - time.monotonic())
            t.join(max(0.0, step))
            if not t.is_alive() or (deadline is not None and time.monotonic() >= deadline):
                return
            frame = sys._current_frames().get(t.ident)
            log.warning("client I/O thread %s still ending after close(); waiting for it. "
                        "It is at:\n%s", t.name,
                        "".join(traceback.format_stack(frame)) if frame else "?")

    # --- I/O thread ------------------------------------------------------------
    def _wake(self):
        self._waker.wake()

    def _add_timer(self, when, fn, args):
        heapq.heappush(self._timers, (when, next(self._timer_seq), fn, args))

    def register_handle(self, handle):
        """``handle._loop_died(reason)`` is called (on this thread) if it dies."""
        self._handles.add(handle)

    def _death_error(self) -> BKError:
        return BKError(f"the client's I/O thread died ({self._dead!r}); this client can "
                       f"do no more I/O: close it and create a new one")

    def _track(self, timeout, conn, rid):
        od = self._timeouts.get(timeout)
        if od is None:
            od = self._timeouts[timeout] = collections.OrderedDict()
        od[rid] = (time.monotonic() + timeout, conn)

    def _untrack(self, rid):
        for od in self._timeouts.values():
            if od.pop(rid, None) is not None:
                return

    def _die(self, exc: BaseException):
        """The I/O thread is dying: fail everything that waits on it."""
        self._dead = exc
        self._closing = True
        self._refuse = self._death_error
        err = self._death_error()
        self._end(lambda handle: handle._loop_died(str(err)))

    def _end(self, fail_handle):
        """The loop ends (``_refuse`` set): fail everything that waits on it.
        Each write handle first (``fail_handle(handle)``: one that already failed
        does not start an ensemble change for each add the connections fail
        below). Then every task handed over and not run yet is run, to its end:
        a read, a request, a recovery's READ_RANGEs, a long poll reach an idle
        connection (:meth:`Connection._start`) and fail at once with the loop's
        error (a task dropped here used to leave its caller waiting for its own
        deadline, or forever). What those tasks hand over in turn (a read
        moving on to its next replica) is run by the same drain. Tasks handed
        over by other threads from here on are refused by ``call_soon`` (it
        takes back what the drain did not get). Then every connection fails
        what it still holds. Timers and tickers are dropped: each serves work
        failed here (speculative reads, an add's back-off, LAC flushes)."""
        for handle in list(self._handles):
            try:
                fail_handle(handle)
            except Exception:
                log.exception("could not fail %r", handle)
        submit = self._submit
        lock = self._lock
        with lock:
            self._ended = True
        while True:
            with lock:
                if not submit:
                    break
                fn, args = submit.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("I/O thread task %r failed at the loop's end", fn)
        for handle in list(self._handles):       # adds those tasks handed over
            try:
                fail_handle(handle)
            except Exception:
                log.exception("could not fail %r", handle)
        for conn in list(self._conns.values()):
            try:
                conn._fail(self._refuse(), fast=True)
            except Exception:
                log.exception("could not fail the requests of %r", conn)
        self._timers = []
        self._tickers = []

    def _shutdown(self):
        """close() (I/O thread): refuse new work, fail what the connections hold,
        and leave the loop at the end of this pass."""
        self._closing = True
        self._refuse = _closed_error
        self._stopping = True
        for conn in list(self._conns.values()):
            if conn.sock is not None or conn.inflight or conn.adds or conn.waiting:
                conn._fail(_closed_error(), fast=True)

    def _run(self):
        self._ident = threading.get_ident()
        sched.request_slice(self.slice_us)          # this thread only; 0: nothing
        sel = self.sel
        poll = sel.poll
        fdmap = sel.data
        submit = self._submit
        waker = self._waker
        next_tick = 0.0
        try:
            while not self._stopping:
                # how long may we sleep?
                if submit or self._dirty:
                    timeout = 0
                else:
                    timeout = 0.05 if (self._tickers or self._timeouts or self._connecting) else 1.0
                    if self._timers:
                        timeout = max(0.0, min(timeout, self._timers[0][0] - time.monotonic()))
                    self._sleeping = True
                    if submit:
                        timeout = 0
                # each fd's connection is taken now, before any is handled: one
                # handled may close another, whose number a new socket may take
                ready = poll(timeout)
                try:
                    events = [(fdmap[fd], mask) for fd, mask in ready]
                except KeyError:
                    events = self._known(ready)
                self._sleeping = False
                self.now = now = time.monotonic()
                for conn, mask in events:
                    if conn is None:
                        waker.drain()           # (nothing to do under epoll: edge-triggered)
                        continue
                    if mask & _READABLE and conn.sock is not None:
                        if conn.state == CONNECTING:
                            conn._on_connected()
                            if conn.sock is None:
                                continue
                        conn._on_readable()
                    if mask & _WRITABLE and conn.sock is not None:
                        conn._on_writable()
                # work handed over by other threads (bounded, so replies keep flowing)
                n = len(submit)
                while n:
                    n -= 1
                    fn, args = submit.popleft()
                    try:
                        fn(*args)
                    except Exception:
                        log.exception("I/O thread task %r failed", fn)
                if self._timers and self._timers[0][0] <= now:
                    self._run_timers(now)
                if now >= next_tick:
                    next_tick = now + 0.05
                    self._tick(now)
                dirty = self._dirty
                if dirty:
                    self._dirty = []
                    for conn in dirty:
                        conn.dirty = False
                        if conn.state == READY:
                            conn._write()
            # Stopped (the client was closed). Tasks handed over during the pass
            # that ran _shutdown never ran: an add among them used to reconnect or
            # stay in its handle's outbox, a read wait for its deadline. They run
            # now, and fail at once, as the work that came before did.
            self._end(lambda handle: handle._loop_stopped())
        except BaseException as e:
            log.exception("bk I/O thread died")
            self._die(e)
            raise
        finally:
            try:
                sel.close()
            except Exception:
                pass
            # (the waker stays open: see _Waker.__del__)
            # The ended thread's ident is free for the next thread to start (glibc
            # hands a new thread the stack, so the pthread id, of the last one to
            # exit): kept, an application thread holding it passed for this loop's,
            # and its call_soon queued a task nobody would run (an idle writer's add
            # after close parked forever, ~19 in 20 new threads on this VM).
            self._ident = None

    def _known(self, ready) -> list:
        """The events of ``ready`` of fds a connection holds. An event of an fd
        none holds killed the I/O thread in a soak (KeyError): a recovery sent
        its READ_RANGEs from the caller's thread, and one to a bookie whose
        connection had broken connected it there; the loop's poll saw the new
        socket between its epoll registration and its map entry. Connections
        are now the I/O thread's alone (``Connection._connect`` refuses another
        thread), so this is only a guard, free on the hot path (it runs on the
        KeyError): such an event is dropped and the fd no longer watched, and
        the loop goes on; ``unknown_events`` counts them (0 in the tests)."""
        fdmap = self.sel.data
        out = []
        for fd, mask in ready:
            conn = fdmap.get(fd, _UNKNOWN)
            if conn is _UNKNOWN:
                self.unknown_events += 1
                if self.unknown_events == 1:
                    log.warning("bk I/O loop: an event of fd %d, which no connection holds: "
                                "no longer watched", fd)
                self.sel.forget(fd)
            else:
                out.append((conn, mask))
        return out

    def _run_timers(self, now):
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, fn, args = heapq.heappop(timers)
            try:
                fn(*args)
            except Exception:
                log.exception("timer %r failed", fn)

    def _tick(self, now):
        for conn in list(self._connecting):
            if now > conn._connect_deadline and conn.state in _SETUP:
                conn._fail(TimeoutError(
                    f"connect to bookie {conn.bookie_id} timed out after "
                    f"{self.connect_timeout:g}s"))
        for timeout, od in list(self._timeouts.items()):
            while od:
                rid, (deadline, conn) = next(iter(od.items()))
                if deadline > now:
                    break
                del od[rid]
                req = conn.inflight.pop(rid, None)
                if req is not None:
                    if self.health is not None:
                        self.health.failed(conn.bookie_id)
                    try:
                        req.on_error(conn, TimeoutError(
                            f"bookie {conn.bookie_id} did not answer within {timeout:g}s"))
                    except Exception:
                        log.exception("timeout handler failed for %r", req)
            if not od:
                del self._timeouts[timeout]
        if self._tickers:
            keep = []
            for fn in self._tickers:
                try:
                    if fn(now) is not False:
                        keep.append(fn)
                except Exception:
                    log.exception("ticker %r failed", fn)
            self._tickers = keep


__all__ = ["IOLoop", "Connection", "DeadConnection", "Call", "BKError"]
