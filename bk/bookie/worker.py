"""One shard of a bookie: a single-threaded epoll loop with group commit.

Theory of operation
-------------------
The worker owns the ledgers with ``protocol.shard_of(ledger_id, num_shards) == shard`` and their
storage (journal + index). Clients reach it through sockets that the arbiter
hands over on the control channel after reading their HELLO.

Each pass of the loop reads every ready socket and dispatches every complete
frame. ADDs, fences and WRITE_LACs only *append* to the journal; their
responses are held. When the pass is over and the group is due (the oldest
held response waited ``journalMaxGroupWaitMSec``, or the unsynced bytes reached
``journalBufferedWritesThreshold``, or no more input is waiting), the group is
committed with ONE sync and only then are its responses sent. So an
acknowledged ADD or a confirmed fence is on disk, and a burst of adds from many
connections shares one sync. With the default wait of 0 a group is due as
soon as a pass holds answers and no sync is in flight: the adds that arrive
while a sync runs form the next group, so groups grow with the load without
a timer adding latency at low load.

Batched adds (``ADD_BATCH``, see ``bk.protocol``): every entry of a batch is
checked and appended at once, straight from the received frame, in ONE pass
over its records (``ShardStorage.add_batch``, ``Journal.append_wire_run``:
located, checked and copied into the journal's staging buffer in the same
loop, the records being journal-shaped, runs of equal-sized records in
chunks of a few C calls; no list of them first; the records a view of the
connection's receive buffer, not msgpack's copy), with
the same per-entry rules as a single ADD (a fenced ledger refuses each entry
that is not a recovery add, EFENCED). Their answers are not frames per entry:
each connection has at most one *group acknowledgement* per group, held like
any response, into which the batches it sends during that group put their
entries (runs ``ledger, first, last``; per-entry errors only where one
occurred). When the group's sync completes, that is ONE frame per connection
for every batched entry of the group. Single ADDs keep their own answers, so a
client that never sends ADD_BATCH sees the protocol as before; HELLO's answer
announces the features (``frameBatching``).

What a pass costs when the load is many lone adds (a ledger per add, as
ledger create + one entry + close makes it) is fixed per pass and per new
ledger, not per byte: the loop polls epoll itself (:class:`_Poller`, no
``selectors`` key per ready socket), storage's ``maintain`` skips its checks
until a flush or trim can be due, and a ledger's first add has its own path
in storage (its MASTER_KEY record, state and tail made in one step).

Input is received with ``recv_into`` the connection's reusable FrameBuffer and
decoded in place; a connection's held answers go out with one ``sendmsg`` of
the frames (no join, no copy into the output buffer unless the socket is full).
``READ_RANGE`` answers many entries of a ledger in one frame, up to a byte
budget (at most half the frame limit).

The sync itself runs on a second thread (``fdatasync`` releases the GIL), as
BookKeeper's journal has its own sync thread: while group N is being made
durable the loop already reads, appends and holds group N+1. The commit is a
pipeline: when N's sync completes (signalled through a pipe the selector
watches), the loop first begins N+1's sync (one ``pwrite`` of its records, the
job handed to the sync thread) and only then answers N, so that answering
(with TLS: encrypting, then ``sendmsg`` to every connection) overlaps N+1's
``fdatasync`` instead of adding to every cycle. Throughput is then bounded by
the larger of CPU and disk time per group instead of their sum. Where Linux
AIO works (``bk.bookie.aiosync``) the "sync thread" is the kernel's: the loop
submits an ``fdatasync`` of the segment (through a descriptor it keeps from
group to group, ``journal.SyncFile``) whose completion bumps an eventfd in
the loop's epoll, and reaps its result there; no Python thread wakes, takes
the GIL or preempts the loop for it. With ``journalDirectWrites`` the job is
the group's write itself (``O_DIRECT`` with ``RWF_DSYNC``, see
``bk.bookie.journal``), submitted the same way; when the journal must write
the same blocks before its completion is seen (a roll, a flush's write-out)
it reaps it first (``_aio_wait``) and the loop completes the group as usual;
dropping AIO (a refused submit, the exit) reaps a write in flight into its
job first, so that the journal's wait for it never needs the context again.
The first group after a roll, whose
sync covers the journal directory too, and every group where AIO is missing
or refused (then for good) take the sync thread. Its hand-off costs the loop
as little GIL traffic as it can: the job goes through a deque and the
thread's eventfd (``bk.park``, written with the GIL released; a queue's
lock, released with the GIL held, had the woken thread preempt the loop only
to find the GIL taken), and the thread syncs through a descriptor it keeps,
so it takes the GIL three times a group (woken, after ``fdatasync``, after
the pipe's write). Either way the completion is the same event to the loop.
What must hold:
an answer leaves only after its own group's sync completed; a connection gets
group N's answers before N+1's (one group is answered at a time, in order); a
fence, a WRITE_LAC and a long poll's wake-up wait for their sync like an add;
a failed sync (or write) answers nothing of its group nor of any later one
(the worker exits and replays); ``_quiesce`` (checkpoint, GC, exit) waits for
the sync in flight, syncs the rest and answers everything. A group that
appended nothing, or any group with ``journalSyncData=false``, is answered at
once (after the group before it). At most one sync is in flight: a second
``fdatasync`` of the same file would wait for the first anyway, and a group
begun later only grows.

A small group is synced inline instead: when it is due while no sync was in
flight (a group gathered during a sync keeps the pipeline: input goes on
arriving, and reading it during the next sync pays), it holds few answers and bytes
(INLINE_MAX_ANSWERS, INLINE_MAX_BYTES), recent syncs were quick (a moving
average of the disk's part of each sync below INLINE_MAX_SYNC) and the loop
has spare time (busy less than INLINE_MAX_LOAD of the last LOAD_WINDOW), the
loop itself pwrites and fdatasyncs it and answers it at once. That is the load of
lone adds (a ledger per entry), where the hand-off to the sync thread and back
(a queue wake, the GIL changing threads, a byte through the pipe, an epoll
wake) cost more CPU and context switches than the sync itself; the loop reads
nothing during the sync, which the bounds keep short. Every rule above holds
the same: the answers leave after their own sync, after the group before
them; a failed write or sync answers nothing (JournalError, the worker
exits); ``_quiesce`` has nothing in flight to wait for. After a slow disk
moment every group takes the sync thread until the average is low again, so
that reading goes on during slow syncs.

Storage (``bk.bookie.storage``) flushes the journal's tail into entry logs
and the index on its own flusher thread; the loop only calls
:meth:`ShardStorage.maintain` once a pass (which swaps the tail when it is
due) and keeps serving meanwhile. Garbage collection drops deleted ledgers at
once (the flusher idle) and hands entry-log compaction to the flusher thread
too, reporting the round to the arbiter when it is done.

Plain reads are answered at once, but a connection's output is bounded: past
OUT_HIGH unsent bytes its remaining frames wait in its buffer, unread, until
the client drains the output (then they are dispatched without waiting for
more input).

Plain reads are answered at once. Long-poll reads wait in ``_waiters`` until the
ledger's LAC passes the reader's, checked after every sync, or until they time
out. A frame that cannot be decoded, is too large or has the wrong shape closes
that connection only (logged once); the loop and every other client go on.

Metrics (:class:`bk.metrics.ShardMetrics`, plain numbers) are updated once per
group commit on the add path; the snapshot rides on the heartbeat to the
arbiter, which sums the shards.

TLS and identities (``bk.security``): the arbiter reads the plaintext HELLO
(which carries no secret) and hands the socket over; when the client asked for
START_TLS the worker answers HELLO in plaintext and then runs the server side
of the handshake on that same socket, non-blocking, in this loop (a
connection that has not finished it within HANDSHAKE_TIMEOUT is closed).
TLS runs through memory BIOs (:class:`bk.security.tls.TLSStream`): a TLS
connection's socket is read once per readiness event in large chunks, as a
plaintext one, and decrypted from memory; its answers are encrypted (full
16 KiB records) and leave with one ``sendmsg``, what the socket does not take
waiting as ciphertext (counted against OUT_HIGH like ``out``). What TLS costs
the loop is OpenSSL's: 0.4-0.45 µs per KiB each way on the project's VM, a
little over half of it AES-256-GCM itself and the rest the record layer and
its copies through the memory BIOs; the Python around it is a few calls per
readiness event, not per frame (docs/performance-log.md, TLS).
With ``authProvider`` set a connection may send nothing but AUTH until its
identity is known; its role then fixes ``_Conn.allowed``, the ops it may
send, checked per frame by :meth:`_dispatch_checked`; a connection whose role
may send everything (and every connection without authentication) is
dispatched by :meth:`_dispatch` directly, as before.

The worker exits when told to stop or SIGTERMed (it drains: syncs, sends what
is held, checkpoints), and also when the control channel breaks (the arbiter
died): a worker never outlives its arbiter.
"""

from __future__ import annotations

import collections
import errno
import gc
import logging
import os
import select
import selectors
import signal
import socket
import ssl
import struct
import sys
import threading
import time
import traceback

from bk import park
from bk import protocol as P
from bk import sched
from bk.bookie import aiosync, control, layout
from bk.bookie.journal import CLOSE_WAIT, JournalError, SyncFile
from bk.bookie.storage import ShardStorage
from bk.config import Config
from bk.errors import (EAUTH, EBADREQ, EBADVERSION, EOK, EREADONLY, ESECURITY, ENOENTRY,
                       AuthError, ProtocolError, status_name)
from bk.metrics import NoMetrics, ShardMetrics
from bk.security import auth, tls

log = logging.getLogger("bk.worker")

_frame = P.encode_frame
RECV_SIZE = 256 * 1024
# Bounded output per connection: once a connection's unsent responses pass
# OUT_HIGH (read responses count their payload), the worker stops dispatching its
# frames (the rest stay in its FrameBuffer) and stops reading it, until the
# client drained the output below OUT_LOW. A client pipelining reads of 5 MiB
# entries without reading the answers costs at most OUT_HIGH + one frame.
OUT_HIGH = 8 * 1024 * 1024
OUT_LOW = 1024 * 1024
HEARTBEAT_INTERVAL = 1.0
# Bytes of live entries one GC round's compaction copies at most (on the
# flusher thread; the loop keeps serving).
COMPACT_ROUND_BYTES = 256 << 20
SWITCH_INTERVAL = 0.0002
# Inline group commit (see the theory of operation): a group is synced on the
# loop's own thread, without the hand-off to the sync thread, when no sync is
# in flight, it holds at most INLINE_MAX_ANSWERS answers and INLINE_MAX_BYTES
# unsynced bytes, and the disk's part of recent syncs averaged under
# INLINE_MAX_SYNC. Measured on the project's 2-core VM with lone adds: the
# hand-off cost ~3 context switches, ~12 syscalls and ~25 us of CPU per group
# (sync thread 20, the loop's wake the rest); a pwrite + fdatasync of 200 B to
# 16 KiB took 45-106 us (p50) alone and 0.5-2.6 ms (p50) with six shards and
# etcd syncing too. Bigger groups come with load, where the pipeline's overlap
# of one group's sync with reading and answering the next pays; 5 ms is past
# this disk's usual syncs and below a slow moment or a spinning disk's, when
# reading should not stop for a sync.
INLINE_MAX_ANSWERS = 8
INLINE_MAX_BYTES = 16 * 1024
INLINE_MAX_SYNC = 0.005
SYNC_AVG_WEIGHT = 0.125      # of the newest sync in the moving average
# ... and only while the loop was busy (reading, appending, answering, syncing
# inline; wall time, so also waiting for a core) less than INLINE_MAX_LOAD of
# the last LOAD_WINDOW: a loop with spare time absorbs a sync's wait, a
# saturated one would queue behind it, where the pipeline hides the sync
# instead. Measured busy shares: create+close p50 0.19 (p90 0.28), bench_writes
# at 30,000 entries/s on one ledger p50 0.29 (p90 0.38; its groups are over
# INLINE_MAX_BYTES anyway); 0.25 sent half of the lone adds to the thread
# whenever the machine was contended, which is when the hand-off costs most.
INLINE_MAX_LOAD = 0.5
LOAD_WINDOW = 0.05
HANDSHAKE_TIMEOUT = 10.0     # TLS handshake and AUTH of a new connection, at most
# the connection states besides READY (0): waiting for the TLS handshake, for AUTH
_READY, _HANDSHAKE, _AUTH = 0, 1, 2


def staggered_checkpoint_bytes(limit: int) -> int:
    """This shard's flush threshold from ``flushIntervalBytes``: a random point in
    the last quarter below it. The bookies of an ensemble write the same bytes;
    staggered, their flushes (and the disk bursts of their entry-log writes)
    do not all fall on the same moment. Lower, never higher: the limit still
    bounds what a restart replays."""
    return limit - limit // 4 * int.from_bytes(os.urandom(2), "big") // 65536


# What a ready mask from epoll means (as ``selectors`` reads it): an error or a
# hang-up makes a socket both readable and writable, so that the call that
# meets it closes the connection.
_READABLE = ~select.EPOLLOUT
_WRITABLE = ~select.EPOLLIN


class _Poller:
    """The loop's epoll, registered like a ``selectors`` selector (EVENT_READ,
    EVENT_WRITE, data), whose :meth:`select` returns ``(data, epoll mask)``
    pairs straight from ``epoll.poll`` (test them with _READABLE / _WRITABLE).
    ``selectors`` wraps each ready fd in a key and converts its mask: a few
    microseconds a pass, and a lone add takes two or three passes."""

    __slots__ = ("_ep", "_data")

    def __init__(self):
        self._ep = select.epoll()
        self._data: dict[int, object] = {}       # fd -> data

    @staticmethod
    def _mask(events: int) -> int:
        return (select.EPOLLIN if events & selectors.EVENT_READ else 0) | \
               (select.EPOLLOUT if events & selectors.EVENT_WRITE else 0)

    def register(self, fileobj, events: int, data=None) -> None:
        fd = fileobj if type(fileobj) is int else fileobj.fileno()
        self._ep.register(fd, self._mask(events))
        self._data[fd] = data

    def modify(self, fileobj, events: int, data=None) -> None:
        fd = fileobj if type(fileobj) is int else fileobj.fileno()
        self._ep.modify(fd, self._mask(events))
        self._data[fd] = data

    def unregister(self, fileobj) -> None:
        """KeyError if ``fileobj`` is not registered (or already closed)."""
        fd = fileobj if type(fileobj) is int else fileobj.fileno()
        del self._data[fd]
        self._ep.unregister(fd)

    def select(self, timeout: float) -> list:
        data = self._data
        return [(data[fd], mask) for fd, mask in self._ep.poll(max(0.0, timeout))]


class _Conn:
    __slots__ = ("sock", "fb", "out", "peer", "closed", "writing", "paused", "ack", "ack_gen",
                 "tls", "state", "allowed", "may_fence", "role", "ident", "deadline")

    def __init__(self, sock: socket.socket, max_frame: int):
        self.sock = sock
        self.fb = P.FrameBuffer(max_frame, views=True)   # (dispatch uses a frame at once)
        self.out = bytearray()
        try:
            self.peer = "%s:%s" % sock.getpeername()[:2]
        except OSError:
            self.peer = "?"
        self.closed = False
        self.writing = False
        self.paused = False
        self.ack = None          # [rid, acked runs, errors] of the group being gathered
        self.ack_gen = -1        # the group ``ack`` belongs to
        self.tls = None          # a tls.TLSStream once START_TLS began
        self.state = _READY
        self.allowed = None      # op codes this connection may send; None: all
        self.may_fence = True
        self.role = None
        self.ident = None        # auth.Identity, checked again when token files change
        self.deadline = 0.0      # of the handshake / AUTH


class ShardWorker:
    """Serves one shard until stopped; :meth:`run` never returns (it exits)."""

    def __init__(self, conf: Config, shard: int, num_shards: int, ctrl: socket.socket,
                 deleted=()):
        self.conf = conf
        self.deleted = deleted     # verified deletions it must know before serving (gc.py)
        self.shard = shard
        self.num_shards = num_shards
        self.ctrl = ctrl
        self.bookie_id = conf.bookie_id
        self.max_frame = conf.nettyMaxFrameSizeBytes
        self.group_wait = conf.journalMaxGroupWaitMSec / 1000.0
        self.group_bytes = conf.journalBufferedWritesThreshold
        self.ckpt_bytes = staggered_checkpoint_bytes(conf.flushIntervalBytes)
        self.readonly = False
        self.stopping = False
        self.sel = _Poller()
        self.conns: set[_Conn] = set()
        self.held: list[tuple[_Conn, bytes]] = []   # responses waiting for the next sync
        self.first_held = 0.0
        self.sync_job = None                         # the group commit in flight, if any
        self.inflight: list[tuple[_Conn, bytes]] = []   # responses it covers
        self._sync_jobs: collections.deque = collections.deque()   # for the sync thread
        self._sync_parker: park.Parker | None = None     # the sync thread parks here
        self._aio: aiosync.AioSync | None = None         # syncs without the sync thread
        self._aio_file = SyncFile()                      # the segment those go through
        self._sync_r = self._sync_w = -1
        self._waiters: dict[int, list] = {}          # ledger -> [(conn, msg, deadline)]
        self._gc_deleted: list[int] = []             # ledger ids of a GC round, in chunks
        self._resume: list[_Conn] = []               # drained: dispatch their buffered frames
        self._compacting = None                      # the stats of a GC round compacting
        self._last_minor = self._last_major = time.monotonic()
        self.storage = None
        self.ppid = os.getppid()
        # Metrics are counted per group commit: the held answers that are not adds
        # (fences, LAC writes) and the held adds that failed are the only per-entry
        # counts, and only on those rare paths.
        self.m = ShardMetrics() if conf.enableStatistics else NoMetrics()
        self._held_other = 0
        self._held_failed = 0
        self._held_acks = 0        # group acknowledgements held (each one frame)
        self._held_batched = 0     # batched adds they cover
        self._gen = 0              # the group being gathered (see _Conn.ack_gen)
        self.features = P.FEATURES if conf.frameBatching else 0
        self._group = None                           # (adds, failed, answers, first held)
        self._sync_t0 = 0.0
        self._sync_avg = 0.0                         # the disk's part of recent syncs (average)
        self._sync_data = conf.journalSyncData       # else no group is synced inline
        self._loop_load = 0.0                        # the loop's busy share, last window
        self._failed = False                         # a sync failed: nothing more is answered
        self._last_read_status = EOK
        self.tls = tls.ServerTLS(conf) if conf.tlsCertificatePath else None
        self.auth = auth.Authenticator(conf)
        self._scratch = bytearray(RECV_SIZE)         # TLS: ciphertext read, then decrypted
        self.tls_required = self.tls is not None and conf.tlsRequired
        if self.tls is not None:
            self.features |= P.FEATURE_TLS
        if self.auth.enabled:
            self.features |= P.FEATURE_AUTH
        self._unready: set[_Conn] = set()            # in handshake or before AUTH
        self._auth_gen = self.auth.generation        # the token files checked against

    # --- life cycle --------------------------------------------------------
    def run(self):
        code = 0
        try:
            sched.request_slice(self.conf.ioThreadSliceMicros)   # this thread only
            self._boot()
            self._loop()
        except Exception as e:
            code = 1
            log.error("shard %d failed: %s\n%s", self.shard, e, traceback.format_exc())
            try:
                control.send(self.ctrl, "error", f"shard {self.shard}: {e}")
            except OSError:
                pass
        finally:
            try:
                self._drain()
            except Exception as e:  # draining must never turn into a hang or a loop
                log.error("shard %d: drain failed: %s", self.shard, e)
                code = code or 1
        logging.shutdown()
        os._exit(code)

    def _boot(self):
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # The sync thread must get the GIL back as soon as fdatasync returns, or
        # a finished group waits out the loop's 5 ms default time slice.
        sys.setswitchinterval(SWITCH_INTERVAL)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        jdir, idir = layout.shard_dirs(self.conf, self.shard)
        t0 = time.monotonic()
        shard, n = self.shard, self.num_shards
        conf = self.conf
        self.storage = ShardStorage(
            jdir, idir, segment_size=conf.journalPreAllocSizeMB << 20,
            sync_data=conf.journalSyncData, owns=lambda lid: P.shard_of(lid, n) == shard,
            progress=self._replay_progress, ledger_dirs=layout.shard_ledger_dirs(conf, shard),
            write_cache_bytes=conf.dbStorage_writeCacheMaxSizeMb << 20,
            flush_bytes=self.ckpt_bytes, flush_interval=conf.flushInterval / 1000.0,
            read_cache_bytes=conf.dbStorage_readAheadCacheMaxSizeMb << 20,
            read_ahead_entries=conf.dbStorage_readAheadCacheBatchSize,
            log_size_limit=conf.logSizeLimit,
            recent_deletions_seconds=conf.gcFullReconcileIntervalSeconds,
            uncache_journal=conf.journalRemovePagesFromCache,
            direct_journal=conf.journalDirectWrites,
            direct_journal_memory=conf.journalDirectMemoryMB << 20,
            index_cache_bytes=conf.dbStorage_rocksDB_blockCacheSize)
        if self.deleted:
            # a zombie writer's add to one of these must be refused from the first request
            self.storage.delete_ledgers(self.deleted)
            self.deleted = ()
        stats = self.storage.stats()
        log.info("shard %d ready in %.2fs: %s ledgers", self.shard,
                 time.monotonic() - t0, stats.get("ledgers"))
        self.ctrl.setblocking(True)
        self.ctrl.settimeout(10.0)
        self.sel.register(self.ctrl, selectors.EVENT_READ, None)
        self._sync_r, self._sync_w = os.pipe()
        os.set_blocking(self._sync_r, False)
        self.sel.register(self._sync_r, selectors.EVENT_READ, "sync")
        self._sync_parker = park.Parker()
        self._start_sync_thread()
        self._aio = self._open_aio()
        if self._aio is not None:
            self.sel.register(self._aio.fd, selectors.EVENT_READ, "aio")
        # What boot built (the storage, the replayed index and ledger states: as
        # many objects as the shard holds ledgers) lives as long as the worker:
        # frozen, the cyclic collector's full passes skip it, as they skip what
        # the fork inherited (see bk.bookie.arbiter), and do not stall the loop.
        gc.freeze()
        control.send(self.ctrl, "ready", {"shard": self.shard, "pid": os.getpid()})

    def _on_term(self, signum, frame):
        self.stopping = True

    def _replay_progress(self, done: int, total: int):
        # A long replay is not a hung boot: the arbiter waits as long as this arrives.
        log.info("shard %d replaying its journal: %d%% (%d of %d MiB)", self.shard,
                 100 * done // max(1, total), done >> 20, total >> 20)
        try:
            control.send(self.ctrl, "replay", done, total)
        except OSError:
            pass

    # --- group commit ------------------------------------------------------------
    def _start_sync_thread(self):
        threading.Thread(target=self._sync_thread, name=f"bk-sync-{self.shard}",
                         daemon=True).start()

    def _open_aio(self):
        return aiosync.open_context() if self.conf.journalSyncThroughAio else None

    def _submit_sync(self, job):
        """Begin a group's sync: through Linux AIO (``bk.bookie.aiosync``: no thread
        of ours wakes for it), else, and for the rare job that must sync the
        directory too (the first after a roll), on the sync thread."""
        aio = self._aio
        if aio is not None and job.directory is None and job.path is not None:
            try:
                if job.parts is not None:    # a direct write (journalDirectWrites)
                    aio.submit_write(job.fd, job.parts, job.offset)
                    job.started(self._aio_wait)   # (only once the kernel has it: a
                else:                             # refused one goes to the thread)
                    aio.submit(self._aio_file.descriptor(job.path))
                return
            except OSError as e:
                log.warning("shard %d: a sync through Linux AIO refused (%s); the sync "
                            "thread syncs from now on", self.shard, e)
                self._close_aio()
        self._hand_sync(job)

    def _close_aio(self):
        """Drop Linux AIO (refused, or at exit). A direct write still in flight
        through it is reaped into its job first: the journal waits for that job
        before it writes the same blocks, slides or unmaps its window (``SyncJob.wait``),
        and nothing could reap it once the context is gone. A request that does
        not complete within the journal's close wait leaves the context in place
        (``AioSync.close``) rather than hang the exit."""
        aio, self._aio = self._aio, None
        if aio is not None:
            try:
                self.sel.unregister(aio.fd)
            except (KeyError, ValueError):
                pass
            job = self.sync_job
            if aio.busy and job is not None and job.waiter is not None:
                try:
                    res = aio.reap(wait=True, timeout=CLOSE_WAIT)
                except OSError as e:
                    log.error("shard %d: reaping the direct write in flight failed: %s",
                              self.shard, e)
                    res = None
                if res is not None:
                    self._aio_done(res)
            if not aio.close(timeout=CLOSE_WAIT):
                log.error("shard %d: a request through Linux AIO did not complete within "
                          "%.0f s; its context is left open", self.shard, CLOSE_WAIT)
        self._aio_file.close()

    def _aio_done(self, res):
        """Put the reaped result of the AIO sync in flight into its job, as the sync
        thread's run would have (a direct write's job is then done: see
        ``SyncJob.wait``)."""
        job = self.sync_job
        job.seconds = time.monotonic() - self._sync_t0
        if res < 0:
            job.error = OSError(-res, f"fdatasync of {job.path}: {os.strerror(-res)}")
        elif job.parts is not None and res != sum(len(v) for _, v in job.parts):
            job.error = OSError(errno.EIO, f"short direct write to {job.path}: {res} bytes")
        if job.done is not None:
            job.done.set()

    def _aio_wait(self, job, timeout=None):
        """The journal waits for the direct write in flight before it writes the
        same blocks again (``Journal._drain``) or unmaps them (its close): reap it
        here, waiting at most ``timeout`` seconds; the loop completes the group as
        usual when it sees the eventfd (still set, see ``reap``). Nothing to reap
        (the context gone: ``_close_aio`` reaped it into the job, if it could)
        leaves the job as it is: the journal sees it not done."""
        aio = self._aio
        if aio is None or not aio.busy or job is not self.sync_job:
            return
        res = aio.reap(wait=True, timeout=timeout)
        if res is not None:
            self._aio_done(res)

    def _hand_sync(self, job):
        """Give the sync thread a job (None: exit). It parks on an eventfd, written
        here with the GIL released: a lock released here (a queue's) would wake it
        while this thread holds the GIL, and on a busy machine the woken thread
        then preempts the loop only to find the GIL taken, and sleeps again."""
        self._sync_jobs.append(job)
        self._sync_parker.unpark()

    def _sync_thread(self):
        jobs, parker, keep = self._sync_jobs, self._sync_parker, SyncFile()
        try:
            while True:
                if not jobs:
                    parker.park()            # may return early: the deque says
                    continue
                job = jobs.popleft()
                if job is None:
                    return
                self._run_sync(job, keep)
        finally:
            keep.close()

    def _run_sync(self, job, keep=None):
        """Run one group's sync (blocking) and tell the loop through the pipe. Per
        group the thread takes the GIL three times (parked, fdatasync, write)."""
        job.run(keep)
        os.write(self._sync_w, b"s")

    def _start_sync(self, done=None):
        """Commit the held group: begin its sync, then answer ``done`` (the group whose
        sync has just completed, see :meth:`_on_sync_done`), so that the answering
        overlaps this sync. A small group due while no sync was in flight (``done``
        None; see :meth:`_may_sync_inline`) is instead synced on this thread and
        answered at once; one gathered during a sync keeps the pipeline, since the
        input goes on arriving. A group that needs no sync (nothing appended, e.g.
        only an already fenced ledger fenced; or journalSyncData=false) is answered
        at once, after ``done``."""
        if done is None and self._may_sync_inline():
            self._sync_inline()
            return
        try:
            job = self.storage.begin_sync()
        except JournalError:         # a failed write: the journal refuses everything now
            self._failed = True
            if done is not None:     # durable already
                self._answer(done)
            raise
        group = self._take_group(self.held)
        held, self.held = self.held, []
        if job is not None and job.path is not None:
            self.sync_job = job
            self._group = group
            self._sync_t0 = time.monotonic()
            self.inflight = held
            self._submit_sync(job)
            if done is not None:
                self._answer(done)
            return
        if done is not None:
            self._answer(done)
        if job is not None:          # journalSyncData=false: written out, nothing to wait for
            self.storage.end_sync(job)
        self._answer((held, group))

    def _may_sync_inline(self) -> bool:
        """Whether the held group is small enough, and the disk quick enough lately,
        to be synced on the loop's thread (only ever when no sync is in flight)."""
        return (self._sync_avg < INLINE_MAX_SYNC and self._loop_load < INLINE_MAX_LOAD
                and len(self.held) <= INLINE_MAX_ANSWERS
                and self.storage.unsynced_bytes <= INLINE_MAX_BYTES and self._sync_data)

    def _sync_inline(self):
        """Sync the held group on this thread (one pwrite + fdatasync), then answer it.
        If the write or the sync fails, nothing of it is answered (JournalError)."""
        group = self._take_group(self.held)
        held, self.held = self.held, []
        if self.storage.unsynced_bytes:     # else nothing to wait for (e.g. a second fence)
            self.inflight = held    # what the sync under way covers, as for the thread's
            t0 = time.monotonic()
            try:
                self.storage.sync()
            except JournalError:
                self._failed = True
                raise
            finally:
                self.inflight = []
            t = time.monotonic() - t0
            self._synced(t, t)
        self._answer((held, group))

    def _synced(self, latency: float, disk: float):
        """A sync completed ``latency`` seconds after it began, the disk's part of it
        ``disk`` (without the hand-off to and from the sync thread): its metric, and
        the moving average of the disk's part that decides inline or pipelined."""
        self.m.synced(latency)
        self._sync_avg += (disk - self._sync_avg) * SYNC_AVG_WEIGHT

    def _end_sync(self):
        """The sync in flight completed: its group ``(answers, counts)``, not answered
        yet. JournalError (and nothing of that group or any later one is ever
        answered) if the sync failed."""
        job, self.sync_job = self.sync_job, None
        answers, self.inflight = self.inflight, []
        try:
            self.storage.end_sync(job)
        except JournalError:
            self._failed = True
            raise
        self._synced(time.monotonic() - self._sync_t0, job.seconds)
        return answers, self._group

    def _answer(self, done):
        """Send a durable group's answers; then the long polls its LACs satisfy."""
        answers, group = done
        self._release(answers)
        self._count_group(group)
        if self._waiters:
            self._wake_waiters(time.monotonic())

    def _take_group(self, held) -> tuple:
        n = len(held)
        adds = n - self._held_other - self._held_acks + self._held_batched
        group = (adds, self._held_failed, adds + self._held_other, self.first_held)
        self._held_other = self._held_failed = self._held_acks = self._held_batched = 0
        self._gen += 1          # later batched adds go into new group acknowledgements
        return group

    def _count_group(self, group):
        adds, failed, answers, first = group
        if answers:
            self.m.add_group(adds, failed, answers, time.monotonic() - first)

    def _on_aio_done(self):
        res = self._aio.reap() if self._aio is not None else None
        job = self.sync_job
        if job is None:
            return
        if res is None:     # unless a direct write the journal waited for was reaped then
            if job.waiter is None or not job.done.is_set():
                return
        else:
            self._aio_done(res)
        self._sync_completed()

    def _on_sync_done(self):
        try:
            os.read(self._sync_r, 64)
        except BlockingIOError:
            return
        if self.sync_job is None:
            return
        self._sync_completed()

    def _sync_completed(self):
        done = self._end_sync()
        if self.held:                # gathered while that sync ran: its sync begins first
            self._start_sync(done)
        else:
            self._answer(done)

    def _wait_sync(self):
        """Block until the sync in flight (if any) completed and is answered."""
        if self.sync_job is None:
            return
        done = self.sync_job.done
        if done is not None and done.is_set() and self.sync_job.waiter is not None:
            self._answer(self._end_sync())      # reaped already (see _aio_wait)
            return
        if self._aio is not None and self._aio.busy:
            self._aio_done(self._aio.reap(wait=True))
            self._answer(self._end_sync())
            return
        os.set_blocking(self._sync_r, True)
        try:
            os.read(self._sync_r, 1)
        finally:
            os.set_blocking(self._sync_r, False)
        self._answer(self._end_sync())

    def _quiesce(self):
        """Make everything durable and answered: before checkpoints, GC and exit.
        After a failed sync nothing more is answered (the held answers are dropped)."""
        if self._failed:
            self.held = []
            return
        self._wait_sync()
        if self.storage.unsynced_bytes:
            try:
                self.storage.sync()
            except JournalError:
                self._failed = True
                raise
        held, self.held = self.held, []
        self._answer((held, self._take_group(held)))

    def _drain(self):
        """The worker's exit: everything durable answered, then the connections and
        the storage closed. A failed sync or write found here (the group in flight,
        or the rest's sync) answers nothing more, and the exit goes on: the sync
        thread and AIO are let go, the connections closed, the journal closed
        (which never waits for ever on a write in flight, see ``Journal.close``)."""
        if self.storage is None:
            return
        try:
            self._quiesce()
        except JournalError as e:
            self._failed = True
            self.held = []
            log.error("shard %d: the last sync failed (%s); nothing more is answered",
                      self.shard, e)
        self._close_aio()
        if self._sync_parker is not None:
            self._hand_sync(None)
        deadline = time.monotonic() + 2.0
        pending = [c for c in self.conns if self._unsent(c) and not c.closed]
        while pending and time.monotonic() < deadline:
            for c in pending:
                self._flush(c)
            pending = [c for c in pending if self._unsent(c) and not c.closed]
            if pending:
                time.sleep(0.01)
        for c in list(self.conns):
            self._close(c, None)
        self.storage.close()
        self._send_hb()               # the last counts, so a clean restart loses none
        self.storage = None

    # --- the loop ----------------------------------------------------------
    def _loop(self):
        sel = self.sel
        storage = self.storage
        next_hb = 0.0
        busy = idle = 0.0          # seconds of this load window (see _may_sync_inline)
        while not self.stopping:
            now = time.monotonic()
            if self.held and self.sync_job is None:
                timeout = max(0.0, self.first_held + self.group_wait - now)
            else:
                timeout = min(HEARTBEAT_INTERVAL, max(0.0, next_hb - now))
                if self._waiters:
                    timeout = min(timeout, 0.05)
            if self._resume:
                timeout = 0
            elif self._compacting is not None:
                timeout = min(timeout, 0.05)
            events = sel.select(timeout)
            woke = time.monotonic()
            idle += woke - now
            for conn, mask in events:
                if conn is None:
                    self._on_control()
                    continue
                if conn == "aio":
                    self._on_aio_done()
                    continue
                if conn == "sync":
                    self._on_sync_done()
                    continue
                if mask & _READABLE:
                    self._on_readable(conn)
                if mask & _WRITABLE and not conn.closed:
                    self._flush(conn)
            if self._resume:
                resume, self._resume = self._resume, []
                for conn in resume:
                    if not conn.closed and not conn.paused:
                        self._dispatch_frames(conn)
            if self.held and self.sync_job is None:
                now = time.monotonic()
                if (not events or storage.unsynced_bytes >= self.group_bytes
                        or now - self.first_held >= self.group_wait):
                    self._start_sync()
            elif self._waiters:
                self._wake_waiters(time.monotonic())
            now = time.monotonic()
            busy += now - woke
            if busy + idle >= LOAD_WINDOW:
                self._loop_load = busy / (busy + idle)
                busy = idle = 0.0
            if now >= next_hb:
                next_hb = now + HEARTBEAT_INTERVAL
                if os.getppid() != self.ppid:
                    log.error("shard %d: the arbiter is gone; exiting", self.shard)
                    return
                if not self._send_hb():
                    return
                if self._unready:
                    self._expire_unready(now)
                self.auth.refresh(now)
                if self.auth.generation != self._auth_gen:
                    self._close_revoked()
            if self._compacting is not None:
                self._compaction_step()
            storage.maintain(now)

    def _send_hb(self) -> bool:
        """A heartbeat, carrying this shard's metrics (see bk.metrics)."""
        try:
            if self.m.enabled:
                snap = self.m.snapshot(self.storage.stats(), len(self.held) + len(self.inflight),
                                       len(self.conns))
                control.send(self.ctrl, "hb", snap)
            else:
                control.send(self.ctrl, "hb")
        except OSError:
            return False
        return True

    def _on_control(self):
        try:
            msg, fds = control.recv(self.ctrl)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            msg, fds = None, []
        if msg is None:
            log.warning("shard %d: control channel closed; exiting", self.shard)
            self.stopping = True
            return
        control.dispatch(self, control.TO_WORKER, msg, fds=fds)

    # --- control messages from the arbiter (bk.bookie.control), by name -------------------
    def handle_conn(self, peer, fds=()):
        """Connections handed over by the arbiter."""
        for fd in fds:
            self._adopt(fd, peer)

    def handle_readonly(self, readonly):
        self.readonly = bool(readonly)
        log.info("shard %d is now %s", self.shard, "read-only" if self.readonly else "writable")

    def handle_gc_begin(self):
        """A full GC round: report every ledger this shard holds (each may have been
        deleted), and which of them are settled (the over-replicated scan skips
        those: dropped already, see ShardStorage.settled)."""
        settled = self.storage.settled()
        control.send_chunked(self.ctrl, "gc_ledgers", self.storage.ledgers(),
                             lambda chunk: [lid for lid in chunk if lid in settled])

    def handle_gc_drop(self, ids):
        # Over-replicated ledgers: the arbiter holds their under-replication
        # locks until this answer, so no re-replication to us races the drop.
        self._quiesce()
        n = self.storage.drop_ledgers(ids)
        if n:
            log.info("shard %d gc: dropped the entries of %d over-replicated ledgers",
                     self.shard, n)
        control.send(self.ctrl, "gc_dropped", n)

    def handle_gc_delete(self, ids, last, threshold=0.0):
        """Deleted ledgers (a round may send them in several messages; ``last`` ends it)."""
        self._gc_deleted.extend(ids)
        if last:
            self._collect_garbage(threshold)

    def handle_stop(self):
        self.stopping = True

    def _collect_garbage(self, threshold: float):
        ids, self._gc_deleted = self._gc_deleted, []
        self._quiesce()
        dropped = self.storage.delete_ledgers(ids) if ids else 0
        stats = {"ledgers_deleted": dropped, "segments_removed": 0, "bytes_freed": 0,
                 "entries_moved": 0, "bytes_moved": 0}
        # compactionThreshold 0 (from the arbiter) turns compaction off; otherwise
        # BookKeeper's schedule: major when its interval passed, else minor.
        level = self._compaction_level() if threshold > 0 else None
        if level is not None and self._compacting is None and \
                self.storage.start_compaction(level, COMPACT_ROUND_BYTES):
            self._compacting = stats         # finished in _compaction_step, from the loop
        else:
            self._gc_done(stats)

    def _compaction_level(self):
        """The threshold of the compaction due now (major, minor) or None."""
        now = time.monotonic()
        conf = self.conf
        if conf.majorCompactionThreshold > 0 and \
                now - self._last_major >= conf.majorCompactionInterval:
            self._last_major = self._last_minor = now
            return conf.majorCompactionThreshold
        if conf.minorCompactionThreshold > 0 and \
                now - self._last_minor >= conf.minorCompactionInterval:
            self._last_minor = now
            return conf.minorCompactionThreshold
        return None

    def _compaction_step(self):
        done = self.storage.compaction_result()
        if done is None:
            return
        stats, self._compacting = self._compacting, None
        for k in ("segments_removed", "bytes_freed", "entries_moved", "bytes_moved"):
            stats[k] += done.get(k, 0)
        self._gc_done(stats)

    def _gc_done(self, stats: dict):
        if stats["ledgers_deleted"] or stats["segments_removed"]:
            log.info("shard %d gc: %s", self.shard, stats)
        control.send(self.ctrl, "gc_done", stats)

    # --- connections ---------------------------------------------------------
    def _adopt(self, fd: int, hello_body: bytes):
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        conn = _Conn(sock, self.max_frame)
        self.conns.add(conn)
        self.sel.register(sock, selectors.EVENT_READ, conn)
        try:
            msg = P.decode_body(hello_body)
            P.check_request(msg)
            self._hello(conn, msg)
        except (ProtocolError, TypeError, ValueError, IndexError) as e:
            self._close(conn, f"bad HELLO: {e}")

    def _hello(self, conn: _Conn, msg: list):
        rid, version, flags = msg[1], msg[2], msg[4]    # msg[3]: the shard (the arbiter's)
        status, reason, kind = EOK, None, None
        start_tls = type(flags) is int and flags & P.HELLO_START_TLS
        if conn.tls and start_tls:
            raise ProtocolError("START_TLS on a connection that is already TLS")
        if version != P.PROTOCOL_VERSION:
            status, reason = EBADVERSION, f"protocol version {version!r} is not {P.PROTOCOL_VERSION}"
        elif flags is not None and type(flags) is not int:
            # a client of before bk.security: its shared secret, in plaintext
            status, kind = EAUTH, "auth"
            reason = ("plaintext shared secrets in HELLO are no longer accepted: the client "
                      "must present a signed token (authToken) after HELLO")
        elif start_tls and self.tls is None:
            status, kind = ESECURITY, "tls_not_offered"
            reason = f"bookie {self.bookie_id} does not offer TLS (no tlsCertificatePath)"
        elif not start_tls and self.tls_required and not conn.tls:
            status, kind = ESECURITY, "tls_required"
            reason = (f"bookie {self.bookie_id} requires TLS (tlsRequired=true): connect "
                      f"with tlsEnabled=true")
        answer = [P.HELLO, rid, status, P.PROTOCOL_VERSION, self.num_shards, self.bookie_id,
                  self.features]
        if reason:
            answer.append(reason)
        self._send(conn, _frame(answer))
        if status != EOK:
            self._refuse_conn(conn, kind, "HELLO refused: " + reason)
            return
        if start_tls:
            self._start_tls(conn)
        elif self.auth.enabled:
            self._await_auth(conn)

    # --- TLS and identities ------------------------------------------------------
    def _refuse_conn(self, conn: _Conn, kind: str | None, reason: str):
        """Close a connection refused by security (or a bad version), its answer
        sent as far as the socket takes it; counted by ``kind``, logged without
        secrets."""
        if kind is not None:
            self.m.auth_failed(kind)
        self._flush(conn)
        self._close(conn, reason)

    def _await_auth(self, conn: _Conn):
        conn.state = _AUTH
        conn.allowed = auth.AUTH_ONLY
        if not conn.deadline:
            conn.deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        self._unready.add(conn)

    def _start_tls(self, conn: _Conn):
        if conn.out:       # the HELLO answer did not go out whole: nothing sane to do
            self._close(conn, "could not send the HELLO answer before TLS")
            return
        try:
            conn.tls = tls.TLSStream(self.tls.context(), conn.sock, server_side=True)
        except (ssl.SSLError, ValueError) as e:
            self._close(conn, f"TLS failed: {tls.reason(e)}")
            return
        conn.state = _HANDSHAKE
        conn.allowed = auth.AUTH_ONLY
        conn.deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        self._unready.add(conn)
        self._handshake(conn)

    def _handshake(self, conn: _Conn):
        t = conn.tls
        try:
            done = t.handshake()
        except (ssl.SSLError, OSError, ValueError) as e:
            self.m.auth_failed("tls_handshake")
            try:
                t.flush()                # the alert tells the client why
            except OSError:
                pass
            self._close(conn, f"TLS handshake failed: {tls.reason(e)}")
            return
        if not done and t.eof:
            self.m.auth_failed("tls_handshake")
            self._close(conn, "TLS handshake failed: the client closed the connection")
            return
        self._flush_tls(conn)
        if done and not conn.closed:
            # A client always sends AUTH after the handshake, even to a bookie that
            # checks no identity: its answer is where a refused certificate shows.
            conn.state = _AUTH
            self._on_readable_tls(conn)

    def _auth(self, conn: _Conn, msg: list):
        P.check_request(msg)
        rid, token = msg[1], msg[2]
        if conn.state == _READY and self.auth.enabled:
            self._send(conn, _frame([P.AUTH, rid, EBADREQ, "already authenticated"]))
            return
        try:
            ident = self.auth.authenticate(token, conn.tls.peer_identity()
                                           if conn.tls is not None else None)
        except AuthError as e:
            self._send(conn, _frame([P.AUTH, rid, EAUTH, str(e)]))
            self._refuse_conn(conn, "auth", f"AUTH refused: {e}")
            return
        role = None if ident is None else ident.role
        conn.allowed, conn.may_fence = self.auth.grant(role)
        conn.role = role
        conn.ident = ident
        conn.state = _READY
        self._unready.discard(conn)
        self._send(conn, _frame([P.AUTH, rid, EOK, role]))

    def _dispatch_checked(self, conn: _Conn, msg: list):
        """Dispatch a frame of a connection whose role may not send every op."""
        allowed = conn.allowed
        if allowed is None:
            self._dispatch(conn, msg)
            return
        op = msg[0]
        if op == P.AUTH:
            self._auth(conn, msg)
            return
        if conn.state != _READY:
            self._refuse_conn(conn, "auth", f"{P.OP_NAMES.get(op, op)} before AUTH")
            return
        if op in allowed and (conn.may_fence or op not in auth.FENCING_OPS
                              or not self._fences(op, msg)):
            self._dispatch(conn, msg)
            return
        self._refuse_op(conn, msg)

    @staticmethod
    def _fences(op: int, msg: list) -> bool:
        flags = msg[4] if op == P.READ else msg[3] if op == P.READ_LAC else msg[6]
        return type(flags) is int and bool(flags & P.FLAG_FENCE)

    def _refuse_op(self, conn: _Conn, msg: list):
        """Answer EAUTH in the shape of the op (the client fails that request with
        AuthError; the connection stays up)."""
        op = msg[0]
        if op == P.ADD_BATCH:
            rid = msg[1]
            errors = []
            for lid, eid, _lac, _s, _e in P.split_add_batch(msg[5], msg[4]):
                errors += (lid, eid, EAUTH)
            answer = P.add_ack(rid, [], errors)
        else:
            P.check_request(msg)
            rid = msg[1]
            if op == P.ADD:
                answer = [P.ADD, rid, EAUTH, msg[2], msg[3]]
            elif op == P.READ:
                answer = [P.READ, rid, EAUTH, msg[2], msg[3], -1, None, None, -1]
            elif op == P.READ_LAC:
                answer = [P.READ_LAC, rid, EAUTH, msg[2], -1, -1]
            elif op == P.WRITE_LAC:
                answer = [P.WRITE_LAC, rid, EAUTH, msg[2]]
            elif op == P.READ_RANGE:
                answer = [P.READ_RANGE, rid, EAUTH, msg[2], msg[3], [], -1]
            else:
                answer = [op, rid, EAUTH]
        self.m.auth_failed("op")
        what = P.OP_NAMES.get(op, op)
        if op in auth.FENCING_OPS:
            what += " (fencing)"
        log.warning("shard %d: refused %s from %s: role %r may not send it", self.shard,
                    what, conn.peer, conn.role)
        self._send(conn, _frame(answer))

    def _expire_unready(self, now: float):
        for conn in [c for c in self._unready if now > c.deadline]:
            self.m.auth_failed("tls_handshake" if conn.state == _HANDSHAKE else "auth")
            self._close(conn, "no TLS handshake or AUTH in time")

    def _close_revoked(self):
        """The token files changed: close the connections whose token was revoked or
        whose key was removed (the client reconnects, presenting its current token)."""
        self._auth_gen = self.auth.generation
        for conn in [c for c in self.conns if c.ident is not None]:
            why = self.auth.refused(conn.ident)
            if why:
                self.m.auth_failed("revoked")
                self._close(conn, f"role {conn.role!r}: {why}")

    def _on_readable_tls(self, conn: _Conn):
        """Read a TLS connection's socket once (as a plaintext one) and dispatch the
        frames of the records it completed."""
        t = conn.tls
        try:
            if conn.state == _HANDSHAKE:
                t.feed(self._scratch)
                self._handshake(conn)
                return
            got = t.recv_into(conn.fb, self._scratch)
        except OSError as e:             # ssl.SSLError included
            self._close_after(conn, e)
            return
        if t.backlog:                    # TLS itself answered something
            self._flush_tls(conn)
        if got:
            self._dispatch_frames(conn)
        elif t.eof:                      # (frames that came with the EOF went first)
            self._close(conn, None)

    def _flush_tls(self, conn: _Conn) -> int:
        """Encrypt ``conn.out`` and send what the socket takes; the ciphertext bytes
        left (-1 if the connection broke)."""
        t = conn.tls
        try:
            if conn.out:
                t.encrypt([conn.out])
                conn.out.clear()
            left = t.flush()
        except OSError as e:
            self._close_after(conn, e)
            return -1
        if bool(left) != conn.writing:
            conn.writing = bool(left)
            self._update_interest(conn)
        return left

    def _on_readable(self, conn: _Conn):
        if conn.tls is not None:
            self._on_readable_tls(conn)
            return
        fb = conn.fb
        try:
            n = conn.sock.recv_into(fb.recv_buffer(RECV_SIZE), RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._close_after(conn, e)
            return
        if not n:
            self._close(conn, None)
            return
        fb.commit(n)
        self._dispatch_frames(conn)

    def _dispatch_frames(self, conn: _Conn):
        """Dispatch the connection's buffered frames until its unsent output passes
        OUT_HIGH; then pause it (no reading, the rest stays buffered) until _flush
        drained it below OUT_LOW."""
        dispatch = self._dispatch if conn.allowed is None else self._dispatch_checked
        try:
            for msg in conn.fb.frames():
                dispatch(conn, msg)
                if len(conn.out) > OUT_HIGH or conn.closed or (
                        conn.tls is not None and conn.tls.backlog_bytes > OUT_HIGH):
                    if not conn.closed and not conn.paused:
                        conn.paused = True
                        self._update_interest(conn)
                    return
        except (ProtocolError, TypeError, ValueError, IndexError, KeyError,
                struct.error, OverflowError) as e:
            self._close(conn, f"protocol error: {e}")

    def _dispatch(self, conn: _Conn, msg: list):
        op = msg[0]
        if op == P.ADD_BATCH and len(msg) == 6:     # the hot paths first (batches: the
            self._add_batch(conn, msg)              # client's default, frameBatching)
            return
        if op == P.ADD and len(msg) == 9:
            _, rid, lid, eid, lac, mk, flags, digest, payload = msg
            if type(payload) is not bytes or type(digest) is not bytes or type(mk) is not bytes:
                raise ProtocolError("ADD with non-bytes master key, digest or payload")
            if type(lid) is not int or type(eid) is not int or type(lac) is not int \
                    or lid < 0 or eid < 0 or type(flags) is not int:
                raise ProtocolError("ADD with a bad ledger id, entry id, LAC or flags")
            if self.readonly:
                self.m.add_error("EREADONLY", True)
                self._send(conn, _frame([P.ADD, rid, EREADONLY, lid, eid]))
                return
            status = self.storage.add_entry(lid, eid, lac, mk, digest, payload, flags & P.FLAG_RECOVERY)
            if status:
                self._held_failed += 1
                self.m.add_error(status_name(status), False)
            self._hold(conn, _frame([P.ADD, rid, status, lid, eid]))
            return
        op = P.check_request(msg)
        rid = msg[1]
        st = self.storage
        if op == P.READ_RANGE:
            self._read_range(conn, msg)
            return
        if op in (P.READ, P.READ_LAC, P.WRITE_LAC, P.GET_LIST_OF_ENTRIES):
            lid = msg[2]
            if type(lid) is not int or lid < 0:
                raise ProtocolError(f"{P.OP_NAMES[op]} with bad ledger id {lid!r}")
            if op == P.READ and (type(msg[3]) is not int or type(msg[4]) is not int
                                 or type(msg[6]) is not int or type(msg[7]) is not int):
                raise ProtocolError("READ with a non-integer entry id, flags, LAC or timeout")
            if op == P.READ_LAC and type(msg[3]) is not int:
                raise ProtocolError("READ_LAC with non-integer flags")
        if op == P.READ:
            _, _, lid, eid, flags, mk, prev_lac, timeout_ms = msg
            if flags & P.FLAG_FENCE:
                if type(mk) is not bytes:
                    raise ProtocolError("fencing READ without a master key")
                status = st.fence(lid, mk)
                self._held_other += 1
                if status != EOK:
                    self._hold(conn, _frame([P.READ, rid, status, lid, eid, -1, None, None, -1]))
                    return
                self._hold(conn, self._read_response(rid, lid, eid))
            elif flags & P.FLAG_LONG_POLL and st.lac(lid) <= prev_lac:
                deadline = time.monotonic() + max(0, timeout_ms) / 1000.0
                self._waiters.setdefault(lid, []).append((conn, msg, deadline))
            elif flags & P.FLAG_LONG_POLL:
                self._send(conn, self._long_poll_response(msg))
            else:
                t0 = time.monotonic()
                frame = self._read_response(rid, lid, eid)
                self._send(conn, frame)
                self.m.read(self._last_read_status, time.monotonic() - t0)
        elif op == P.READ_LAC:
            _, _, lid, flags, mk = msg
            if flags & P.FLAG_FENCE:
                if type(mk) is not bytes:
                    raise ProtocolError("fencing READ_LAC without a master key")
                status = st.fence(lid, mk)
                self._held_other += 1
                if status != EOK:
                    self._hold(conn, _frame([P.READ_LAC, rid, status, lid, -1, -1]))
                    return
                status, lac, last = st.read_lac(lid)
                self._hold(conn, _frame([P.READ_LAC, rid, status, lid, lac, last]))
            else:
                status, lac, last = st.read_lac(lid)
                self._send(conn, _frame([P.READ_LAC, rid, status, lid, lac, last]))
        elif op == P.WRITE_LAC:
            _, _, lid, mk, lac = msg
            if type(mk) is not bytes or type(lac) is not int:
                raise ProtocolError("WRITE_LAC needs a bytes master key and an integer LAC")
            if self.readonly:
                self._send(conn, _frame([P.WRITE_LAC, rid, EREADONLY, lid]))
                return
            self._held_other += 1
            self._hold(conn, _frame([P.WRITE_LAC, rid, st.write_lac(lid, mk, lac), lid]))
        elif op == P.GET_BOOKIE_INFO:
            self._send(conn, _frame([P.GET_BOOKIE_INFO, rid, EOK, self._info()]))
        elif op == P.GET_LIST_OF_ENTRIES:
            lid = msg[2]
            status, ranges = st.list_entries(lid)
            self._send(conn, _frame([P.GET_LIST_OF_ENTRIES, rid, status, lid, ranges]))
        elif op == P.PING:
            self._send(conn, _frame([P.PING, rid, EOK]))
        elif op == P.HELLO:
            self._hello(conn, msg)
        elif op == P.AUTH:
            self._auth(conn, msg)
        elif op == P.ADD:
            raise ProtocolError(f"ADD request has {len(msg)} fields, expected 9")
        else:
            self._send(conn, _frame([op, rid, EBADREQ]))

    def _add_batch(self, conn: _Conn, msg: list):
        """ADD_BATCH: append every entry now; the connection's group acknowledgement
        of this group (one frame, sent after its sync) gets the entries' runs and
        errors."""
        _, rid, mk, flags, count, records = msg
        if type(mk) is not bytes or type(flags) is not int or type(rid) is not int:
            raise ProtocolError("ADD_BATCH with a non-bytes master key or bad flags")
        if self.readonly:
            errors = []
            for lid, eid, _lac, _s, _e in P.split_add_batch(records, count):
                errors += (lid, eid, EREADONLY)
                self.m.add_error("EREADONLY", True)
            self._send(conn, _frame(P.add_ack(rid, [], errors)))
            return
        ack = conn.ack
        if conn.ack_gen != self._gen:
            ack = conn.ack = [rid, [], []]
            conn.ack_gen = self._gen
            self._held_acks += 1
            self._hold(conn, ack)
        else:
            ack[0] = rid
        failed = self.storage.add_batch(records, count, mk, flags & P.FLAG_RECOVERY,
                                        ack[1], ack[2])
        self._held_batched += count
        if failed:
            self._held_failed += failed
            errors = ack[2]
            for i in range(len(errors) - 3 * failed + 2, len(errors), 3):
                self.m.add_error(status_name(errors[i]), False)

    def _read_range(self, conn: _Conn, msg: list):
        _, rid, lid, first, last, max_bytes, flags, mk, stride, offset = msg
        for v in (lid, first, last, max_bytes, flags, stride, offset):
            if type(v) is not int:
                raise ProtocolError("READ_RANGE with a non-integer field")
        if lid < 0 or stride < 1 or not 0 <= offset < stride:
            raise ProtocolError(f"READ_RANGE with a bad ledger id, stride or offset: "
                                f"{lid}, {stride}, {offset}")
        # The answer must fit a frame: payloads up to half of it (at least one entry).
        budget = max(1, min(max_bytes, self.max_frame // 2))
        if flags & P.FLAG_FENCE:
            if type(mk) is not bytes:
                raise ProtocolError("fencing READ_RANGE without a master key")
            status = self.storage.fence(lid, mk)
            self._held_other += 1
            if status != EOK:
                self._hold(conn, _frame([P.READ_RANGE, rid, status, lid, first, [], -1]))
                return
            status, nxt, entries = self.storage.read_range(lid, first, last, budget, stride,
                                                           offset)
            self._hold(conn, _frame([P.READ_RANGE, rid, status, lid, nxt, entries,
                                     self.storage.lac(lid)]))
            return
        t0 = time.monotonic()
        status, nxt, entries = self.storage.read_range(lid, first, last, budget, stride, offset)
        self._send(conn, _frame([P.READ_RANGE, rid, status, lid, nxt, entries,
                                 self.storage.lac(lid)]))
        self.m.read_range(status, len(entries) // 4, time.monotonic() - t0)

    def _read_response(self, rid: int, lid: int, eid: int) -> bytes:
        if eid < 0:
            self._last_read_status = ENOENTRY
            return _frame([P.READ, rid, ENOENTRY, lid, eid, -1, None, None, self.storage.lac(lid)])
        status, entry_lac, digest, payload = self.storage.read_entry(lid, eid)
        self._last_read_status = status
        if status != EOK:
            return _frame([P.READ, rid, status, lid, eid, -1, None, None, self.storage.lac(lid)])
        return _frame([P.READ, rid, EOK, lid, eid, entry_lac, digest, payload,
                       self.storage.lac(lid)])

    def _long_poll_response(self, msg: list) -> bytes:
        rid, lid, eid = msg[1], msg[2], msg[3]
        lac = self.storage.lac(lid)
        # The entry rides along only once the LAC covers it: a tailer must never be
        # handed an entry that is not yet confirmed.
        if 0 <= eid <= lac:
            status, entry_lac, digest, payload = self.storage.read_entry(lid, eid)
        else:
            status = ENOENTRY
        if status == EOK:
            return _frame([P.READ, rid, EOK, lid, eid, entry_lac, digest, payload, lac])
        return _frame([P.READ, rid, EOK if status == ENOENTRY else status, lid, -1, -1,
                       None, None, lac])

    def _wake_waiters(self, now: float):
        st = self.storage
        for lid in list(self._waiters):
            waiting = self._waiters[lid]
            lac = st.lac(lid)
            keep = []
            for conn, msg, deadline in waiting:
                if conn.closed:
                    continue
                if lac > msg[6] or now >= deadline:
                    self._send(conn, self._long_poll_response(msg))
                else:
                    keep.append((conn, msg, deadline))
            if keep:
                self._waiters[lid] = keep
            else:
                del self._waiters[lid]

    def _info(self) -> dict:
        info = layout.disk_space(self.conf)
        info.update(self.storage.stats())
        info.update(bookie_id=self.bookie_id, shard=self.shard, num_shards=self.num_shards,
                    readonly=self.readonly, pid=os.getpid(),
                    cpu_seconds=time.process_time())
        return info

    # --- output ----------------------------------------------------------------
    def _hold(self, conn: _Conn, frame: bytes):
        if not self.held:
            self.first_held = time.monotonic()
        self.held.append((conn, frame))

    def _release(self, held):
        touched = {}
        for conn, frame in held:
            if not conn.closed:
                if type(frame) is list:          # a group acknowledgement
                    frame = _frame(P.add_ack(frame[0], frame[1], frame[2]))
                frames = touched.get(conn)
                if frames is None:
                    touched[conn] = [frame]
                else:
                    frames.append(frame)
        for conn, frames in touched.items():
            if conn.out or len(frames) > 64:   # many single answers: one buffer, as before
                for f in frames:
                    conn.out += f
                self._flush(conn)
            else:
                self._send_frames(conn, frames)

    def _send_frames(self, conn: _Conn, frames: list):
        """Send frames with one ``sendmsg`` (no join); what the socket does not take
        waits in ``conn.out``."""
        if conn.tls is not None:     # encrypted, then one sendmsg of the records
            if conn.out:
                for f in frames:
                    conn.out += f
            else:
                try:
                    conn.tls.encrypt(frames)
                except ssl.SSLError as e:
                    self._close_after(conn, e)
                    return
            self._flush(conn)
            return
        try:
            n = conn.sock.sendmsg(frames)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as e:
            self._close_after(conn, e)
            return
        for f in frames:
            k = len(f)
            if n >= k:
                n -= k
                continue
            conn.out += memoryview(f)[n:] if n else f
            n = 0
        if conn.out:
            self._flush(conn)

    def _send(self, conn: _Conn, frame: bytes):
        if not conn.out and not conn.writing and not conn.closed:
            self._send_frames(conn, [frame])     # no copy into conn.out if it all goes
            return
        conn.out += frame
        if not conn.writing:
            self._flush(conn)

    def _flush(self, conn: _Conn):
        if conn.closed:
            return
        if conn.tls is not None:
            if conn.state == _HANDSHAKE:
                self._handshake(conn)    # it waited for the socket to take its bytes
                return
            unsent = self._flush_tls(conn)
            if unsent < 0:
                return
        else:
            if not conn.out:
                return
            try:
                n = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self._close_after(conn, e)
                return
            if n:
                del conn.out[:n]
            unsent = len(conn.out)
        want_write = bool(unsent)
        paused = conn.paused and unsent > OUT_LOW
        if want_write != conn.writing or paused != conn.paused:
            if conn.paused and not paused and conn.fb.pending:
                self._resume.append(conn)      # frames left waiting: dispatch them now
            conn.writing = want_write
            conn.paused = paused
            self._update_interest(conn)

    @staticmethod
    def _unsent(conn: _Conn) -> int:
        return len(conn.out) + (conn.tls.backlog_bytes if conn.tls is not None else 0)

    def _update_interest(self, conn: _Conn):
        mask = (0 if conn.paused else selectors.EVENT_READ) | \
               (selectors.EVENT_WRITE if conn.writing else 0)
        if mask == 0:
            mask = selectors.EVENT_WRITE
        self.sel.modify(conn.sock, mask, conn)

    def _close_after(self, conn: _Conn, e: OSError):
        """Close ``conn`` after a socket error: a reset or broken pipe is the peer
        leaving (no reason logged), a TLS error says what TLS refused."""
        if isinstance(e, ssl.SSLError):
            self._close(conn, f"TLS error: {tls.reason(e)}")
        else:
            self._close(conn, None if e.errno in (errno.ECONNRESET, errno.EPIPE) else str(e))

    def _close(self, conn: _Conn, reason: str | None):
        if conn.closed:
            return
        conn.closed = True
        if reason:
            log.warning("shard %d: closing connection from %s: %s", self.shard, conn.peer, reason)
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        self.conns.discard(conn)
        self._unready.discard(conn)
