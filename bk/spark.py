"""bk as a Spark data source (``bookkeeper``): batch and streaming reads of logs
and ledgers, batch and exactly-once streaming writes into logs, and a
distributed check of every ledger's replicas.

Theory of operation
-------------------
*Reading.* The driver plans; the executors read. Planning reads the log record
(``bk.log.metadata``) and cuts the range [start, end) of Positions into input
partitions, one per segment (and per entry range of a large segment when
``minPartitions`` asks for more): each :class:`LogPartition` names a ledger,
the entries to read and the Positions to keep. A task reads its entries
without recovery (a reader never fences a writer), decodes the record sets
and yields Arrow record batches in Position order (without a Python object
per record: the length prefixes are walked, the bytes gathered by Arrow).
The end of what can be read is, segment by segment, the last entry of a closed segment,
and the LAC of the first *open* one — never beyond it: a writer rolls by
appending a new segment before closing the old one, so entries of the old one
may still become readable; stopping at the first open segment keeps every
offset a clean cut of the log.

*Streaming.* Offsets are ``{log: "segment:entry:slot"}``, the Position of the
next record owed. ``latestOffset`` is that end, or with ``maxRecordsPerTrigger``
the Position after N records, found by a binary search over the entries'
record-set headers (each carries the number of records before it in its
segment), so the driver reads O(log n) entries, not the data. A start before
the log's truncation point fails the query (``failOnDataLoss``, default true,
as Kafka's source does) or, with false, skips to that point.

*Writing, exactly once.* Each task writes its rows' ``data`` into a new
*staging* ledger as record sets and closes it; its commit message names the
ledger. The driver's commit appends the staged ledgers, in partition order, to
the log record as closed segments in one CAS (``bk.log.append_ledgers``). For
a streaming query the same CAS records the batch id under the sink's id; a
commit whose id is not above the one recorded appends nothing and deletes its
new staging ledgers. Why this is exactly once:

1. Spark runs a micro-batch's commit only after every task of it succeeded,
   and records the batch in the checkpoint's commit log only after our commit
   returned. Between the two, a crash makes Spark replay the batch on restart
   (same id, same offsets, so the same rows); the log record already holds
   that id, and the replay's CAS is refused: nothing is appended twice.
2. The append and the batch id are one CAS on one etcd key: there is no
   moment at which the records are in the log but the id is not, or the other
   way round. A lost CAS (another writer, a truncation, another sink) re-reads
   and decides again, so a commit racing other writers of the log never
   overwrites them; segments only get new numbers after the existing ones.
3. The sink's id is ``spark:<query id>``: the id that Spark keeps in the
   checkpoint (the same across restarts from it, a new one for a new
   checkpoint, whose batch ids restart at 0). Tasks read it, and the batch id,
   from their TaskContext (``sql.streaming.queryId``, ``streaming.sql.batchId``),
   so it does not matter how the checkpoint was given (``checkpointLocation``
   or ``spark.sql.streaming.checkpointLocation``) or where it lives.
4. Rows are appended only as whole staging ledgers that their task closed:
   a task that failed half-way contributes nothing, and its retry writes a
   new ledger.

Staging ledgers never outlive their use. A task registers its ledger before
creating it (``bk.log.staging``: the id is allocated, recorded with the sink
and batch or the batch job's write id, then the ledger is created under that
id). Abort deletes the ledgers its messages name; commit and abort then
collect every registered ledger of the same job, or of the same sink up to
this batch id, that is not in the log: those of tasks that died before
reporting (an executor lost), of zombie attempts, of replays. A streaming
batch whose every task died names no sink to its abort: the sink's next
commit collects its ledgers. ``bkshell cleanstaging`` collects what drivers
that died too left behind.

*Clients.* The driver side of a query runs in long-lived Python processes and
Spark reuses its Python workers, so each process keeps one client per
metadata URI (closed at exit) rather than one per call.

*Checking.* ``check_ledgers`` lists the ledgers on the driver and checks them
in parallel partitions: each asks every bookie of each write set which entries
it holds (GET_LIST_OF_ENTRIES) and reports what is missing.

Only plain options travel to the executors (the reader and writer objects are
pickled); clients are made in the process that uses them.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import uuid

from pyspark.sql.datasource import (DataSource, DataSourceReader, DataSourceStreamReader,
                                    DataSourceStreamWriter, DataSourceWriter, InputPartition,
                                    WriterCommitMessage)
from pyspark.sql.streaming.datasource import ReadMaxRows, SupportsTriggerAvailableNow

from bk.errors import BKError, LogTruncatedError, NoSuchLedgerError, NoSuchLogError
from bk.log import metadata, staging
from bk.log.records import HEADER_SIZE, Position, decode_record_set, encode_record_set

__all__ = ["register", "check_ledgers", "BookKeeperDataSource", "LOG_SCHEMA", "LEDGER_SCHEMA",
           "PROBLEM_SCHEMA"]

log = logging.getLogger("bk.spark")

LOG_SCHEMA = ("log string, position string, segment long, ledger_id long, entry_id long, "
              "slot int, data binary")
LEDGER_SCHEMA = "ledger_id long, entry_id long, data binary"
PROBLEM_SCHEMA = "ledger_id long, entry_id long, bookie string, problem string"

_READ_BATCH = 64                 # entries per read request of a task
_ARROW_ROWS = 4096               # rows per Arrow record batch
_ENTRY_BYTES = 256 * 1024        # a writer's record set (one ledger entry)
_ENTRY_RECORDS = 4096
# Rows as Arrow record batches (the default), or as plain tuples when
# BK_SPARK_ARROW=0 in the workers' environment: only for comparing the two
# (scripts/bench_spark.py).
_ARROW = os.environ.get("BK_SPARK_ARROW", "1") != "0"
_SPARK_OPTIONS = {"path", "paths", "checkpointlocation", "queryname"}


# --- options -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Options:
    """The data source's options, parsed and checked (plain values: picklable)."""

    uri: str
    log: str | None = None
    ledgers: tuple = ()
    password: bytes = b""
    starting: str = "earliest"
    ending: str = "latest"
    min_partitions: int = 1
    max_records: int | None = None
    fail_on_data_loss: bool = True
    given: frozenset = frozenset()      # the options set by the user (canonical names)


_NAMES = {n.lower(): n for n in (
    "metadataServiceUri", "log", "ledgers", "password", "startingPosition", "endingPosition",
    "minPartitions", "maxRecordsPerTrigger", "failOnDataLoss")}


def _position_option(name: str, value: str) -> str:
    v = value.strip().lower()
    if v in ("earliest", "latest"):
        return v
    try:
        return str(Position.parse(value))
    except ValueError as e:
        raise ValueError(f"option {name}: 'earliest', 'latest' or a Position: {e}") from None


def _int_option(name: str, value: str, minimum: int) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        raise ValueError(f"option {name}: {value!r} is not an integer") from None
    if n < minimum:
        raise ValueError(f"option {name}: {n} is below the minimum {minimum}")
    return n


def parse_options(raw) -> Options:
    """Options from Spark's (case-insensitive) option map; ValueError naming the
    option that is unknown, missing or malformed."""
    got = {}
    for k, v in dict(raw).items():
        lk = k.lower()
        if lk in _SPARK_OPTIONS:
            continue
        if lk not in _NAMES:
            raise ValueError(f"unknown option {k!r} of data source 'bookkeeper' (known: "
                             f"{', '.join(sorted(_NAMES.values()))})")
        got[_NAMES[lk]] = v
    uri = got.get("metadataServiceUri") or os.environ.get("BK_metadataServiceUri")
    if not uri:
        raise ValueError("option metadataServiceUri is required (etcd://host:port/ledgers)")
    if not uri.startswith("etcd://"):
        raise ValueError(f"option metadataServiceUri: {uri!r} is not etcd://host:port/prefix")
    kw = {"uri": uri}
    if ("log" in got) == ("ledgers" in got):
        raise ValueError("give exactly one of the options log and ledgers")
    if "log" in got:
        metadata.check_log_name(got["log"])
        kw["log"] = got["log"]
    else:
        try:
            kw["ledgers"] = tuple(int(x) for x in got["ledgers"].split(",") if x.strip())
        except ValueError:
            raise ValueError(f"option ledgers: {got['ledgers']!r} is not a list of ledger "
                             f"ids such as '12,15'") from None
        if not kw["ledgers"] or any(x < 0 for x in kw["ledgers"]):
            raise ValueError(f"option ledgers: {got['ledgers']!r} names no ledger")
        for name in ("startingPosition", "endingPosition", "maxRecordsPerTrigger"):
            if name in got:
                raise ValueError(f"option {name} applies to a log, not to ledgers")
    if "password" in got:
        kw["password"] = got["password"].encode("utf-8")
    if "startingPosition" in got:
        kw["starting"] = _position_option("startingPosition", got["startingPosition"])
    if "endingPosition" in got:
        kw["ending"] = _position_option("endingPosition", got["endingPosition"])
        if kw["ending"] == "earliest":
            raise ValueError("option endingPosition: 'latest' or a Position")
    if "minPartitions" in got:
        kw["min_partitions"] = _int_option("minPartitions", got["minPartitions"], 1)
    if "maxRecordsPerTrigger" in got:
        kw["max_records"] = _int_option("maxRecordsPerTrigger", got["maxRecordsPerTrigger"], 1)
    if "failOnDataLoss" in got:
        v = str(got["failOnDataLoss"]).strip().lower()
        if v not in ("true", "false"):
            raise ValueError(f"option failOnDataLoss: {got['failOnDataLoss']!r} is not "
                             f"true or false")
        kw["fail_on_data_loss"] = v == "true"
    kw["given"] = frozenset(got)
    return Options(**kw)


_READ_ONLY = ("startingPosition", "endingPosition", "minPartitions", "maxRecordsPerTrigger",
              "failOnDataLoss")


def _refuse(opts: Options, names, what: str) -> None:
    for name in names:
        if name in opts.given:
            raise ValueError(f"option {name} does not apply to {what}")


# --- clients: one per process and metadata URI -----------------------------------------
#
# The driver side of a query (planning, offsets, commits) runs in long-lived
# Python processes, and Spark reuses its Python workers for task after task: a
# client (an etcd channel, a watch of the bookies, bookie connections) made per
# call costs more than the call (about 2 ms to connect, and a staging ledger's
# create-write-close takes twice as long in a new client as in a warm one), so
# each process keeps one per URI, closed at exit. After a fork the child makes
# its own (the key has the pid).

_clients: dict = {}
_clients_lock = threading.Lock()


# BK_SPARK_CLIENT_PER_CALL=1 in the environment: a new client per call instead
# (closed at exit): only to measure what reuse is worth (scripts/bench_spark.py).
_PER_CALL = os.environ.get("BK_SPARK_CLIENT_PER_CALL", "0") == "1"


def _client(opts: Options):
    key = (os.getpid(), opts.uri)
    if _PER_CALL:
        from bk.client.bookkeeper import BookKeeper
        with _clients_lock:
            if not _clients:
                atexit.register(_close_clients)
            c = _clients[(*key, len(_clients))] = BookKeeper(opts.uri)
        return c
    c = _clients.get(key)
    if c is not None and not c._closed:
        return c
    from bk.client.bookkeeper import BookKeeper
    with _clients_lock:
        c = _clients.get(key)
        if c is None or c._closed:
            if not _clients:
                atexit.register(_close_clients)
            c = _clients[key] = BookKeeper(opts.uri)
        return c


def _close_clients() -> None:
    """Close this process's clients (at exit, or when a test wants them gone)."""
    with _clients_lock:
        mine = [k for k in _clients if k[0] == os.getpid()]
        for k in mine:
            try:
                _clients.pop(k).close()
            except BKError as e:       # pragma: no cover - best effort at exit
                log.debug("closing the client of %s: %s", k[1], e)


# --- planning (driver) -----------------------------------------------------------------

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


def _readable_end(client, seg: dict, password: bytes) -> int:
    """The last entry of a segment that readers may read: its last entry if closed,
    else its LAC."""
    if seg["state"] == metadata.CLOSED:
        return int(seg["last_entry_id"])
    h = client.open_ledger_no_recovery(seg["ledger_id"], password)
    try:
        return h.metadata.last_entry_id if h.is_closed else h.last_add_confirmed
    finally:
        h.close()


def _segments_to_read(client, opts: Options, rec: dict):
    """[(segment dict, last readable entry)] up to and including the first open one."""
    out = []
    for s in rec["segments"]:
        out.append((s, _readable_end(client, s, opts.password)))
        if s["state"] != metadata.CLOSED:
            break
    return out


def _latest(rec: dict, segs) -> Position:
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


def _check_start(opts: Options, rec: dict, start: Position) -> Position:
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


def _resolve(rec: dict, segs, which: str) -> Position:
    if which == "earliest":
        return _earliest(rec)
    if which == "latest":
        return _latest(rec, segs)
    return Position.parse(which)


def _plan_log(opts: Options, segs, start: Position, end: Position) -> list:
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
    client = _client(opts)
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


def _records_before(lh, entry: int, slot: int, last: int, total: int) -> int:
    """Records of the segment before Position (_, entry, slot)."""
    if entry > last:
        return total
    rs = decode_record_set(lh.read_entry(entry).data)
    return rs.records_before + min(slot, len(rs.records))


def _position_of(lh, seg: int, first: int, last: int, target: int) -> Position:
    """The Position of the record with index ``target`` in the segment (0-based),
    by binary search over the entries' headers; target < the segment's total."""
    lo, hi = first, last
    while lo < hi:          # the largest entry whose records_before <= target
        mid = (lo + hi + 1) // 2
        if decode_record_set(lh.read_entry(mid).data).records_before <= target:
            lo = mid
        else:
            hi = mid - 1
    rb = decode_record_set(lh.read_entry(lo).data).records_before
    return Position(seg, lo, target - rb)


def _limit(client, opts: Options, segs, start: Position, end: Position, n: int) -> Position:
    """The Position after at most ``n`` records from ``start`` (not beyond ``end``)."""
    from bk.log.writer import segment_tail
    for s, last in segs:
        seg = s["segment"]
        if seg < start.segment or last < 0:
            continue
        if Position(seg, 0, 0) >= end:
            break
        h = client.open_ledger_no_recovery(s["ledger_id"], opts.password)
        try:
            if s["state"] == metadata.CLOSED:
                total = int(s["records"])
            else:
                total = segment_tail(client, h)[3]
            before = _records_before(h, start.entry_id, start.slot, last, total) \
                if seg == start.segment else 0
            if total - before > n:
                return min(end, _position_of(h, seg, start.entry_id if seg == start.segment
                                             else 0, last, before + n))
            n -= total - before
        finally:
            h.close()
    return end


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
    h = _open_segment(_client(opts), opts, p)
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
    from bk.log.records import _HEADER, _LEN, VERSION, RecordSetError
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
    h = _open_segment(_client(opts), opts, p)
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
    h = _client(opts).open_ledger_no_recovery(p.ledger_id, opts.password)
    try:
        for ent in _entries(h, p.first, p.last):
            yield (p.ledger_id, ent.entry_id, bytes(ent.data))
    finally:
        h.close()


def _ledger_batches(opts: Options, p: LedgerPartition):
    import pyarrow as pa
    h = _client(opts).open_ledger_no_recovery(p.ledger_id, opts.password)
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


def _read(opts: Options, partition):
    if isinstance(partition, LedgerPartition):
        return (_ledger_batches if _ARROW else _ledger_rows)(opts, partition)
    return (_log_batches if _ARROW else _log_rows)(opts, partition)


class _BatchReader(DataSourceReader):
    def __init__(self, opts: Options):
        self.opts = opts

    def partitions(self):
        opts = self.opts
        if opts.ledgers:
            return _plan_ledgers(opts)
        client = _client(opts)
        rec, _ = metadata.read(client._store, opts.log)
        segs = _segments_to_read(client, opts, rec)
        start = _check_start(opts, rec, _resolve(rec, segs, opts.starting))
        end = _resolve(rec, segs, opts.ending)
        return _plan_log(opts, segs, start, end)

    def read(self, partition):
        return _read(self.opts, partition)


class _StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, opts: Options):
        if not opts.log:
            raise ValueError("a streaming read needs the option log (ledgers are batch only)")
        _refuse(opts, ["endingPosition"], "a streaming read (it runs until stopped)")
        self.opts = opts
        self._target = None

    def _state(self, client):
        try:
            rec, _ = metadata.read(client._store, self.opts.log)
        except NoSuchLogError:
            rec = metadata.new_record()
        return rec, _segments_to_read(client, self.opts, rec)

    def initialOffset(self):
        rec, segs = self._state(_client(self.opts))
        return {self.opts.log: str(_resolve(rec, segs, self.opts.starting))}

    def getDefaultReadLimit(self):
        from pyspark.sql.streaming.datasource import ReadAllAvailable
        n = self.opts.max_records
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self):
        rec, segs = self._state(_client(self.opts))
        self._target = _latest(rec, segs)

    def latestOffset(self, start, limit=None):
        opts = self.opts
        client = _client(opts)
        rec, segs = self._state(client)
        begin = _check_start(opts, rec, Position.parse(start[opts.log]))
        end = _latest(rec, segs)
        if self._target is not None:
            end = min(end, self._target)
        end = max(end, begin)
        if isinstance(limit, ReadMaxRows):
            end = _limit(client, opts, segs, begin, end, limit.max_rows)
        return {opts.log: str(end)}

    def reportLatestOffset(self):
        return None

    def partitions(self, start, end):
        opts = self.opts
        rec, segs = self._state(_client(opts))
        begin = _check_start(opts, rec, Position.parse(start[opts.log]))
        stop = Position.parse(end[opts.log])
        return _plan_log(opts, segs, begin, stop)

    def read(self, partition):
        return _read(self.opts, partition)

    def commit(self, end):
        pass

    def stop(self):
        pass


# --- writing ---------------------------------------------------------------------------

@dataclasses.dataclass
class StagedLedger(WriterCommitMessage):
    """A task's staging ledger (closed), or ledger_id -1 when the task had no rows;
    ``sink``: the streaming query it wrote for (None in a batch job)."""

    ledger_id: int
    last_entry_id: int
    records: int
    bytes: int
    sink: str | None = None


def _data_index(schema) -> int:
    names = [f.name for f in schema.fields]
    if "data" not in names:
        raise ValueError(f"writing to a bookkeeper log needs a column 'data' (binary or "
                         f"string); the DataFrame has {names}")
    t = schema["data"].dataType.typeName()
    if t not in ("binary", "string"):
        raise ValueError(f"column 'data' must be binary or string, not {t}")
    return names.index("data")


# Spark sets these local properties on the jobs of a streaming query: the
# query's id (kept in its checkpoint, the same across restarts from it) and the
# micro-batch's id. Tasks see them in their TaskContext.
_QUERY_ID = "sql.streaming.queryId"
_BATCH_ID = "streaming.sql.batchId"


def _sink_of_task(log_name: str) -> tuple[str, int]:
    """(sink id, batch id) of the streaming query this task writes for."""
    from pyspark import TaskContext
    tc = TaskContext.get()
    qid = tc.getLocalProperty(_QUERY_ID) if tc is not None else None
    batch = tc.getLocalProperty(_BATCH_ID) if tc is not None else None
    if not qid or batch is None:
        raise ValueError(f"streaming write to log {log_name}: the task does not know its "
                         f"streaming query (no {_QUERY_ID} / {_BATCH_ID} in its context); "
                         f"the sink is identified by the query id that Spark keeps in the "
                         f"query's checkpointLocation, so start the query with "
                         f".option('checkpointLocation', path)")
    return "spark:" + qid, int(batch)


def _write_staging(opts: Options, index: int, rows, write_id: str | None,
                   streaming: bool) -> StagedLedger:
    """Write ``rows``' data to a new staging ledger (bk.log.staging), as record sets;
    close it."""
    sink, batch = _sink_of_task(opts.log) if streaming else (None, None)
    client = lh = None
    records = nbytes = 0
    buf, size = [], 0
    try:
        for row in rows:
            v = row[index]
            if v is None:
                raise ValueError(f"write to log {opts.log}: a row has a null 'data'")
            v = v.encode("utf-8") if isinstance(v, str) else bytes(v)
            if lh is None:
                client = _client(opts)
                lh = staging.create(client, opts.log, sink=sink, batch=batch, write=write_id,
                                    password=opts.password)
            buf.append(v)
            size += len(v)
            if size >= _ENTRY_BYTES or len(buf) >= _ENTRY_RECORDS:
                lh.add_entry(encode_record_set(buf, records, nbytes))
                records, nbytes, buf, size = records + len(buf), nbytes + size, [], 0
        if lh is None:
            return StagedLedger(-1, -1, 0, 0, sink)
        if buf:
            lh.add_entry(encode_record_set(buf, records, nbytes))
            records, nbytes = records + len(buf), nbytes + size
        lh.close()
        return StagedLedger(lh.ledger_id, lh.last_add_confirmed, records, nbytes, sink)
    except BaseException:
        if lh is not None:
            _forget_quietly(client, opts.log, lh.ledger_id)
        raise


def _forget_quietly(client, log_name: str, lid: int) -> None:
    try:
        staging.forget(client, log_name, lid)
    except BKError as e:
        log.warning("could not delete staging ledger %d: %s", lid, e)


def _the_sink(opts: Options, staged) -> str | None:
    sinks = {m.sink for m in staged}
    if len(sinks) > 1:
        raise ValueError(f"streaming write to log {opts.log}: one batch's tasks name "
                         f"several queries {sorted(map(str, sinks))}")
    return sinks.pop() if sinks else None


def _collect_quietly(client, opts: Options, **kw) -> None:
    try:
        staging.collect(client, opts.log, **kw)
    except BKError as e:        # the next commit, or bkshell cleanstaging, tries again
        log.warning("log %s: collecting staging ledgers: %s", opts.log, e)


def _commit(opts: Options, messages, write_id=None, batch_id=None) -> bool:
    """Append the staged ledgers to the log (with the sink's batch id when
    streaming), then collect this sink's or job's staging ledgers that are not
    in the log: those of tasks that died, or of a replay."""
    from bk.log import append_ledgers
    staged = [m for m in messages if m is not None]
    ledgers = [m for m in staged if m.ledger_id >= 0]
    sink = _the_sink(opts, staged) if batch_id is not None else None
    client = _client(opts)
    done = True
    if ledgers:
        done = append_ledgers(
            client, opts.log,
            [{k: getattr(m, k) for k in ("ledger_id", "last_entry_id", "records", "bytes")}
             for m in ledgers],
            sink, batch_id if sink is not None else None)
        if not done:        # a replay of a committed batch: its new copy is not needed
            log.info("log %s: batch %s of %s was already committed", opts.log, batch_id, sink)
            for m in ledgers:
                _forget_quietly(client, opts.log, m.ledger_id)
    if write_id is not None or sink is not None:
        _collect_quietly(client, opts, sink=sink, up_to_batch=batch_id, write=write_id)
    return done


def _abort(opts: Options, messages, write_id=None, batch_id=None) -> None:
    staged = [m for m in messages if m is not None]
    client = _client(opts)
    for m in staged:
        if m.ledger_id >= 0:
            _forget_quietly(client, opts.log, m.ledger_id)
    # Tasks that died took their messages with them: their ledgers are found by
    # their registration (a streaming batch whose every task died names no sink
    # here; its ledgers go at the sink's next commit).
    sink = _the_sink(opts, staged) if batch_id is not None else None
    if write_id is not None or sink is not None:
        _collect_quietly(client, opts, sink=sink, up_to_batch=batch_id, write=write_id)


class _BatchWriter(DataSourceWriter):
    def __init__(self, opts: Options, index: int):
        self.opts, self.index = opts, index
        self.write_id = uuid.uuid4().hex          # names this job's staging ledgers

    def write(self, iterator):
        return _write_staging(self.opts, self.index, iterator, self.write_id, False)

    def commit(self, messages):
        _commit(self.opts, messages, write_id=self.write_id)

    def abort(self, messages):
        _abort(self.opts, messages, write_id=self.write_id)


class _StreamWriter(DataSourceStreamWriter):
    def __init__(self, opts: Options, index: int):
        self.opts, self.index = opts, index

    def write(self, iterator):
        return _write_staging(self.opts, self.index, iterator, None, True)

    def commit(self, messages, batchId):
        _commit(self.opts, messages, batch_id=batchId)

    def abort(self, messages, batchId):
        _abort(self.opts, messages, batch_id=batchId)


# --- the data source -----------------------------------------------------------------

def _writable(opts: Options, schema, overwrite: bool) -> int:
    if not opts.log:
        raise ValueError("writing needs the option log (ledgers can only be read)")
    _refuse(opts, _READ_ONLY, f"a write (to log {opts.log})")
    if overwrite:
        raise ValueError(f"write to log {opts.log}: a log can only be appended to "
                         f"(mode 'append')")
    return _data_index(schema)


class BookKeeperDataSource(DataSource):
    """The ``bookkeeper`` data source: logs and ledgers of a bk cluster."""

    @classmethod
    def name(cls):
        return "bookkeeper"

    def _opts(self) -> Options:
        return parse_options(self.options)

    def schema(self):
        return LEDGER_SCHEMA if self._opts().ledgers else LOG_SCHEMA

    def reader(self, schema):
        opts = self._opts()
        _refuse(opts, ["maxRecordsPerTrigger"], "a batch read")
        return _BatchReader(opts)

    def streamReader(self, schema):
        return _StreamReader(self._opts())

    def writer(self, schema, overwrite):
        opts = self._opts()
        return _BatchWriter(opts, _writable(opts, schema, overwrite))

    def streamWriter(self, schema, overwrite):
        # The sink is the streaming query (its id, which Spark keeps in the
        # checkpoint): the tasks learn it from their context (_sink_of_task).
        opts = self._opts()
        return _StreamWriter(opts, _writable(opts, schema, False))


def register(spark) -> None:
    """Register the ``bookkeeper`` data source with a SparkSession."""
    spark.dataSource.register(BookKeeperDataSource)

# --- the distributed check -----------------------------------------------------------

@dataclasses.dataclass
class _LedgerIds(InputPartition):
    uri: str
    ids: list


def _check_one(store, pool, lid: int) -> list:
    from bk import protocol as P
    from bk.admin import fragment_bounds
    from bk.errors import EOK, NoSuchLedgerError as _Gone
    try:
        md = store.read_ledger(lid)[0]
    except _Gone:
        return []           # deleted since it was listed
    bookies = sorted({b for _, ens in md.ensembles for b in ens})
    held, out = {}, []
    for b in bookies:
        try:
            r = pool.call(b, lid, P.get_list_of_entries, lid)
        except BKError as e:
            out.append((lid, -1, b, f"bookie unreachable: {e}"))
            continue
        held[b] = set(P.ranges_to_ids(r[4])) if r[2] == EOK and r[4] else set()
    if md.is_closed:
        last = md.last_entry_id
    else:
        # An open ledger is checked to its LAC: what the highest stored entry
        # says was confirmed before it (its writer may still be adding).
        top = max((max(s) for s in held.values() if s), default=-1)
        last = -1
        if top >= 0:
            for b in md.write_set(top):
                try:
                    r = pool.call(b, lid, P.read, lid, top)
                except BKError:
                    continue
                if r[2] == EOK:
                    last = max(last, int(r[5]))
    for i in range(len(md.ensembles)):
        lo, hi = fragment_bounds(md, i, last)
        for e in range(lo, hi + 1):
            for b in md.write_set(e):
                if b in held and e not in held[b]:
                    out.append((lid, e, b, "missing"))
    return out


def _check_partition(p: _LedgerIds):
    from bk.admin import BookiePool
    from bk.meta.store import MetadataStore
    store = MetadataStore(p.uri)
    pool = BookiePool(store)
    try:
        for lid in p.ids:
            yield from _check_one(store, pool, lid)
    finally:
        pool.close()
        store.close()


class _CheckReader(DataSourceReader):
    def __init__(self, uri: str, parts: int):
        self.uri, self.parts = uri, parts

    def partitions(self):
        from bk.meta.store import MetadataStore
        store = MetadataStore(self.uri)
        try:
            ids = list(store.list_ledgers())
        finally:
            store.close()
        n = max(1, min(self.parts, len(ids)))
        return [_LedgerIds(self.uri, ids[i::n]) for i in range(n)]

    def read(self, partition):
        return _check_partition(partition)


class _CheckSource(DataSource):
    @classmethod
    def name(cls):
        return "bookkeeper_check"

    def schema(self):
        return PROBLEM_SCHEMA

    def reader(self, schema):
        uri = self.options.get("metadataServiceUri")
        return _CheckReader(uri, int(self.options.get("partitions", "8")))


def check_ledgers(spark, uri: str, partitions: int | None = None):
    """A DataFrame of problems (ledger_id, entry_id, bookie, problem): every entry of
    every ledger (closed ones to their last entry, open ones to their LAC) that a
    bookie of its write set does not hold; entry_id -1 for a bookie unreachable."""
    if not isinstance(uri, str) or not uri.startswith("etcd://"):
        raise ValueError(f"check ledgers: {uri!r} is not a metadata service URI "
                         f"(etcd://host:port/prefix)")
    spark.dataSource.register(_CheckSource)
    n = partitions or max(2, spark.sparkContext.defaultParallelism * 2)
    return (spark.read.format("bookkeeper_check").option("metadataServiceUri", uri)
            .option("partitions", str(n)).load())
