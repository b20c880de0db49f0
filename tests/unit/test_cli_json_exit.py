"""``--json`` changes only stdout: a benchmark whose adds failed, or whose
verification failed, prints its document and exits 1 with the text form's error
line (the benchmark itself is stubbed: what is checked is the command's contract)."""

from __future__ import annotations

import json

from click.testing import CliRunner

import bk.bench.recovery
import bk.bench.writes
from bk.cli.shell import cli

URI = ["--metadata", "etcd://127.0.0.1:1/ledgers"]     # parsed, never dialled


def _writes(errors):
    def fake(uri, **kw):
        return {"entries": 10, "seconds": 1.0, "entries_per_sec": 10.0, "mb_per_sec": 0.01,
                "client_cpu_us_per_entry": 1.0, "errors": errors, "latency_max_ms": 1.0,
                "latency_ms": {"p50": 1, "p95": 1, "p99": 1, "p99.9": 1}}
    return fake


def test_bench_writes_exits_1_when_adds_failed_with_and_without_json(monkeypatch):
    monkeypatch.setattr(bk.bench.writes, "bench_writes", _writes(3))
    runs = [CliRunner().invoke(cli, [*URI, "bench", "writes", *j]) for j in ([], ["--json"])]
    for r in runs:
        assert r.exit_code == 1, r.output
        assert r.stderr.splitlines()[-1] == "bkshell: error: 3 adds failed"
    assert json.loads(runs[1].stdout)["errors"] == 3
    monkeypatch.setattr(bk.bench.writes, "bench_writes", _writes(0))
    r = CliRunner().invoke(cli, [*URI, "bench", "writes", "--json"])
    assert r.exit_code == 0 and r.stderr == "" and json.loads(r.stdout)["errors"] == 0


def test_bench_recovery_failed_verification_is_one_error_line_in_both_forms(monkeypatch):
    def fake(**kw):
        return {"verified": False, "problems": ["ledger 7 entry 3 missing on b:1"]}
    monkeypatch.setattr(bk.bench.recovery, "bench_recovery", fake)
    r = CliRunner().invoke(cli, ["bench", "recovery", "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["verified"] is False
    assert r.stderr == ("bkshell: error: bench recovery: not every entry is on every bookie "
                        "of its write set (first: ledger 7 entry 3 missing on b:1)\n")
