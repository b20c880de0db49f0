"""Writes into a log, exactly once: each task writes a staging ledger, the
driver's commit appends the staged ledgers to the log in one CAS, with the
streaming batch id (see the theory of operation in :mod:`bk.spark`)."""

from __future__ import annotations

import dataclasses
import logging
import uuid

from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceStreamWriter, DataSourceWriter, WriterCommitMessage

from bk.errors import BKError
from bk.log import append_ledgers, staging
from bk.log.records import encode_record_set
from bk.spark.clients import client_for
from bk.spark.options import READ_ONLY, Options, refuse

log = logging.getLogger("bk.spark")

_ENTRY_BYTES = 256 * 1024        # a writer's record set (one ledger entry)
_ENTRY_RECORDS = 4096


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
                client = client_for(opts)
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
    staged = [m for m in messages if m is not None]
    ledgers = [m for m in staged if m.ledger_id >= 0]
    sink = _the_sink(opts, staged) if batch_id is not None else None
    client = client_for(opts)
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
    client = client_for(opts)
    for m in staged:
        if m.ledger_id >= 0:
            _forget_quietly(client, opts.log, m.ledger_id)
    # Tasks that died took their messages with them: their ledgers are found by
    # their registration (a streaming batch whose every task died names no sink
    # here; its ledgers go at the sink's next commit).
    sink = _the_sink(opts, staged) if batch_id is not None else None
    if write_id is not None or sink is not None:
        _collect_quietly(client, opts, sink=sink, up_to_batch=batch_id, write=write_id)


class BatchWriter(DataSourceWriter):
    def __init__(self, opts: Options, index: int):
        self.opts, self.index = opts, index
        self.write_id = uuid.uuid4().hex          # names this job's staging ledgers

    def write(self, iterator):
        return _write_staging(self.opts, self.index, iterator, self.write_id, False)

    def commit(self, messages):
        _commit(self.opts, messages, write_id=self.write_id)

    def abort(self, messages):
        _abort(self.opts, messages, write_id=self.write_id)


class StreamWriter(DataSourceStreamWriter):
    def __init__(self, opts: Options, index: int):
        self.opts, self.index = opts, index

    def write(self, iterator):
        return _write_staging(self.opts, self.index, iterator, None, True)

    def commit(self, messages, batchId):
        _commit(self.opts, messages, batch_id=batchId)

    def abort(self, messages, batchId):
        _abort(self.opts, messages, batch_id=batchId)


def writable(opts: Options, schema, overwrite: bool) -> int:
    """The index of the column ``data``; ValueError if ``opts`` cannot write."""
    if not opts.log:
        raise ValueError("writing needs the option log (ledgers can only be read)")
    refuse(opts, READ_ONLY, f"a write (to log {opts.log})")
    if overwrite:
        raise ValueError(f"write to log {opts.log}: a log can only be appended to "
                         f"(mode 'append')")
    return _data_index(schema)
