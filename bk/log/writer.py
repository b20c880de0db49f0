"""The log writer: ownership, batching into record sets, rolling.

Theory of operation
-------------------
*Ownership* (:func:`take_ownership`, the steps of BookKeeper's "Ledgers to
logs"): read the log record; recovery-open (fence) the ledgers of the open
segments (the last two at most, though a sink may have appended closed
segments after them), which closes them at their final last entry; create a new ledger;
CAS-append it as a new open segment with ``epoch + 1``. A lost CAS means
someone else changed the log meanwhile: the new ledger is deleted and the
steps start over. No append is served before the CAS succeeded. Why two: a
writer rolls by appending the new segment *before* closing the old
one, so a writer that dies (or is deposed) mid-roll leaves two open segments.
Fencing is what deposes the previous writer: its next add gets EFENCED from
the bookies, which this module turns into :class:`bk.errors.LogFencedError`.

*Batching*: records are buffered and sent as one ledger entry (a record set,
``bk.log.records``) once ``logBatchBytes`` are buffered, once the oldest
buffered record has waited ``logBatchLingerMs`` (a background thread), or at
once for the blocking ``append``. Entries are acknowledged in entry-id order
by the ledger handle; a record's Future resolves with its Position when its
entry is acknowledged. The ledger handle's callbacks run on the client's I/O
thread, so they never take this writer's lock (an appender holding it may be
waiting for that very thread to free the add window).

*Tailing*: a reader sees an entry once the bookies know it is confirmed
(its LAC). With adds flowing, the next add carries it; a linger after an
acknowledgement, a ledger with nothing in flight sends its LAC explicitly.

*Rolling* (size, entry count, age, or ``roll()``): appends pause; the buffer
is flushed to the old ledger; a new ledger is created and CAS-appended to the
record; the old ledger gets an end-of-segment marker entry (and one empty
entry that carries the marker's LAC), so tailing readers move on at once; it
is closed (which waits for its outstanding adds) and its segment CAS-closed
with its totals; appends resume on the new ledger.
Pausing keeps the log free of holes: a record of the new segment is never
acknowledged while an older one could still fail. Any CAS that finds a higher
epoch means a new writer took over: the writer fails with LogFencedError.

A ledger that fails beyond repair (no bookies left, fenced) breaks the writer:
every pending and later append raises that error; ``close()`` still releases
it, and a new writer (``open_log_writer``) continues the log. A ledger deleted
under the writer (by hand, or with the whole log by ``delete_log``) is such a
failure: the appends raise NoSuchLedgerError naming the log and the ledger
(once the bookies refuse its adds, or its roll or close finds its metadata
gone), never LogFencedError, since no other writer took over.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

from bk.errors import (BKError, ClientClosedError, LedgerFencedError, LogFencedError,
                       MetadataVersionError, NoSuchLedgerError, NoSuchLogError)
from bk.log import metadata
from bk.meta.ledger import LedgerState
from bk.log.records import (END_OF_SEGMENT, HEADER_SIZE, RECORD_OVERHEAD, Position,
                            decode_record_set, encode_record_set)

log = logging.getLogger("bk.log")

SHAPE_KEYS = ("ensemble_size", "write_quorum_size", "ack_quorum_size")
CONF_KEYS = ("logRollBytes", "logRollEntries", "logRollSeconds", "logBatchBytes",
             "logBatchLingerMs")


def segment_tail(client, ledger_handle) -> tuple[int, int, int, int, int]:
    """(last entry id, last entry with records, its records, records, bytes) of a
    log's ledger up to its LAC (its last entry once closed), from the record-set
    headers: the last entry has the totals; the last entry *with records* is a few
    back when the segment ends with a roll's empty marker entries."""
    last = ledger_handle.last_add_confirmed
    if ledger_handle.metadata.state == LedgerState.CLOSED:
        last = ledger_handle.metadata.last_entry_id
    if last < 0:
        return -1, -1, 0, 0, 0
    rs = decode_record_set(ledger_handle.read_entry(last).data)
    records, nbytes, slots = rs.records_after, rs.bytes_after, len(rs.records)
    e = last
    while slots == 0 and e > 0 and rs.records_before > 0:
        e -= 1
        rs = decode_record_set(ledger_handle.read_entry(e).data)
        slots = len(rs.records)
    return last, e, slots, records, nbytes


def fence_segment(client, name: str, seg: dict) -> tuple[int, int, int]:
    """Recovery-open a segment's ledger (fence and close it); (last entry, records, bytes)."""
    try:
        h = client.open_ledger(seg["ledger_id"])
    except NoSuchLedgerError:
        # Only a deletion behind the log's back does this; nothing can be read there.
        log.warning("log %s: ledger %d of segment %d is gone; closing the segment empty",
                    name, seg["ledger_id"], seg["segment"])
        return -1, 0, 0
    try:
        last, _e, _slots, records, nbytes = segment_tail(client, h)
    finally:
        h.close()
    return last, records, nbytes


def take_ownership(client, name: str, shape: dict):
    """Make this client the log's only writer. Returns (record, version, handle, segment)."""
    store = client._store
    while True:
        # 1. Read the log record (an absent log is created empty).
        rec, version = metadata.read_or_create(store, name)
        # 2. Recovery-open (fence) the ledgers of the open segments: the previous
        #    writer can add nothing more, and each segment closes at its final entry.
        #    A writer leaves at most two (mid-roll), normally the last two; but an
        #    exactly-once sink (bk.log.append_ledgers) may have appended closed
        #    segments after them, so every open one is fenced, wherever it is.
        for seg in rec["segments"]:
            if seg["state"] == metadata.OPEN:
                last, records, nbytes = fence_segment(client, name, seg)
                rec = metadata.with_segment_closed(rec, seg["segment"], last, records, nbytes)
        # 3. Create a new ledger.
        lh = client.create_ledger(custom_metadata={"bk.log": name}, **shape)
        # 4. CAS-append it as the open segment, with epoch + 1.
        new, segment = metadata.with_new_segment(rec, lh.ledger_id, new_epoch=True)
        try:
            version = store.cas_json(metadata.key(name), new, version)
        except MetadataVersionError:
            # 5. Lost: another writer (or a truncation) changed the log. Start over.
            _discard_ledger(client, lh)
            continue
        return new, version, lh, segment


def _discard_ledger(client, lh) -> None:
    try:
        lh.close()
        client.delete_ledger(lh.ledger_id)
    except BKError as e:
        log.warning("could not delete unused ledger %d: %s", lh.ledger_id, e)


class LogWriter:
    """The one writer of a log (``client.open_log_writer``); thread-safe."""

    def __init__(self, client, name: str, conf, shape: dict):
        self._client = client
        self.name = name
        self._store = client._store
        self._shape = dict(shape)
        self._batch_bytes = int(conf.logBatchBytes)
        self._linger = int(conf.logBatchLingerMs) / 1000.0
        self._roll_bytes = int(conf.logRollBytes)
        self._roll_entries = int(conf.logRollEntries)
        self._roll_seconds = float(conf.logRollSeconds)
        # An entry is one frame: the ledger's payload limit minus the record set's header.
        self._max_entry = client.max_entry_size
        self._max_record = self._max_entry - HEADER_SIZE - RECORD_OVERHEAD
        self._cond = threading.Condition(threading.Lock())
        self._roll_lock = threading.Lock()
        self._buf: list = []
        self._buf_bytes = 0
        self._buf_size = HEADER_SIZE
        self._waiters: list = []          # (slot, Future) of buffered records
        self._buf_since = 0.0
        self._error: BaseException | None = None   # set once; appends raise it
        self._closed = False
        self._rolling = False
        self._roll_wanted = False
        self._rec, self._version, lh, segment = take_ownership(client, name, self._shape)
        self._epoch = self._rec["epoch"]
        self._start_segment(lh, segment)
        self._thread = threading.Thread(target=self._run, name=f"bk-log-writer-{name}",
                                        daemon=True)
        self._thread.start()

    def __repr__(self):
        return f"<LogWriter {self.name} epoch={self._epoch} segment={self._segment}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def epoch(self) -> int:
        return self._epoch

    def _start_segment(self, lh, segment):
        # An idle writer must still let readers see its last entry: the ledger
        # sends its LAC explicitly after about a linger (its ticker's period).
        lh.ensure_explicit_lac(max(self._linger, 0.001))
        self._lh = lh
        self._segment = segment
        self._seg_records = 0
        self._seg_bytes = 0
        self._seg_entries = 0
        self._seg_started = time.monotonic()

    # --- appends ---------------------------------------------------------------
    def _check_record(self, data):
        if type(data) is not bytes:
            if isinstance(data, (bytearray, memoryview)):
                data = bytes(data)
            else:
                raise TypeError(f"append to log {self.name}: a record must be bytes, not "
                                f"{type(data).__name__}")
        if len(data) > self._max_record:
            raise ValueError(f"append to log {self.name}: record of {len(data)} bytes exceeds "
                             f"the entry limit of {self._max_record} bytes "
                             f"(nettyMaxFrameSizeBytes minus overheads)")
        return data

    def _wait_writable(self, for_roll=False):
        """Under the lock: raise the writer's error, or wait out a roll (also one
        that is due: appends pause once a segment reached its roll threshold, so
        a fast appender cannot keep the roll from happening)."""
        while True:
            if self._error is not None:
                raise self._error
            if self._closed:
                raise BKError(f"append to log {self.name}: the writer is closed")
            if not self._rolling and (for_roll or not self._roll_wanted):
                return
            self._cond.wait(0.05)

    def _add(self, data, fut):
        """Under the lock: buffer one record, sending the buffer first if it would
        not fit one entry."""
        n = len(data)
        if self._buf and self._buf_size + RECORD_OVERHEAD + n > self._max_entry:
            self._flush()
        if not self._buf:
            self._buf_since = time.monotonic()
        if fut is not None:
            self._waiters.append((len(self._buf), fut))
        self._buf.append(data)
        self._buf_bytes += n
        self._buf_size += RECORD_OVERHEAD + n
        if self._buf_bytes >= self._batch_bytes:
            self._flush()

    def append_async(self, data) -> concurrent.futures.Future:
        """Buffer a record; the Future resolves to its Position once it is durable."""
        data = self._check_record(data)
        fut = concurrent.futures.Future()
        with self._cond:
            self._wait_writable()
            first = not self._buf
            self._add(data, fut)
            if self._buf and (self._linger <= 0):
                self._flush()
            elif first and self._buf:
                self._cond.notify_all()       # the linger clock starts
        return fut

    def append(self, data) -> Position:
        """Append one record; returns its Position once Qa bookies have it."""
        data = self._check_record(data)
        fut = concurrent.futures.Future()
        with self._cond:
            self._wait_writable()
            self._add(data, fut)
            self._flush()                     # the caller waits: lingering only delays it
        return fut.result()

    def append_many(self, records) -> Position | None:
        """Append records pipelined (batched into entries); returns the last
        Position once every one of them is durable (None for no records)."""
        fut = self.append_many_async(records)
        if fut is None:
            return None
        with self._cond:
            self._flush()                     # the caller waits: lingering only delays it
        # Entries of a ledger are acknowledged in order and a failure fails every
        # later one: the last record's result stands for all of them.
        return fut.result()

    def append_many_async(self, records) -> concurrent.futures.Future | None:
        """Append records without waiting (batched, sent within a linger); a Future
        of the last one's Position (resolved: all are durable), or None for none."""
        fut = None
        it = iter(records)
        while True:
            chunk = []
            for data in it:
                chunk.append(self._check_record(data))
                if len(chunk) >= 1024:
                    break
            if not chunk:
                break
            with self._cond:
                self._wait_writable()
                wake = False
                add = self._add
                last = len(chunk) - 1
                for i, data in enumerate(chunk):
                    if self._roll_wanted:
                        self._wait_writable()     # releases the lock: the roll happens
                    if not self._buf:
                        wake = True
                    if i == last:
                        fut = concurrent.futures.Future()
                        add(data, fut)
                    else:
                        add(data, None)
                if self._buf and self._linger <= 0:
                    self._flush()
                elif wake and self._buf:
                    self._cond.notify_all()   # the linger clock starts
        return fut

    def flush(self) -> None:
        """Send what is buffered now (appends are otherwise sent within a linger)."""
        with self._cond:
            self._flush()

    def _flush(self):
        """Under the lock: send the buffer as one entry of the current segment."""
        if not self._buf:
            return
        recs, waiters = self._buf, self._waiters
        payload = encode_record_set(recs, self._seg_records, self._seg_bytes)
        self._seg_records += len(recs)
        self._seg_bytes += self._buf_bytes
        self._seg_entries += 1
        self._buf, self._waiters, self._buf_bytes, self._buf_size = [], [], 0, HEADER_SIZE
        segment = self._segment

        lh = self._lh

        def done(exc, entry_id):
            # On the client's I/O thread: no locks of this writer here.
            if exc is None:
                # A linger after the acknowledgement, if the ledger is idle by then,
                # its LAC goes out: a tailing reader sees the last record within
                # about a linger plus a round trip (with adds in flight the next
                # one carries it; the ledger's own ticker only every 50 ms).
                lh.flush_lac(delay=max(self._linger, 0.001))
                for slot, fut in waiters:
                    fut.set_result(Position(segment, entry_id, slot))
                return
            err = self._failed(exc, lh)
            for _slot, fut in waiters:
                fut.set_exception(err)

        try:
            self._lh.add_entry_async(payload, callback=done)
        except BKError as e:
            done(e, -1)
        if self._rolling_due():
            self._roll_wanted = True
            self._cond.notify_all()

    def _failed(self, exc, lh=None) -> BaseException:
        """The writer's error for a failed add (the first one sticks)."""
        if self._error is None:
            if isinstance(exc, LedgerFencedError):
                err = LogFencedError(f"append to log {self.name}: this writer (epoch "
                                     f"{self._epoch}) was deposed; its ledger "
                                     f"{(lh or self._lh).ledger_id} is fenced ({exc})")
            elif isinstance(exc, NoSuchLedgerError):
                err = NoSuchLedgerError(f"append to log {self.name}: the writer's ledger "
                                        f"{(lh or self._lh).ledger_id} was deleted under it "
                                        f"(not by this log's truncation, which never deletes "
                                        f"the open segment); open a new writer to continue "
                                        f"({exc})")
            elif isinstance(exc, ClientClosedError):
                err = ClientClosedError(f"append to log {self.name}: the client is closed "
                                        f"({exc})")
            else:
                msg = (f"append to log {self.name}: the writer's ledger failed beyond "
                       f"repair; open a new writer to continue ({exc})")
                try:
                    err = type(exc)(msg)
                except Exception:
                    err = BKError(msg)
            err.__cause__ = exc
            self._error = err
            with_cond_notify(self._cond)
        return self._error

    # --- rolling -------------------------------------------------------------------
    def _rolling_due(self) -> bool:
        if self._roll_bytes and self._seg_bytes + self._buf_bytes >= self._roll_bytes:
            return True
        if self._roll_entries and self._seg_entries >= self._roll_entries:
            return True
        return False

    def roll(self) -> None:
        """Continue on a new ledger now: create it, CAS-append it, close the old one."""
        self._roll()

    def _roll(self):
        with self._roll_lock:
            with self._cond:
                self._wait_writable(for_roll=True)
                self._flush()
                self._rolling = True
                self._roll_wanted = False
                old, old_segment = self._lh, self._segment
            try:
                # Create, then CAS-append the new segment: from here on it is the
                # one a takeover fences along with the old one.
                lh = self._client.create_ledger(custom_metadata={"bk.log": self.name},
                                                **self._shape)
                try:
                    segment = self._cas(lambda rec: metadata.with_new_segment(
                        rec, lh.ledger_id, new_epoch=False), returns_segment=True)
                except BKError:
                    _discard_ledger(self._client, lh)
                    raise
                records, nbytes = self._seg_records, self._seg_bytes
                # Mark the old segment's end, so that tailing readers move on at
                # once rather than after a long poll times out; the empty entry
                # after the marker carries the marker's LAC to the bookies.
                old.add_entry(encode_record_set([], records, nbytes, flags=END_OF_SEGMENT))
                old.add_entry(encode_record_set([], records, nbytes))
                # Then close the previous ledger (waits for its adds) and its segment.
                old.close()
                last = old.last_add_confirmed
                self._cas(lambda rec: metadata.with_segment_closed(
                    rec, old_segment, last, records, nbytes))
                with self._cond:
                    self._start_segment(lh, segment)
            except BKError as e:
                with self._cond:
                    if self._error is None:
                        self._failed(e)
                raise self._error from None
            finally:
                with self._cond:
                    self._rolling = False
                    self._cond.notify_all()

    def _cas(self, transition, returns_segment=False):
        """CAS a transition of the log record. A record with another epoch means a
        new writer owns the log: LogFencedError. Other changes (truncation) are
        merged by applying the transition again."""
        rec, version = self._rec, self._version
        for _ in range(50):
            out = transition(rec)
            new, segment = out if returns_segment else (out, None)
            try:
                self._version = self._store.cas_json(metadata.key(self.name), new, version)
                self._rec = new
                return segment
            except MetadataVersionError:
                try:
                    rec, version = metadata.read(self._store, self.name)
                except NoSuchLogError:
                    raise LogFencedError(f"log {self.name} was deleted under its writer") \
                        from None
                if rec["epoch"] != self._epoch:
                    raise LogFencedError(
                        f"log {self.name}: a new writer (epoch {rec['epoch']}) took over from "
                        f"this one (epoch {self._epoch})") from None
        raise MetadataVersionError(f"log {self.name}: too many concurrent changes")

    # --- background: linger flushes and rolls ---------------------------------------
    def _run(self):
        while True:
            roll = False
            with self._cond:
                if self._closed or self._error is not None:
                    return
                if self._rolling:             # roll() in another thread
                    self._cond.wait(0.05)
                    continue
                now = time.monotonic()
                if self._roll_wanted or (self._roll_seconds and self._seg_entries and
                                         now - self._seg_started >= self._roll_seconds):
                    roll = True
                elif self._buf and now - self._buf_since >= self._linger:
                    self._flush()
                    continue
                else:
                    wait = 1.0
                    if self._buf:
                        wait = min(wait, self._buf_since + self._linger - now)
                    if self._roll_seconds and self._seg_entries:
                        wait = min(wait, self._seg_started + self._roll_seconds - now)
                    self._cond.wait(max(wait, 0.0005))
                    continue
            if roll:
                try:
                    self._roll()
                except BKError as e:
                    # The appends raise it; a writer that was already broken is no news.
                    log.log(logging.DEBUG if e is self._error or self._closed
                            else logging.WARNING,
                            "log %s: roll failed: %s", self.name, e)
                    return

    # --- close ---------------------------------------------------------------------
    def close(self) -> None:
        """Send what is buffered, wait for it, close the ledger and its segment.
        The log stays; the next writer continues it."""
        with self._cond:
            if self._closed:
                return
            if self._error is None:
                self._flush()
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(10.0)
        with self._roll_lock:                 # a roll() under way finishes first
            lh = self._lh
            try:
                lh.close()
            except BKError as e:
                if self._error is None:
                    self._failed(e)
                log.info("log %s: closing ledger %d: %s", self.name, lh.ledger_id, e)
                return
            if self._error is not None:
                return
            try:
                self._cas(lambda rec: metadata.with_segment_closed(
                    rec, self._segment, lh.last_add_confirmed, self._seg_records,
                    self._seg_bytes))
            except BKError as e:
                # The ledger is closed; the next writer's takeover closes the segment.
                log.info("log %s: closing segment %d: %s", self.name, self._segment, e)


def with_cond_notify(cond):
    """Wake waiters of ``cond`` if its lock is free now; never block (I/O thread)."""
    if cond.acquire(blocking=False):
        try:
            cond.notify_all()
        finally:
            cond.release()
