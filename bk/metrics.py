"""Every metric bk exports, defined once: the bookie's and the client's.

Theory of operation
-------------------
A bookie is an arbiter plus one forked shard worker per shard. Each worker
counts its own work in plain Python numbers (:class:`ShardMetrics`: no locks,
no label lookups; the add path updates it once per group commit) and sends a
snapshot of them to the arbiter with every heartbeat (once a second) on the
control channel. The arbiter (:class:`BookieMetrics`) sums the shards' latest
snapshots, and when a worker dies it folds that worker's last snapshot into a
per-shard *carried* total before the restarted worker starts again from zero:
a bookie's counters and histograms therefore only grow across worker
restarts, and each restart is visible as ``bookie_worker_restarts``.
What a killed worker counted after its last heartbeat (at most a second of
work) is lost; a worker that stops normally sends a last snapshot.

This replaces prometheus_client's multiprocess mode, which would need an
environment variable set before the library is first imported in every
process, a directory of mmap files to clean up per bookie, and a lock taken on
every update: the control channel already exists and already beats once a
second.

Names follow BookKeeper where the concept exists (``bookie_journal_JOURNAL_SYNC``,
``bookkeeper_server_ADD_ENTRY_REQUEST``, ``bookie_ledgers_count``, ...);
latencies are histograms in seconds. Counters are exposed with the
``_total`` suffix of the Prometheus text format.

This module is plain Python: a bookie that serves no HTTP never loads
prometheus_client. :mod:`bk.exposition` turns these numbers into Prometheus
metric families, and holds the client's metrics (prometheus_client histograms
and counters in a registry of their own, :func:`bk.exposition.client_registry`,
that an application exposes as it likes).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import dataclass

from bk.errors import status_name

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

# Latency buckets (seconds): from a page-cache read to a slow disk's sync.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Entries per journal sync.
GROUP_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str
    help: str
    labels: tuple = ()
    buckets: tuple = ()


def _m(name, kind, help, labels=(), buckets=()):
    return Metric(name, kind, help, tuple(labels), tuple(buckets))


# --- bookie: counted by each shard worker, summed by the arbiter ----------------------
ADD_ENTRY_REQUEST = _m("bookkeeper_server_ADD_ENTRY_REQUEST", HISTOGRAM,
                       "Add requests by outcome, and the time from receipt to the answer "
                       "(seconds). Every add of a group commit is charged the wait of the "
                       "group's oldest add.", ["success"], LATENCY_BUCKETS)
ADD_ENTRY_ERRORS = _m("bookkeeper_server_ADD_ENTRY_ERRORS", COUNTER,
                      "Add requests answered with an error, by status code.", ["status"])
READ_ENTRY_REQUEST = _m("bookkeeper_server_READ_ENTRY_REQUEST", HISTOGRAM,
                        "Entries read (by READ or READ_RANGE; not long-poll reads) by "
                        "outcome, each charged the time its request took to read and "
                        "answer (seconds). A request answered with an error counts as one "
                        "failed read.", ["success"], LATENCY_BUCKETS)
READ_RANGE_REQUEST = _m("bookkeeper_server_READ_RANGE_REQUEST", HISTOGRAM,
                        "READ_RANGE requests (one per frame, however many entries it "
                        "answered) by outcome, and the time to read and answer each "
                        "(seconds).", ["success"], LATENCY_BUCKETS)
READ_ENTRY_ERRORS = _m("bookkeeper_server_READ_ENTRY_ERRORS", COUNTER,
                       "Entry reads answered with an error, by status code.", ["status"])
JOURNAL_SYNC = _m("bookie_journal_JOURNAL_SYNC", HISTOGRAM,
                  "Journal group commits: time from the start of the sync to its end "
                  "(seconds).", (), LATENCY_BUCKETS)
JOURNAL_BATCH = _m("bookie_journal_JOURNAL_FORCE_WRITE_BATCH_ENTRIES", HISTOGRAM,
                   "Answers (adds, fences, LAC writes) released by one journal group "
                   "commit.", (), GROUP_BUCKETS)
JOURNAL_WRITE_BYTES = _m("bookie_journal_JOURNAL_WRITE_BYTES", COUNTER,
                         "Bytes written to the journal and made durable.")
JOURNAL_QUEUE = _m("bookie_journal_JOURNAL_QUEUE_SIZE", GAUGE,
                   "Answers waiting for a journal sync (held plus in flight), at the last "
                   "heartbeat.")
JOURNAL_BYTES = _m("bookie_journal_bytes", GAUGE, "Disk space used by journal segments.")
LEDGERS = _m("bookie_ledgers_count", GAUGE, "Ledgers stored on this bookie.")
ENTRIES = _m("bookie_entries_count", GAUGE, "Entries stored on this bookie.")
CONNECTIONS = _m("bookie_connections", GAUGE, "Open client connections.")
CHECKPOINTS = _m("bookie_CHECKPOINTS", COUNTER, "Index checkpoints taken.")
AUTH_FAILURES = _m("bookie_AUTH_FAILURES", COUNTER, "Connections or requests refused by TLS "
                   "or authentication, by kind (tls_required, tls_not_offered, tls_handshake, "
                   "auth, op, revoked).", ["kind"])
SHARD_METRICS = [ADD_ENTRY_REQUEST, ADD_ENTRY_ERRORS, READ_ENTRY_REQUEST, READ_ENTRY_ERRORS,
                 READ_RANGE_REQUEST, JOURNAL_SYNC, JOURNAL_BATCH, JOURNAL_WRITE_BYTES,
                 JOURNAL_QUEUE, JOURNAL_BYTES, LEDGERS, ENTRIES, CONNECTIONS, CHECKPOINTS,
                 AUTH_FAILURES]

# --- bookie: kept by the arbiter -----------------------------------------------------
SERVER_STATUS = _m("bookie_SERVER_STATUS", GAUGE, "1 while the bookie is writable, 0 while "
                   "it is read-only.")
DISK_USAGE = _m("bookie_disk_usage_ratio", GAUGE, "Used fraction of the fullest bookie disk "
                "(read-only at diskUsageThreshold).")
DISK_FREE = _m("bookie_disk_free_bytes", GAUGE, "Free bytes on the bookie's disks.")
WORKER_RESTARTS = _m("bookie_worker_restarts", COUNTER, "Shard workers restarted after they "
                     "died.", ["shard"])
SHARD_UP = _m("bookie_shard_up", GAUGE, "1 while the shard worker serves.", ["shard"])
CONNECTIONS_ACCEPTED = _m("bookie_connections_accepted", COUNTER, "Client connections "
                          "handed to a shard worker.")
GC_RUNS = _m("bookie_GC_RUNS", COUNTER, "Garbage collection rounds completed (all shards).")
DELETED_LEDGERS = _m("bookie_DELETED_LEDGER_COUNT", COUNTER, "Ledgers dropped by garbage "
                     "collection.")
COMPACTED_SEGMENTS = _m("bookie_COMPACTED_SEGMENTS", COUNTER, "Journal segments removed by "
                        "compaction.")
RECLAIMED_BYTES = _m("bookie_RECLAIMED_COMPACTION_SPACE_BYTES", COUNTER, "Bytes of journal "
                     "segments removed by compaction.")
# BookKeeper's GarbageCollectorStats has no counter of its over-replicated GC:
# named after its scope (bookie_gc_...) and what they count
OVERREP_CLAIMS = _m("bookie_gc_OVERREPLICATED_CLAIMS", COUNTER, "Ledgers the over-replicated "
                    "GC claimed: closed, this bookie in none of their ensembles, every bookie "
                    "of their write sets holding their entries; their under-replication lock "
                    "held while the shard drops them.")
OVERREP_DROPPED = _m("bookie_gc_OVERREPLICATED_DROPPED", COUNTER, "Claimed over-replicated "
                     "ledgers whose entries a shard dropped (one that held no entry is not "
                     "counted).")
ARBITER_METRICS = [SERVER_STATUS, DISK_USAGE, DISK_FREE, WORKER_RESTARTS, SHARD_UP,
                   CONNECTIONS_ACCEPTED, GC_RUNS, DELETED_LEDGERS, COMPACTED_SEGMENTS,
                   RECLAIMED_BYTES, OVERREP_CLAIMS, OVERREP_DROPPED]

# --- auto-recovery (served by the auditor) ---------------------------------------------
UNDER_REPLICATED = _m("auditor_NUM_UNDER_REPLICATED_LEDGERS", GAUGE, "Ledgers marked "
                      "under-replicated, as the auditor last saw them.")
UNDER_REPLICATED_AGE = _m("auditor_UNDER_REPLICATED_OLDEST_AGE_SECONDS", GAUGE, "Age of the "
                          "oldest under-replicated mark, as the auditor last saw it.")
AUDITOR_ELECTED = _m("auditor_ELECTED", GAUGE, "1 while this process is the elected auditor "
                     "(served by processes that run auto-recovery).")
REPLICATED_ENTRIES = _m("replication_REREPLICATED_ENTRIES", COUNTER, "Entries copied to a "
                        "replacement bookie by this process's replication worker.")
REPLICATED_BYTES = _m("replication_REREPLICATED_BYTES", COUNTER, "Payload bytes copied by "
                      "this process's replication worker (rate(): bytes/s replicated).")
NOT_ADHERING = _m("auditor_NUM_LEDGERS_NOT_ADHERING_TO_PLACEMENT_POLICY", GAUGE, "Ledgers "
                  "with a fragment whose write quorums span fewer racks than the placement "
                  "policy asks, at the auditor's last placement check.")
AUTORECOVERY_METRICS = [UNDER_REPLICATED, UNDER_REPLICATED_AGE, AUDITOR_ELECTED,
                        REPLICATED_ENTRIES, REPLICATED_BYTES, NOT_ADHERING]

# --- metadata (served by the bookie elected compactor, bk.meta.compactor) -----------------
METADATA_COMPACTIONS = _m("bookkeeper_metadata_COMPACTIONS", COUNTER, "Compactions of etcd's "
                          "history made by this bookie as the elected compactor.")
METADATA_DB_SIZE = _m("bookkeeper_metadata_DB_SIZE_BYTES", GAUGE, "etcd's db size as the "
                      "elected compactor last read it (its status).")
METADATA_DB_SIZE_IN_USE = _m("bookkeeper_metadata_DB_SIZE_IN_USE_BYTES", GAUGE, "The part of "
                             "etcd's db in use as the elected compactor last read it: the rest "
                             "is free pages that only a defragmentation gives back.")
METADATA_METRICS = [METADATA_COMPACTIONS, METADATA_DB_SIZE, METADATA_DB_SIZE_IN_USE]

# --- client ------------------------------------------------------------------------------
CLIENT_ADD = _m("bookkeeper_client_ADD_ENTRY", HISTOGRAM, "Client adds by outcome: time from "
                "add_entry to its confirmation (seconds).", ["success"], LATENCY_BUCKETS)
CLIENT_READ = _m("bookkeeper_client_READ_ENTRY", HISTOGRAM, "Client entry reads by outcome "
                 "(seconds per read call).", ["success"], LATENCY_BUCKETS)
CLIENT_ENSEMBLE_CHANGES = _m("bookkeeper_client_ENSEMBLE_CHANGES", COUNTER,
                             "Ensemble changes of this client's writers.")
CLIENT_RECOVERIES = _m("bookkeeper_client_LEDGER_RECOVER", COUNTER, "Ledger recoveries run "
                       "by this client, by outcome.", ["success"])
CLIENT_BOOKIE_ERRORS = _m("bookkeeper_client_BOOKIE_ERRORS", COUNTER, "Errors from bookies "
                          "(error answers, timeouts, broken connections), by kind.", ["kind"])
CLIENT_SPECULATIVE_READS = _m("bookkeeper_client_SPECULATIVE_READS", COUNTER, "Reads also "
                              "sent to the next replica because one had not answered within "
                              "speculativeReadTimeout.")

ALL = SHARD_METRICS + ARBITER_METRICS + AUTORECOVERY_METRICS + [CLIENT_ADD, CLIENT_READ,
                                         CLIENT_ENSEMBLE_CHANGES, CLIENT_RECOVERIES,
                                         CLIENT_BOOKIE_ERRORS, CLIENT_SPECULATIVE_READS]


# --- shard worker side ---------------------------------------------------------------
class _Hist:
    """Non-cumulative bucket counts (the last one is +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n


class ShardMetrics:
    """One shard worker's numbers: plain attributes the worker updates, and
    :meth:`snapshot` to send them to the arbiter."""

    enabled = True

    def __init__(self):
        self.add_ok = _Hist(LATENCY_BUCKETS)
        self.add_fail = _Hist(LATENCY_BUCKETS)
        self.read_ok = _Hist(LATENCY_BUCKETS)
        self.read_fail = _Hist(LATENCY_BUCKETS)
        self.range_ok = _Hist(LATENCY_BUCKETS)
        self.range_fail = _Hist(LATENCY_BUCKETS)
        self.sync = _Hist(LATENCY_BUCKETS)
        self.batch = _Hist(GROUP_BUCKETS)
        self.add_errors: dict[str, int] = {}
        self.read_errors: dict[str, int] = {}
        self.auth_failures: dict[str, int] = {}

    def add_group(self, adds: int, failed: int, batch: int, latency: float) -> None:
        """One group commit answered: ``adds`` ADDs of which ``failed`` got an error,
        ``batch`` answers in all, the oldest having waited ``latency``."""
        if adds > failed:
            self.add_ok.observe(latency, adds - failed)
        if failed:
            self.add_fail.observe(latency, failed)
        self.batch.observe(batch)

    def add_error(self, status_name: str, immediate: bool) -> None:
        self.add_errors[status_name] = self.add_errors.get(status_name, 0) + 1
        if immediate:           # refused at once (read-only): not part of a group
            self.add_fail.observe(0.0)

    def auth_failed(self, kind: str) -> None:
        """A connection or request refused by TLS or authentication."""
        self.auth_failures[kind] = self.auth_failures.get(kind, 0) + 1

    def read(self, status: int, latency: float, entries: int = 1) -> None:
        """A READ (``entries`` = 1) or the ``entries`` a READ_RANGE answered: each is
        one entry read; a request answered with an error is one failed read."""
        if status == 0:
            if entries:
                self.read_ok.observe(latency, entries)
        else:
            self.read_fail.observe(latency)
            name = status_name(status)
            self.read_errors[name] = self.read_errors.get(name, 0) + 1

    def read_range(self, status: int, entries: int, latency: float) -> None:
        """One READ_RANGE request that answered ``entries`` entries."""
        (self.range_ok if status == 0 else self.range_fail).observe(latency)
        self.read(status, latency, entries)

    def synced(self, latency: float) -> None:
        self.sync.observe(latency)

    def snapshot(self, stats: dict, queue: int, connections: int) -> dict:
        """Everything as msgpack-able values: {name: [[labels, value], ...]}, a
        histogram's value being [bucket counts, sum]."""
        def h(x):
            return [list(x.counts), x.sum]
        return {
            ADD_ENTRY_REQUEST.name: [[["true"], h(self.add_ok)], [["false"], h(self.add_fail)]],
            READ_ENTRY_REQUEST.name: [[["true"], h(self.read_ok)], [["false"], h(self.read_fail)]],
            ADD_ENTRY_ERRORS.name: [[[k], v] for k, v in self.add_errors.items()],
            READ_ENTRY_ERRORS.name: [[[k], v] for k, v in self.read_errors.items()],
            READ_RANGE_REQUEST.name: [[["true"], h(self.range_ok)],
                                      [["false"], h(self.range_fail)]],
            JOURNAL_SYNC.name: [[[], h(self.sync)]],
            JOURNAL_BATCH.name: [[[], h(self.batch)]],
            JOURNAL_WRITE_BYTES.name: [[[], stats.get("synced_bytes", 0)]],
            CHECKPOINTS.name: [[[], stats.get("checkpoints", 0)]],
            JOURNAL_QUEUE.name: [[[], queue]],
            JOURNAL_BYTES.name: [[[], stats.get("journal_bytes", 0)]],
            LEDGERS.name: [[[], stats.get("ledgers", 0)]],
            ENTRIES.name: [[[], stats.get("entries", 0)]],
            CONNECTIONS.name: [[[], connections]],
            AUTH_FAILURES.name: [[[k], v] for k, v in self.auth_failures.items()],
        }


class NoMetrics(ShardMetrics):
    """``enableStatistics=false``: the same calls, doing nothing."""

    enabled = False

    def add_group(self, adds, failed, batch, latency):
        pass

    def add_error(self, status_name, immediate):
        pass

    def auth_failed(self, kind):
        pass

    def read(self, status, latency, entries=1):
        pass

    def read_range(self, status, entries, latency):
        pass

    def synced(self, latency):
        pass


# --- arbiter side --------------------------------------------------------------------
_BY_NAME = {m.name: m for m in ALL}


def _merge(into: dict, snap: dict) -> None:
    """Add the counters and histograms of ``snap`` (a worker's snapshot, or totals
    ``{name: {labels: value}}``) into the totals ``into`` (gauges are skipped: a dead
    worker's gauges are not carried)."""
    for name, series in snap.items():
        m = _BY_NAME.get(name)
        if m is None or m.kind == GAUGE:
            continue
        dst = into.setdefault(name, {})
        for labels, value in (series.items() if isinstance(series, dict) else series):
            key = tuple(labels)
            if m.kind == HISTOGRAM:
                cur = dst.get(key)
                if cur is None:
                    dst[key] = [list(value[0]), value[1]]
                else:
                    cur[0] = [a + b for a, b in zip(cur[0], value[0])]
                    cur[1] += value[1]
            else:
                dst[key] = dst.get(key, 0) + value


class BookieMetrics:
    """The arbiter's view: the sum over shard workers plus its own numbers (the loop
    updates; the HTTP thread reads them through :mod:`bk.exposition`)."""

    def __init__(self, num_shards: int):
        self.lock = threading.Lock()
        self.num_shards = num_shards
        self.current: dict[int, dict] = {}     # shard -> latest snapshot of the live worker
        self.carried: dict[int, dict] = {}     # shard -> totals of its dead workers
        self.restarts = [0] * num_shards
        self.up = [0] * num_shards
        self.accepted = 0
        self.gc_runs = 0
        self.deleted_ledgers = 0
        self.compacted_segments = 0
        self.reclaimed_bytes = 0
        self.overrep_claims = 0                # the over-replicated GC (the metadata thread)
        self.overrep_dropped = 0
        self.readonly = False
        self.autorecovery: AutoRecoveryMetrics | None = None   # once it runs one
        self.metadata_compactions = 0
        self.metadata_db_size = None           # set while this bookie is the compactor
        self.metadata_db_size_in_use = None    # (None too when etcd does not say it)
        self.disk: dict = {}
        self.disk_source = None                # callable -> layout.disk_space dict

    # updates, from the arbiter's loop
    def update(self, shard: int, snap: dict) -> None:
        with self.lock:
            self.current[shard] = snap
            self.up[shard] = 1

    def worker_died(self, shard: int) -> None:
        with self.lock:
            snap = self.current.pop(shard, None)
            if snap:
                _merge(self.carried.setdefault(shard, {}), snap)
            self.up[shard] = 0

    def restarted(self, shard: int) -> None:
        with self.lock:
            self.restarts[shard] += 1

    def gc_done(self, results: dict) -> None:
        with self.lock:
            self.gc_runs += 1
            for r in results.values():
                self.deleted_ledgers += r.get("ledgers_deleted", 0)
                self.compacted_segments += r.get("segments_removed", 0)
                self.reclaimed_bytes += r.get("bytes_freed", 0)

    def overreplicated(self, claims: int = 0, dropped: int = 0) -> None:
        """The over-replicated GC claimed ``claims`` ledgers; a shard dropped the
        entries of ``dropped``."""
        with self.lock:
            self.overrep_claims += claims
            self.overrep_dropped += dropped

    # reads, from the HTTP thread
    def totals(self) -> dict:
        """{name: {labels: value}} summed over shards (gauges: live workers only)."""
        with self.lock:
            out: dict = {}
            for c in self.carried.values():
                _merge(out, c)
            for snap in self.current.values():
                _merge(out, snap)
                for name, series in snap.items():
                    m = _BY_NAME.get(name)
                    if m is not None and m.kind == GAUGE:
                        dst = out.setdefault(name, {})
                        for labels, value in series:
                            dst[tuple(labels)] = dst.get(tuple(labels), 0) + value
            return out


class AutoRecoveryMetrics:
    """The numbers of one process's auto-recovery (a bookie's, or ``bookie
    autorecovery``'s), exposed by :mod:`bk.exposition`. Its threads set the
    attributes; the under-replicated gauges are served only while it is the
    auditor (``under_replicated`` is None otherwise), the placement gauge only
    once it ran a placement check as the auditor."""

    def __init__(self):
        self.auditor = 0                       # 1 while this process is the auditor
        self.under_replicated: int | None = None
        self.under_replicated_age = 0.0
        self.not_adhering: int | None = None   # set by the auditor's placement check
        self.replicated_entries = 0
        self.replicated_bytes = 0
