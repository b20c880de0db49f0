"""Auto-recovery against real etcd and bookies: a lost bookie's ledgers are
re-replicated by the elected auditor and the replication workers."""

from __future__ import annotations

import bk
from bk.meta import underreplication as UR
from bk.testing import bkshell_ok, closed_ledger, shell_json, wait_until

PW = b"ar"
AR = {"autoRecoveryDaemonEnabled": True, "lostBookieRecoveryDelay": 0}


def test_lost_bookie_is_rereplicated_then_a_second_loss_loses_nothing(cluster_factory):
    c = cluster_factory(4, conf_overrides=AR)
    data = {}
    with bk.BookKeeper(c.metadata_uri) as client:
        for i in range(6):
            lh = client.create_ledger(3, 2, 2, password=PW)
            data[lh.ledger_id] = [b"L%d-e%d" % (i, e) for e in range(30)]
            lh.add_entries(data[lh.ledger_id])
            lh.close()
        victim = c.bookies[0]
        affected = [lid for lid in data
                    if any(victim.bookie_id in ens for _, ens in
                           client.ledger_metadata(lid).ensembles)]
        assert affected
        victim.kill()

        def repaired():
            if any(True for _ in UR.list_marked(c.store)):
                return False
            return all(victim.bookie_id not in ens
                       for lid in data for _, ens in client.ledger_metadata(lid).ensembles)
        wait_until(repaired, timeout=90, what="the lost bookie's ledgers re-replicated")
        # Every entry is on every bookie of its write set again.
        for lid in data:
            md = client.ledger_metadata(lid)
            for e in range(30):
                for b in md.write_set(e):
                    assert e in c.entries_on(b, lid), (lid, e, b)
        # A second original bookie dies: the data is still all there.
        second = next(b for b in c.bookies[1:]
                      if any(b.bookie_id in ens for lid in affected
                             for _, ens in client.ledger_metadata(lid).ensembles))
        second.kill()
        for lid, entries in data.items():
            rh = client.open_ledger(lid, password=PW)
            assert [e.data for e in rh.read_entries(0, 29)] == entries


def test_auditor_failover(cluster_factory):
    c = cluster_factory(3, conf_overrides=AR)
    from bk.meta.recipes import Election
    probe = Election(c.store, UR.AUDITOR, "probe")
    wait_until(lambda: probe.leader() is not None, what="an auditor elected")
    first = probe.leader()
    c.bookie(first).kill()
    wait_until(lambda: probe.leader() not in (None, first), timeout=60,
               what="another auditor elected")
    assert probe.leader() in {b.bookie_id for b in c.bookies if b.alive}


def test_delay_back_in_time_then_triggeraudit(cluster_factory):
    c = cluster_factory(4, conf_overrides={**AR, "lostBookieRecoveryDelay": 3600})
    with bk.BookKeeper(c.metadata_uri) as client:
        lids = [closed_ledger(client, [b"x%d" % e for e in range(20)], password=PW)
                for _ in range(4)]
        ensembles = {lid: client.ledger_metadata(lid).ensembles for lid in lids}
        wait_until(lambda: shell_json("--metadata", c.metadata_uri, "whoisauditor",
                                      "--json")["auditor"], what="an auditor elected")
        auditor = bkshell_ok(c.metadata_uri, "whoisauditor", "--json")["auditor"]
        victim = next(b for b in c.bookies if b.bookie_id != auditor and
                      any(b.bookie_id in ens for e in ensembles.values() for _, ens in e))
        assert bkshell_ok(c.metadata_uri, "autorecovery", "--json")["enabled"] is True
        # Gone, then back within the delay: nothing is marked, nothing copied.
        victim.kill()
        wait_until(lambda: victim.bookie_id not in c.store.all_bookies(), what="it gone")
        assert bkshell_ok(c.metadata_uri, "listunderreplicated", "--json") == []
        victim.start()
        assert bkshell_ok(c.metadata_uri, "listunderreplicated", "--json") == []
        assert {lid: client.ledger_metadata(lid).ensembles for lid in lids} == ensembles
        # Gone again; triggeraudit does not wait out the delay.
        victim.kill()
        wait_until(lambda: victim.bookie_id not in c.store.all_bookies(), what="it gone")
        out = bkshell_ok(c.metadata_uri, "triggeraudit", "--json")
        assert out["triggered"] is True and out["auditor"] == auditor and out["trigger"] >= 1
        wait_until(lambda: all(victim.bookie_id not in ens for lid in lids
                               for _, ens in client.ledger_metadata(lid).ensembles)
                   and not bkshell_ok(c.metadata_uri, "listunderreplicated", "--json"),
                   timeout=90, what="re-replication after triggeraudit")
        assert bkshell_ok(c.metadata_uri, "lostbookierecoverydelay", "--set", "0",
                      "--json") == {"lostBookieRecoveryDelay": 0}
        for lid in lids:
            rh = client.open_ledger(lid, password=PW)
            assert [e.data for e in rh.read_entries(0, 19)] == [b"x%d" % e for e in range(20)]


def test_ledger_without_a_surviving_replica_is_reported_not_retried(cluster_factory):
    import time
    c = cluster_factory(3, conf_overrides=AR)
    with bk.BookKeeper(c.metadata_uri) as client:
        lh = client.create_ledger(1, 1, 1, password=PW)        # one copy only
        lh.add_entries([b"only-copy"] * 5)
        lh.close()
        holder = c.bookie(client.ledger_metadata(lh.ledger_id).ensembles[0][1][0])
        holder.kill()

        def reported():
            rows = shell_json("--metadata", c.metadata_uri, "listunderreplicated", "--json")
            return rows and rows[0].get("error")
        wait_until(reported, timeout=60, what="the failure reported")
        row = bkshell_ok(c.metadata_uri, "listunderreplicated", "--json")[0]
        assert row["ledger_id"] == lh.ledger_id and row["missing"] == [holder.bookie_id]
        assert "no reachable replica" in row["error"]
        assert row["retryAt"] > time.time() + 60            # backed off, not a tight loop


def test_the_auditor_serves_the_under_replicated_count(cluster_factory):
    import urllib.request
    c = cluster_factory(2, conf_overrides={**AR, "httpServerEnabled": True,
                                           "httpServerPort": 0})
    from bk.meta.recipes import Election
    probe = Election(c.store, UR.AUDITOR, "probe")
    wait_until(lambda: probe.leader() is not None, what="an auditor elected")
    UR.mark(c.store, 12345, ["127.0.0.1:1"])           # a deleted ledger: it is unmarked
    auditor = c.bookie(probe.leader())
    port = c.store.bookie_info(auditor.bookie_id)["httpPort"]

    def gauge(name="auditor_NUM_UNDER_REPLICATED_LEDGERS", bookie=auditor, port=port):
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        for line in text.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    wait_until(lambda: gauge() is not None, what="the gauge served by the auditor")
    wait_until(lambda: not list(UR.list_marked(c.store)), what="the deleted ledger unmarked")
    wait_until(lambda: gauge() == 0, timeout=30, what="the gauge back to 0")
    assert gauge("auditor_ELECTED") == 1
    assert gauge("auditor_UNDER_REPLICATED_OLDEST_AGE_SECONDS") == 0
    other = next(b for b in c.bookies if b is not auditor)
    other_port = c.store.bookie_info(other.bookie_id)["httpPort"]
    assert gauge("auditor_ELECTED", port=other_port) == 0
    assert gauge("auditor_NUM_UNDER_REPLICATED_LEDGERS", port=other_port) is None
    assert gauge("replication_REREPLICATED_BYTES_total", port=other_port) == 0
