"""The log reader: every acknowledged record once, in order, tailing the open segment.

Theory of operation
-------------------
The reader keeps the Position of the next record it owes (``_next``) and a
handle on the ledger of that position's segment, opened *without* recovery (a
reader must never fence the writer). In that ledger it reads what is known to
be durable: up to the last entry of a CLOSED ledger, up to the LAC of an open
one. At the LAC of an open ledger it long-polls the bookies
(``read_last_add_confirmed_and_entry``): a bookie answers as soon as the LAC
passes the entry (piggybacked on the next add, or sent explicitly by an idle
writer), so tailing costs no polling. When the long poll times out, the ledger
handle re-reads its metadata: a ledger closed meanwhile (the writer rolled, or a
new writer's recovery fenced it) then reads on to its final last entry — which
may include entries a recovery found past the old LAC — and the reader moves
to the next segment number, which it looks up in the log record. Only a
reader waiting for a segment that does not exist yet polls the log record
(with back-off). A roll is quicker: the writer ends the old segment with a
marker entry (``END_OF_SEGMENT``), and the reader moves on when it reads it.

A client closed under a reader ends its wait at once: the long poll raises
ClientClosedError, and so does every later read.

Truncation deletes whole ledgers after recording ``truncated_before`` by CAS:
the reader checks that point whenever it consults the record (opening a
segment, a ledger gone), and raises LogTruncatedError when its next position
lies before it.

A ledger deleted otherwise: with the whole log (``delete_log``), the record is
gone too and the reader raises NoSuchLogError; behind the log's back (by hand,
``client.delete_ledger``), the reader raises NoSuchLedgerError naming the
segment and the ledger, at once when its handle is refused (the bookies
collected the ledger, or its metadata is gone when a long poll ends), and
never skips the segment silently: its records are lost, and the application
decides (a new reader from a later Position).
"""

from __future__ import annotations

import collections
import threading
import time

from bk.errors import (BKError, LogTruncatedError, NoSuchEntryError, NoSuchLedgerError)
from bk.log import metadata
from bk.log.records import LogRecord, Position, decode_record_set
from bk.meta.ledger import LedgerState

_READ_BATCH = 64              # entries per read of a ledger
_LONG_POLL = 1.0              # seconds of one long poll (then the metadata is checked)
_RECORD_POLL = (0.02, 0.25)   # back-off of re-reading the log record for a new segment


class LogReader:
    """Reads one log (``client.open_log_reader``); iterate it, or ``read_next``."""

    def __init__(self, client, name: str, start="earliest"):
        self._client = client
        self.name = name
        self._store = client._store
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._lh = None
        self._seg = None
        self._closed = False
        self._rec, _ = metadata.read(self._store, name)
        self._next = self._start_position(start)

    def __repr__(self):
        return f"<LogReader {self.name} next={self._next}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def position(self) -> Position:
        """The Position of the next record this reader will return (or skip to)."""
        return self._pending[0].position if self._pending else self._next

    def _start_position(self, start) -> Position:
        rec = self._rec
        segs = rec["segments"]
        trunc = metadata.truncated_before(rec)
        if start == "earliest":
            first = Position(segs[0]["segment"], 0, 0) if segs else \
                Position(metadata.next_segment_number(rec), 0, 0)
            return max(first, trunc) if trunc else first
        if start == "latest":
            if not segs:
                return Position(metadata.next_segment_number(rec), 0, 0)
            last = segs[-1]
            if last["state"] == metadata.CLOSED:
                return Position(last["segment"] + 1, 0, 0)
            self._open_handle(last)
            lh = self._lh
            end = lh.metadata.last_entry_id if lh.metadata.state == LedgerState.CLOSED \
                else lh.last_add_confirmed
            return Position(last["segment"], end + 1, 0)
        try:
            pos = Position.parse(start)
        except ValueError as e:
            raise ValueError(f"open reader of log {self.name}: start must be 'earliest', "
                             f"'latest' or a Position: {e}") from None
        if trunc and pos < trunc:
            raise LogTruncatedError(f"read log {self.name} from {pos}: the log is truncated "
                                    f"before {trunc}")
        return pos

    # --- reading ---------------------------------------------------------------------
    def read_next(self, timeout: float | None = None) -> LogRecord | None:
        """The next record, or None if none came within ``timeout`` seconds
        (None: wait as long as it takes)."""
        out = self.read_batch(1, timeout)
        return out[0] if out else None

    def read_batch(self, max_records: int = 1000, timeout: float | None = None) -> list:
        """Up to ``max_records`` records: those available now, else waits up to
        ``timeout`` seconds for at least one; possibly empty."""
        if max_records < 1:
            raise ValueError(f"read log {self.name}: max_records must be >= 1")
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._lock:
            if self._closed:
                raise BKError(f"read log {self.name}: the reader is closed")
            while not self._pending:
                if not self._fill(deadline):
                    return []
            n = min(max_records, len(self._pending))
            return [self._pending.popleft() for _ in range(n)]

    def __iter__(self):
        while not self._closed:
            rec = self.read_next(timeout=1.0)
            if rec is not None:
                yield rec

    def _left(self, deadline) -> float:
        return _LONG_POLL if deadline is None else deadline - time.monotonic()

    def _fill(self, deadline) -> bool:
        """Read what comes next into ``_pending``; False if the deadline passed first."""
        polls = 0
        once = True         # a zero timeout still looks once
        while True:
            if self._client._closed:
                # (a reader polling for a segment would meet a closed store, a
                # tailing one a closed loop: the same error either way)
                raise self._client._closed_error(f"read log {self.name}")
            if self._lh is None:
                if self._open_next_segment():
                    continue
                left = self._left(deadline)
                if left <= 0 and not once:
                    return False
                once = False
                time.sleep(max(0.0, min(left, _RECORD_POLL[0] * (2 ** polls), _RECORD_POLL[1])))
                polls += 1
                self._refresh_record()
                continue
            lh, seg = self._lh, self._seg
            e = self._next.entry_id
            closed = lh.metadata.state == LedgerState.CLOSED
            limit = lh.metadata.last_entry_id if closed else lh.last_add_confirmed
            if e <= limit:
                try:
                    entries = lh.read_entries(e, min(limit, e + _READ_BATCH - 1))
                except NoSuchLedgerError as exc:
                    self._check_truncated(refresh=True)
                    raise self._segment_deleted(seg, lh, exc) from None
                except NoSuchEntryError:
                    self._check_truncated(refresh=True)
                    raise
                if self._take(seg, entries) or closed and self._next.entry_id > limit:
                    self._next_segment(seg)
                if self._pending:
                    return True
                continue
            if closed:
                self._next_segment(seg)   # read to its last entry
                continue
            left = self._left(deadline)
            if left <= 0 and not once:
                return False
            once = False
            try:
                _lac, entry = lh.read_last_add_confirmed_and_entry(
                    e, timeout=max(0.0, min(left, _LONG_POLL)))
            except NoSuchLedgerError as exc:
                self._check_truncated(refresh=True)
                raise self._segment_deleted(seg, lh, exc) from None
            if entry is not None:
                if self._take(seg, [entry]):
                    self._next_segment(seg)
                if self._pending:
                    return True

    def _segment_deleted(self, seg, lh, exc) -> NoSuchLedgerError:
        """The error of a read whose segment's ledger was deleted, not by a
        truncation of the log (checked before: that is LogTruncatedError) and not
        with the log (its record is gone: NoSuchLogError, also checked before)."""
        self._pending.clear()
        return NoSuchLedgerError(f"read log {self.name} at {self._next}: the ledger "
                                 f"{lh.ledger_id} of segment {seg} was deleted behind the "
                                 f"log's back; its records are lost ({exc})")

    def _take(self, seg, entries) -> bool:
        """Queue the records of ``entries``; True at the segment's end marker."""
        nxt = self._next
        extend = self._pending.extend
        new = tuple.__new__         # the named tuples without their Python-level __new__
        for ent in entries:
            rs = decode_record_set(ent.data)
            eid = ent.entry_id
            # Only a start inside an entry skips records of it.
            skip = nxt.slot if eid == nxt.entry_id else 0
            extend([new(LogRecord, (new(Position, (seg, eid, slot)), data))
                    for slot, data in enumerate(rs.records) if slot >= skip])
            if rs.end_of_segment:
                return True
        self._next = Position(seg, entries[-1].entry_id + 1, 0)
        return False

    def _next_segment(self, seg):
        """Done with segment ``seg``: on to the next one of the log."""
        self._next = Position(seg + 1, 0, 0)
        self._lh.close()
        self._lh = None
        self._refresh_record()

    # --- segments and the log record --------------------------------------------------
    def _refresh_record(self):
        self._rec, _ = metadata.read(self._store, self.name)

    def _check_truncated(self, refresh=False):
        if refresh:
            self._refresh_record()
        trunc = metadata.truncated_before(self._rec)
        if trunc and self._next < trunc:
            self._pending.clear()
            raise LogTruncatedError(f"read log {self.name} at {self._next}: the log was "
                                    f"truncated before {trunc}")

    def _open_next_segment(self) -> bool:
        """Open the segment holding ``_next`` (or the first after it); False if the
        log has none yet."""
        self._check_truncated()
        for s in self._rec["segments"]:
            if s["segment"] >= self._next.segment:
                if s["segment"] > self._next.segment:
                    self._next = Position(s["segment"], 0, 0)
                try:
                    self._open_handle(s)
                except NoSuchLedgerError:
                    self._check_truncated(refresh=True)
                    raise
                return True
        return False

    def _open_handle(self, seg: dict):
        self._lh = self._client.open_ledger_no_recovery(seg["ledger_id"])
        self._seg = seg["segment"]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._lh is not None:
                self._lh.close()
                self._lh = None
