"""bkshell's log commands against real etcd and bookies (one cluster for the module:
each test uses logs of its own names and compares listings with what was there
before it)."""

import base64
import json
import os
import signal
import subprocess
import sys

import pytest

import bk
from bk.testing import shell_err, shell_ok

pytestmark = pytest.mark.timeout(120)


def test_log_commands(shared_cluster):
    m = ["--metadata", shared_cluster.metadata_uri]
    with bk.BookKeeper(shared_cluster.metadata_uri) as c:
        before = c.list_logs()
        w = c.open_log_writer("orders", logRollEntries=2)
        pos = [w.append(b"order-%d" % i) for i in range(6)]       # 3 segments
        w.close()
    assert json.loads(shell_ok(*m, "listlogs", "--json").stdout) == sorted(before + ["orders"])
    assert shell_ok(*m, "listlogs").stdout.split() == sorted(before + ["orders"])
    info = json.loads(shell_ok(*m, "loginfo", "orders", "--json").stdout)
    assert info["records"] == 6 and info["last_position"] == str(pos[-1])
    # The third roll happened after the sixth entry: a fourth, empty segment.
    assert [s["state"] for s in info["segments"]] == ["closed"] * 4
    assert [s["records"] for s in info["segments"]] == [2, 2, 2, 0]
    assert "6 records" in shell_ok(*m, "loginfo", "orders").stdout

    lines = shell_ok(*m, "readlog", "orders").stdout.splitlines()
    assert lines == [f"{p}\torder-{i}" for i, p in enumerate(pos)]
    rows = [json.loads(x) for x in shell_ok(*m, "readlog", "orders", "--from", str(pos[1]), "--to",
                                            str(pos[4]), "--json").stdout.splitlines()]
    assert [r["position"] for r in rows] == [str(p) for p in pos[1:5]]
    assert base64.b64decode(rows[0]["data"]) == b"order-1"
    assert len(shell_ok(*m, "readlog", "orders", "--limit", "2").stdout.splitlines()) == 2
    assert "6f 72 64 65 72" in shell_ok(*m, "readlog", "orders", "--format", "hex").stdout

    out = json.loads(shell_ok(*m, "truncatelog", "orders", "--before", str(pos[2]),
                              "--json").stdout)
    assert len(out["deleted_ledgers"]) == 1
    assert shell_ok(*m, "readlog", "orders").stdout.splitlines()[0] == f"{pos[2]}\torder-2"
    assert "truncated" in shell_err(*m, "readlog", "orders", "--from", str(pos[0]), code=1)

    assert "does not exist" in shell_err(*m, "loginfo", "nope", code=1)
    assert "log name" in shell_err(*m, "loginfo", "a/b", code=2)
    assert "segment:entry:slot" in shell_err(*m, "truncatelog", "orders", "--before", "x", code=2)
    assert "deleted log orders" in shell_ok(*m, "deletelog", "orders").stdout
    assert shell_ok(*m, "listlogs").stdout.split() == before


def test_tail_follows_and_stops_on_ctrl_c(shared_cluster):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(bk.__file__)), os.environ.get("PYTHONPATH")])))
    with bk.BookKeeper(shared_cluster.metadata_uri) as c:
        w = c.open_log_writer("t")
        w.append(b"before")
        proc = subprocess.Popen([sys.executable, "-m", "bk.cli.shell", "--metadata",
                                 shared_cluster.metadata_uri, "tail", "t", "--earliest", "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                text=True)
        try:
            got = [json.loads(proc.stdout.readline())]
            for i in range(3):
                w.append(b"live-%d" % i)
                got.append(json.loads(proc.stdout.readline()))
            assert [base64.b64decode(g["data"]) for g in got] == \
                [b"before", b"live-0", b"live-1", b"live-2"]
            proc.send_signal(signal.SIGINT)
            assert proc.wait(20) == 0
            assert "Traceback" not in proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        w.close()


def test_bench_log_runs(shared_cluster):
    with bk.BookKeeper(shared_cluster.metadata_uri) as c:
        before = c.list_logs()
    r = json.loads(shell_ok("--metadata", shared_cluster.metadata_uri, "bench", "log",
                            "--duration", "0.5", "--tail-rate", "2000", "--json").stdout)
    assert r["records"] > 0 and r["records_per_sec"] > 0
    t = r["tail"]
    assert t["records"] == t["records_sent"] > 0 and t["latency_ms"]["p50"] >= 0
    with bk.BookKeeper(shared_cluster.metadata_uri) as c:
        assert c.list_logs() == before      # the bench cleans up after itself


def test_cleanstaging_deletes_what_no_commit_can_take(shared_cluster):
    """Staging ledgers left by dead tasks whose driver died too: bkshell cleanstaging
    deletes those of a batch its sink committed since and those older than
    --older-than; it keeps one that a commit may still take, and the log's own."""
    from bk.log import staging
    from bk.log.records import encode_record_set
    m = ["--metadata", shared_cluster.metadata_uri]
    with bk.BookKeeper(shared_cluster.metadata_uri) as c:
        def staged(**who):
            lh = staging.create(c, "sunk", **who)
            lh.add_entry(encode_record_set([b"r"]))
            lh.close()
            return lh.ledger_id
        committed = staged(sink="q1", batch=3)
        assert bk.log.append_ledgers(c, "sunk", [{"ledger_id": committed, "last_entry_id": 0,
                                                  "records": 1, "bytes": 1}], "q1", 3)
        dead_of_committed_batch = staged(sink="q1", batch=3)   # a dead attempt of batch 3
        in_flight = staged(sink="q1", batch=4)                 # batch 4 may still commit
        old_job = staged(write="job-1")
        out = json.loads(shell_ok(*m, "cleanstaging", "--dry-run", "--json").stdout)
        assert out["deleted"] == {"sunk": [dead_of_committed_batch]}
        assert len(staging.pending(c, "sunk")) == 4            # a dry run changes nothing
        shell_ok(*m, "cleanstaging")
        assert sorted(e["ledger_id"] for e in staging.pending(c, "sunk")) == \
            sorted([in_flight, old_job])
        with pytest.raises(bk.errors.NoSuchLedgerError):
            c.ledger_metadata(dead_of_committed_batch)
        # Old enough: no job runs that long. The committed ledger stays in the log.
        assert "deleted 2 staging" in shell_ok(*m, "cleanstaging", "sunk", "--older-than",
                                               "0").stdout
        assert staging.pending(c, "sunk") == []
        assert [s["ledger_id"] for s in c.log_info("sunk").segments] == [committed]
        assert c.ledger_metadata(committed).custom_metadata["bk.spark.sink"] == b"q1"
