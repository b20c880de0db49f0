"""Streaming reads: offsets are ``{log: "segment:entry:slot"}``, the Position of
the next record owed; ``maxRecordsPerTrigger`` is met by a binary search over
the record-set headers (each counts the records before it in its segment), so
the driver reads O(log n) entries, not the data."""

from __future__ import annotations

from pyspark.sql.datasource import DataSourceStreamReader
from pyspark.sql.streaming.datasource import (ReadAllAvailable, ReadMaxRows,
                                              SupportsTriggerAvailableNow)

from bk.errors import NoSuchLogError
from bk.log import metadata
from bk.log.records import Position, decode_record_set
from bk.log.writer import segment_tail
from bk.spark.clients import client_for
from bk.spark.options import Options, refuse
from bk.spark.reader import (check_start, latest, plan_log, read_partition, resolve,
                             segments_to_read)


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


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, opts: Options):
        if not opts.log:
            raise ValueError("a streaming read needs the option log (ledgers are batch only)")
        refuse(opts, ["endingPosition"], "a streaming read (it runs until stopped)")
        self.opts = opts
        self._target = None

    def _state(self, client):
        try:
            rec, _ = metadata.read(client._store, self.opts.log)
        except NoSuchLogError:
            rec = metadata.new_record()
        return rec, segments_to_read(client, self.opts, rec)

    def initialOffset(self):
        rec, segs = self._state(client_for(self.opts))
        return {self.opts.log: str(resolve(rec, segs, self.opts.starting))}

    def getDefaultReadLimit(self):
        n = self.opts.max_records
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self):
        rec, segs = self._state(client_for(self.opts))
        self._target = latest(rec, segs)

    def latestOffset(self, start, limit=None):
        opts = self.opts
        client = client_for(opts)
        rec, segs = self._state(client)
        begin = check_start(opts, rec, Position.parse(start[opts.log]))
        end = latest(rec, segs)
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
        rec, segs = self._state(client_for(opts))
        begin = check_start(opts, rec, Position.parse(start[opts.log]))
        stop = Position.parse(end[opts.log])
        return plan_log(opts, segs, begin, stop)

    def read(self, partition):
        return read_partition(self.opts, partition)

    def commit(self, end):
        pass

    def stop(self):
        pass
