"""bkshell against real etcd and real bookies: each command's success and error paths."""

import json
import os
import subprocess
import sys

import pytest

import bk
from bk.errors import LedgerFencedError
from bk.util import free_port
from bk.testing import shell, shell_err, shell_ok

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def err(*args, **kw):
    """The one error line of a bkshell command that must fail."""
    stderr = shell_err(*args, **kw)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bkshell: error: "), stderr
    return lines[0]


# --- no cluster ---------------------------------------------------------------------

def test_missing_metadata_uri():
    for cmd in (["listbookies"], ["listledgers"], ["recover", "x:1"], ["ledgermetadata", "1"]):
        line = err(*cmd)
        assert "no metadata service URI" in line and "BK_METADATA_URI" in line


def test_bad_and_unreachable_uri():
    line = err("--metadata", "zk://127.0.0.1:2181/ledgers", "listledgers")
    assert "zk://127.0.0.1:2181/ledgers" in line
    uri = f"etcd://127.0.0.1:{free_port()}/ledgers"
    for cmd in (["listbookies"], ["listledgers"], ["ledgermetadata", "1"], ["deleteledger", "1"],
                ["bookieinfo"], ["recover", "127.0.0.1:1"], ["simpletest", "--entries", "1"]):
        line = err("--metadata", uri, "--timeout", "0.5", *cmd)
        assert uri in line, (cmd, line)
    # the environment variable names the URI as well
    line = err("--timeout", "0.5", "listledgers", env={"BK_METADATA_URI": uri})
    assert uri in line


def test_subprocess_entry_point_and_help():
    """The real entry point: help works, errors are one line without traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BK_")}
    p = subprocess.run([os.path.join(ROOT, "bin", "bkshell"), "--help"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert p.returncode == 0 and "recover" in p.stdout and "Examples" in p.stdout
    p = subprocess.run([sys.executable, "-m", "bk.cli.shell", "listledgers"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode != 0 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "no metadata service URI" in p.stderr
    for cmd in ("metaformat", "listbookies", "bookieinfo", "bookiesanity", "listledgers",
                "ledgermetadata", "readledger", "deleteledger", "simpletest", "recoverledger",
                "fenceledger", "recover", "decommissionbookie", "lastmark", "readjournal"):
        r = shell_ok(cmd, "--help")
        assert "Example" in r.stdout, cmd
    for sub in ("writes", "bookie"):
        assert "Example" in shell_ok("bench", sub, "--help").stdout


# --- with a cluster -------------------------------------------------------------------------
# test_bookie_commands formats the metadata: a cluster of its own. The others share
# the module's cluster and compare listings with what was there before them.

def test_bookie_commands(cluster):
    uri = cluster.metadata_uri
    ids = sorted(b.bookie_id for b in cluster.bookies)
    r = shell_ok("--metadata", uri, "listbookies")
    assert [line.split("\t")[0] for line in r.stdout.splitlines()] == ids
    assert all(line.endswith("\twritable") for line in r.stdout.splitlines())
    rows = json.loads(shell_ok("--metadata", uri, "listbookies", "--all", "--json").stdout)
    assert [r["id"] for r in rows] == ids and {r["state"] for r in rows} == {"writable"}
    ro = shell_ok("--metadata", uri, "listbookies", "--readonly", "--json")
    assert json.loads(ro.stdout) == []
    # --conf supplies the URI too (a bookie's conf file has metadataServiceUri)
    r = shell_ok("--conf", cluster.bookies[0].conf_file, "listbookies")
    assert len(r.stdout.splitlines()) == 3

    info = json.loads(shell_ok("--metadata", uri, "bookieinfo", "--json").stdout)
    assert [i["id"] for i in info] == ids
    for i in info:
        assert 0 < i["free_bytes"] <= i["total_bytes"] and i["shards"] == 2
    r = shell_ok("--metadata", uri, "bookieinfo", ids[0])
    assert r.stdout.startswith(ids[0]) and "free" in r.stdout
    assert "not registered" in err("--metadata", uri, "bookieinfo", "127.0.0.1:1")

    r = shell_ok("--metadata", uri, "bookiesanity", ids[1])
    assert "succeeded" in r.stdout
    res = json.loads(shell_ok("--metadata", uri, "bookiesanity", ids[2], "--json").stdout)
    assert res["ok"] and res["entries"] == 10
    assert list(bk.BookKeeper(uri).list_ledgers()) == []      # its ledgers are deleted
    assert "not registered" in err("--metadata", uri, "bookiesanity", "127.0.0.1:1")
    assert "not found" in err("--metadata", uri, "recover", "127.0.0.1:1")
    assert "127.0.0.1:1" in err("--metadata", uri, "bench", "bookie", "127.0.0.1:1")

    # metaformat: refuses without --force; --force needs --yes when it cannot ask
    assert "already exist" in err("--metadata", uri, "metaformat")
    assert "--yes" in err("--metadata", uri, "metaformat", "--force")
    with bk.BookKeeper(uri) as c:
        lh = c.create_ledger(3, 2, 2)
        lh.add_entry(b"x")
        lh.close()
    shell_ok("--metadata", uri, "metaformat", "--force", "--yes")
    assert shell_ok("--metadata", uri, "listledgers").stdout == ""


def test_ledger_commands(shared_cluster):
    uri = shared_cluster.metadata_uri
    before = json.loads(shell_ok("--metadata", uri, "listledgers", "--json").stdout)
    r = shell_ok("--metadata", uri, "simpletest", "--entries", "20", "--keep")
    first = r.stdout.splitlines()[0]
    assert first.startswith("20 entries written to ledger ")
    lid = int(first.rsplit(" ", 1)[1])
    assert "verified" in r.stdout
    res = json.loads(shell_ok("--metadata", uri, "simpletest", "--entries", "5", "--ensemble", "3",
                              "--write-quorum", "3", "--ack-quorum", "2", "--json").stdout)
    assert res["verified"] and res["deleted"]
    assert "ensemble_size >= write_quorum_size" in err(
        "--metadata", uri, "simpletest", "--ensemble", "2", "--write-quorum", "3")

    with bk.BookKeeper(uri) as c:
        lh = c.create_ledger(3, 2, 2, password=b"pw", custom_metadata={"app": b"test"})
        payloads = [b"hello %d" % i for i in range(10)]
        lh.add_entries(payloads)
        lh.close()
    lid2 = lh.ledger_id

    listed = sorted(before + [lid, lid2])
    r = shell_ok("--metadata", uri, "listledgers")
    assert r.stdout.split() == [str(x) for x in listed]
    assert json.loads(shell_ok("--metadata", uri, "listledgers", "--json").stdout) == listed
    r = shell_ok("--metadata", uri, "listledgers", "--meta")
    assert r.stdout.splitlines()[listed.index(lid2)].startswith(
        f"{lid2}\tCLOSED\tE=3 Qw=2 Qa=2\tlast=9")
    mds = json.loads(shell_ok("--metadata", uri, "listledgers", "--meta", "--json").stdout)
    assert [m["ledgerId"] for m in mds] == listed
    assert all("passwordDigest" not in m and "masterKey" not in m for m in mds)

    md = json.loads(shell_ok("--metadata", uri, "ledgermetadata", str(lid2), "--json").stdout)
    assert md["state"] == "CLOSED" and md["lastEntryId"] == 9 and md["customMetadata"] == \
        {"app": "test"} and len(md["ensembles"][0][1]) == 3
    r = shell_ok("--metadata", uri, "ledgermetadata", str(lid2))
    assert "CLOSED" in r.stdout and "custom app = test" in r.stdout

    r = shell_ok("--metadata", uri, "readledger", str(lid2))
    assert r.stdout.splitlines() == [f"{i}\thello {i}" for i in range(10)]
    r = shell_ok("--metadata", uri, "readledger", str(lid2), "--from", "3", "--to", "4", "--json")
    assert [(e["entry_id"], e["data"]) for e in json.loads(r.stdout)] == \
        [(3, "aGVsbG8gMw=="), (4, "aGVsbG8gNA==")]
    r = shell_ok("--metadata", uri, "readledger", str(lid2), "--format", "raw")
    assert r.stdout_bytes == b"".join(payloads)
    r = shell_ok("--metadata", uri, "readledger", str(lid2), "--to", "0", "--format", "hex")
    assert "68 65 6c 6c 6f 20 30" in r.stdout
    assert "past the last entry" in err("--metadata", uri, "readledger", str(lid2), "--to", "10")

    # unknown ledger: every ledger command says so
    for cmd in ("ledgermetadata", "readledger", "deleteledger", "recoverledger", "fenceledger"):
        line = err("--metadata", uri, cmd, "999999")
        assert "999999" in line and "no such ledger" in line, (cmd, line)
    r = shell("--metadata", uri, "ledgermetadata", "abc")
    assert r.exit_code == 2 and "not a ledger id" in r.stderr

    r = shell_ok("--metadata", uri, "deleteledger", str(lid))
    assert f"deleted ledger {lid}" in r.stdout
    assert json.loads(shell_ok("--metadata", uri, "listledgers", "--json").stdout) == \
        sorted(before + [lid2])


def test_fence_and_recover_ledger(shared_cluster):
    uri = shared_cluster.metadata_uri
    with bk.BookKeeper(uri) as c:
        w = c.create_ledger(3, 3, 2, password=b"secret")
        w.add_entries([b"e%d" % i for i in range(50)])
        r = shell_ok("--metadata", uri, "fenceledger", str(w.ledger_id))
        assert f"ledger {w.ledger_id} fenced and closed: last entry 49" in r.stdout
        with pytest.raises(LedgerFencedError):
            w.add_entry(b"after fence")
        md = c.ledger_metadata(w.ledger_id)
        assert md.state == "CLOSED" and md.last_entry_id == 49
        assert md.length == sum(len(b"e%d" % i) for i in range(50))
        rh = c.open_ledger(w.ledger_id, password=b"secret")
        assert [e.data for e in rh.read_entries(49, 49)] == [b"e49"]

        w2 = c.create_ledger(3, 2, 2, password=b"other")
        w2.add_entries([b"x"] * 7)
        res = json.loads(shell_ok("--metadata", uri, "recoverledger", str(w2.ledger_id),
                                  "--json").stdout)
        assert res == {"ledger": w2.ledger_id, "state": "CLOSED", "last_entry_id": 6,
                       "length": 7}
        with pytest.raises(LedgerFencedError):
            w2.add_entry(b"late")
        # recovering a closed ledger changes nothing
        r = shell_ok("--metadata", uri, "recoverledger", str(w2.ledger_id))
        assert "last entry 6" in r.stdout

        # an empty open ledger closes at -1
        w3 = c.create_ledger(2, 2, 2)
        r = shell_ok("--metadata", uri, "recoverledger", str(w3.ledger_id))
        assert "last entry -1" in r.stdout


def test_local_inspection(cluster):
    b = cluster.bookies[0]
    uri = cluster.metadata_uri
    shell_ok("--metadata", uri, "simpletest", "--entries", "30", "--ensemble", "3",
             "--write-quorum", "3", "--ack-quorum", "3", "--keep")
    rows = json.loads(shell_ok("--conf", b.conf_file, "lastmark", "--json").stdout)
    assert [r["shard"] for r in rows] == [0, 1]
    assert all(r["mark"] and ":" in r["mark"] for r in rows)
    r = shell_ok("--conf", b.conf_file, "lastmark")
    assert r.stdout.startswith("shard 0\t")

    adds = []
    for shard in (0, 1):
        r = shell_ok("--conf", b.conf_file, "readjournal", "--shard", str(shard), "--json")
        recs = [json.loads(line) for line in r.stdout.splitlines()]
        adds += [x for x in recs if x["type"] == "ADD"]
    assert sorted(x["entry"] for x in adds) == list(range(30))
    r = shell_ok("--conf", b.conf_file, "readjournal", "--shard", "0", "--limit", "2")
    assert len(r.stdout.splitlines()) <= 2
    # reading the journal changed nothing: the bookie still serves
    shell_ok("--metadata", uri, "bookiesanity", b.bookie_id)

    assert "--conf" in err("--metadata", uri, "lastmark")
    assert "--conf" in err("--metadata", uri, "readjournal")
    assert "2 shards" in err("--conf", b.conf_file, "readjournal", "--shard", "5")
    assert "mark" in err("--conf", b.conf_file, "readjournal", "--from", "nonsense")
    missing = str(b.dir) + "/nope.conf"
    assert "nope.conf" in err("--conf", missing, "lastmark")


def test_bench_commands(shared_cluster):
    uri = shared_cluster.metadata_uri
    bid = shared_cluster.bookies[0].bookie_id
    r = shell_ok("--metadata", uri, "bench", "bookie", bid, "--count", "2000", "--json")
    res = json.loads(r.stdout)
    assert res["adds"] == 2000 and res["adds_per_sec"] > 0
    r = shell_ok("bench", "bookie", bid, "--count", "500")        # host:port needs no metadata
    assert "adds/s" in r.stdout
    r = shell_ok("--metadata", uri, "bench", "writes", "--duration", "1", "--window", "100",
                 "--json")
    res = json.loads(r.stdout)
    assert res["entries"] > 0 and res["errors"] == 0 and res["write_quorum"] == 3
    r = shell_ok("--metadata", uri, "bench", "writes", "--duration", "0.5", "--ensemble", "2",
                 "--write-quorum", "2", "--ack-quorum", "1", "--entry-size", "100")
    assert "entries/s" in r.stdout and "p99" in r.stdout
    line = err("bench", "bookie", f"127.0.0.1:{free_port()}", "--count", "10")
    assert "127.0.0.1" in line
    r = shell("--metadata", uri, "bench", "writes", "--ensemble", "2", "--write-quorum", "3")
    assert r.exit_code == 2
