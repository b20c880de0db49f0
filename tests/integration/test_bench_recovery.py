"""``bkshell bench recovery`` at a tiny size: a real 4-bookie cluster with
auto-recovery, one bookie killed, its entries re-replicated and checked."""

from __future__ import annotations

from bk.bench.recovery import bench_recovery, parse_size
from bk.testing import TEST_DEFAULTS, shell_err, shell_ok


def test_bench_recovery_rereplicates_exactly_what_the_lost_bookie_held(tmp_path):
    r = bench_recovery(size=3 << 20, ledgers=6, writers=1, writer_rate=200, baseline=0.5,
                       conf_overrides=TEST_DEFAULTS, base_dir=str(tmp_path), timeout=120)
    assert r["entries"] == 3 * 1024 and r["bytes_written"] == 3 << 20
    assert r["killed"] != r["auditor"]
    assert 0 < r["lost_bytes"] < r["bytes_written"]
    assert r["lost_bytes"] == r["lost_entries"] * 1024
    # The workers copied exactly what the lost bookie held, nothing more, nothing twice.
    assert r["rereplicated_bytes_by_workers"] == r["lost_bytes"]
    assert r["verified"] and r["problems"] == []
    assert r["under_replicated_at_end"] == 0
    assert r["seconds_kill_to_empty"] >= r["seconds_marked_to_empty"] > 0
    assert r["mb_per_sec"] > 0
    during = r["writer_latency_ms_during_recovery"]
    assert r["writer_errors"] == 0 and r["writer_latency_ms_before_kill"]["count"] > 0
    assert during["count"] == 0 or during["p99"] is not None
    assert list(tmp_path.iterdir()) == []       # the cluster's temp dir is gone


def test_parse_size_and_the_cli_help():
    assert parse_size("1G") == 1 << 30 and parse_size("256M") == 256 << 20
    assert parse_size("512K") == 512 << 10 and parse_size("4096") == 4096
    # (in this process: test_shell runs the real entry point)
    r = shell_ok("bench", "recovery", "--help")
    assert "--writers" in r.stdout and "kill -> first" in r.stdout
    assert "not a size" in shell_err("bench", "recovery", "--size", "lots", code=2)


def test_pipelined_copy_reads_from_the_next_replica_when_the_first_is_gone(cluster_factory):
    """Replicator._copy_fragment keeps several batches of reads and adds in flight; an
    entry whose first surviving replica is dead too is read from the next one,
    and the copy still reports exactly what it copied."""
    import bk
    from bk.admin import Admin
    from bk.autorecovery import replicator as A
    from bk.bench.recovery import entries_on

    c = cluster_factory(5)
    n = A.COPY_BATCH * (A.READ_AHEAD + A.ADD_WINDOW) + 37      # several batches, a ragged end
    data = [b"entry-%d" % e for e in range(n)]
    with bk.BookKeeper(c.metadata_uri) as client:
        lh = client.create_ledger(3, 3, 2, password=b"pipe")
        lh.add_entries(data)
        lh.close()
        ens = client.ledger_metadata(lh.ledger_id).ensembles[0][1]
        victim, first_source = ens[0], ens[1]    # first_source: the first replica of 2/3
        c.bookie(victim).kill()
        c.bookie(first_source).kill()
        with Admin(c.metadata_uri) as admin:
            report = admin.recover_bookie(victim)
        assert report.ok, report.failed
        (fr,) = report.fragments
        assert fr.done and fr.copied == n and fr.already == 0
        assert fr.bytes_copied == sum(len(d) for d in data)
        assert entries_on(c.store, fr.replacement, lh.ledger_id) == set(range(n))
        rh = client.open_ledger(lh.ledger_id, password=b"pipe")
        assert [e.data for e in rh.read_entries(0, n - 1)] == data
        # A second run copies nothing: the victim is in no ensemble any more.
        with Admin(c.metadata_uri) as admin:
            assert admin.recover_bookie(victim).fragments == []
