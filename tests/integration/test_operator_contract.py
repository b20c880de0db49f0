"""Promises of API.md's "Commands", "Observability", "Hosts" and "Metadata at scale"
that no other test held, through real processes: the metrics that GC, etcd's
compactor and the auditor's placement check move; ``bookie stop`` of a bookie
started in the foreground; ``--daemon`` detaching; ``bindAddress``;
``bookie localcluster``'s first line and its HTTP ports in ``listbookies``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

from bk.testing import (TEST_DEFAULTS, BookieProcess, bookie_localcluster, bkshell_ok,
                        http_get, shell_json, shell_ok, wait_until)
from bk.util import free_port

HTTP = {"httpServerEnabled": "true", "httpServerPort": 0}


def scrape(port) -> dict:
    """{sample name (labels dropped): value} of one /metrics scrape; families
    that are not served are absent."""
    status, text, _ = http_get(port, "/metrics")
    assert status == 200, text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


def _http_port(c, bookie_id):
    return c.store.bookie_info(bookie_id)["httpPort"]


def test_gc_compactor_and_placement_metrics_move(cluster_factory):
    c = cluster_factory(3, num_shards=1, conf_overrides={
        **HTTP, "gcWaitTime": 300, "metadataCompactionIntervalSeconds": 1, "flushInterval": 300,
        "autoRecoveryDaemonEnabled": "true", "auditorPeriodicPlacementPolicyCheckInterval": 1,
        "ensemblePlacementPolicy": "rackaware"})
    uri = c.metadata_uri
    ids = [b.bookie_id for b in c.bookies]
    ports = {b: _http_port(c, b) for b in ids}
    for i, b in enumerate(ids):
        shell_ok("--metadata", uri, "setrack", b, f"/r/{'abc'[i]}")
    with c.client(ensemblePlacementPolicy="rackaware") as client:
        gone = client.create_ledger(3, 3, 2)
        gone.add_entries([b"a", b"b", b"c"])
        gone.close()
        kept = client.create_ledger(3, 2, 2)
        kept.add_entry(b"x")
        kept.close()
        # GC: each bookie held the deleted ledger once (one shard): exactly one drop
        before = {b: scrape(p) for b, p in ports.items()}
        assert all(m["bookie_DELETED_LEDGER_COUNT_total"] == 0 for m in before.values())
        client.delete_ledger(gone.ledger_id)
    for b, p in ports.items():
        wait_until(lambda: scrape(p)["bookie_DELETED_LEDGER_COUNT_total"] == 1, 60,
                   f"{b} counting the deleted ledger")
        m = scrape(p)
        assert m["bookie_GC_RUNS_total"] >= 1
        assert m["bookie_disk_free_bytes"] > 0 and 0 < m["bookie_disk_usage_ratio"] < 1
        assert m["bookie_journal_bytes"] > 0
        assert "bookie_journal_JOURNAL_QUEUE_SIZE" in m
        # flushes (checkpoints of the index) every flushInterval while entries wait
        wait_until(lambda: scrape(p)["bookie_CHECKPOINTS_total"] >= 1, 30,
                   f"{b} counting a checkpoint")
    # etcd's compactor: one bookie is elected, compacts, and only it exports the
    # compaction count and etcd's db size
    def compactor():
        return shell_json("--metadata", uri, "metastatus", "--json")["compactor"]
    wait_until(lambda: compactor() in ids, 30, "a compactor elected")
    leader = compactor()
    wait_until(lambda: scrape(ports[leader]).get("bookkeeper_metadata_COMPACTIONS_total", 0)
               >= 1, 60, "a compaction counted")
    m = scrape(ports[leader])
    assert m["bookkeeper_metadata_DB_SIZE_BYTES"] > 0
    assert 0 < m["bookkeeper_metadata_DB_SIZE_IN_USE_BYTES"] <= m["bookkeeper_metadata_DB_SIZE_BYTES"]
    exporting = {b for b in ids if "bookkeeper_metadata_DB_SIZE_BYTES" in scrape(ports[b])}
    last = shell_json("--metadata", uri, "metastatus", "--json")["lastCompaction"]
    if compactor() == leader:       # (a lease lost under load would move it: rare)
        assert exporting == {leader} and last["by"] == leader
    # the auditor's placement check: 0, then 1 once two bookies of the kept ledger's
    # ensemble share a rack (E3 Qw2: one write quorum sits in that rack)
    wait_until(lambda: shell_ok("--metadata", uri, "whoisauditor").stdout.strip() in ids, 30,
               "an auditor elected")
    auditor = shell_ok("--metadata", uri, "whoisauditor").stdout.strip()
    name = "auditor_NUM_LEDGERS_NOT_ADHERING_TO_PLACEMENT_POLICY"
    wait_until(lambda: scrape(ports[auditor]).get(name) == 0, 30, "a clean placement check")
    ens = kept.metadata.last_ensemble
    for b in ens[:2]:
        shell_ok("--metadata", uri, "setrack", b, "/r/z")
    wait_until(lambda: scrape(ports[auditor]).get(name) == 1, 30,
               "the auditor counting the ledger in one rack")
    for b in ids:
        if b != auditor:               # only the auditor exports it
            assert name not in scrape(ports[b])


def _bookie(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("BK_")}
    return subprocess.run([sys.executable, "-m", "bk.cli.bookie", *args], capture_output=True,
                          text=True, timeout=90, env=env)


def _connects(host, port) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


def test_bookie_stop_daemon_and_bind_address(cluster_factory, tmp_path):
    c = cluster_factory(1, num_shards=1, conf_overrides=HTTP)
    b = c.bookies[0]
    port, hport = b.port, _http_port(c, b.bookie_id)
    # bindAddress defaults to advertisedAddress (127.0.0.1): not on 127.0.0.2
    assert _connects("127.0.0.1", port) and not _connects("127.0.0.2", port)
    assert not _connects("127.0.0.2", hport)
    # `bookie stop` through the pid file, for a bookie started in the foreground
    pid = b.pid
    r = _bookie("stop", "--conf", b.conf_file)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"bookie stopped (pid {pid})\n"
    assert b.proc.wait(60) == 0
    wait_until(lambda: b.bookie_id not in c.store.list_bookies(), what="deregistration")
    assert _bookie("stop", "--conf", b.conf_file).stdout.startswith("bookie not running")
    # `bookie format`: refuses without --force when it cannot ask (no terminal), then
    # wipes the directories and the cookie; the next start formats anew
    assert c.store.read_cookie(b.bookie_id)[0] is not None
    r = _bookie("format", "--conf", b.conf_file)
    assert r.returncode == 1 and r.stderr.endswith("; pass --force to confirm\n"), r.stderr
    assert c.store.read_cookie(b.bookie_id)[0] is not None
    r = _bookie("format", "--conf", b.conf_file, "--force")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == \
        f"removed the cookie of {b.bookie_id} from the metadata store"
    assert c.store.read_cookie(b.bookie_id)[0] is None
    b.start()
    wait_until(lambda: c.store.read_cookie(b.bookie_id)[0] is not None, what="a new cookie")
    with c.client() as client:
        h = client.create_ledger(1, 1, 1)
        h.add_entry(b"after format")
        h.close()
        assert [e.data for e in client.open_ledger(h.ledger_id).read_entries(0, 0)] == \
            [b"after format"]
    # --daemon: its own session, no controlling terminal, stdin from /dev/null;
    # bindAddress=0.0.0.0: reachable on every local address, HTTP too
    d = BookieProcess(c.metadata_uri, str(tmp_path / "d"), free_port(), store=c.store,
                      conf_overrides={**TEST_DEFAULTS, **HTTP, "bindAddress": "0.0.0.0"})
    r = _bookie("start", "--conf", d.conf_file, "--daemon")
    assert r.returncode == 0, r.stderr
    try:
        wait_until(lambda: d.bookie_id in c.store.list_bookies(), what="registration")
        status = json.loads(_bookie("status", "--conf", d.conf_file, "--json").stdout)
        dpid = status["pid"]
        # (a session of its own: setsid, then a second fork so that it can never
        # acquire a terminal again)
        assert status["running"] and os.getsid(dpid) != os.getsid(0)
        with open(f"/proc/{dpid}/stat") as f:
            tty_nr = int(f.read().rsplit(")", 1)[1].split()[4])
        assert tty_nr == 0
        assert os.readlink(f"/proc/{dpid}/fd/0") == "/dev/null"
        assert _connects("127.0.0.2", d.port) and _connects("127.0.0.1", d.port)
        # refused while it runs
        r = _bookie("format", "--conf", d.conf_file, "--force")
        assert r.returncode == 1 and f"bookie is running (pid {dpid}); stop it first" in r.stderr
        # --daemon logs to logFile (default: bookie.log in the first ledger directory)
        log = os.path.join(d.dir, "ledgers", "bookie.log")
        assert os.path.getsize(log) > 0, os.listdir(os.path.dirname(log))
        dh = _http_port(c, d.bookie_id)
        # httpServerPort=0: a free port, logged (and registered, so listbookies has it)
        with open(log) as f:
            assert f"HTTP on port {dh} (metrics: http://127.0.0.1:{dh}/metrics)" in f.read()
        assert http_get(dh, "/heartbeat", host="127.0.0.2")[:2] == (200, "OK")
        assert d.bookie_id == f"127.0.0.1:{d.port}"     # still advertised as before
    finally:
        r = _bookie("stop", "--conf", d.conf_file)
    assert r.returncode == 0 and r.stdout.startswith("bookie stopped"), r.stderr
    assert _bookie("status", "--conf", d.conf_file).returncode == 3


def test_localcluster_prints_the_uri_first_and_its_http_ports_are_listed(tmp_path):
    with bookie_localcluster(str(tmp_path / "lc")) as (p, out):
        assert out[0].startswith("metadataServiceUri=etcd://127.0.0.1:"), out
        uri = out[0].strip().split("=", 1)[1]
        printed = sorted(int(line.rsplit(":", 1)[1].split("/")[0]) for line in out
                         if "metrics http://" in line)
        rows = bkshell_ok(uri, "listbookies", "--json")
        assert sorted(r["httpPort"] for r in rows) == printed and len(printed) == 2
        for port in printed:
            assert http_get(port, "/heartbeat")[:2] == (200, "OK")
        # its bookies run auto-recovery: one of them is the auditor, by its bookie id
        wait_until(lambda: shell_json("--metadata", uri, "whoisauditor", "--json")["auditor"]
                   in {r["id"] for r in rows}, 30, "an auditor elected")
        p.send_signal(signal.SIGINT)
        assert p.wait(60) == 0


def test_a_full_disk_with_read_only_mode_disabled_stops_the_bookie(cluster_factory, small_fs):
    """readOnlyModeEnabled=false: past diskUsageThreshold the bookie shuts down (exit
    1, saying why) instead of turning read-only."""
    c = cluster_factory(0)
    b = c.add_bookie(journalDirectories=str(small_fs / "journal"),
                     ledgerDirectories=str(small_fs / "ledgers"), journalPreAllocSizeMB=4,
                     nettyMaxFrameSizeBytes=2 << 20, readOnlyModeEnabled="false",
                     diskUsageThreshold=0.6, diskUsageLwmThreshold=0.5, diskCheckInterval=200)
    assert b.bookie_id in c.store.list_bookies()
    with open(small_fs / "filler", "wb") as f:
        f.write(b"\0" * (44 << 20))        # usage over 60%
    assert b.proc.wait(60) == 1
    assert b.bookie_id not in c.store.list_bookies(readonly=True)
    wait_until(lambda: b.bookie_id not in c.store.list_bookies(), what="deregistration")
    with open(b.log_file) as f:
        assert "reached diskUsageThreshold 60.0% and readOnlyModeEnabled is false: " \
               "shutting down" in f.read()
