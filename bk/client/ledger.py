"""Ledger handles: writing (quorum acks, ensemble changes, close) and reading.

Theory of operation (write path)
--------------------------------
A user thread turns payloads into :class:`PendingAdd` objects under the
handle's lock: it assigns the entry id, the cumulative length, signs the
digest (carrying the LAC known at that moment: the piggybacked LAC) and packs
the entry's ADD_BATCH record head once (the payload is not copied here).
``add_entry_async`` makes exactly one object per entry (the op) and appends
it to a deque: this path runs once per entry in the user's thread, so it
holds no lists, no request ids and nothing a rare path needs. The ops are
handed, in entry-id order, to the I/O thread through that deque, which it
drains without taking the lock (so the I/O thread never waits while a
submitter signs), and which from then on owns every piece of mutable write
state: the ``_pending`` deque, the acknowledgements, the LAC, the ensemble.
It hands each bookie of the ensemble, with one ``send_adds`` per drain, the
ops whose write set (the Qw bookies starting at slot ``entry % E``) it is in
(with E == Qw, with whole ADD_BATCH frames encoded once for all of them); the
connection batches them (``bk.client.connection``) and a group
acknowledgement confirms many at once. Confirmations are kept per ensemble
slot, not per op: one Python int per slot whose bit ``e - _ack_base`` says
the slot's bookie confirmed entry e, so a run of confirmed entries is one OR
(no step per entry), a confirmation that arrives twice counts once, and the
entries that Qa (and Qw) slots confirmed are a few ANDs and ORs of the ints
(``_quorum_masks``). The handle then advances once: the head of ``_pending``
is acknowledged once Qa bookies confirmed it; acknowledging pops every
complete op from the head, so acknowledgement (and the LAC) follows entry-id
order whatever order bookies answer in. When only the head is complete (a
blocking add's every acknowledgement) it is popped alone, without the lists a
run is handled with.

A bookie that fails (connection error, an error status, or an add older than
``addEntryTimeoutSec`` it has not confirmed) starts an *ensemble change*:
acknowledgements stop (the LAC freezes, so the first unacknowledged entry is a
stable fragment start), a worker thread picks a writable replacement (by the
placement policy, ``bk.client.placement``) and CASes the metadata with a new
fragment starting at LAC + 1, or earlier: at the first entry of the current
fragment that was acknowledged by Qa bookies but never confirmed by the failed
one. Such entries are kept (``_unconfirmed``) until every bookie of their write
set confirmed them, and a bookie still silent about the oldest after
``addEntryTimeoutSec`` is replaced even though Qa was reached: otherwise a
client cut off from one bookie would leave every later entry with Qa copies
instead of Qw and hold them all in memory for the silent bookie. They count
against ``throttle`` like unacknowledged adds, so what the client holds for a
silent bookie is bounded (the writer waits for the replacement instead). Moving
acknowledged entries to a new fragment is safe: each keeps the Qa copies of
bookies that stay in its write set, and the replacement is sent it at once. A lost CAS re-reads: a
ledger still OPEN is merged and retried, one IN_RECOVERY or CLOSED fences the
writer. A recovery's write handle changes its ensemble in memory only: the
recovery stores the new fragments with its closing CAS (``bk.client.recovery``).
Once committed, the I/O thread forgets the replaced bookie's confirmations,
resends every pending entry of its slot to the new bookie, and
acknowledgements resume. No entry is ever acknowledged by a bookie that is no
longer in its write set.

EFENCED from more than Qw - Qa bookies of an entry's write set means Qa can no
longer be reached: every pending and later add fails with LedgerFencedError.
A bookie answers EFENCED to the adds of a deleted ledger too (its tombstone),
so on that refusal alone the handle reads the metadata once, on a metadata
thread: a missing key makes the adds fail with NoSuchLedgerError instead
(``_refused``). Reads refused by bookies that know no such ledger ask the same
way (``_raise_if_deleted``), and a metadata re-read that finds the key gone
says so: never a metadata read per entry.

A bookie that answers ETOOMANYREQUESTS is alive but overloaded: the add is
resent to that same bookie after a back-off (2 ms, doubling), and only a
bookie still refusing once the add is ``addEntryTimeoutSec`` old is failed
(ensemble change). An add acknowledged by Qa other bookies meanwhile is still
resent to it: it must get its copy. EREADONLY is a failure at once: a
read-only bookie takes no writes until its disk frees up, and a bookie that
failed is avoided as a replacement by this handle for
``bookieQuarantineTimeSeconds``: avoided, not refused, since it is taken when
no other writable bookie is left (a long-lived ledger must not run out of
bookies).

Reads try the write set's bookies in order and move on when one fails, lacks
the entry, or returns a copy whose digest does not verify. A reader's length
follows the entries it reads: each entry's digest signs the ledger's length
after it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import itertools
import logging
import operator
import threading
import time
import weakref

from bk import protocol
from bk.client import digest as _digest
from bk.client.connection import Call, DeadConnection, closed_error_among, record_frames
from bk.errors import (AuthError, BadPasswordError, BadRequestError, BKError, BookieUnavailableError,
                       ClientClosedError, DigestMismatchError,
                       LedgerClosedError, LedgerFencedError, MetadataError, MetadataVersionError,
                       NoSuchEntryError,
                       NoSuchLedgerError,
                       TimeoutError, TooManyRequestsError, error_for_status)
from bk.errors import EAUTH, EBADREQ, EFENCED, ENOENTRY, ENOLEDGER, EOK, ETOOMANYREQUESTS, EUA
from bk.exposition import client_metrics, observe_many
from bk.meta.ledger import LedgerMetadata, LedgerState
from bk.park import parker
from bk.retry import retry_cas

log = logging.getLogger("bk.client")

_ADD = protocol.ADD
_encode = protocol.encode_frame
_unpack_rec = protocol.unpack_record_head
_REC_HEAD = protocol.REC_HEAD
_FRAME_OVERHEAD = 256          # header fields + digest of an ADD frame, generously
_READ_WINDOW = 1000            # most single READs kept in flight by read_entries
_RANGE_WINDOW = 10_000         # most entries of a read_entries window of READ_RANGEs (two in flight)
_FIRST_ENTRY_GUESS = 64 * 1024  # entry size assumed before read_entries saw one
# Bytes of entries one READ_RANGE asks for. Cold catch-up of 1 KiB entries, same
# run, alternating (bench_scale --catchup-only pattern): 256 KiB requests 210-250
# MB/s, requests of 40 entries ~145 (a request's own cost), half a frame (2.5
# MiB) 145-195 (the first answer is built, and the last decoded, alone).
_RANGE_REQUEST_BYTES = 256 * 1024
_PROBE_ENTRIES = 16            # first window of a read whose entry size is unknown
_data_of = operator.attrgetter("data")
_t_sent_of = operator.attrgetter("t_sent")
_popleft = collections.deque.popleft
_BUSY_BACKOFF = 0.002          # first wait before resending an add refused as ETOOMANYREQUESTS
_REC_PACK: dict = {}           # digest size -> pack of its ADD_BATCH record head (made once)
# Entries acknowledged past a writer's _ack_base before _rebase: small, so that the
# bitsets of a writer with few adds in flight (blocking adds) stay a few machine
# words, whose ANDs and ORs cost less than the Python steps around them.
_REBASE_AT = 256
# Why a handle's adds fail when its bookies refuse them (_refused): the bookies
# answer EFENCED both to a ledger fenced by a recovery and to one deleted (its
# tombstone); the metadata tells which.
_FENCED = "ledger is fenced (recovered by another client)"
_DELETED = "ledger was deleted (its metadata is gone)"


class LedgerEntry:
    """One entry read back: ``ledger_id``, ``entry_id``, ``data`` (bytes), ``length``
    (the ledger's cumulative length after this entry)."""

    __slots__ = ("ledger_id", "entry_id", "data", "length")

    def __init__(self, ledger_id, entry_id, data, length):
        self.ledger_id = ledger_id
        self.entry_id = entry_id
        self.data = data
        self.length = length

    def __repr__(self):
        return f"LedgerEntry(ledger={self.ledger_id}, entry={self.entry_id}, {len(self.data)} bytes)"

    def __eq__(self, other):
        return (isinstance(other, LedgerEntry) and other.ledger_id == self.ledger_id
                and other.entry_id == self.entry_id and other.data == self.data)


class PendingAdd:
    """One add in flight (I/O-thread state after submission).

    ``head`` is the entry's ADD_BATCH record head (ids, LAC, digest) and ``data``
    its payload: the two buffers every bookie of its write quorum is sent. Which
    bookies confirmed it is not kept here but in the handle's per-slot bitsets
    (``LedgerHandle._acks``), so that a group acknowledgement touches no op. One
    is made per entry written, so it holds only what every add needs; ``frame``
    (a single ADD, for a bookie without batches), ``nfenced`` and ``backoff``
    are set only on the paths that need them."""

    __slots__ = ("handle", "entry_id", "head", "data", "wlen", "length",
                 "done", "cb", "t_sent", "frame", "nfenced", "backoff")

    def __init__(self, handle, entry_id, head, data, length, cb, wlen):
        # wlen: len(head) + len(data), which the submitter knows without a call
        self.handle = handle
        self.entry_id = entry_id
        self.head = head
        self.data = data
        self.wlen = wlen
        self.length = length
        self.done = False
        self.cb = cb
        self.t_sent = 0.0

    def single_frame(self) -> bytes:
        """This entry as a single ADD frame (made once, for bookies without batches;
        the LAC and digest are those of the record head)."""
        try:
            return self.frame
        except AttributeError:
            pass
        h = self.handle
        lac, dlen = _unpack_rec(self.head)[3:5]
        digest = self.head[_REC_HEAD:_REC_HEAD + dlen]
        f = self.frame = _encode([_ADD, next(h._loop.rids), h._lid, self.entry_id, lac,
                                  h._master_key, h._flags, digest, self.data])
        return f

    def on_reply(self, conn, msg):
        h = self.handle
        if msg[2] == EOK:
            e = self.entry_id
            h._confirm_run(conn, e, e)
            # (an acknowledged op still counts its late confirmations: see _unconfirmed)
            pending = h._pending
            if pending and pending[0] is self:
                h._advance()
        else:
            h._add_error(self, conn, msg[2])

    def on_error(self, conn, exc):
        # also once acknowledged: a bookie of its write set that fails before it
        # confirmed is replaced, so that the entry gets its Qw copies
        self.handle._bookie_failed(conn, exc)


class _Waiter:
    """Blocks a user thread until an add (or the last add of a batch) completes.

    The thread parks on its own eventfd (:mod:`bk.park`), which the I/O thread
    writes with the GIL released; not an Event (a Condition, an RLock and one
    more lock per wait) nor a Lock (whose release wakes the thread under the
    GIL): one is made per blocking add."""

    __slots__ = ("parker", "done", "entry_id", "error")

    def __init__(self):
        self.parker = parker()
        self.done = False
        self.entry_id = None
        self.error = None

    def __call__(self, exc, entry_id):
        self.error = exc
        self.entry_id = entry_id
        self.done = True
        self.parker.unpark()

    def wait(self):
        while not self.done:
            self.parker.park()
        if self.error is not None:
            raise self.error
        return self.entry_id


# Orders the lazy creation of an _AddFuture's Condition against its completion.
_FUTURE_LOCK = threading.Lock()
_PENDING = concurrent.futures._base.PENDING
_FINISHED = concurrent.futures._base.FINISHED
_DONE = (_FINISHED, concurrent.futures._base.CANCELLED,
         concurrent.futures._base.CANCELLED_AND_NOTIFIED)


class _AddFuture(concurrent.futures.Future):
    """What ``add_entry_async`` returns: a ``concurrent.futures.Future`` (result,
    exception, done, add_done_callback, ``concurrent.futures.wait``...) whose
    Condition and its RLock are made only when someone waits on it while it is
    still pending. Most adds complete before anyone looks, and the base class's
    constructor was most of the CPU of a thread submitting adds. Called as the
    add's callback ``(exc, entry_id)`` on the I/O thread."""

    def __init__(self):          # not super().__init__(): _condition, _waiters are lazy
        self._state = _PENDING
        self._result = None
        self._exception = None
        self._done_callbacks = []

    def __getattr__(self, name):
        # called only for attributes not set yet: the base class's lazy ones
        if name not in ("_condition", "_waiters"):
            raise AttributeError(name)
        with _FUTURE_LOCK:
            d = self.__dict__
            if "_condition" not in d:
                d["_waiters"] = []
                d["_condition"] = threading.Condition()
            return d[name]

    def __call__(self, exc, entry_id):
        with _FUTURE_LOCK:
            lazy = "_condition" not in self.__dict__
            if lazy:                # nobody waits on it: nothing to notify
                if exc is None:
                    self._result = entry_id
                else:
                    self._exception = exc
                self._state = _FINISHED
        if not lazy:
            if exc is None:
                self.set_result(entry_id)
            else:
                self.set_exception(exc)
            return
        for fn in self._done_callbacks:
            try:
                fn(self)
            except Exception:
                log.exception("exception calling callback for %r", self)

    def done(self):
        return self._state in _DONE          # one read: no lock (nor a Condition made)

    def result(self, timeout=None):
        if self._state == _FINISHED:        # no lock once it is done
            if self._exception is not None:
                raise self._exception
            return self._result
        return super().result(timeout)

    def exception(self, timeout=None):
        if self._state == _FINISHED:
            return self._exception
        return super().exception(timeout)


class _ReadBatch:
    """The reads of one window of read_entries (I/O thread): ``results[i]`` gets
    entry ``first + i``; an entry no replica could give ends in ``failed`` (its
    op, for the error). Counts down and wakes the caller."""

    __slots__ = ("remaining", "event", "results", "first", "failed")

    def __init__(self, n, first=0):
        self.remaining = n
        self.event = threading.Event()
        self.results = [None] * n
        self.first = first
        self.failed = {}
        if n == 0:
            self.event.set()

    def one_done(self):
        self.remaining -= 1
        if self.remaining == 0:
            self.event.set()

    def done(self, k):
        self.remaining -= k
        if self.remaining == 0:
            self.event.set()


class _ReadOp:
    """Read one entry, trying the bookies of its write set in order (I/O thread).

    ``conns`` is the write set, quarantined bookies last (``bk.client.health``).
    ``idx`` is the next replica to ask, ``outstanding`` the requests in flight:
    with ``speculativeReadTimeout`` the next replica is asked too when one has
    not answered within it, and the first good copy wins. The entry ends in its
    batch: ``results`` when read, ``failed`` (this op, for the error) when no
    replica could give it."""

    __slots__ = ("h", "entry_id", "conns", "idx", "batch", "result", "errors", "timeout",
                 "outstanding", "done", "__weakref__")

    def __init__(self, h, entry_id, conns, batch, timeout):
        self.h = h
        self.entry_id = entry_id
        self.conns = conns
        self.idx = 0
        self.batch = batch
        self.result = None
        self.errors = []
        self.timeout = timeout
        self.outstanding = 0
        self.done = False

    def start(self):
        conn = self.conns[self.idx]
        self.idx += 1
        self.send(conn)
        self.speculate_later()

    def send(self, conn):
        """A single READ of the entry to ``conn`` (counted in flight)."""
        self.outstanding += 1
        h = self.h
        rid = next(h._loop.rids)
        conn.send(rid, self, _encode(protocol.read(rid, h._lid, self.entry_id)), self.timeout)

    def speculate_later(self):
        spec = self.h._spec_timeout
        if spec and not self.done and self.idx < len(self.conns):
            # a weak reference: the timer must not keep a read (and its entry's
            # data) alive after the caller has it
            self.h._loop._add_timer(self.h._loop.now + spec, _speculate_ref,
                                    (weakref.ref(self), self.idx))

    def _speculate(self, idx):
        # still waiting for the replicas asked so far: ask the next one as well
        if not self.done and self.idx == idx and self.outstanding:
            self.h._m.speculative_reads.inc()
            self.start()

    def complete(self, entry):
        if not self.done:
            self.done = True
            self.result = entry
            batch = self.batch
            batch.results[self.entry_id - batch.first] = entry
            batch.one_done()

    def failed(self, bookie_id, exc):
        self.outstanding -= 1
        if self.done:
            return
        self.errors.append((bookie_id, exc))
        if self.idx < len(self.conns):
            self.start()
        elif self.outstanding <= 0:
            self.done = True
            self.batch.failed[self.entry_id] = self
            self.batch.one_done()

    def on_reply(self, conn, msg):
        status = msg[2]
        if status == EOK:
            try:
                length = self.h._digest.verify(self.entry_id, msg[5], msg[6], msg[7])
            except DigestMismatchError as e:
                self.failed(conn.bookie_id, e)
            else:
                self.outstanding -= 1
                self.complete(LedgerEntry(self.h._lid, self.entry_id, msg[7], length))
            return
        self.failed(conn.bookie_id, error_for_status(status if status != EOK else ENOENTRY,
                                                     f"bookie {conn.bookie_id}"))

    def on_error(self, conn, exc):
        self.failed(conn.bookie_id, exc)

    def no_ledger(self) -> bool:
        """True if a bookie answered that it has no such ledger (deleted?)."""
        return any(type(e) is NoSuchLedgerError for _, e in self.errors)

    def error(self) -> BKError:
        what = f"read entry {self.entry_id} of ledger {self.h._lid}"
        if closed_error_among(e for _, e in self.errors) is not None:
            return self.h._client._closed_error(what)
        detail = "; ".join(f"{b}: {e}" for b, e in self.errors)
        kinds = [type(e) for _, e in self.errors]
        if any(k is DigestMismatchError for k in kinds):
            return DigestMismatchError(f"{what}: no copy with a valid digest ({detail})")
        if kinds and all(k in (NoSuchEntryError, NoSuchLedgerError) for k in kinds):
            return NoSuchEntryError(f"{what}: no bookie of the write set has it ({detail})")
        return BookieUnavailableError(f"{what}: no bookie of the write set answered ({detail})")


class _RangeRead:
    """READ_RANGE of the entries ``first..last`` with id ``offset`` mod ``stride``
    (one fragment's entries whose first replica to ask is ``conns[0]``: their
    write set, healthy bookies first), on the I/O thread. An answer is verified
    and stored in bulk (no object per entry but the LedgerEntry handed back);
    only an entry the bookie lacks or sent corrupt, or every entry left when the
    bookie fails, gets a single-entry read op that moves on to its next replica
    (``_ReadOp``). With ``speculativeReadTimeout``, every entry of a request not
    answered within it gets a read op asking its next replica as well (``spec``:
    the op counts this request as in flight, and the first good copy wins). A
    bookie without the feature gets single READs. Answers cut by the byte budget
    are followed up from ``next``."""

    __slots__ = ("h", "conn", "conns", "first", "last", "stride", "offset", "budget", "batch",
                 "spec", "rid", "__weakref__")

    def __init__(self, h, conns, first, last, stride, offset, budget, batch):
        self.h = h
        self.conns = conns
        self.conn = conns[0]
        self.first = first          # the next entry wanted (aligned on offset)
        self.last = last
        self.stride = stride
        self.offset = offset
        self.budget = budget
        self.batch = batch
        self.spec = None            # entry -> _ReadOp also asking its next replicas
        self.rid = None

    def begin(self):
        self.start()

    def start(self):
        h = self.h
        rid = self.rid = next(h._loop.rids)
        self.conn.send_featured(
            protocol.FEATURE_READ_RANGE, rid, self,
            _encode(protocol.read_range(rid, h._lid, self.first, self.last, self.budget,
                                        stride=self.stride, offset=self.offset)),
            h._read_timeout)
        spec = h._spec_timeout
        if spec and len(self.conns) > 1:
            h._loop._add_timer(h._loop.now + spec, _speculate_ref, (weakref.ref(self), rid))

    def _speculate(self, rid):
        # the request ``rid`` still unanswered: each entry it waits for asks its
        # next replica as well
        if rid != self.rid or self.first > self.last:
            return
        h = self.h
        batch = self.batch
        results, base = batch.results, batch.first
        spec = self.spec if self.spec is not None else {}
        for e in range(self.first, self.last + 1, self.stride):
            if e in spec or results[e - base] is not None:
                continue
            op = _ReadOp(h, e, self.conns, batch, h._read_timeout)
            op.idx = op.outstanding = 1         # this request is its ask of conns[0]
            spec[e] = op
            h._m.speculative_reads.inc()
            op.start()
        self.spec = spec

    def _fallback(self, entries, bookie_id=None, error=None):
        """Single reads of ``entries``: from the next replica if this bookie
        failed them (``error``), else from the first."""
        h = self.h
        for e in entries:
            op = _ReadOp(h, e, self.conns, self.batch, h._read_timeout)
            if error is None:
                op.start()
            else:
                op.idx = op.outstanding = 1
                op.failed(bookie_id, error)

    def _fail(self, e, bookie_id, error):
        """This bookie could not give entry ``e``: its read moves on."""
        op = self.spec.pop(e, None) if self.spec else None
        if op is not None:
            op.failed(bookie_id, error)
        else:
            self._fallback((e,), bookie_id, error)

    def unsupported(self, conn):
        entries = range(self.first, self.last + 1, self.stride)
        self.first = self.last + 1
        spec, self.spec = self.spec, None
        plain = []
        for e in entries:
            op = spec.pop(e, None) if spec else None
            if op is None:
                plain.append(e)
            elif not op.done:
                op.outstanding -= 1         # the READ_RANGE it counted: a single READ instead
                op.send(conn)
        self._fallback(plain)

    def on_reply(self, conn, msg):
        status = msg[2]
        if status == EOK and type(msg[4]) is int and msg[4] > self.first:
            nxt, entries = msg[4], msg[5]
            batch = self.batch
            results = batch.results
            base = batch.first
            lid = self.h._lid
            first, stride, offset = self.first, self.stride, self.offset
            top = min(self.last, nxt - 1)
            spec = self.spec
            wanted = range(first, top + 1, stride)
            n = len(wanted)
            if n and not spec and type(entries) is list and len(entries) == 4 * n:
                # the common answer, every entry wanted once and in order: verified
                # and made into LedgerEntry objects in one loop, stored by slicing
                got = self.h._digest.verify_run(entries, first, stride, LedgerEntry)
                if got is not None and \
                        results[first - base:top - base + 1:stride].count(None) == n:
                    results[first - base:top - base + 1:stride] = got
                    batch.done(n)
                    self.first = first + n * stride
                    if self.first <= self.last:
                        self.start()
                    return
            ok: list = []
            bad: list = []
            self.h._digest.verify_flat(entries, ok, bad)
            got = 0
            seen = 0
            for i in range(0, len(ok), 3):
                e = ok[i]
                if first <= e <= top and (e - offset) % stride == 0:
                    op = spec.pop(e, None) if spec else None
                    if op is not None:          # also asked elsewhere: first copy wins
                        op.outstanding -= 1
                        op.complete(LedgerEntry(lid, e, ok[i + 1], ok[i + 2]))
                        seen += 1
                    elif results[e - base] is None:
                        results[e - base] = LedgerEntry(lid, e, ok[i + 1], ok[i + 2])
                        got += 1
            bid = conn.bookie_id
            for e, err in bad:
                if first <= e <= top and (e - offset) % stride == 0:
                    self._fail(e, bid, err)
            if got + seen + len(bad) < len(wanted):
                # covered up to nxt - 1: what is missing there, this bookie lacks
                badset = {e for e, _ in bad}
                missing = [e for e in wanted if results[e - base] is None and e not in badset]
                for e in missing:
                    self._fail(e, bid, NoSuchEntryError(f"bookie {bid}: no entry {e}"))
            if spec:
                for e in wanted:
                    spec.pop(e, None)
            if got:
                batch.done(got)
            self.first = first + len(wanted) * stride
            if self.first <= self.last:
                self.start()
            return
        exc = error_for_status(status if status != EOK else ENOENTRY, f"bookie {conn.bookie_id}")
        self.on_error(conn, exc)

    def on_error(self, conn, exc):
        entries = range(self.first, self.last + 1, self.stride)
        self.first = self.last + 1
        bid = conn.bookie_id if conn is not None else self.conn.bookie_id
        for e in entries:
            self._fail(e, bid, exc)


class WriterState(enum.Enum):
    """The state of a ledger handle as a writer: the one table of what it may do.

    ================  ==========  ================  ===========  ======
    state             takes adds  change in flight  close began  broken
    ================  ==========  ================  ===========  ======
    OPEN              yes         no                no           no
    CHANGING          yes         yes               no           no
    CLOSING           no          no                yes          no
    CLOSING_CHANGING  no          yes               yes          no
    BROKEN            no          no                no           yes
    BROKEN_CLOSED     no          no                yes          yes
    ================  ==========  ================  ===========  ======

    While an ensemble change is in flight acknowledgements wait (the LAC is the
    new fragment's start) but adds still queue; close() waits for the change to
    end (``_settle``). A broken handle (``failure()`` says why) fails every add
    and starts no change: one in flight may still commit its metadata, but it
    resends nothing and the handle stays broken.
    The only moves are :data:`_TRANSITIONS` (``LedgerHandle._move``); the states
    of a read handle are OPEN and CLOSING (its close)."""

    OPEN = (True, False, False, False)
    CHANGING = (True, True, False, False)
    CLOSING = (False, False, True, False)
    CLOSING_CHANGING = (False, True, True, False)
    BROKEN = (False, False, False, True)
    BROKEN_CLOSED = (False, False, True, True)

    def __init__(self, takes_adds, changing, closed, broken):
        self.takes_adds = takes_adds
        self.changing = changing
        self.closed = closed
        self.broken = broken


_W = WriterState
# (state, event) -> next state. Events: "change" (a bookie failed: an ensemble
# change starts), "changed" (it was committed), "close" (close() or
# retire() began), "fail" (adds can no longer succeed). A pair not here is a bug.
_TRANSITIONS = {
    (_W.OPEN, "change"): _W.CHANGING,
    (_W.CLOSING, "change"): _W.CLOSING_CHANGING,
    (_W.CHANGING, "changed"): _W.OPEN,
    (_W.CLOSING_CHANGING, "changed"): _W.CLOSING,
    (_W.BROKEN, "changed"): _W.BROKEN,
    (_W.BROKEN_CLOSED, "changed"): _W.BROKEN_CLOSED,
    **{(st, "close"): nxt for st, nxt in [
        (_W.OPEN, _W.CLOSING), (_W.CHANGING, _W.CLOSING_CHANGING), (_W.CLOSING, _W.CLOSING),
        (_W.CLOSING_CHANGING, _W.CLOSING_CHANGING), (_W.BROKEN, _W.BROKEN_CLOSED),
        (_W.BROKEN_CLOSED, _W.BROKEN_CLOSED)]},
    **{(st, "fail"): _W.BROKEN_CLOSED if st.closed else _W.BROKEN for st in _W},
}
del _W


class LedgerHandle:
    """A handle on one ledger: writable (from create_ledger) or read-only (open_*).

    Safe to share between threads. Properties: ``ledger_id``,
    ``last_add_confirmed``, ``length``, ``is_closed``, ``metadata``.
    """

    def __init__(self, client, md: LedgerMetadata, version: int, password: bytes | None,
                 writable: bool = False, recovery: bool = False, lac: int = -1, length: int = 0,
                 master_key: bytes | None = None):
        # password None (with master_key): an administrator's handle, see
        # bk.client.recovery.recover_ledger; a mac digest then goes unchecked. Both:
        # master_key is the password's, already hashed (create_ledger).
        self._client = client
        self._loop = client._io
        self._conf = client.conf
        self._md = md
        self._version = version
        self._lid = md.ledger_id
        self._E = md.ensemble_size
        self._qw = md.write_quorum_size
        # A recovery write-back counts only once its whole write set has it (dead
        # bookies replaced): recovery must not leave an entry it wrote back
        # under-replicated, nor end (and its client close) with copies in flight.
        self._qa = md.write_quorum_size if recovery else md.ack_quorum_size
        self._master_key = master_key if password is None or master_key is not None \
            else _digest.master_key(password)
        self._digest = _digest.EntryDigest(md.ledger_id, md.digest_type, password)
        self._writable = writable
        self._recovery = recovery
        self._lac = lac
        self._length = length
        self._length_entry = -1       # reader: the entry whose cumulative length _length is
        self._read_lock = threading.Lock()
        self._state = WriterState.OPEN
        self._state_lock = threading.Lock()     # transitions come from several threads
        self._read_timeout = float(self._conf.readEntryTimeoutSec)
        self._reorder = bool(self._conf.reorderReadSequenceEnabled)
        self._spec_timeout = float(self._conf.speculativeReadTimeout) / 1000.0
        self._read_window_bytes = int(self._conf.readWindowBytes)
        self._read_avg = 0                # average size of the entries read so far
        self._max_payload = int(self._conf.nettyMaxFrameSizeBytes) - _FRAME_OVERHEAD
        self._bconns: dict = {}           # bookie id -> Connection for this ledger's shard
        self._m = client_metrics()
        self._m_add_ok = self._m.add_ok               # bound once: no label lookup per add
        self._conn_gen = self._loop.generation
        self._prepare_conns(b for _, ens in md.ensembles for b in ens)
        if writable:
            self._init_writer()
        else:
            # add_entry_async's first step, the throttle check, then finds the
            # window full and _check_open refuses the add (LedgerClosedError):
            # a reader's refusal costs the writer's path no check of its own
            self._submitted = self._completed = self._throttle = 0
            self._unconfirmed = ()

    # --- public properties ------------------------------------------------------
    @property
    def ledger_id(self) -> int:
        return self._lid

    @property
    def last_add_confirmed(self) -> int:
        return self._lac

    @property
    def length(self) -> int:
        """Sum of the payload bytes. A CLOSED ledger: its length in the metadata. A
        writer: up to its last acknowledged entry. A reader of an open ledger: the
        ledger's length after the highest entry it has read at or below its LAC
        (each entry carries that length, signed by its digest); 0 before its first
        read, and it grows as the reader reads on."""
        if self._md.state == LedgerState.CLOSED:
            return self._md.length
        return self._length

    @property
    def is_closed(self) -> bool:
        """True once the ledger is CLOSED (or this write handle was closed)."""
        return (self._writable and self._state.closed) or self._md.state == LedgerState.CLOSED

    @property
    def metadata(self) -> LedgerMetadata:
        return self._md

    def __repr__(self):
        return (f"<LedgerHandle {self._lid} {'writer' if self._writable else 'reader'} "
                f"lac={self._lac} state={self._md.state}>")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- what recovery (bk.client.recovery) and logs (bk.log) ask of a handle -----
    # Recovery reads with a reader handle and writes back with a recovery writer;
    # these named methods are the only parts of a handle it uses besides the
    # public API, so the handle's fields stay its own.
    @property
    def metadata_version(self) -> int:
        """The metadata's version (mod_revision) this handle last wrote or read."""
        return self._version

    @property
    def read_timeout(self) -> float:
        """readEntryTimeoutSec of this handle's client."""
        return self._read_timeout

    @property
    def read_window_bytes(self) -> int:
        """readWindowBytes: the byte budget of one READ_RANGE answer."""
        return self._read_window_bytes

    def connections(self, bookie_ids) -> list:
        """The connections to ``bookie_ids`` for this ledger's shard (made if needed;
        caller thread: may ask etcd for a bookie's address)."""
        ids = list(bookie_ids)
        self._prepare_conns(ids)
        return self._conns_of(ids)

    def fencing_read_lac(self, conn, callback, tag=None) -> None:
        """Send a fencing READ_LAC to ``conn`` (with this handle's master key)."""
        self._loop.request(conn, protocol.read_lac, self._lid, True, self._master_key,
                           timeout=self._read_timeout, callback=callback, tag=tag)

    def fencing_read(self, conn, entry_id: int, callback) -> None:
        """Send a fencing READ of ``entry_id`` to ``conn``."""
        self._loop.request(conn, protocol.read, self._lid, entry_id, True, self._master_key,
                           timeout=self._read_timeout, callback=callback)

    def fencing_read_range_frame(self, rid: int, first: int, last: int, budget: int) -> bytes:
        """The encoded frame of a fencing READ_RANGE of ``first..last``."""
        return protocol.encode_frame(protocol.read_range(rid, self._lid, first, last, budget,
                                                         True, self._master_key))

    def verify_entry(self, entry_id: int, entry_lac: int, digest: bytes, payload) -> int:
        """Check a copy's digest; its ledger length (DigestMismatchError if it is bad)."""
        return self._digest.verify(entry_id, entry_lac, digest, payload)

    def read_entry_once(self, entry_id: int) -> LedgerEntry:
        """Read one entry up to the LAC, from its write set, without the retries of
        :meth:`read_entries`."""
        return self._read_range(entry_id, entry_id, retry=False)[0]

    def write_back(self, entry_id, data, length, entry_lac, digest) -> None:
        """A recovery writer's write-back of a found entry (see _submit_recovery)."""
        self._submit_recovery(entry_id, data, length, entry_lac, digest)

    def ensure_explicit_lac(self, interval: float) -> None:
        """Send the LAC explicitly after ``interval`` seconds of idleness, unless this
        writer already does (explicitLacInterval): a log writer's readers tail it."""
        if not self._explicit_lac:
            self._explicit_lac = interval

    def wait_written(self, timeout: float) -> bool:
        """Wait until every submitted add completed (acknowledged or failed); False
        if ``timeout`` seconds passed first."""
        return self._drain(timeout)

    def failure(self):
        """``(exception class, reason)`` once this writer is broken, else None."""
        return self._error

    def retire(self) -> None:
        """Stop a recovery writer without closing the ledger (recovery closes it
        itself): it takes no more adds and its ticker stops."""
        self._move("close")
        try:
            self._loop.call_soon(self._stop_ticker)
        except BKError:
            pass            # the client's I/O ended: no ticker runs any more

    # --- connections --------------------------------------------------------------
    def _prepare_conns(self, bookie_ids):
        """Resolve (caller thread: may ask etcd or probe) a connection per bookie."""
        if self._loop.generation != self._conn_gen:
            self._bconns = {}
            self._conn_gen = self._loop.generation
        for bid in bookie_ids:
            c = self._bconns.get(bid)
            if c is None or isinstance(c, DeadConnection):
                self._bconns[bid] = self._client._connection(bid, self._lid)

    def _conns_of(self, bookie_ids):
        bconns = self._bconns
        return [bconns[b] for b in bookie_ids]

    # ============================ write path ======================================
    def _init_writer(self):
        self._lock = threading.Lock()
        self._next_entry = self._lac + 1
        self._pushed_length = self._length
        self._submitted = 0
        # Lists of ops for the I/O thread, in entry order. Submitters append under
        # self._lock; the I/O thread pops without it (deque operations are atomic),
        # so it never waits for a submitter signing entries.
        self._outbox = collections.deque()
        self._flush_armed = False
        rec = _REC_PACK.get(self._digest.size)
        if rec is None:
            rec = _REC_PACK[self._digest.size] = protocol.add_record_struct(self._digest.size).pack
        self._rec = rec
        self._sign = self._digest.sign
        self._dlen = self._digest.size
        self._hlen = _REC_HEAD + self._dlen    # an entry's ADD_BATCH record head
        self._completed = 0                 # I/O thread only
        self._pending = collections.deque()  # I/O thread only
        self._error = None                  # (exception class, reason) once the handle is broken
        self._failed_slots: set = set()
        # Entries acknowledged (Qa) before every bookie of their write set confirmed
        # them, in entry order (I/O thread). A bookie that has not confirmed the
        # oldest within addEntryTimeoutSec is replaced like one that failed, and the
        # new fragment starts at the first entry it lacks (_change_from), so those
        # entries are resent and get their Qw copies; until then they are held here
        # and by the bookie's connection, and count against the throttle.
        self._unconfirmed = collections.deque()
        # Which slot confirmed which entry (I/O thread): bit ``e - _ack_base`` of
        # ``_acks[slot]`` is set once the slot's bookie confirmed entry e. A group
        # acknowledgement's run of entries is one OR into its slot's int, and how
        # many slots confirmed an entry is counted from the ints (_quorum_masks),
        # never kept per op: a confirmation that comes twice counts once.
        # _ack_base is at most the first entry of _pending and of _unconfirmed
        # (_rebase moves it on as they drain).
        self._acks = [0] * self._E
        self._ack_base = self._next_entry
        self._masks = masks_for(self._E, self._qw, self._qa)
        self._change_from = None
        self._deciding = False              # fenced or deleted? (_refused) being asked
        self._change_lock = threading.Lock()
        self._close_lock = threading.Lock()  # close() retries: one metadata write at a time
        self._failed_at: dict = {}          # bookie -> monotonic time it failed this handle
        self._quarantine = float(self._conf.bookieQuarantineTimeSeconds)
        self._throttle = int(self._conf.throttle)
        self._add_timeout = float(self._conf.addEntryTimeoutSec)
        self._cond = threading.Condition()
        self._waiting = 0
        self._ticker_on = False
        self._flags = protocol.FLAG_RECOVERY if self._recovery else 0
        self._bkey = (self._master_key, self._flags)   # adds batch per (key, flags)
        # explicitLacInterval > 0: an idle writer sends its LAC (WRITE_LAC) so that
        # readers see the last entry without waiting for the next add.
        self._explicit_lac = float(self._conf.explicitLacInterval) / 1000.0
        self._lac_sent = -1
        self._lac_sent_at = 0.0
        self._lac_flush_armed = False
        self._set_ensemble(self._md.last_ensemble)
        self._loop.register_handle(self)

    def _move(self, event: str) -> WriterState:
        """Take the writer from its state to the one :data:`_TRANSITIONS` gives
        for ``event``; returns the state it was in."""
        with self._state_lock:
            was = self._state
            try:
                self._state = _TRANSITIONS[was, event]
            except KeyError:
                raise RuntimeError(f"ledger {self._lid}: writer cannot {event!r} "
                                   f"when {was.name}") from None
        return was

    def _loop_stopped(self):
        """The client was closed and its I/O thread ends (called on it): adds still
        in flight or in the outbox (handed over as it closed) fail as the ones
        the closed connections failed did; a handle with none is left as it is
        (its next add is refused by the loop: :meth:`_refused_by_loop`)."""
        ob = self._outbox
        if not ob and not self._pending:
            return
        while ob:
            self._pending.append(ob.popleft())
        self._error_out(ClientClosedError, "the client was closed")

    def _refused_by_loop(self):
        """Under self._lock: the I/O loop refused to take this handle's adds (the
        client closed, or its thread died), and the caller raises its error. The
        handle breaks: with the flush left armed, every later add would have
        queued behind a hand-over that never happens and waited forever; now
        each raises at once (``_check_open``), and none waits for the add
        window. (What the outbox still holds, nobody sends; the adds that put
        it there got this error.)"""
        self._flush_armed = False
        if self._error is None:
            self._error = (ClientClosedError, "the client was closed") \
                if self._client._closed else (BKError, "the client's I/O thread is gone")
        if not self._state.broken:
            self._move("fail")

    def _loop_died(self, reason):
        """The client's I/O thread is dying (called on it): fail every add in flight
        or still in the outbox, and refuse later ones."""
        ob = self._outbox
        while ob:
            self._pending.append(ob.popleft())
        self._error_out(BKError, reason)

    def _set_ensemble(self, ensemble):
        conns = self._conns_of(ensemble)
        self._ens_conns = conns
        self._slot_of = {c: i for i, c in enumerate(conns)}
        # conn -> its slot (in _acks), for the bookies whose confirmations count
        # (not failed)
        self._ack_slot = {c: i for i, c in enumerate(conns) if i not in self._failed_slots}

    def _what_add(self, entry_id):
        return f"add entry {entry_id} to ledger {self._lid}"

    def _check_payload(self, data):
        if type(data) is not bytes:
            if isinstance(data, (bytearray, memoryview)):
                return bytes(data)
            raise TypeError(f"add to ledger {self._lid}: entry must be bytes, not "
                            f"{type(data).__name__}")
        if len(data) > self._max_payload:
            raise ValueError(f"add to ledger {self._lid}: entry of {len(data)} bytes exceeds "
                             f"the frame limit (nettyMaxFrameSizeBytes="
                             f"{self._conf.nettyMaxFrameSizeBytes})")
        return data

    def _check_open(self):
        if not self._writable:
            raise LedgerClosedError(f"add to ledger {self._lid}: handle is read-only "
                                    f"(opened for reading)")
        st = self._state
        if st.closed:
            raise LedgerClosedError(f"add to ledger {self._lid}: ledger handle is closed")
        if st.broken:
            cls, reason = self._error
            raise cls(f"add entry {self._next_entry} to ledger {self._lid}: {reason}")

    def _outstanding(self):
        # adds not yet acknowledged, plus acknowledged ones a bookie of their write
        # set has not confirmed (held for it): both count against the throttle, so
        # a silent bookie bounds what the client holds instead of growing it
        return self._submitted - self._completed + len(self._unconfirmed)

    def _wait_window(self, n):
        limit = self._throttle
        if self._outstanding() + n <= limit:
            return
        if threading.current_thread() is self._loop._thread:
            return      # an add from a callback: waiting here would stop the I/O thread
        with self._cond:
            self._waiting += 1
            try:
                while self._outstanding() + n > limit and not self._state.broken:
                    self._cond.wait(0.05)
            finally:
                self._waiting -= 1

    def _submit(self, payloads, last_cb, each_cb=None):
        """Assign ids, sign, hand to the I/O thread. Returns the ops."""
        lid = self._lid
        sign = self._sign
        rec = self._rec
        dlen = self._dlen
        hlen = self._hlen
        with self._lock:
            self._check_open()
            ops = []
            append = ops.append
            entry = self._next_entry
            length = self._pushed_length
            lac = self._lac
            for data in payloads:
                n = len(data)
                length += n
                append(PendingAdd(self, entry, rec(n, lid, entry, lac, dlen,
                                                   sign(entry, lac, length, data)),
                                  data, length, each_cb, hlen + n))
                entry += 1
            if last_cb is not None and ops:
                ops[-1].cb = last_cb
            self._next_entry = entry
            self._pushed_length = length
            self._submitted += len(ops)
            self._outbox.extend(ops)
            self._arm_flush()
        return ops

    def _submit_one(self, data, cb):
        """``_submit`` of one checked payload, the path of every add_entry_async:
        one op, no lists. (Inlined into add_entry_async: its thread's CPU per
        entry 0.97x, the I/O thread's 1.05x at 30,000 TLS adds/s, 6 pairs, client11;
        not kept.)"""
        if self._submitted - self._completed + len(self._unconfirmed) >= self._throttle:
            self._check_open()
            self._wait_window(1)
        with self._lock:
            if not self._state.takes_adds or not self._writable:
                self._check_open()
            entry = self._next_entry
            lac = self._lac
            n = len(data)
            length = self._pushed_length + n
            self._outbox.append(PendingAdd(
                self, entry, self._rec(n, self._lid, entry, lac, self._dlen,
                                       self._sign(entry, lac, length, data)),
                data, length, cb, self._hlen + n))
            self._next_entry = entry + 1
            self._pushed_length = length
            self._submitted += 1
            if not self._flush_armed:
                self._flush_armed = True
                try:
                    self._loop.call_soon(self._io_flush)
                except BKError:
                    self._refused_by_loop()
                    raise

    def _arm_flush(self):
        # Under self._lock, after ops were added to the outbox (in entry order). The
        # I/O thread is asked once per drain, not once per entry: it disarms before
        # it drains, so an op added after its drain began re-arms.
        if not self._flush_armed:
            self._flush_armed = True
            try:
                self._loop.call_soon(self._io_flush)
            except BKError:
                self._refused_by_loop()
                raise

    def _io_flush(self):
        # Disarm first, then drain what is there now (see _arm_flush).
        self._flush_armed = False
        ob = self._outbox
        n = len(ob)
        if n:
            # n pops by C iterators (this thread alone pops; submitters only append)
            self._io_send(list(map(_popleft, itertools.repeat(ob, n))))

    def _not_on_io_thread(self, what):
        if threading.current_thread() is self._loop._thread:
            raise RuntimeError(f"{what} on ledger {self._lid} from an add callback would block "
                               f"the client's I/O thread forever; use add_entry_async")

    def _submit_recovery(self, entry_id, data, length, entry_lac, digest):
        """Recovery write-back of a found entry: the copy as read, its LAC and digest
        bytes unchanged (no re-signing, so no password is needed, even for mac)."""
        self._wait_window(1)
        with self._lock:
            if self._state.broken:
                return
            assert entry_id == self._next_entry, (entry_id, self._next_entry)
            head = protocol.add_record_head(self._lid, entry_id, entry_lac, digest, len(data))
            self._outbox.append(PendingAdd(self, entry_id, head, data, length, None,
                                           len(head) + len(data)))
            self._next_entry = entry_id + 1
            self._pushed_length = length
            self._submitted += 1
            self._arm_flush()

    def add_entry(self, data) -> int:
        """Add one entry; block until Qa bookies have it; return its entry id."""
        data = self._check_payload(data)
        self._check_open()
        self._not_on_io_thread("add_entry")
        w = _Waiter()
        self._submit_one(data, w)
        return w.wait()

    def add_entries(self, entries) -> int:
        """Add entries pipelined (at most ``throttle`` outstanding); return the last id."""
        payloads = [self._check_payload(d) for d in entries]
        self._check_open()
        self._not_on_io_thread("add_entries")
        if not payloads:
            return self._lac
        w = _Waiter()
        chunk = max(1, min(self._throttle // 2, 512))
        for i in range(0, len(payloads), chunk):
            part = payloads[i:i + chunk]
            self._wait_window(len(part))
            self._submit(part, w if i + chunk >= len(payloads) else None)
        return w.wait()

    @property
    def max_entry_size(self) -> int:
        """The largest payload one add takes (the frame limit less an ADD's overhead)."""
        return self._max_payload

    def flush_lac(self, delay: float = 0.0) -> None:
        """In ``delay`` seconds, if no add is in flight then, send the LAC to the
        bookies (WRITE_LAC), so that tailing readers see the last entry without
        waiting for the next add or ``explicitLacInterval``. Calls made while one
        is pending are merged. Any thread."""
        if not self._lac_flush_armed:
            self._lac_flush_armed = True
            self._loop.call_later(delay, self._flush_lac_io)

    def _flush_lac_io(self):
        self._lac_flush_armed = False
        if not self._pending and self._state.takes_adds \
                and self._lac > self._lac_sent:
            self._send_explicit_lac(self._loop.now)

    def add_entry_async(self, data, callback=None):
        """Add one entry without blocking on its acknowledgement.

        Without ``callback``: returns a ``concurrent.futures.Future`` resolving to
        the entry id. With ``callback``: calls ``callback(exc_or_None, entry_id)``
        on the client's I/O thread (keep it short) and returns None. Blocks only
        while ``throttle`` adds are already outstanding.
        """
        if data.__class__ is not bytes:
            data = self._check_payload(data)
        n = len(data)
        if n > self._max_payload:
            self._check_payload(data)           # raises
        if callback is None:
            fut = callback = _AddFuture()
        else:
            fut = None
        self._submit_one(data, callback)
        return fut

    # --- I/O thread -------------------------------------------------------------------
    def _io_send(self, ops):
        if self._state.broken:
            for op in ops:
                self._fail_op(op)
            return
        if not self._ticker_on:
            self._ticker_on = True
            self._loop._tickers.append(self._tick)
        if self._explicit_lac:
            self._lac_sent_at = self._loop.now
        now = self._loop.now
        for op in ops:
            op.t_sent = now
        self._pending.extend(ops)
        conns = self._ens_conns
        E = self._E
        qw = self._qw
        failed = self._failed_slots
        if E == qw:                  # every bookie gets every entry
            # whole frames encoded once for all of them (a bookie without batches
            # ignores them)
            loop = self._loop
            frames = record_frames(ops, loop.batch_bytes, self._bkey, loop.rids) \
                if loop.batching and E > 1 else None
            for s, conn in enumerate(conns):
                if not failed or s not in failed:
                    conn.send_adds(ops, frames)
            return
        for s, conn in enumerate(conns):
            if failed and s in failed:
                continue
            mine = [op for op in ops if (s - op.entry_id) % E < qw]
            if mine:
                conn.send_adds(mine)

    def _confirm_run(self, conn, first, last):
        """``conn``'s bookie confirmed entries ``first..last`` (I/O thread): one OR
        into its slot's bitset. Ignored from a bookie whose confirmations do not
        count (failed, replaced, not in the ensemble) and below _ack_base (entries
        no longer tracked)."""
        s = self._ack_slot.get(conn)
        if s is None:
            return
        base = self._ack_base
        if first < base:
            if last < base:
                return
            first = base
        self._acks[s] |= ((1 << (last - first + 1)) - 1) << (first - base)

    def _confirmed_by(self, entry_id, slot) -> bool:
        """True if ``slot`` confirmed ``entry_id`` (a tracked entry; False below
        _ack_base, where nothing is known any more)."""
        off = entry_id - self._ack_base
        return off >= 0 and (self._acks[slot] >> off) & 1 == 1

    def _nconfirmed(self, entry_id) -> int:
        """How many slots confirmed ``entry_id`` (0 below _ack_base)."""
        off = entry_id - self._ack_base
        return 0 if off < 0 else sum((a >> off) & 1 for a in self._acks)

    def _quorum_masks(self):
        """``(qa_mask, qw_mask)``: the entries (bit ``e - _ack_base``) that at least
        Qa, and at least Qw, slots confirmed (see :func:`quorum_masks`). A slot's
        bits are all in its write sets (it is sent and confirms nothing else; a
        replaced slot's are cleared from the new fragment's start), so counting
        over every slot is counting over each entry's write set."""
        return self._masks(self._acks)

    def _rebase(self):
        """Move _ack_base up to the first tracked entry (dropping the bits below it),
        so that the bitsets span what is in flight, not the ledger."""
        pending, unc = self._pending, self._unconfirmed
        first = self._lac + 1
        if pending:
            first = pending[0].entry_id
        if unc and unc[0].entry_id < first:
            first = unc[0].entry_id
        k = first - self._ack_base
        if k > 0:
            self._acks = [a >> k for a in self._acks]
            self._ack_base = first

    def _advance(self):
        if self._state.changing:
            return
        pending = self._pending
        unconfirmed = self._unconfirmed
        if not pending and not unconfirmed:
            return
        base = self._ack_base
        q_a, q_w = self._masks(self._acks)      # _quorum_masks(), inline
        n = 0
        if pending:
            off = pending[0].entry_id - base
            m = q_a >> off
            if m & 1 and (not m & 2 or len(pending) == 1):
                # Only the head: a blocking add's case (one entry per
                # acknowledgement), without the lists of a run below.
                n = 1
                op = _popleft(pending)
                if not (q_w >> off) & 1:
                    unconfirmed.append(op)
                e = self._lac = op.entry_id
                self._length = op.length
                self._completed += 1
                lats = (self._loop.now - op.t_sent,)
                op.done = True
                cb = op.cb
                if cb is not None:
                    try:
                        cb(None, e)
                    except Exception:
                        log.exception("add callback failed")
            else:
                # the run of entries from the head that Qa slots confirmed (its
                # trailing ones), and the part of it all Qw slots confirmed
                n = min((m ^ (m + 1)).bit_length() - 1, len(pending))
        if n > 1:
            m = q_w >> off
            full = (m ^ (m + 1)).bit_length() - 1
            ops = list(map(_popleft, itertools.repeat(pending, n)))
            if full < n:
                # not on every bookie of their write set yet (or confirmed out of
                # order: dropped from the head of _unconfirmed in turn)
                unconfirmed.extend(ops[full:] if full else ops)
            last = ops[-1]
            # the LAC, length and count cover all n before any callback runs:
            # they are all acknowledged, a callback may read the LAC, and a
            # blocking add's thread, woken by its callback, may close at once
            # (close waits until every add is counted)
            self._lac = last.entry_id
            self._length = last.length
            self._completed += n
            lats = list(map(self._loop.now.__sub__, map(_t_sent_of, ops)))
            for op in ops:
                op.done = True
                cb = op.cb
                if cb is not None:
                    try:
                        cb(None, op.entry_id)
                    except Exception:
                        log.exception("add callback failed")
        popped = False
        while unconfirmed:
            off = unconfirmed[0].entry_id - base
            m = q_w >> off
            k = (m ^ (m + 1)).bit_length() - 1
            if not k:
                break
            end = base + off + k            # entries below it: on every bookie
            while unconfirmed and unconfirmed[0].entry_id < end:
                unconfirmed.popleft()
            popped = True
        if n:
            observe_many(self._m_add_ok, lats)
            if self._lac - base >= _REBASE_AT:
                self._rebase()
        if (n or popped) and self._waiting:
            with self._cond:
                self._cond.notify_all()

    def _fail_op(self, op, exc=None):
        if op.done:
            return
        op.done = True
        self._completed += 1
        self._m.add_fail.observe(self._loop.now - op.t_sent)
        cb = op.cb
        if cb is not None:
            cls, reason = self._error
            try:
                cb(cls(f"{self._what_add(op.entry_id)}: {reason}"), op.entry_id)
            except Exception:
                log.exception("add callback failed")

    def _error_out(self, cls, reason):
        """The handle can no longer add: fail every pending add, refuse later ones."""
        if not self._state.broken:
            self._error = (cls, reason)         # before the state says broken
            self._move("fail")
            log.warning("ledger %d: adds fail from now on: %s", self._lid, reason)
        pending = self._pending
        while pending:
            self._fail_op(pending.popleft())
        self._unconfirmed.clear()
        with self._cond:
            self._cond.notify_all()

    def _add_error(self, op, conn, status):
        if op.done and (self._state.broken or status == EFENCED):
            return      # failed already, or acknowledged: later adds see the fence
        if status == EFENCED:
            op.nfenced = nfenced = getattr(op, "nfenced", 0) + 1
            if nfenced > self._qw - self._qa:
                self._refused()
            return
        if status == EUA:
            self._error_out(BadPasswordError, f"bookie {conn.bookie_id} refused the master key")
            return
        if status == EAUTH:      # this client's role may not add: no other bookie will differ
            self._error_out(AuthError, f"bookie {conn.bookie_id} refused the add: this "
                                       f"client's role may not write")
            return
        if status == ETOOMANYREQUESTS:
            self._add_busy(op, conn)
            return
        if status == EBADREQ:
            # The bookie is fine; the request was wrong (malformed, or sent to a shard
            # that does not own the ledger): replacing the bookie would not help and
            # would cost a metadata write. Entries are acknowledged in order, so the
            # handle cannot go on past this entry.
            self._error_out(BadRequestError, (
                f"bookie {conn.bookie_id} refused entry {op.entry_id} as a bad request "
                f"(EBADREQ): the client sent a malformed or misrouted request (a client "
                f"bug, or a client and bookie that disagree on protocol or shard count); "
                f"the bookie was not replaced"))
            return
        # EREADONLY included: a read-only bookie takes no adds until its disk frees
        # up, so it is replaced (and, being failed, quarantined by this handle).
        self._bookie_failed(conn, error_for_status(status, f"bookie {conn.bookie_id}"))

    def _refused(self):
        """More than Qw - Qa bookies refused an add as fenced (I/O thread): Qa can no
        longer be reached. A bookie says the same of a ledger that was deleted (its
        tombstone answers EFENCED), so the metadata decides which the application is
        told: no key, NoSuchLedgerError; else LedgerFencedError. The metadata is read
        on a metadata thread, and only on this path (never per add). Until it has
        answered, the handle starts no ensemble change (``_bookie_failed``): adds
        queue, and fail with the class decided."""
        if self._deciding or self._state.broken:
            return
        self._deciding = True
        try:
            self._client._executor.submit(self._decide_refusal)
        except RuntimeError:            # the client is closing: no thread to ask with
            self._error_out(LedgerFencedError, _FENCED)

    def _decide_refusal(self):
        cls, reason = LedgerFencedError, _FENCED
        try:
            self._client._store.read_ledger(self._lid)
        except NoSuchLedgerError:
            cls, reason = NoSuchLedgerError, _DELETED
        except BKError as e:
            # cannot tell (etcd unreachable): the bookies' word stands
            log.info("ledger %d: fenced or deleted? metadata unreadable (%s): fenced",
                     self._lid, e)
        try:
            self._loop.call_soon(self._error_out, cls, reason)
        except BKError:
            pass        # the client closed: the loop's end failed the adds

    def _add_busy(self, op, conn):
        """ETOOMANYREQUESTS: the bookie is alive but overloaded. Replacing it would
        move load around and cost a metadata write, so resend to it after a back-off
        doubling from 2 ms; fail it only once the add is addEntryTimeoutSec old."""
        if self._state.broken or conn not in self._ack_slot:
            return
        left = op.t_sent + self._add_timeout - self._loop.now
        if left <= 0:
            self._bookie_failed(conn, TooManyRequestsError(
                f"{self._what_add(op.entry_id)}: bookie {conn.bookie_id} was still overloaded "
                f"(ETOOMANYREQUESTS) after {self._add_timeout:g}s"))
            return
        backoff = getattr(op, "backoff", None)
        if backoff is None:
            backoff = op.backoff = {}
        delay = backoff.get(conn, _BUSY_BACKOFF)
        backoff[conn] = delay * 2
        self._loop.call_later(min(delay, left), self._resend_busy, op, conn)

    def _resend_busy(self, op, conn):
        # The bookie confirmed it meanwhile, or was replaced: nothing left to do.
        slot = self._ack_slot.get(conn)
        if self._state.broken or slot is None or self._confirmed_by(op.entry_id, slot):
            return
        conn.send_adds([op])

    def _bookie_failed(self, conn, exc):
        self._m.bookie_errors.labels(type(exc).__name__).inc()
        if self._state.broken or self._md.state == LedgerState.CLOSED or self._deciding:
            return      # (a closed ledger's ensembles are final; a refused one's end near)
        if self._client._closed:
            self._error_out(ClientClosedError, "the client was closed")
            return
        slot = self._slot_of.get(conn)
        if slot is None or slot in self._failed_slots:
            return
        log.warning("ledger %d: bookie %s failed (%s); replacing it", self._lid,
                    conn.bookie_id, exc)
        self._client._health.failed(conn.bookie_id)
        first = self._first_unconfirmed_by(slot)
        with self._change_lock:
            self._failed_slots.add(slot)
            if first is not None and (self._change_from is None or first < self._change_from):
                self._change_from = first
        self._ack_slot.pop(conn, None)
        if not self._state.changing:
            self._move("change")
            self._client._executor.submit(self._change_ensemble)

    def _first_unconfirmed_by(self, slot):
        """The first acknowledged entry of the last fragment whose write set holds
        ``slot`` and that it has not confirmed (I/O thread), or None."""
        unc = self._unconfirmed
        if not unc:
            return None
        E, qw = self._E, self._qw
        frag = self._md.ensembles[-1][0]
        confirmed = self._confirmed_by
        for op in unc:
            e = op.entry_id
            if e >= frag and (slot - e) % E < qw and not confirmed(e, slot):
                return e
        return None

    def _tick(self, now):
        if self._state.closed and not self._pending and not self._unconfirmed:
            self._ticker_on = False
            return False
        if self._explicit_lac and self._lac > self._lac_sent and not self._recovery \
                and now - self._lac_sent_at >= self._explicit_lac:
            self._send_explicit_lac(now)
        if self._state.changing or self._state.broken:
            return
        unc = self._unconfirmed
        if unc:
            # drop what every bookie confirmed, and what lies in an earlier
            # fragment (its ensemble is history: auto-recovery's to repair)
            qw, frag = self._qw, self._md.ensembles[-1][0]
            n = len(unc)
            while unc and (unc[0].entry_id < frag or self._nconfirmed(unc[0].entry_id) >= qw):
                unc.popleft()
            if n != len(unc) and self._waiting:
                with self._cond:
                    self._cond.notify_all()
        for op in (self._pending[0] if self._pending else None, unc[0] if unc else None):
            if op is None or now - op.t_sent < self._add_timeout:
                continue
            e = op.entry_id
            for i in range(self._qw):
                s = (e + i) % self._E
                conn = self._ens_conns[s]
                if not self._confirmed_by(e, s):
                    self._bookie_failed(conn, TimeoutError(
                        f"{self._what_add(e)}: bookie {conn.bookie_id} did not confirm within "
                        f"{self._add_timeout:g}s"))

    def _send_explicit_lac(self, now):
        lac = self._lac
        self._lac_sent, self._lac_sent_at = lac, now
        loop = self._loop
        for i, conn in enumerate(self._ens_conns):
            if i in self._failed_slots:
                continue
            rid = next(loop.rids)
            conn.send(rid, Call(b""), _encode(protocol.write_lac(rid, self._lid,
                                                                 self._master_key, lac)),
                      self._add_timeout)

    # --- ensemble change (worker thread, then I/O thread) ---------------------------
    def _change_ensemble(self):
        try:
            try:
                self._change_ensemble_once()
            except NoSuchLedgerError:
                # its CAS found no metadata: deleted under the writer (the bookies,
                # not yet collecting it, still took its adds)
                self._loop.call_soon(self._error_out, NoSuchLedgerError, _DELETED)
            except BKError as e:
                # The adds fail with the reason's own class (LedgerFencedError,
                # NotEnoughBookiesError, MetadataError, ...).
                self._loop.call_soon(self._error_out, type(e), f"ensemble change failed: {e}")
            except Exception as e:  # never leave adds hanging
                log.exception("ensemble change of ledger %d failed", self._lid)
                self._loop.call_soon(self._error_out, BKError, f"ensemble change failed: {e!r}")
        except BKError:
            # the client closed (or its I/O thread died) under the change: the
            # loop's end failed this handle's adds, nothing is left to tell it
            pass

    def _change_ensemble_once(self):
        md, version = self._md, self._version
        start = self._lac + 1               # frozen while CHANGING
        with self._change_lock:
            failed_slots = set(self._failed_slots)
            if self._change_from is not None:
                # acknowledged entries a failed bookie never confirmed move to the
                # new fragment (never below the current one's start) and are resent
                start = max(md.ensembles[-1][0], min(start, self._change_from))
                self._change_from = None
        old_ens = md.last_ensemble
        failed = [old_ens[s] for s in sorted(failed_slots)]
        now = time.monotonic()
        for b in failed:
            self._failed_at[b] = now
        self._failed_at = {b: t for b, t in self._failed_at.items()
                           if now - t < self._quarantine or b in failed}
        client = self._client
        racks = client._racks()
        # The failed bookies leave (they are in old_ens, which replace_bookies never
        # picks from); bookies that failed this handle earlier are only avoided.
        new_ens, mapping = client._place(
            lambda writable: client._placement.replace_bookies(writable, old_ens, failed,
                                                                self._qw, racks),
            avoid=set(self._failed_at) - set(failed))
        if self._recovery:
            # Kept in memory until the recovery closes the ledger with it. Stored
            # now, it would outlive a recovery that then fails: the next recovery
            # would read the writer's entries from replacement bookies that never
            # got them, and take their "no such entry" for proof that an
            # acknowledged entry does not exist.
            new_md = md.replace(ensembles=[(f, b) for f, b in md.ensembles if f < start]
                                + [(start, new_ens)])
            new_version = version
        else:
            def changed(md):
                if md.state != LedgerState.OPEN:
                    raise LedgerFencedError(f"ledger is {md.state.value} in the metadata store "
                                            f"(recovered by another client)")
                return md.replace(ensembles=[(f, b) for f, b in md.ensembles if f < start]
                                  + [(start, new_ens)])
            new_md, new_version = self._cas_metadata(f"ensemble change of ledger {self._lid}",
                                                     changed)
        log.info("ledger %d: ensemble from entry %d is now %s (replaced %s)%s", self._lid, start,
                 new_ens, mapping, " (recovery: stored when it closes the ledger)"
                 if self._recovery else "")
        self._m.ensemble_changes.inc()
        self._prepare_conns(new_ens)
        new_conns = {s: self._bconns[new_ens[s]] for s in failed_slots}
        self._loop.call_soon(self._commit_change, new_md, new_version, new_conns)

    def _commit_change(self, new_md, new_version, new_conns):
        start = new_md.ensembles[-1][0]         # the new fragment's first entry
        self._md, self._version = new_md, new_version
        old_conns = list(self._ens_conns)
        for s in new_conns:
            # the replaced bookie's connection stops holding this ledger's adds
            old_conns[s].forget_adds(self._lid)
        with self._change_lock:
            self._failed_slots -= set(new_conns)
        self._set_ensemble(new_md.last_ensemble)
        # the new bookies confirmed nothing of the new fragment yet: their slots'
        # bits from its start go (below it, the replaced bookie's stay: history)
        keep = start - self._ack_base
        for s in new_conns:
            self._acks[s] &= (1 << keep) - 1 if keep > 0 else 0
        if not self._state.broken:
            E, qw = self._E, self._qw
            still_failed = self._failed_slots
            resend = {}
            moved = [op for op in self._unconfirmed if op.entry_id >= start]
            for op in itertools.chain(moved, self._pending):
                e = op.entry_id
                resent = False
                for i in range(qw):
                    s = (e + i) % E
                    if s in new_conns and s not in still_failed:
                        resend.setdefault(s, []).append(op)
                        resent = True
                if resent:
                    op.t_sent = self._loop.now
            for s, ops in resend.items():
                self._ens_conns[s].send_adds(ops)
        if self._failed_slots and not self._state.broken:
            self._client._executor.submit(self._change_ensemble)
            return
        self._move("changed")
        if not self._state.broken:
            self._advance()

    # --- close -------------------------------------------------------------------------
    def _drain(self, timeout):
        """Wait until every submitted add completed (acknowledged or failed)."""
        if self._submitted == self._completed:
            return True             # a blocking writer's close: nothing to wait for
        deadline = time.monotonic() + timeout
        with self._cond:
            self._waiting += 1
            try:
                while self._submitted != self._completed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(min(left, 0.05))
            finally:
                self._waiting -= 1
        return True

    def _settle(self, timeout):
        """Before closing, wait (bounded) until every acknowledged entry is confirmed by
        its whole write set, or the bookies that did not were replaced (and the
        entries resent) and no ensemble change is running: a closed ledger cannot
        change its ensembles any more."""
        if not self._unconfirmed and not self._state.changing:
            return
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._unconfirmed or self._state.changing) and not self._state.broken:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("ledger %d: closing with %d acknowledged entries not yet on "
                                "every bookie of their write set", self._lid,
                                len(self._unconfirmed))
                    return
                self._cond.wait(min(left, 0.05))

    def close(self) -> None:
        """Close: writers wait for outstanding adds, then CAS the ledger to CLOSED.

        The handle takes no adds once close() has begun. If the metadata write
        fails (etcd unreachable: MetadataError), the ledger is still OPEN in the
        store; calling close() again retries just that write."""
        if not self._writable:
            self._move("close")
            return
        with self._close_lock:
            with self._lock:
                first = not self._move("close").closed
            if self._client._closed:
                # its adds fail (or failed) with the client; its metadata cannot
                # be written: at once, not after waiting out _drain's bound
                raise self._client._closed_error(f"close ledger {self._lid}")
            if first:
                timeout = (self._add_timeout * 3
                           + float(self._conf.metadataTimeoutMillis) / 1000 * 3)
                if not self._drain(timeout):
                    self._loop.call_soon(self._error_out, LedgerClosedError,
                                         "ledger handle was closed before the add completed")
                    self._drain(5.0)
                self._settle(self._add_timeout * 2
                             + float(self._conf.metadataTimeoutMillis) / 1000 * 3)
                if self._client._closed:         # it closed while we waited
                    raise self._client._closed_error(f"close ledger {self._lid}")
                # no call_soon(_stop_ticker) here: _tick removes itself at its next
                # run once the writer is closed with nothing in flight, and waking
                # the I/O thread for it cost every ledger a syscall
            elif self._md.state == LedgerState.CLOSED:
                return
            self._close_metadata()
            # what close could not wait out stays under-replicated for the auditor
            if self._unconfirmed:
                try:
                    self._loop.call_soon(self._unconfirmed.clear)
                except BKError:
                    pass            # the client's I/O is gone: nothing holds them

    def close_async(self, callback=None):
        """:meth:`close` without blocking (BookKeeper's ``asyncClose``).

        Without ``callback``: returns a ``concurrent.futures.Future`` (result None);
        with ``callback``: calls ``callback(exc_or_None, None)`` and returns None.
        The errors are those close() raises. A writer with nothing in flight
        queues its metadata write on the store's combiner (no thread waits for
        it); one with adds still outstanding, an ensemble change under way or a
        close already begun closes on a metadata thread of the client."""
        done = _AddFuture() if callback is None else callback
        fast = False
        if self._writable and self._close_lock.acquire(blocking=False):
            with self._lock:
                st = self._state
                fast = (not st.closed and not st.changing and not self._unconfirmed
                        and self._submitted == self._completed)
                if fast:
                    self._move("close")
            if not fast:
                self._close_lock.release()
        if fast:
            self._close_metadata_async(done)
        elif not self._writable:
            self._move("close")
            done(None, None)
        else:
            def close():
                try:
                    self.close()
                except BaseException as e:
                    done(e, None)
                else:
                    done(None, None)
            try:
                self._client._executor.submit(close)
            except RuntimeError:
                done(BKError(f"close ledger {self._lid}: the client is closed"), None)
        return done if callback is None else None

    def _close_metadata_async(self, done):
        # under self._close_lock, which the write's callback releases
        closed = self._closed_change()
        try:
            new_md = closed(self._md)
        except BaseException as e:
            self._close_lock.release()
            done(e, None)
            return
        if new_md is None:
            self._close_lock.release()
            done(None, None)
            return

        def written(exc, version):
            if exc is None:
                self._md, self._version = new_md, version
            elif isinstance(exc, NoSuchLedgerError):
                exc = self._deleted(f"close ledger {self._lid}")
            elif isinstance(exc, MetadataVersionError):
                # lost the CAS (a recovery, a concurrent close): re-read and decide as
                # close() does, on a metadata thread (it blocks)
                def again():
                    try:
                        self._close_metadata(reread=True)
                    except BaseException as e:
                        done(e, None)
                    else:
                        done(None, None)
                    finally:
                        self._close_lock.release()
                try:
                    self._client._executor.submit(again)
                    return
                except RuntimeError:
                    exc = BKError(f"close ledger {self._lid}: the client is closed")
            self._close_lock.release()
            done(exc, None)
        try:
            self._client._store.write_ledger_async(new_md, self._version, written)
        except BaseException as e:
            self._close_lock.release()
            done(e, None)

    def _stop_ticker(self):
        if self._ticker_on and self._tick in self._loop._tickers:
            self._loop._tickers.remove(self._tick)
        self._ticker_on = False

    def _cas_metadata(self, what, change, reread=False):
        """Write ``change(md)`` over this handle's metadata with compare-and-swap
        (:func:`bk.retry.retry_cas`): after a lost CAS, re-read and apply ``change``
        to what is there now. ``change`` raises to give up, or returns None when
        there is nothing to write. Returns ``(metadata, version)``."""
        store = self._client._store
        cur = [self._md, self._version, reread]       # metadata, version, re-read?

        def attempt():
            if cur[2]:
                cur[0], cur[1] = store.read_ledger(self._lid)
            cur[2] = True
            new_md = change(cur[0])
            if new_md is None:
                return cur[0], cur[1]
            return new_md, store.write_ledger(new_md, cur[1])
        return retry_cas(what, attempt)

    def _close_metadata(self, reread=False):
        try:
            self._md, self._version = self._cas_metadata(f"close ledger {self._lid}",
                                                         self._closed_change(), reread)
        except NoSuchLedgerError:
            raise self._deleted(f"close ledger {self._lid}") from None

    def _deleted(self, what) -> NoSuchLedgerError:
        """The error of a call (``what``, naming the ledger) on a deleted ledger."""
        return NoSuchLedgerError(f"{what}: {_DELETED} ({self._client.uri})")

    def _raise_if_deleted(self, what) -> None:
        """The refusal path of a read (a bookie said it has no such ledger): one
        metadata read; NoSuchLedgerError if the ledger's key is gone (deleted),
        else nothing (the caller raises what the bookies said)."""
        try:
            self._client._store.read_ledger(self._lid)
        except NoSuchLedgerError:
            raise self._deleted(what) from None
        except MetadataError:
            if self._client._closed:
                raise self._client._closed_error(what) from None

    def _closed_change(self):
        """The change of a close: the metadata CLOSED at this writer's LAC and length
        (None if it is already; LedgerFencedError if another client closed or
        recovers it)."""
        lac, length = self._lac, self._length
        what = f"close ledger {self._lid}"

        def closed(md):
            if md.state == LedgerState.CLOSED:
                if md.last_entry_id == lac:
                    return None
                raise LedgerFencedError(
                    f"{what}: ledger was closed by another client at entry {md.last_entry_id}, "
                    f"this writer's last acknowledged entry is {lac}")
            if md.state == LedgerState.IN_RECOVERY and not self._recovery:
                raise LedgerFencedError(f"{what}: ledger is being recovered by another client")
            return md.replace(state=LedgerState.CLOSED, last_entry_id=lac, length=length)
        return closed

    # ============================ read path ============================================
    def _readable_last(self):
        if self._md.state == LedgerState.CLOSED:
            return self._md.last_entry_id
        return self._lac

    def read_entries(self, first: int, last: int) -> list:
        """Entries ``first..last`` (inclusive), up to the LAC (or last entry if closed)."""
        self._check_range(first, last)
        self._check_client("read entries", first, last)
        limit = self._readable_last()
        if last > limit:
            raise NoSuchEntryError(
                f"read entries {first}..{last} of ledger {self._lid}: entry {last} is past the "
                f"last add confirmed ({limit})")
        out = self._timed_read(first, last)
        self._note_read(out)
        return out

    def _timed_read(self, first, last):
        t0 = time.monotonic()
        try:
            out = self._read_range(first, last)
        except BaseException:
            self._m.read_fail.observe(time.monotonic() - t0)
            raise
        self._m.read_ok.observe(time.monotonic() - t0)
        return out

    def read_unconfirmed_entries(self, first: int, last: int) -> list:
        """Entries ``first..last`` even past the LAC (NoSuchEntryError if one is missing)."""
        self._check_range(first, last)
        self._check_client("read entries", first, last)
        if self._md.state != LedgerState.CLOSED:
            try:
                self._refresh_metadata(f"read entries {first}..{last} of ledger {self._lid}")
            except MetadataError:
                pass
        out = self._timed_read(first, last)
        self._note_read(out)
        return out

    def _note_read(self, entries):
        """A reader's length follows the highest confirmed entry it has verified, as
        BookKeeper's read-only handle does; an entry past the LAC does not count
        (recovery may still drop it)."""
        if self._writable or not entries:
            return
        with self._read_lock:           # readers may be shared: never move it backwards
            limit = self._readable_last()
            for e in reversed(entries):
                if e.entry_id <= limit:
                    if e.entry_id > self._length_entry:
                        self._length_entry = e.entry_id
                        self._length = e.length
                    return

    def _check_client(self, what, first=None, last=None):
        """A read on a closed client fails at once (its metadata refresh would
        meet a closed store, its requests a closed loop)."""
        if self._client._closed:
            if first is not None:
                what = f"{what} {first}..{last}"
            raise self._client._closed_error(f"{what} of ledger {self._lid}")

    def _check_range(self, first, last):
        if not isinstance(first, int) or not isinstance(last, int):
            raise TypeError(f"read of ledger {self._lid}: entry ids must be integers")
        if first < 0 or last < first - 1:
            raise ValueError(f"read of ledger {self._lid}: bad range {first}..{last}")

    def _read_range(self, first, last, retry=True):
        out = []
        if last < first:
            return out
        e = first
        nbytes = 0
        ahead = None            # the next window (as _begin_window gives it), begun early
        while e <= last:
            if ahead is None:
                end, batch, known = self._begin_window(e, last, out, nbytes)
            else:
                (end, batch, known), ahead = ahead, None
            if known and end < last and self._loop.batching:
                # The next window's READ_RANGEs go out now, so the bookies work on
                # it while this thread takes this one's entries (no idle gap
                # between windows); each window is half of readWindowBytes.
                ahead = self._begin_window(end + 1, last, out, nbytes)
            self._wait_reads(batch, e, end)
            results = batch.results
            if batch.failed:
                for i, res in enumerate(results):
                    if res is None:
                        op = batch.failed[e + i]
                        err = op.error()
                        if isinstance(err, NoSuchEntryError) and op.no_ledger():
                            self._raise_if_deleted(f"read entry {e + i} of ledger {self._lid}")
                        if retry and self._md.state != LedgerState.CLOSED and \
                                not isinstance(err, ClientClosedError) and \
                                isinstance(err, (NoSuchEntryError, BookieUnavailableError)):
                            # Our view of the ensembles may be stale (a writer's
                            # ensemble change).
                            if self._refresh_metadata(f"read entry {e + i} of ledger "
                                                      f"{self._lid}"):
                                return out + results[:i] + \
                                    self._read_range(e + i, last, retry=False)
                        raise err
            out += results
            nbytes += sum(map(len, map(_data_of, results)))
            e = end + 1
        if out:
            self._read_avg = max(1, nbytes // len(out))
        return out

    def _begin_window(self, e, last, out, nbytes):
        """Start the reads of the window from entry ``e`` (up to ``last``), sized in
        bytes from the entries read so far; ``(end, batch, size known)``."""
        hint = self._read_avg or self._entry_size_hint()
        avg = nbytes // len(out) if out else (hint or _FIRST_ENTRY_GUESS)
        cap = _RANGE_WINDOW if self._loop.batching else _READ_WINDOW
        window = max(1, min(cap, self._read_window_bytes // 2 // max(1, avg)))
        known = bool(out or hint)
        if not known:
            window = min(window, _PROBE_ENTRIES)    # learn the entry size first
        end = min(last, e + window - 1)
        return end, self._begin_reads(range(e, end + 1), avg), known

    def _entry_size_hint(self) -> int:
        """The average entry size before this handle has read any: from the
        metadata of a closed ledger (its length over its entries), else from the
        cumulative length of the last entry this reader saw; 0 if unknown (then a
        first window of a few entries measures it). Sizing requests by a guess
        cost either way: 64 KiB for 1 KiB entries made requests of a few entries,
        each with its own overhead; a small guess for large entries would put
        more than ``readWindowBytes`` in flight."""
        md = self._md
        if md.state == LedgerState.CLOSED and md.length > 0 and md.last_entry_id >= 0:
            return max(1, md.length // (md.last_entry_id + 1))
        if self._length_entry >= 0 and self._length > 0:
            return max(1, self._length // (self._length_entry + 1))
        return 0

    def _begin_reads(self, entry_ids, avg=_FIRST_ENTRY_GUESS):
        """Start reading a window of consecutive entries (of about ``avg`` bytes);
        returns its _ReadBatch (see :meth:`_wait_reads`)."""
        md = self._md
        self._prepare_conns({b for _, ens in md.ensembles for b in ens})
        batch = _ReadBatch(len(entry_ids), entry_ids[0] if entry_ids else 0)
        # healthy replicas first (reorderReadSequenceEnabled)
        order = self._client._health.order if self._reorder else _same
        if len(entry_ids) > 1 and self._loop.batching:
            self._loop.call_soon(self._start_ranged, entry_ids[0], entry_ids[-1], batch, avg,
                                 order)
        elif entry_ids:
            ops = [_ReadOp(self, e, self._conns_of(order(md.write_set(e))), batch,
                           self._read_timeout)
                   for e in entry_ids]
            self._loop.call_soon(_start_all, ops)
        return batch

    def _wait_reads(self, batch, first, last):
        """Wait until every read of ``batch`` (entries ``first..last``) ended."""
        # generous bound: every replica may time out in turn
        if not batch.event.wait(self._read_timeout * (self._qw + 1) + 5):
            raise TimeoutError(f"read entries {first}..{last} of ledger {self._lid}: "
                               f"no answer")

    def _start_ranged(self, first, last, batch, avg, order):
        """Start the reads of ``first..last`` as READ_RANGEs (I/O thread): per
        fragment, each bookie is asked for the entries it is the first replica
        to ask of (``order``: quarantined bookies last; stride E, offset the
        slot), in requests of about a frame's budget sent at once, so the
        answers stream back pipelined."""
        md = self._md
        frags = md.ensembles
        # Requests of _RANGE_REQUEST_BYTES, all sent at once: the bookie builds the
        # next answers while this thread decodes one, and only the first and the
        # last request are not overlapped.
        budget = max(1, min(self._read_window_bytes, self._loop.max_frame_size // 2,
                            _RANGE_REQUEST_BYTES))
        e = first
        while e <= last:
            k = len(frags) - 1
            while k > 0 and frags[k][0] > e:
                k -= 1
            end = min(last, frags[k + 1][0] - 1) if k + 1 < len(frags) else last
            ens = frags[k][1]
            E = len(ens)
            per = max(1, budget // max(1, avg))          # entries of one request
            for a in range(e, min(e + E, end + 1)):
                # the replicas to ask, healthy ones first: every entry of the slot
                # has the same write set, so the same order
                conns = self._conns_of(order(md.write_set(a)))
                dead = isinstance(conns[0], DeadConnection)
                while a <= end:
                    b = min(end, a + (per - 1) * E)
                    rr = _RangeRead(self, conns, a, b, E, a % E, budget, batch)
                    if dead:
                        rr.unsupported(None)
                    else:
                        rr.begin()
                    a = b + E
            e = end + 1

    def read_entry(self, entry_id: int) -> LedgerEntry:
        return self.read_entries(entry_id, entry_id)[0]

    def _refresh_metadata(self, what=None) -> bool:
        """Re-read the metadata; True if it changed. NoSuchLedgerError naming
        ``what`` (the call) if the ledger was deleted."""
        try:
            md, version = self._client._store.read_ledger(self._lid)
        except NoSuchLedgerError:
            raise self._deleted(what or f"read the metadata of ledger {self._lid}") from None
        except MetadataError:
            if self._client._closed:        # the store closed with the client
                raise self._client._closed_error(
                    f"read the metadata of ledger {self._lid}") from None
            raise
        if version == self._version:
            return False
        if not self._writable:
            self._md, self._version = md, version
            if md.state == LedgerState.CLOSED and md.last_entry_id > self._lac:
                self._lac = md.last_entry_id
        return True

    def read_last_add_confirmed(self) -> int:
        """Ask the bookies of the last ensemble for the LAC; update and return it."""
        if self._writable:
            return self._lac
        self._check_client("read last add confirmed")
        what = f"read last add confirmed of ledger {self._lid}"
        if self._md.state != LedgerState.CLOSED:
            self._refresh_metadata(what)
        if self._md.state == LedgerState.CLOSED:
            self._lac = max(self._lac, self._md.last_entry_id)
            return self._lac
        ens = self._md.last_ensemble
        self._prepare_conns(ens)
        calls = [self._loop.request(c, protocol.read_lac, self._lid, False, None,
                                    timeout=self._read_timeout) for c in self._conns_of(ens)]
        best = None
        errors = []
        ok = no_ledger = False
        for call in calls:
            call.wait(self._read_timeout + 5)
            if call.reply is not None and call.reply[2] == EOK:
                ok = True
                lac = call.reply[4]
                if lac is not None and (best is None or lac > best):
                    best = lac
            elif call.reply is not None and call.reply[2] in (ENOLEDGER, ENOENTRY):
                no_ledger = no_ledger or call.reply[2] == ENOLEDGER
                best = -1 if best is None else best
            else:
                errors.append(f"{call.conn.bookie_id if call.conn else '?'}: "
                              f"{call.error or call.reply}")
        if closed_error_among(call.error for call in calls) is not None:
            raise self._client._closed_error(what)
        if no_ledger and not ok:
            # no bookie knows the ledger: new and empty, or deleted since the refresh
            self._raise_if_deleted(what)
        if best is None:
            raise BookieUnavailableError(f"read last add confirmed of ledger {self._lid}: "
                                         f"no bookie answered ({'; '.join(errors)})")
        if best > self._lac:
            self._lac = best
        return self._lac

    def read_last_add_confirmed_and_entry(self, entry_id: int, timeout: float = 1.0):
        """Long poll: wait up to ``timeout`` s for the LAC to reach ``entry_id``.

        Returns ``(lac, entry)``; ``entry`` is the LedgerEntry of ``entry_id`` when
        it is confirmed, else None.
        """
        if entry_id < 0:
            raise ValueError(f"long poll on ledger {self._lid}: bad entry id {entry_id}")
        self._check_client(f"long poll for entry {entry_id}")
        if entry_id <= self._readable_last():
            return self._lac_after(entry_id), self.read_entry(entry_id)
        if self._md.state == LedgerState.CLOSED:
            return self._md.last_entry_id, None
        md = self._md
        ws = md.write_set(entry_id)
        self._prepare_conns(ws)
        timeout_ms = max(0, int(timeout * 1000))
        results = collections.deque()
        done = threading.Event()
        n = len(ws)

        def on_done(call):
            results.append(call)
            if len(results) == n or (call.reply is not None and call.reply[2] == EOK
                                     and call.reply[7] is not None):
                done.set()

        prev = self._lac
        for c in self._conns_of(ws):
            self._loop.request(c, protocol.read, self._lid, entry_id, False, None, True, prev,
                               timeout_ms, timeout=timeout + self._read_timeout,
                               callback=on_done)
        done.wait(timeout + self._read_timeout + 5)
        if closed_error_among(call.error for call in list(results)) is not None:
            # not "nothing came": the client closed under the poll
            raise self._client._closed_error(f"long poll for entry {entry_id} of ledger "
                                             f"{self._lid}")
        best = prev
        entry = None
        for call in list(results):
            r = call.reply
            if r is None or r[2] != EOK:
                continue
            blac = r[8]
            if blac is not None and blac > best:
                best = blac
            if entry is None and r[7] is not None and r[4] == entry_id:
                try:
                    length = self._digest.verify(entry_id, r[5], r[6], r[7])
                    entry = LedgerEntry(self._lid, entry_id, r[7], length)
                except DigestMismatchError:
                    pass
        if best > self._lac:
            self._lac = best
        if self._lac < entry_id:
            # The writer's last entry is only ever confirmed by the metadata (CLOSED);
            # a ledger deleted under the poll ends it with NoSuchLedgerError.
            try:
                self._refresh_metadata(f"long poll for entry {entry_id} of ledger {self._lid}")
            except MetadataError:
                pass
            if self._md.state == LedgerState.CLOSED:
                self._lac = max(self._lac, self._md.last_entry_id)
        if entry_id > self._lac:
            return self._lac, None
        if entry is None:
            entry = self.read_entry(entry_id)
        else:
            self._note_read((entry,))
        return self._lac, entry

    def _lac_after(self, entry_id):
        return self._readable_last()


def quorum_masks(acks, qw, qa):
    """``(at least qa, at least qw)`` of the bitsets ``acks``: the bits set in at
    least that many of them. ``ge[k]`` collects the bits seen in k or more of
    the bitsets folded in so far."""
    ge = [0] * (qw + 1)
    for a in acks:
        if a:
            for k in range(qw, 1, -1):
                ge[k] |= ge[k - 1] & a
            ge[1] |= a
    return ge[qa], ge[qw]


def _masks_3_3_2(acks):
    a, b, c = acks
    ab = a & b
    return ab | (c & (a | b)), ab & c


def _masks_3_3_3(acks):
    a, b, c = acks
    m = a & b & c
    return m, m


def _masks_2_2_2(acks):
    m = acks[0] & acks[1]
    return m, m


# Shapes whose masks are a few operators, without quorum_masks' loops: a write
# with one entry per acknowledgement (blocking adds) computes them per entry.
_MASKS = {(3, 3, 2): _masks_3_3_2, (3, 3, 3): _masks_3_3_3, (2, 2, 2): _masks_2_2_2}


def masks_for(E, qw, qa):
    """The function ``acks -> (qa_mask, qw_mask)`` for an ensemble of this shape."""
    f = _MASKS.get((E, qw, qa))
    if f is None:
        def f(acks):
            return quorum_masks(acks, qw, qa)
    return f


def _speculate_ref(ref, idx):
    op = ref()
    if op is not None:
        op._speculate(idx)


def _same(bookies):
    return bookies


def _start_all(ops):
    for op in ops:
        op.start()
