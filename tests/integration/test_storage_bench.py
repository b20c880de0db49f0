"""``bkshell bench scale --catchup-only``: the catch-up read benchmark from the
shell, against the real one-bookie cluster it starts (real etcd and bookie)."""

from __future__ import annotations

import json

from bk.testing import shell_err, shell_ok


def test_bench_scale_catchup_only_reads_every_entry(tmp_path):
    r = shell_ok("bench", "scale", "--catchup-only", "--catchup-entries", 40,
                 "--read-ledgers", 2, "--set", "dbStorage_writeCacheMaxSizeMb=2",
                 "--dir", tmp_path, "--json")
    out = json.loads(r.stdout)
    assert (out["ledgers"], out["entries"]) == (2, 80)
    assert out["mb"] == round(80 * 1024 / 1e6, 1) and out["mb_per_sec"] > 0
    assert out["worker_us_per_entry"] > 0 and out["client_us_per_entry"] > 0
    # each ledger's rate is printed too: one per ledger read, each a real rate
    assert len(out["per_ledger_mb_per_sec"]) == 2
    assert all(x > 0 for x in out["per_ledger_mb_per_sec"])


def test_bench_scale_catchup_only_needs_entries():
    stderr = shell_err("bench", "scale", "--catchup-only", "--catchup-entries", 0)
    assert "--catchup-entries" in stderr and "Traceback" not in stderr
