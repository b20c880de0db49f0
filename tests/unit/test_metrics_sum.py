"""bk.metrics without processes: a shard's snapshot, the arbiter's sum over shards,
and totals carried over a worker's restart."""
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bk import metrics as M
from bk.exposition import registry_of
from bk.errors import ENOENTRY


def samples(bm):
    text = generate_latest(registry_of(bm)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def shard(adds, reads=0, entries=0, stats_bytes=0):
    m = M.ShardMetrics()
    m.add_group(adds, 0, adds, 0.003)
    for _ in range(reads):
        m.read(0, 0.0002)
    return m.snapshot({"entries": entries, "synced_bytes": stats_bytes, "ledgers": 1}, 0, 1)


def test_shards_are_summed_and_histogram_buckets_cumulate():
    bm = M.BookieMetrics(2)
    bm.update(0, shard(5, reads=2, entries=5))
    bm.update(1, shard(7, reads=1, entries=7))
    s = samples(bm)
    ok = (("success", "true"),)
    assert s[("bookkeeper_server_ADD_ENTRY_REQUEST_count", ok)] == 12
    assert s[("bookkeeper_server_READ_ENTRY_REQUEST_count", ok)] == 3
    # 3 ms falls in the 5 ms bucket, not the 2.5 ms one; +Inf holds everything.
    assert s[("bookkeeper_server_ADD_ENTRY_REQUEST_bucket", (("le", "0.0025"),) + ok)] == 0
    assert s[("bookkeeper_server_ADD_ENTRY_REQUEST_bucket", (("le", "0.005"),) + ok)] == 12
    assert s[("bookkeeper_server_ADD_ENTRY_REQUEST_bucket", (("le", "+Inf"),) + ok)] == 12
    assert abs(s[("bookkeeper_server_ADD_ENTRY_REQUEST_sum", ok)] - 12 * 0.003) < 1e-9
    assert s[("bookie_entries_count", ())] == 12
    assert s[("bookie_shard_up", (("shard", "1"),))] == 1


def test_a_later_snapshot_replaces_the_earlier_one():
    bm = M.BookieMetrics(1)
    bm.update(0, shard(5))
    bm.update(0, shard(9))             # cumulative: 9 in all, not 14
    assert samples(bm)[("bookkeeper_server_ADD_ENTRY_REQUEST_count",
                        (("success", "true"),))] == 9


def test_a_dead_workers_counts_are_carried_and_its_gauges_dropped():
    bm = M.BookieMetrics(2)
    bm.update(0, shard(5, entries=5, stats_bytes=100))
    bm.update(1, shard(3, entries=3, stats_bytes=50))
    bm.worker_died(0)
    bm.restarted(0)
    s = samples(bm)
    assert s[("bookkeeper_server_ADD_ENTRY_REQUEST_count", (("success", "true"),))] == 8
    assert s[("bookie_journal_JOURNAL_WRITE_BYTES_total", ())] == 150
    assert s[("bookie_entries_count", ())] == 3        # only the live worker's gauge
    assert s[("bookie_shard_up", (("shard", "0"),))] == 0
    assert s[("bookie_worker_restarts_total", (("shard", "0"),))] == 1
    bm.update(0, shard(2, entries=6, stats_bytes=10))   # the new worker starts from 0
    s = samples(bm)
    assert s[("bookkeeper_server_ADD_ENTRY_REQUEST_count", (("success", "true"),))] == 10
    assert s[("bookie_journal_JOURNAL_WRITE_BYTES_total", ())] == 160
    assert s[("bookie_entries_count", ())] == 9
    bm.worker_died(0)                   # a second death adds to the carried totals
    assert samples(bm)[("bookkeeper_server_ADD_ENTRY_REQUEST_count",
                        (("success", "true"),))] == 10


def test_errors_by_status_and_failed_groups():
    m = M.ShardMetrics()
    m.add_error("EFENCED", False)
    m.add_error("EREADONLY", True)
    m.add_group(4, 1, 5, 0.001)
    m.read(ENOENTRY, 0.0001)
    bm = M.BookieMetrics(1)
    bm.update(0, m.snapshot({}, 0, 0))
    s = samples(bm)
    assert s[("bookkeeper_server_ADD_ENTRY_ERRORS_total", (("status", "EFENCED"),))] == 1
    assert s[("bookkeeper_server_ADD_ENTRY_ERRORS_total", (("status", "EREADONLY"),))] == 1
    assert s[("bookkeeper_server_ADD_ENTRY_REQUEST_count", (("success", "true"),))] == 3
    assert s[("bookkeeper_server_ADD_ENTRY_REQUEST_count", (("success", "false"),))] == 2
    assert s[("bookkeeper_server_READ_ENTRY_ERRORS_total", (("status", "ENOENTRY"),))] == 1
    assert s[("bookie_journal_JOURNAL_FORCE_WRITE_BATCH_ENTRIES_sum", ())] == 5


def test_every_metric_is_defined_once():
    names = [m.name for m in M.ALL]
    assert len(names) == len(set(names))
    for m in M.ALL:
        assert m.help and m.kind in (M.COUNTER, M.GAUGE, M.HISTOGRAM)
        assert (m.kind == M.HISTOGRAM) == bool(m.buckets)


def test_no_metrics_counts_nothing():
    m = M.NoMetrics()
    m.add_group(5, 0, 5, 0.1)
    m.add_error("EFENCED", True)
    m.read(0, 0.1)
    assert not m.enabled and m.add_ok.counts == [0] * len(m.add_ok.counts)


def test_a_read_range_counts_its_entries_and_one_request():
    bm = M.BookieMetrics(1)
    m = M.ShardMetrics()
    m.read_range(0, 40, 0.002)            # one READ_RANGE answering 40 entries
    m.read_range(0, 0, 0.001)             # one that found none of its entries
    m.read_range(ENOENTRY, 0, 0.001)      # and one answered with an error
    m.read(0, 0.0001)                     # one plain READ
    bm.update(0, m.snapshot({}, 0, 0))
    s = samples(bm)
    ok, bad = (("success", "true"),), (("success", "false"),)
    assert s[("bookkeeper_server_READ_ENTRY_REQUEST_count", ok)] == 41
    assert s[("bookkeeper_server_READ_ENTRY_REQUEST_count", bad)] == 1
    assert abs(s[("bookkeeper_server_READ_ENTRY_REQUEST_sum", ok)] - (40 * 0.002 + 0.0001)) < 1e-9
    assert s[("bookkeeper_server_READ_RANGE_REQUEST_count", ok)] == 2
    assert s[("bookkeeper_server_READ_RANGE_REQUEST_count", bad)] == 1
    assert s[("bookkeeper_server_READ_ENTRY_ERRORS_total", (("status", "ENOENTRY"),))] == 1
