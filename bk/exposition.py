"""The Prometheus side of :mod:`bk.metrics`: the bookie's and auto-recovery's
numbers as metric families (read at each scrape), and the client's metrics.

bk.metrics keeps plain numbers and loads no prometheus_client, so a bookie that
serves no HTTP (``httpServerEnabled=false``) never imports it; this module is
loaded by the HTTP views (bk.bookie.http, bk.autorecovery.daemon) and by the
client, whose histograms and counters are prometheus_client objects in a
registry of their own (:func:`client_registry`).
"""

from __future__ import annotations

import threading
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from bk import metrics as M


# --- bookie and auto-recovery --------------------------------------------------------
def _bookie_families(b):
    """The families of a :class:`bk.metrics.BookieMetrics` ``b``: the shards' sums,
    then the arbiter's own numbers."""
    totals = b.totals()
    for m in M.SHARD_METRICS:
        series = totals.get(m.name, {})
        if m.kind == M.HISTOGRAM:
            fam = HistogramMetricFamily(m.name, m.help, labels=m.labels)
            if m.labels == ("success",):       # both outcomes always present
                for v in ("true", "false"):
                    series.setdefault((v,), [[0] * (len(m.buckets) + 1), 0.0])
            elif not series:
                series[()] = [[0] * (len(m.buckets) + 1), 0.0]
            for labels, (counts, total) in sorted(series.items()):
                acc, buckets = 0, []
                for bound, c in zip(list(m.buckets) + [float("inf")], counts):
                    acc += c
                    buckets.append((_le(bound), acc))
                fam.add_metric(list(labels), buckets, total)
        else:
            cls = CounterMetricFamily if m.kind == M.COUNTER else GaugeMetricFamily
            fam = cls(m.name, m.help, labels=m.labels)
            if not m.labels and not series:
                series = {(): 0}
            for labels, value in sorted(series.items()):
                fam.add_metric(list(labels), value)
        yield fam
    with b.lock:
        disk = dict(b.disk)
        yield _gauge(M.SERVER_STATUS, 0 if b.readonly else 1)
        yield _gauge(M.DISK_USAGE, disk.get("usage", 0.0))
        yield _gauge(M.DISK_FREE, disk.get("free_bytes", 0))   # layout.disk_space's key
        fam = CounterMetricFamily(M.WORKER_RESTARTS.name, M.WORKER_RESTARTS.help,
                                  labels=["shard"])
        for i, n in enumerate(b.restarts):
            fam.add_metric([str(i)], n)
        yield fam
        fam = GaugeMetricFamily(M.SHARD_UP.name, M.SHARD_UP.help, labels=["shard"])
        for i, n in enumerate(b.up):
            fam.add_metric([str(i)], n)
        yield fam
        for m, v in ((M.CONNECTIONS_ACCEPTED, b.accepted), (M.GC_RUNS, b.gc_runs),
                     (M.DELETED_LEDGERS, b.deleted_ledgers),
                     (M.COMPACTED_SEGMENTS, b.compacted_segments),
                     (M.RECLAIMED_BYTES, b.reclaimed_bytes),
                     (M.OVERREP_CLAIMS, b.overrep_claims),
                     (M.OVERREP_DROPPED, b.overrep_dropped)):
            yield CounterMetricFamily(m.name, m.help, value=v)
    if b.metadata_db_size is not None:
        yield CounterMetricFamily(M.METADATA_COMPACTIONS.name, M.METADATA_COMPACTIONS.help,
                                  value=b.metadata_compactions)
        yield _gauge(M.METADATA_DB_SIZE, b.metadata_db_size)
        if b.metadata_db_size_in_use is not None:
            yield _gauge(M.METADATA_DB_SIZE_IN_USE, b.metadata_db_size_in_use)
    if b.autorecovery is not None:
        yield from _autorecovery_families(b.autorecovery)


def _autorecovery_families(a):
    """The families of a :class:`bk.metrics.AutoRecoveryMetrics` ``a``."""
    if a.under_replicated is not None:
        yield _gauge(M.UNDER_REPLICATED, a.under_replicated)
        yield _gauge(M.UNDER_REPLICATED_AGE, a.under_replicated_age)
    if a.not_adhering is not None:
        yield _gauge(M.NOT_ADHERING, a.not_adhering)
    yield _gauge(M.AUDITOR_ELECTED, a.auditor)
    yield CounterMetricFamily(M.REPLICATED_ENTRIES.name, M.REPLICATED_ENTRIES.help,
                              value=a.replicated_entries)
    yield CounterMetricFamily(M.REPLICATED_BYTES.name, M.REPLICATED_BYTES.help,
                              value=a.replicated_bytes)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def _gauge(m: M.Metric, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(m.name, m.help, value=value)


class _Collector:
    """A prometheus_client collector over one object of bk.metrics."""

    def __init__(self, families, metrics):
        self._families = families
        self._metrics = metrics

    def collect(self):
        return self._families(self._metrics)


def registry_of(metrics) -> CollectorRegistry:
    """A registry serving ``metrics`` (a :class:`bk.metrics.BookieMetrics` or a
    :class:`bk.metrics.AutoRecoveryMetrics`), read at each scrape."""
    families = (_bookie_families if isinstance(metrics, M.BookieMetrics)
                else _autorecovery_families)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(families, metrics))
    return reg


# --- client --------------------------------------------------------------------------
class ClientMetrics:
    """The metrics of one client process, in their own registry."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.add = Histogram(M.CLIENT_ADD.name, M.CLIENT_ADD.help, M.CLIENT_ADD.labels,
                             buckets=M.CLIENT_ADD.buckets, registry=r)
        self.add_ok = self.add.labels("true")
        self.add_fail = self.add.labels("false")
        self.read = Histogram(M.CLIENT_READ.name, M.CLIENT_READ.help, M.CLIENT_READ.labels,
                              buckets=M.CLIENT_READ.buckets, registry=r)
        self.read_ok = self.read.labels("true")
        self.read_fail = self.read.labels("false")
        self.ensemble_changes = Counter(M.CLIENT_ENSEMBLE_CHANGES.name,
                                        M.CLIENT_ENSEMBLE_CHANGES.help, registry=r)
        self.recoveries = Counter(M.CLIENT_RECOVERIES.name, M.CLIENT_RECOVERIES.help,
                                  M.CLIENT_RECOVERIES.labels, registry=r)
        self.bookie_errors = Counter(M.CLIENT_BOOKIE_ERRORS.name, M.CLIENT_BOOKIE_ERRORS.help,
                                     M.CLIENT_BOOKIE_ERRORS.labels, registry=r)
        self.speculative_reads = Counter(M.CLIENT_SPECULATIVE_READS.name,
                                         M.CLIENT_SPECULATIVE_READS.help, registry=r)


def observe_many(hist, values) -> None:
    """``hist.observe(v)`` for every v of ``values`` (a prometheus_client Histogram
    child), with one update per bucket: the client's add path observes the
    latencies of all the entries one acknowledgement completed at once."""
    if not values:
        return
    if len(values) == 1:            # one entry per acknowledgement: a blocking add's case
        v = values[0]
        hist._sum.inc(v)
        hist._buckets[bisect_left(hist._upper_bounds, v)].inc(1)
        return
    bounds = hist._upper_bounds
    counts = [0] * len(bounds)
    for v in values:
        counts[bisect_left(bounds, v)] += 1
    hist._sum.inc(sum(values))
    buckets = hist._buckets
    for i, n in enumerate(counts):
        if n:
            buckets[i].inc(n)


_client: ClientMetrics | None = None
_client_lock = threading.Lock()


def client_metrics() -> ClientMetrics:
    """The process's client metrics (shared by every BookKeeper client in it)."""
    global _client
    with _client_lock:
        if _client is None:
            _client = ClientMetrics()
        return _client


def client_registry() -> CollectorRegistry:
    """The registry of the client metrics, for an application to expose."""
    return client_metrics().registry
