"""bkshell's and bookie's contract with scripts, through real processes: long walks
count on stderr and never in --json's stdout; every command whose output is data
has --json; the JSON and the text forms of a command exit with the same code and
the same one-line error."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

import pytest

from bk.exitcodes import EXIT_ERROR, EXIT_NOT_RUNNING
from bk.meta.ledger import LedgerMetadata
from bk.meta.racks import set_rack
from bk.testing import bkshell, wait_until

# Three bookies that never run: registered (so placement counts their racks) under
# the test's own prefix. A and B are in different racks, B and C in one.
A, B, C = "10.9.0.1:3181", "10.9.0.2:3181", "10.9.0.3:3181"
LEDGERS = 2100           # past two progress lines (every 1000 ledgers)


def _bad(i: int) -> bool:
    """Ledger i of the walk sits in one rack (every 7th)."""
    return i % 7 == 3


def _error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("bkshell: error: "), stderr
    assert "Traceback" not in stderr
    return lines[-1]


@pytest.fixture(scope="module")
def walked(module_cluster_factory):
    """A cluster of its own (etcd, no bookie process) with LEDGERS ledgers' metadata,
    written straight to etcd (these commands only read metadata), and three
    registered bookies in two racks."""
    cluster = module_cluster_factory(0)
    store = cluster.store
    regs = [store.register_bookie(b, {"address": b.rsplit(":", 1)[0], "port": 3181}, ttl=30)
            for b in (A, B, C)]
    set_rack(store, A, "/r/a")
    set_rack(store, B, "/r/b")
    set_rack(store, C, "/r/b")
    ids = []
    while len(ids) < LEDGERS:
        ids.extend(store.reserve_ledger_ids())
    ids = sorted(ids[:LEDGERS])
    done, errors = [], []
    lock = threading.Lock()

    def cb(err, _version):
        with lock:
            (errors if err else done).append(err)
    for i, lid in enumerate(ids):
        ens = [B, C] if _bad(i) else [A, B]
        store.create_ledger_async(LedgerMetadata(
            ledger_id=lid, ensemble_size=2, write_quorum_size=2, ack_quorum_size=2,
            ensembles=[(0, ens)]), cb)
    wait_until(lambda: len(done) + len(errors) == LEDGERS, 120, "the ledgers created")
    assert errors == []
    try:
        yield cluster.metadata_uri, ids
    finally:
        for r in regs:
            r.close()


def _counts(stderr: str, pattern: str) -> list[int]:
    """The counts of the progress lines (each must match ``pattern``, with the count
    as its group), in order; the last line must say done."""
    lines = stderr.splitlines()
    assert lines and lines[-1].endswith(", done"), stderr
    counts = []
    for line in lines[:-1]:
        m = re.fullmatch(pattern, line)
        assert m, (line, stderr)
        counts.append(int(m.group(1)))
    m = re.fullmatch(pattern, lines[-1][:-len(", done")])
    assert m and int(m.group(1)) == LEDGERS, stderr
    return counts


def test_listledgers_counts_on_stderr_never_in_json(walked):
    uri, ids = walked
    for args in (["listledgers", "--meta", "--json"], ["listledgers", "--json"]):
        r = bkshell(uri, *args)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)              # stdout is one document, nothing else
        got = [x["ledgerId"] if isinstance(x, dict) else x for x in out]
        assert got == ids
        counts = _counts(r.stderr, r"listledgers: (\d+) ledgers read")
        # a line at every thousand (and maybe more, one a second): in order
        assert {1000, 2000} <= set(counts) and counts == sorted(counts), r.stderr
    r = bkshell(uri, "listledgers", "--meta")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [int(x.split("\t", 1)[0]) for x in lines] == ids
    assert lines[3].split("\t")[1:3] == ["OPEN", "E=2 Qw=2 Qa=2"] and f"0:[{B},{C}]" in lines[3]
    counts = _counts(r.stderr, r"listledgers: (\d+) ledgers read")
    assert {1000, 2000} <= set(counts)


def test_placementcheck_counts_and_fails_the_same_with_and_without_json(walked):
    uri, ids = walked
    bad = [lid for i, lid in enumerate(ids) if _bad(i)]
    r = bkshell(uri, "placementcheck", "--json")
    assert r.returncode == EXIT_ERROR, r.stderr
    rows = json.loads(r.stdout)
    assert rows == [{"ledger": lid, "first_entry": 0, "ensemble": [B, C], "racks": 1,
                     "min_racks": 2} for lid in bad]
    line = _error_line(r.stderr)
    assert line == (f"bkshell: error: {len(bad)} fragments of {len(bad)} ledgers span fewer "
                    f"than 2 racks (of {LEDGERS} ledgers checked)")
    progress = r.stderr.strip().splitlines()[:-1]
    pattern = r"placementcheck: (\d+) ledgers checked, (\d+) fragments not adhering"
    seen = {}
    for p in progress[:-1]:
        m = re.fullmatch(pattern, p)
        assert m, (p, r.stderr)
        seen[int(m.group(1))] = int(m.group(2))
    # what was found so far, exactly, at each thousand
    assert seen[1000] == sum(map(_bad, range(1000)))
    assert seen[2000] == sum(map(_bad, range(2000)))
    assert progress[-1] == (f"placementcheck: {LEDGERS} ledgers checked, {len(bad)} "
                            f"fragments not adhering, done")
    text = bkshell(uri, "placementcheck")
    assert text.returncode == EXIT_ERROR and _error_line(text.stderr) == line
    assert text.stdout.splitlines()[0] == (f"ledger {bad[0]} from entry 0: {B} {C} spans 1 "
                                           f"of 2 racks")
    assert len(text.stdout.splitlines()) == len(bad)
    # one rack is enough: nothing to report, exit 0 in both forms
    ok = bkshell(uri, "placementcheck", "--min-racks", "1", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout) == [], ok.stderr
    ok = bkshell(uri, "placementcheck", "--min-racks", "1")
    assert ok.returncode == 0 and ok.stdout == ""
    assert ok.stderr.strip().splitlines()[-1] == \
        f"every fragment of {LEDGERS} ledgers adheres to the placement policy"


def test_whoisauditor_exits_1_in_both_forms_when_none_is_elected(walked):
    uri, _ = walked           # no process runs auto-recovery on this prefix
    j = bkshell(uri, "whoisauditor", "--json")
    t = bkshell(uri, "whoisauditor")
    assert j.returncode == t.returncode == EXIT_ERROR
    assert json.loads(j.stdout) == {"auditor": None, "epoch": None}
    assert t.stdout == ""
    assert _error_line(j.stderr) == _error_line(t.stderr) == \
        "bkshell: error: no auditor is elected (is auto-recovery running anywhere?)"


def test_data_commands_have_json(shared_cluster, tmp_path):
    uri = shared_cluster.metadata_uri
    b0 = shared_cluster.bookies[0].bookie_id
    with shared_cluster.client() as c:
        h = c.create_ledger(3, 2, 2, password=b"pw")
        h.add_entries([b"abc", b"de"])
        h.close()
    lid = h.ledger_id
    r = bkshell(uri, "deleteledger", str(lid), "--json")     # no terminal: not asked
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"ledger": lid, "deleted": True, "state": "CLOSED",
                                    "last_entry_id": 1, "length": 5}
    # deleted: the second time fails, in both forms alike
    j = bkshell(uri, "deleteledger", str(lid), "--json")
    t = bkshell(uri, "deleteledger", str(lid))
    assert j.returncode == t.returncode == EXIT_ERROR and j.stdout == t.stdout == ""
    assert _error_line(j.stderr) == _error_line(t.stderr)
    assert "no such ledger" in _error_line(j.stderr)
    # ledger ids are decimal: a hex id is a usage error (2), not a lookup of another id
    r = bkshell(uri, "deleteledger", "0x10", "--json")
    assert r.returncode == 2 and r.stdout == ""
    assert "'0x10' is not a ledger id (a decimal integer)" in r.stderr
    # setrack: the rack stored and whether the bookie is known
    before = json.loads(bkshell(uri, "getrack", b0, "--json").stdout)["rack"]
    r = bkshell(uri, "setrack", b0, "/r/json", "--json")
    try:
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert json.loads(r.stdout) == {"id": b0, "rack": "/r/json", "known": True}
        assert json.loads(bkshell(uri, "getrack", b0, "--json").stdout)["rack"] == "/r/json"
    finally:
        bkshell(uri, "setrack", b0, before)
    ghost = "10.99.0.7:3181"
    r = bkshell(uri, "setrack", ghost, "/r/ghost", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == {"id": ghost, "rack": "/r/ghost",
                                                          "known": False}
    assert r.stderr.startswith(f"warning: bookie {ghost} is not registered")
    # a bad rack: exit 2 in both forms
    j = bkshell(uri, "setrack", b0, "no-slash", "--json")
    t = bkshell(uri, "setrack", b0, "no-slash")
    assert j.returncode == t.returncode and j.returncode != 0 and j.stdout == ""
    assert _error_line(j.stderr) == _error_line(t.stderr)
    # metaformat on a prefix of its own
    fresh = uri.rsplit("/", 1)[0] + "/contract-metaformat"
    r = bkshell(fresh, "metaformat", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["uri"] == fresh and out["wiped"] is False and len(out["instanceId"]) >= 8
    r = bkshell(fresh, "metaformat", "--force", "--yes", "--json")
    again = json.loads(r.stdout)
    assert again["wiped"] is True and again["instanceId"] != out["instanceId"]
    # refused without --force (keys exist): the same exit and line in both forms
    j = bkshell(fresh, "metaformat", "--json")
    t = bkshell(fresh, "metaformat")
    assert j.returncode == t.returncode == EXIT_ERROR and j.stdout == t.stdout == ""
    assert _error_line(j.stderr) == _error_line(t.stderr)


def _bookie(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("BK_")}
    return subprocess.run([sys.executable, "-m", "bk.cli.bookie", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_bookie_status_json(shared_cluster, tmp_path):
    b = shared_cluster.bookies[0]
    r = _bookie("status", "--conf", b.conf_file, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["id"] == b.bookie_id and out["running"] is True and out["pid"] == b.pid
    assert os.path.exists(out["pidFile"])
    text = _bookie("status", "--conf", b.conf_file)
    assert text.returncode == 0 and text.stdout == f"bookie {b.bookie_id} is running " \
                                                   f"(pid {b.pid})\n"
    # not running: exit 3 in both forms
    gone = str(tmp_path / "gone.pid")
    r = _bookie("status", "--conf", b.conf_file, "--pid-file", gone, "--json")
    assert r.returncode == EXIT_NOT_RUNNING, r.stderr
    assert json.loads(r.stdout) == {"id": b.bookie_id, "running": False, "pid": None,
                                    "pidFile": gone}
    assert _bookie("status", "--conf", b.conf_file, "--pid-file", gone).returncode == \
        EXIT_NOT_RUNNING
