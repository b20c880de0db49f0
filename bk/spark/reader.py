"""Batch reads: planning on the driver (input partitions, one per segment or per
entry range of a large one) and reading on the executors (record sets decoded
into Arrow record batches). The stream reader (:mod:`bk.spark.stream`) plans
with the same functions."""

from __future__ import annotations

import dataclasses
import logging
import os

from pyspark.sql.datasource import DataSourceReader, InputPartition

from bk.errors import LogTruncatedError, NoSuchLedgerError
from bk.log import metadata
from bk.log.records import (_HEADER, _LEN, HEADER_SIZE, VERSION, Position, RecordSetError,
                            decode_record_set)
from bk.spark.clients import client_for
from bk.spark.options import Options

log = logging.getLogger("bk.spark")

_READ_BATCH = 64                 # entries per read request of a task
# Rows as Arrow record batches (the default), or as plain tuples when
# BK_SPARK_ARROW=0 in the workers' environment: only for comparing the two
# (scripts/bench_spark.py).
_ARROW = os.environ.get("BK_SPARK_ARROW", "1") != "0"


@dataclasses.dataclass
class LogPartition(InputPartition):
    """Records of one segment of a log: entries first..last of ledger ``ledger_id``,
    keeping Positions in [start, end)."""

    log: str
    segment: int
    ledger_id: int
    first: int
    last: int
    start: tuple
    end: tuple


@dataclasses.dataclass
class LedgerPartition(InputPartition):
    """Entries first..last of one ledger."""

    ledger_id: int
    first: int
    last: int


def readable_end(client, seg: dict, password: bytes) -> int:
    """The last entry of a segment that readers may read: its last entry if closed,
    else its LAC."""
    if seg["state"] == metadata.CLOSED:
        return int(seg["last_entry_id"])
    h = client.open_ledger_no_recovery(seg["ledger_id"], password)
    try:
        return h.metadata.last_entry_id if h.is_closed else h.last_add_confirmed
    finally:
        h.close()


def segments_to_read(client, opts: Options, rec: dict):
    """[(segment dict, last readable entry)] up to and including the first open one."""
    out = []
    for s in rec["segments"]:
        out.append((s, readable_end(client, s, opts.password)))
        if s["state"] != metadata.CLOSED:
            break
    return out


def latest(rec: dict, segs) -> Position:
    """The Position after the last readable record."""
    if not segs:
        return Position(metadata.next_segment_number(rec), 0, 0)
    s, last = segs[-1]
    if s["state"] == metadata.CLOSED:
        return Position(s["segment"] + 1, 0, 0)
    return Position(s["segment"], last + 1, 0)


def _earliest(rec: dict) -> Position:
    segs = rec["segments"]
    first = Position(segs[0]["segment"], 0, 0) if segs else \
        Position(metadata.next_segment_number(rec), 0, 0)
    trunc = metadata.truncated_before(rec)
    return max(first, trunc) if trunc else first


def check_start(opts: Options, rec: dict, start: Position) -> Position:
    trunc = metadata.truncated_before(rec)
    if trunc and start < trunc:
        if opts.fail_on_data_loss:
            raise LogTruncatedError(
                f"read log {opts.log} from {start}: the log is truncated before {trunc}, so "
                f"records were lost (set failOnDataLoss=false to skip to {trunc})")
        log.warning("log %s: records from %s to %s were truncated; skipping them",
                    opts.log, start, trunc)
        return trunc
    return start


def resolve(rec: dict, segs, which: str) -> Position:
    if which == "earliest":
        return _earliest(rec)
    if which == "latest":
        return latest(rec, segs)
    return Position.parse(which)


def plan_log(opts: Options, segs, start: Position, end: Position) -> list:
    """Input partitions for the records in [start, end)."""
    pieces = []
    for s, last in segs:
        n = s["segment"]
        lo = max(start, Position(n, 0, 0))
        hi = min(end, Position(n, last + 1, 0))
        if lo >= hi:
            continue
        first_e = lo.entry_id
        last_e = hi.entry_id if hi.slot > 0 else hi.entry_id - 1
        if hi.segment > n:
            last_e = last
        if last_e >= first_e:
            pieces.append((s, first_e, last_e, lo, hi))
    total = sum(p[2] - p[1] + 1 for p in pieces)
    per = max(1, -(-total // opts.min_partitions)) if opts.min_partitions > len(pieces) \
        else None
    out = []
    for s, first_e, last_e, lo, hi in pieces:
        step = per or (last_e - first_e + 1)
        for a in range(first_e, last_e + 1, step):
            b = min(last_e, a + step - 1)
            out.append(LogPartition(opts.log, s["segment"], s["ledger_id"], a, b,
                                    tuple(max(lo, Position(s["segment"], a, 0))),
                                    tuple(min(hi, Position(s["segment"], b + 1, 0)))))
    return out


def _plan_ledgers(opts: Options) -> list:
    client = client_for(opts)
    ranges = []
    for lid in opts.ledgers:
        h = client.open_ledger_no_recovery(lid, opts.password)
        try:
            last = h.metadata.last_entry_id if h.is_closed else h.last_add_confirmed
        finally:
            h.close()
        if last >= 0:
            ranges.append((lid, last))
    total = sum(last + 1 for _, last in ranges)
    step = max(1, -(-total // opts.min_partitions))
    out = []
    for lid, last in ranges:
        s = step if opts.min_partitions > len(ranges) else last + 1
        out.extend(LedgerPartition(lid, a, min(last, a + s - 1)) for a in range(0, last + 1, s))
    return out


# --- reading (executors) -------------------------------------------------------------

def _entries(h, first: int, last: int):
    """Entries first..last of an open handle, ``_READ_BATCH`` per request. The
    driver planned them up to a LAC it saw; this handle's own view of the LAC
    may lag it (another bookie answered), and entries up to a LAC are durable,
    so those past this handle's view are read as unconfirmed ones."""
    seen = h.metadata.last_entry_id if h.is_closed else h.last_add_confirmed
    for a in range(first, last + 1, _READ_BATCH):
        b = min(last, a + _READ_BATCH - 1)
        yield from (h.read_entries(a, b) if b <= seen else h.read_unconfirmed_entries(a, b))


def _open_segment(client, opts: Options, p: LogPartition):
    try:
        return client.open_ledger_no_recovery(p.ledger_id, opts.password)
    except NoSuchLedgerError:
        raise LogTruncatedError(f"read log {p.log} segment {p.segment}: its ledger "
                                f"{p.ledger_id} is gone (the log was truncated or "
                                f"deleted meanwhile)") from None


def _slot_range(p: LogPartition, entry: int, count: int) -> tuple[int, int]:
    """The slots of ``entry`` (of ``count`` records) within [p.start, p.end)."""
    here = (p.segment, entry)
    s_at, e_at = tuple(p.start[:2]), tuple(p.end[:2])
    lo = 0 if here > s_at else (p.start[2] if here == s_at else count)
    hi = count if here < e_at else (p.end[2] if here == e_at else 0)
    return min(lo, count), max(min(hi, count), 0)


def _log_rows(opts: Options, p: LogPartition):
    """Rows as tuples (the plain-rows mode, for comparison)."""
    h = _open_segment(client_for(opts), opts, p)
    try:
        for ent in _entries(h, p.first, p.last):
            e = ent.entry_id
            recs = decode_record_set(ent.data).records
            lo, hi = _slot_range(p, e, len(recs))
            for slot in range(lo, hi):
                yield (p.log, f"{p.segment}:{e}:{slot}", p.segment, p.ledger_id, e, slot,
                       recs[slot])
    finally:
        h.close()


def _unpack_entries(ents, p: LogPartition):
    """The records of record sets ``ents`` within [p.start, p.end) as Arrow arrays
    (entry ids, slots, data), or None if there are none. One pass over each
    entry's length prefixes in Python (they chain: each says where the next one
    is); the bytes are never a Python object per record: the entries, joined,
    are seen as a binary array whose elements alternate between the bytes
    between records (headers, length prefixes, records outside the range) and
    the records, and Arrow takes every second element in one copy."""
    import pyarrow as pa
    import pyarrow.compute as pc
    unpack = _LEN.unpack_from
    entry_ids, slots, bounds = [], [], [0]
    base = 0
    bufs = []
    for ent in ents:
        mv = memoryview(ent.data)
        n = len(mv)
        if n < HEADER_SIZE:
            raise RecordSetError(f"entry {ent.entry_id}: record set of {n} bytes is shorter "
                                 f"than its header")
        version, _flags, count, _rb, _bb = _HEADER.unpack_from(mv, 0)
        if version != VERSION:
            raise RecordSetError(f"entry {ent.entry_id}: record set version {version}")
        lo, hi = _slot_range(p, ent.entry_id, count)
        off = HEADER_SIZE
        for slot in range(count):
            if off + 4 > n:
                raise RecordSetError(f"entry {ent.entry_id}: record set truncated at "
                                     f"record {slot}")
            (ln,) = unpack(mv, off)
            off += 4
            if lo <= slot < hi:
                bounds.append(base + off)           # end of a gap, start of a record
                bounds.append(base + off + ln)
            off += ln
        if off != n:
            raise RecordSetError(f"entry {ent.entry_id}: record set of {n} bytes does not "
                                 f"end after its {count} records")
        if hi > lo:
            entry_ids.extend([ent.entry_id] * (hi - lo))
            slots.extend(range(lo, hi))
        bufs.append(mv)
        base += n
    if not entry_ids:
        return None
    whole = b"".join(bufs) if len(bufs) > 1 else bytes(bufs[0])
    bounds.append(base)                              # the trailing gap
    pieces = pa.Array.from_buffers(pa.large_binary(), len(bounds) - 1, [
        None, pa.array(bounds, pa.int64()).buffers()[1], pa.py_buffer(whole)])
    data = pc.take(pieces, pa.array(range(1, len(bounds) - 1, 2), pa.int64()))
    return (pa.array(entry_ids, pa.int64()), pa.array(slots, pa.int32()),
            data.cast(pa.binary()))


def _log_batches(opts: Options, p: LogPartition):
    """The partition's rows as Arrow record batches, a read request's entries each."""
    import pyarrow as pa
    import pyarrow.compute as pc
    h = _open_segment(client_for(opts), opts, p)
    segment = pa.scalar(str(p.segment))
    try:
        for a in range(p.first, p.last + 1, _READ_BATCH):
            cols = _unpack_entries(_entries(h, a, min(p.last, a + _READ_BATCH - 1)), p)
            if cols is None:
                continue
            entry_a, slot_a, data = cols
            n = len(entry_a)
            position = pc.binary_join_element_wise(
                segment, pc.cast(entry_a, pa.string()), pc.cast(slot_a, pa.string()), ":")
            yield pa.RecordBatch.from_arrays(
                [pa.repeat(pa.scalar(p.log, pa.string()), n), position,
                 pa.repeat(pa.scalar(p.segment, pa.int64()), n),
                 pa.repeat(pa.scalar(p.ledger_id, pa.int64()), n), entry_a, slot_a, data],
                names=["log", "position", "segment", "ledger_id", "entry_id", "slot", "data"])
    finally:
        h.close()


def _ledger_rows(opts: Options, p: LedgerPartition):
    h = client_for(opts).open_ledger_no_recovery(p.ledger_id, opts.password)
    try:
        for ent in _entries(h, p.first, p.last):
            yield (p.ledger_id, ent.entry_id, bytes(ent.data))
    finally:
        h.close()


def _ledger_batches(opts: Options, p: LedgerPartition):
    import pyarrow as pa
    h = client_for(opts).open_ledger_no_recovery(p.ledger_id, opts.password)
    try:
        for a in range(p.first, p.last + 1, _READ_BATCH):
            ents = list(_entries(h, a, min(p.last, a + _READ_BATCH - 1)))
            yield pa.RecordBatch.from_arrays(
                [pa.repeat(pa.scalar(p.ledger_id, pa.int64()), len(ents)),
                 pa.array([e.entry_id for e in ents], pa.int64()),
                 pa.array([bytes(e.data) for e in ents], pa.binary())],
                names=["ledger_id", "entry_id", "data"])
    finally:
        h.close()


def read_partition(opts: Options, partition):
    """The rows of one input partition (Arrow record batches, or tuples)."""
    if isinstance(partition, LedgerPartition):
        return (_ledger_batches if _ARROW else _ledger_rows)(opts, partition)
    return (_log_batches if _ARROW else _log_rows)(opts, partition)


class BatchReader(DataSourceReader):
    def __init__(self, opts: Options):
        self.opts = opts

    def partitions(self):
        opts = self.opts
        if opts.ledgers:
            return _plan_ledgers(opts)
        client = client_for(opts)
        rec, _ = metadata.read(client._store, opts.log)
        segs = segments_to_read(client, opts, rec)
        start = check_start(opts, rec, resolve(rec, segs, opts.starting))
        end = resolve(rec, segs, opts.ending)
        return plan_log(opts, segs, start, end)

    def read(self, partition):
        return read_partition(self.opts, partition)
