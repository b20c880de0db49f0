"""Metrics and the HTTP endpoint of real bookies (bk.metrics, bk.bookie.http)."""
import json
import os
import re
import signal
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bk import protocol as P
from bk.errors import EBADREQ, EOK, EREADONLY
from bk.testing import BookieConnection, bookie_localcluster, http_get, sigstop, wait_until

KEY = b"k" * 20
HTTP = {"httpServerEnabled": "true", "httpServerPort": 0}
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def http_port(c, b):
    return c.store.bookie_info(b.bookie_id)["httpPort"]


def scrape(port) -> dict:
    """{(sample name, sorted labels): value} of one /metrics scrape."""
    status, text, ctype = http_get(port, "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}


def served_names(port) -> set:
    """Every sample name /metrics serves or declares (a labelled family without
    series yet has no samples, only its HELP and TYPE)."""
    text = http_get(port, "/metrics")[1]
    names = set()
    for fam in text_string_to_metric_families(text):
        names.update(s.name for s in fam.samples)
        names.update(fam.name + sfx for sfx in SUFFIXES.get(fam.type, ("",)))
    return names


def val(m, name, **labels):
    return m.get((name, tuple(sorted(labels.items()))), 0)


def add(c, lid, eid, data=b"x", lac=-1):
    return c.call(P.add(c.next_rid(), lid, eid, lac, KEY, b"d%d" % eid, data))


def read(c, lid, eid):
    return c.call(P.read(c.next_rid(), lid, eid))


def ledgers_per_shard(num_shards):
    """One ledger id owned by each shard."""
    out = {}
    lid = 1
    while len(out) < num_shards:
        out.setdefault(P.shard_of(lid, num_shards), lid)
        lid += 1
    return out


@pytest.fixture(scope="module")
def http_bookie(module_cluster_factory):
    """One bookie serving HTTP, shared by the tests that only add to it and read it:
    each uses its own ledgers and asserts on how far the counters moved."""
    return module_cluster_factory(1, conf_overrides=HTTP)


ADD_OK = ("bookkeeper_server_ADD_ENTRY_REQUEST_count", {"success": "true"})
READ_OK = ("bookkeeper_server_READ_ENTRY_REQUEST_count", {"success": "true"})


def test_counts_are_exact_summed_over_shards_and_survive_a_worker_kill(cluster_factory):
    c = cluster_factory(1, conf_overrides=HTTP)
    b = c.bookies[0]
    port = http_port(c, b)
    lids = ledgers_per_shard(b.num_shards)
    adds = {0: 7, 1: 12}
    reads = {0: 3, 1: 5}
    for shard, lid in lids.items():
        with BookieConnection(b.bookie_id, shard=shard) as conn:
            for eid in range(adds[shard]):
                assert add(conn, lid, eid, b"e%d" % eid, lac=eid - 1)[2] == EOK
            for eid in range(reads[shard]):
                assert read(conn, lid, eid)[7] == b"e%d" % eid
            assert read(conn, lid, 999)[2] != EOK           # one failed read per shard
    # A misrouted add is refused by the storage with EBADREQ: counted as an error.
    with BookieConnection(b.bookie_id, shard=1 - P.shard_of(lids[0], 2)) as conn:
        assert add(conn, lids[0], 50)[2] == EBADREQ
    total_adds, total_reads = sum(adds.values()), sum(reads.values())

    def settled():
        m = scrape(port)
        return (val(m, ADD_OK[0], **ADD_OK[1]) == total_adds
                and val(m, READ_OK[0], **READ_OK[1]) == total_reads
                and val(m, "bookkeeper_server_ADD_ENTRY_ERRORS_total", status="EBADREQ") == 1)
    wait_until(settled, what="every shard's adds and reads in /metrics")
    m = scrape(port)
    assert val(m, "bookkeeper_server_READ_ENTRY_REQUEST_count", success="false") == 2
    assert val(m, "bookkeeper_server_READ_ENTRY_ERRORS_total", status="ENOENTRY") == 2
    assert val(m, "bookkeeper_server_ADD_ENTRY_REQUEST_count", success="false") == 1
    assert val(m, "bookkeeper_server_ADD_ENTRY_REQUEST_bucket", success="true",
               le="+Inf") == total_adds
    assert val(m, "bookkeeper_server_ADD_ENTRY_REQUEST_sum", success="true") > 0
    assert val(m, "bookie_journal_JOURNAL_SYNC_count") >= 1
    assert val(m, "bookie_journal_JOURNAL_FORCE_WRITE_BATCH_ENTRIES_sum") == total_adds + 1
    assert val(m, "bookie_journal_JOURNAL_WRITE_BYTES_total") > 19 * 2
    assert val(m, "bookie_ledgers_count") == 2
    assert val(m, "bookie_entries_count") == total_adds
    assert val(m, "bookie_SERVER_STATUS") == 1
    assert 0 < val(m, "bookie_disk_usage_ratio") < 1
    assert val(m, "bookie_connections_accepted_total") == 3
    assert val(m, "bookie_worker_restarts_total", shard="0") == 0
    # A later heartbeat does not count the same work again.
    with BookieConnection(b.bookie_id, shard=0) as conn:
        assert read(conn, lids[0], 0)[2] == EOK
    wait_until(lambda: val(scrape(port), *READ_OK[:1], **READ_OK[1]) == total_reads + 1,
               what="one more read")
    assert val(scrape(port), ADD_OK[0], **ADD_OK[1]) == total_adds

    # SIGKILL shard 1's worker: its counts are carried, the restart is visible.
    with BookieConnection(b.bookie_id, shard=1) as conn:
        pid = conn.call(P.get_bookie_info(conn.next_rid()))[3]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: val(scrape(port), "bookie_worker_restarts_total", shard="1") == 1,
               what="restart counted")
    wait_until(lambda: val(scrape(port), "bookie_shard_up", shard="1") == 1,
               what="shard 1 up again")
    m = scrape(port)
    assert val(m, ADD_OK[0], **ADD_OK[1]) == total_adds          # neither reset nor doubled
    assert val(m, READ_OK[0], **READ_OK[1]) == total_reads + 1
    assert val(m, "bookie_entries_count") == total_adds          # gauges: the new worker's
    # The restarted worker counts on top of its predecessor's totals.
    with BookieConnection(b.bookie_id, shard=1) as conn:
        assert add(conn, lids[1], adds[1], b"after", lac=adds[1] - 1)[2] == EOK
    wait_until(lambda: val(scrape(port), ADD_OK[0], **ADD_OK[1]) == total_adds + 1,
               what="add after restart")
    m = scrape(port)
    assert val(m, READ_OK[0], **READ_OK[1]) == total_reads + 1
    assert val(m, "bookie_worker_restarts_total", shard="0") == 0


def test_http_endpoints_state_and_errors(cluster_factory, small_fs):
    c = cluster_factory(0)
    b = c.add_bookie(journalDirectories=str(small_fs / "journal"),
                     ledgerDirectories=str(small_fs / "ledgers"), journalPreAllocSizeMB=4,
                     nettyMaxFrameSizeBytes=2 << 20, diskUsageThreshold=0.6,
                     diskUsageLwmThreshold=0.5, diskCheckInterval=200, **HTTP)
    port = http_port(c, b)
    assert port > 0
    assert http_get(port, "/heartbeat")[:2] == (200, "OK")
    status, body, ctype = http_get(port, "/api/v1/bookie/info")
    info = json.loads(body)
    assert status == 200 and ctype == "application/json"
    assert info["bookieId"] == b.bookie_id and info["httpPort"] == port
    assert info["numShards"] == 2 and [s["ready"] for s in info["shards"]] == [True, True]
    state = json.loads(http_get(port, "/api/v1/bookie/state")[1])
    assert state["readOnly"] is False and state["state"] == "writable" and state["running"]
    status, body, _ = http_get(port, "/api/v1/autorecovery/status")
    assert status == 200 and json.loads(body)["running"] is False
    assert http_get(port, "/nope")[0] == 404
    assert http_get(port, "/metrics/extra")[0] == 404
    assert http_get(port, "/heartbeat", method="POST")[0] == 405
    assert http_get(port, "/metrics", method="DELETE")[0] == 405
    # `bkshell listbookies` shows the HTTP port.
    from bk.admin import Admin
    with Admin(c.metadata_uri) as a:
        rows = a.list_bookies(all=True)
    assert rows[0]["httpPort"] == port

    with BookieConnection(b.bookie_id, shard=0) as w:
        filler = small_fs / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * (44 << 20))
        wait_until(lambda: json.loads(http_get(port, "/api/v1/bookie/state")[1])["readOnly"],
                   what="state endpoint says read-only")
        assert http_get(port, "/heartbeat")[0] == 200           # still serving
        wait_until(lambda: val(scrape(port), "bookie_SERVER_STATUS") == 0, what="status 0")
        wait_until(lambda: add(w, 0, 0)[2] == EREADONLY, what="EREADONLY")
        wait_until(lambda: val(scrape(port), "bookkeeper_server_ADD_ENTRY_ERRORS_total",
                               status="EREADONLY") >= 1, what="read-only refusal counted")
        os.unlink(filler)
        wait_until(lambda: json.loads(http_get(port, "/api/v1/bookie/state")[1])["state"]
                   == "writable", what="writable again")


def test_dashboard_queries_only_metrics_a_bookie_serves(http_bookie):
    with open(os.path.join(ROOT, "conf", "grafana", "bk.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs
    names = set()
    for e in exprs:
        names.update(n for n in re.findall(r"\b(?:bookie|bookkeeper_server)_[A-Za-z0-9_]+", e))
    assert names
    c = http_bookie
    served = served_names(http_port(c, c.bookies[0]))
    missing = sorted(n for n in names if n not in served)
    assert not missing, f"the dashboard queries metrics no bookie serves: {missing}"
    with open(os.path.join(ROOT, "conf", "prometheus", "alerts.yml")) as f:
        exprs = [line.split("expr:", 1)[1] for line in f if line.strip().startswith("expr:")]
    assert len(exprs) >= 4
    for n in re.findall(r"\b(?:bookie|bookkeeper_server)_[A-Za-z0-9_]+", " ".join(exprs)):
        assert n in served, n


def test_statistics_off_counts_nothing(cluster_factory):
    c = cluster_factory(1, conf_overrides=dict(HTTP, enableStatistics="false"))
    b = c.bookies[0]
    port = http_port(c, b)
    with BookieConnection(b.bookie_id, shard=P.shard_of(1, 2)) as conn:
        for eid in range(5):
            assert add(conn, 1, eid, lac=eid - 1)[2] == EOK
    assert http_get(port, "/heartbeat")[0] == 200
    m = scrape(port)
    assert val(m, ADD_OK[0], **ADD_OK[1]) == 0
    assert val(m, "bookie_SERVER_STATUS") == 1


def test_client_metrics_count_adds_and_reads(cluster_factory):
    from bk import BookKeeper
    from bk.exposition import client_registry

    c = cluster_factory(3)
    reg = client_registry()

    def v(name, **labels):
        return reg.get_sample_value(name, labels) or 0
    before_add = v("bookkeeper_client_ADD_ENTRY_count", success="true")
    before_read = v("bookkeeper_client_READ_ENTRY_count", success="true")
    with BookKeeper(c.metadata_uri) as bk:
        assert bk.metrics_registry is reg
        lh = bk.create_ledger(3, 2, 2, password=b"p")
        for i in range(10):
            lh.add_entry(b"entry-%d" % i)
        lh.close()
        rh = bk.open_ledger(lh.ledger_id, password=b"p")
        if True:
            assert [e.data for e in rh.read_entries(0, 9)] == [b"entry-%d" % i
                                                              for i in range(10)]
    assert v("bookkeeper_client_ADD_ENTRY_count", success="true") - before_add == 10
    assert v("bookkeeper_client_ADD_ENTRY_sum", success="true") > 0
    assert v("bookkeeper_client_READ_ENTRY_count", success="true") - before_read >= 1


def test_localcluster_serves_and_prints_one_metrics_url_per_bookie(tmp_path):
    with bookie_localcluster(str(tmp_path / "lc")) as (p, out):
        urls = re.findall(r"metrics (http://\S+/metrics)", "".join(out))
        assert len(urls) == 2 and len(set(urls)) == 2, "".join(out)
        for url in urls:
            with urllib.request.urlopen(url, timeout=10) as r:
                assert r.status == 200 and b"bookie_SERVER_STATUS 1.0" in r.read()
        p.send_signal(signal.SIGINT)
        assert p.wait(60) == 0


def test_client_metrics_count_ensemble_changes_bookie_errors_and_recoveries(cluster_factory):
    from bk import BookKeeper
    from bk.exposition import client_registry

    c = cluster_factory(4)
    reg = client_registry()

    def v(name, **labels):
        return reg.get_sample_value(name, labels) or 0
    changes = v("bookkeeper_client_ENSEMBLE_CHANGES_total")
    errors = sum(v("bookkeeper_client_BOOKIE_ERRORS_total", kind=k)
                 for k in ("BookieUnavailableError", "TimeoutError"))
    recovered = v("bookkeeper_client_LEDGER_RECOVER_total", success="true")
    with BookKeeper(c.metadata_uri, addEntryTimeoutSec=2) as bk:
        lh = bk.create_ledger(3, 2, 2, password=b"p")
        for i in range(5):
            lh.add_entry(b"a%d" % i)
        victim = lh.metadata.last_ensemble[0]
        c.bookie(victim).kill(signal.SIGKILL)
        for i in range(5):
            lh.add_entry(b"b%d" % i)
        assert victim not in lh.metadata.last_ensemble
        assert v("bookkeeper_client_ENSEMBLE_CHANGES_total") == changes + 1
        assert sum(v("bookkeeper_client_BOOKIE_ERRORS_total", kind=k)
                   for k in ("BookieUnavailableError", "TimeoutError")) > errors
        # Opening the still-open ledger recovers it: one recovery, counted once.
        rh = bk.open_ledger(lh.ledger_id, password=b"p")
        assert rh.last_add_confirmed == 9
        assert v("bookkeeper_client_LEDGER_RECOVER_total", success="true") == recovered + 1
        bk.open_ledger(lh.ledger_id, password=b"p")      # closed now: nothing to recover
        assert v("bookkeeper_client_LEDGER_RECOVER_total", success="true") == recovered + 1


def test_read_entry_request_counts_entries_and_read_range_counts_requests(http_bookie):
    import bk
    c = http_bookie
    port = http_port(c, c.bookies[0])
    with bk.BookKeeper(c.metadata_uri) as client:
        lh = client.create_ledger(1, 1, 1, password=b"m")
        lh.add_entries([b"r%d" % i for i in range(100)])
        lh.close()
        before = scrape(port)
        rh = client.open_ledger(lh.ledger_id, password=b"m")       # closed: no recovery reads
        assert [e.data for e in rh.read_entries(0, 99)] == [b"r%d" % i for i in range(100)]

    def moved(m, name):
        return val(m, name, success="true") - val(before, name, success="true")
    wait_until(lambda: moved(scrape(port), READ_OK[0]) == 100, what="100 entry reads counted")
    m = scrape(port)
    requests = moved(m, "bookkeeper_server_READ_RANGE_REQUEST_count")
    # one READ_RANGE: 100 entries of a few bytes (the closed ledger's metadata
    # gives their size) fit one request's 256 KiB
    assert requests == 1
    assert moved(m, "bookkeeper_server_READ_ENTRY_REQUEST_count") == 100
    assert val(m, "bookkeeper_server_READ_RANGE_REQUEST_count", success="false") == \
        val(before, "bookkeeper_server_READ_RANGE_REQUEST_count", success="false")


def test_a_fresh_reader_sizes_its_read_ranges_by_the_entries(http_bookie):
    """A new handle reads 1 KiB entries in requests of 256 KiB: from the closed
    ledger's metadata (length / entries), or, for an open ledger, after a first
    window of 16 entries. A 64 KiB guess made requests of 40 entries (25 for
    these 1,000), each with its own cost on both sides. The same requests
    whether the bookie answers from its write cache or, once flushed, from its
    entry logs: the byte budget of an answer is of payload on both paths (the
    entry logs' counted the digests as well, cut every answer one entry short
    and made 7 and 11 requests where the write cache made 4 and 8)."""
    import bk
    c = http_bookie
    b = c.bookies[0]
    blob = bytes(range(256)) * 4
    with bk.BookKeeper(c.metadata_uri) as client:
        open_lh = client.create_ledger(1, 1, 1, password=b"m")
        open_lh.add_entries([blob] * 1000)
        open_lh.add_entry(blob)          # carries LAC 999 (the batch's adds lag it)
        lh = client.create_ledger(1, 1, 1, password=b"m")
        lh.add_entries([blob] * 1000)
        lh.close()
        # closed: ceil(1000 / 256) requests of 256 entries. Open: its size is
        # unknown until read, so a first window of 16 entries is asked in
        # requests sized by a 64 KiB guess (4 of 4 entries), then the other
        # 984 in ceil(984 / 256).
        want = {lh.ledger_id: 4, open_lh.ledger_id: 4 + 4}
        for where in ("write cache", "entry logs"):
            if where == "entry logs":
                b.restart()                  # a clean stop flushes the write cache
            port = http_port(c, b)
            for lid in (lh.ledger_id, open_lh.ledger_id):
                before = scrape(port)
                rh = client.open_ledger_no_recovery(lid, password=b"m")
                got = rh.read_entries(0, 999)
                assert [e.entry_id for e in got] == list(range(1000))
                assert all(e.data == blob for e in got)

                def moved(m, name):
                    return val(m, name, success="true") - val(before, name, success="true")
                wait_until(lambda: moved(scrape(port), READ_OK[0]) == 1000,
                           what="1000 entry reads counted")
                requests = moved(scrape(port), "bookkeeper_server_READ_RANGE_REQUEST_count")
                assert requests == want[lid], (where, lid, requests)
        open_lh.close()


def test_autorecovery_status_reports_what_the_metadata_store_holds(cluster_factory):
    c = cluster_factory(1, conf_overrides=HTTP)
    port = http_port(c, c.bookies[0])
    st = json.loads(http_get(port, "/api/v1/autorecovery/status")[1])
    assert st["running"] is False and "no auditor" in st["message"] and not st["here"]
    # `bkshell listbookies` prints where the HTTP endpoint is.
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "bk.cli.shell", "--metadata", c.metadata_uri,
                        "listbookies"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith(f"writable\thttp://127.0.0.1:{port}"), r.stdout
    from bk.meta import underreplication as UR
    from bk.meta.recipes import Election
    auditor = Election(c.store, UR.AUDITOR, "autorecovery-elsewhere-1")
    assert auditor.campaign(timeout=10)
    UR.mark(c.store, 7, ["127.0.0.1:9999"])
    st = json.loads(http_get(port, "/api/v1/autorecovery/status")[1])
    assert st == {"running": True, "enabled": True, "auditor": "autorecovery-elsewhere-1",
                  "underReplicatedLedgers": 1, "checks": {}, "here": False}
    UR.record_check(c.store, "replicas", {"at": 1.0, "ledgers": 3, "marked": 0})
    st = json.loads(http_get(port, "/api/v1/autorecovery/status")[1])
    assert st["checks"] == {"replicas": {"at": 1.0, "ledgers": 3, "marked": 0}}
    UR.update_settings(c.store, enabled=False)      # bkshell autorecovery --disable
    assert json.loads(http_get(port, "/api/v1/autorecovery/status")[1])["enabled"] is False
    auditor.resign()


def test_http_answers_while_every_shard_is_stopped_and_a_taken_port_fails_the_boot(
        cluster_factory):
    c = cluster_factory(1, conf_overrides=HTTP)
    b = c.bookies[0]
    port = http_port(c, b)
    pids = b.worker_pids()
    assert len(pids) == 2
    sigstop(*pids)
    try:       # served by the arbiter's thread: a stuck shard loop does not block it
        assert http_get(port, "/heartbeat")[0] == 200
        assert val(scrape(port), "bookie_SERVER_STATUS") == 1
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    with pytest.raises(Exception, match="cannot bind httpServerPort"):
        c.add_bookie(httpServerPort=port)
    assert c.bookies[-1].last_exit == 6
