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

Modules: ``options`` (parsing, schemas), ``clients`` (one per process),
``reader`` (planning and batch reads), ``stream`` (offsets, rate limits),
``writer`` (staging ledgers, exactly-once commits), ``check`` (the
distributed check).
"""

from __future__ import annotations

from pyspark.sql.datasource import DataSource

from bk.spark.check import check_ledgers
from bk.spark.options import (LEDGER_SCHEMA, LOG_SCHEMA, PROBLEM_SCHEMA, Options,
                              parse_options, refuse)
from bk.spark.reader import BatchReader
from bk.spark.stream import StreamReader
from bk.spark.writer import BatchWriter, StreamWriter, writable

__all__ = ["register", "check_ledgers", "BookKeeperDataSource", "LOG_SCHEMA", "LEDGER_SCHEMA",
           "PROBLEM_SCHEMA"]


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
        refuse(opts, ["maxRecordsPerTrigger"], "a batch read")
        return BatchReader(opts)

    def streamReader(self, schema):
        return StreamReader(self._opts())

    def writer(self, schema, overwrite):
        opts = self._opts()
        return BatchWriter(opts, writable(opts, schema, overwrite))

    def streamWriter(self, schema, overwrite):
        # The sink is the streaming query (its id, which Spark keeps in the
        # checkpoint): the tasks learn it from their context (_sink_of_task).
        opts = self._opts()
        return StreamWriter(opts, writable(opts, schema, False))


def register(spark) -> None:
    """Register the ``bookkeeper`` data source with a SparkSession."""
    spark.dataSource.register(BookKeeperDataSource)
