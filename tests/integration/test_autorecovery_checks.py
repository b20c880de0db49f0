"""The auditor's periodic checks and a returning bookie's over-replicated GC,
against real etcd and bookie processes."""

from __future__ import annotations

import os
import time


import bk
from bk import protocol as P
from bk.bookie.index import Index
from bk.errors import EFENCED, EOK
from bk.meta import underreplication as UR
from bk.testing import BookieConnection, shell_json, shell_ok, wait_until

PW = b"checks"
AR = {"autoRecoveryDaemonEnabled": True, "lostBookieRecoveryDelay": 3600,
      "auditorPeriodicCheckInterval": 0, "auditorReplicasCheckInterval": 0}


def remove_entry_by_hand(bookie, lid: int, entry: int) -> None:
    """With the bookie stopped (so everything is flushed), unlink ``entry`` of
    ``lid`` from its shard's index (as an operator's slip or a bad disk block
    would): the bookie then has no such entry, although every other one is
    intact."""
    shard = P.shard_of(lid, bookie.num_shards)
    index = Index(os.path.join(bookie.dir, "ledgers", f"shard-{shard}"))
    try:
        run = index.lookup(lid, entry)
        assert run is not None, "the entry is not there to remove"
        i = run.index_of(entry)
        with index.write() as w:
            w.delete_run(run)
            for a, b in ((0, i), (i + 1, run.count)):
                if a < b:
                    w.put_run(run.slice(a, b))
    finally:
        index.close()


def indexed_entries(bookie, lid: int, entries) -> set:
    """Which of ``entries`` of ``lid`` the stopped bookie's index has."""
    shard = P.shard_of(lid, bookie.num_shards)
    index = Index(os.path.join(bookie.dir, "ledgers", f"shard-{shard}"))
    try:
        return {e for e in entries if index.lookup(lid, e) is not None}
    finally:
        index.close()


def _ledger(client, entries=20, e=3, qw=2):
    lh = client.create_ledger(e, qw, qw, password=PW)
    lh.add_entries([b"c%d" % i for i in range(entries)])
    lh.close()
    return lh.ledger_id


def test_replica_check_restores_an_entry_removed_by_hand(cluster_factory):
    # The replicas check runs every second; a bookie stopped for a moment is not
    # lost (lostBookieRecoveryDelay), and unreachable is not "lacks".
    c = cluster_factory(3, conf_overrides={**AR, "auditorReplicasCheckInterval": 1})
    with bk.BookKeeper(c.metadata_uri) as client:
        lid = _ledger(client)
        md = client.ledger_metadata(lid)
        holder = c.bookie(md.write_set(5)[0])
        holder.stop()
        remove_entry_by_hand(holder, lid, 5)
        # checked on disk before the start: once it runs, the check (every second)
        # may copy the entry back before a query could see it missing
        assert indexed_entries(holder, lid, range(20)) == \
            {e for e in range(20) if holder.bookie_id in md.write_set(e)} - {5}
        holder.start()
        wait_until(lambda: 5 in c.entries_on(holder.bookie_id, lid), timeout=60,
                   what="the removed entry copied back by the replicas check")
        wait_until(lambda: not list(UR.list_marked(c.store)), what="the record removed")
        # Repaired in place: the ensembles did not change.
        assert client.ledger_metadata(lid).ensembles == md.ensembles
        for b in md.write_set(5):
            assert 5 in c.entries_on(b, lid)
        # A run that began while the ledger was marked skipped it; a run that began
        # after the repair checks it and finds nothing.
        repaired_at = time.time()
        wait_until(lambda: UR.checks(c.store)["replicas"]["started"] > repaired_at,
                   timeout=30, what="a replicas check that began after the repair")
        last = UR.checks(c.store)["replicas"]
        assert last["ledgers"] >= 1 and last["marked"] == 0
        rh = client.open_ledger(lid, password=PW)
        assert [e.data for e in rh.read_entries(0, 19)] == [b"c%d" % i for i in range(20)]


def test_ledger_check_finds_a_bookie_that_lost_a_fragment_end(cluster_factory):
    c = cluster_factory(3, conf_overrides={**AR, "auditorPeriodicCheckInterval": 1})
    with bk.BookKeeper(c.metadata_uri) as client:
        lid = _ledger(client, entries=10)
        md = client.ledger_metadata(lid)
        # The last entry a bookie holds: what the ledger check reads.
        holder = c.bookie(md.write_set(9)[1])
        holder.stop()
        remove_entry_by_hand(holder, lid, 9)
        holder.start()
        wait_until(lambda: 9 in c.entries_on(holder.bookie_id, lid), timeout=60,
                   what="the lost last entry copied back by the ledger check")
        assert UR.checks(c.store)["ledgers"]["ledgers"] >= 1
        assert client.ledger_metadata(lid).ensembles == md.ensembles


def test_returning_bookie_drops_what_was_rereplicated_but_stays_fenced(cluster_factory):
    conf = {**AR, "lostBookieRecoveryDelay": 0, "gcWaitTime": 500,
            "gcOverreplicatedLedgerWaitTime": 1000}
    c = cluster_factory(4, conf_overrides=conf)
    with bk.BookKeeper(c.metadata_uri) as client:
        lids = [_ledger(client) for _ in range(4)]
        victim = c.bookie(client.ledger_metadata(lids[0]).ensembles[0][1][0])
        held = {lid: c.entries_on(victim.bookie_id, lid) for lid in lids}
        held = {lid: es for lid, es in held.items() if es}
        assert held
        victim.kill()
        wait_until(lambda: all(victim.bookie_id not in ens for lid in lids
                               for _, ens in client.ledger_metadata(lid).ensembles)
                   and not list(UR.list_marked(c.store)), timeout=90,
                   what="the victim's ledgers re-replicated")
        victim.start()
        # Its copies are no longer needed: every bookie of each write set has them.
        wait_until(lambda: all(not c.entries_on(victim.bookie_id, lid) for lid in held),
                   timeout=60, what="the returning bookie's stale copies dropped")
        victim.kill()                 # kill -9 after the drop: it stays dropped and fenced
        victim.start()
        assert all(not c.entries_on(victim.bookie_id, lid) for lid in held)
        shard_of = P.shard_of
        for lid in held:
            md = client.ledger_metadata(lid)
            for e in range(20):
                for b in md.write_set(e):
                    assert e in c.entries_on(b, lid)
            # No tombstone, still fenced: an old writer's add is refused, a recovery
            # add (the bookie picked to hold the ledger again) is taken.
            with BookieConnection(victim.bookie_id,
                                  shard=shard_of(lid, victim.num_shards)) as conn:
                from bk.client import digest as D
                data = b"zombie"
                sig = D.EntryDigest(lid, "crc32c", PW).sign(20, 19, 999, data)
                r = conn.call(P.add(conn.next_rid(), lid, 20, 19, D.master_key(PW), sig, data))
                assert r[2] == EFENCED
                r = conn.call(P.read(conn.next_rid(), lid, 3))
                src = next(b for b in md.write_set(3) if b != victim.bookie_id)
                with BookieConnection(src, shard=shard_of(lid, c.bookie(src).num_shards)) as s:
                    got = s.call(P.read(s.next_rid(), lid, 3))
                assert got[2] == EOK
                r = conn.call(P.add(conn.next_rid(), lid, 3, got[5], D.master_key(PW), got[6],
                                    got[7], True))
                assert r[2] == EOK
                # It serves the copy it took. (Asked on this connection at once: the
                # bookie is in no write set of the ledger, so its over-replicated GC,
                # every second here, may rightly drop the copy again at any time.)
                back = conn.call(P.read(conn.next_rid(), lid, 3))
                assert back[2] == EOK and back[7] == got[7], back
        for lid in lids:
            rh = client.open_ledger(lid, password=PW)
            assert [e.data for e in rh.read_entries(0, 19)] == [b"c%d" % i for i in range(20)]


def _overrep_scans(cluster, bookie_id, lid):
    """The bookie's last over-replicated scan of the shard holding ``lid``."""
    import json
    import urllib.request
    port = cluster.store.bookie_info(bookie_id)["httpPort"]
    info = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/bookie/info",
                                             timeout=5).read())
    shard = P.shard_of(lid, info["numShards"])
    return info["lastOverreplicatedScan"].get(str(shard))


def test_no_drop_until_the_new_write_sets_hold_every_entry(cluster_factory):
    """A bookie replaced in a ledger keeps its copy as long as the replacement
    lacks entries (the new ensemble not fully written), and drops it after."""
    conf = {**AR, "autoRecoveryDaemonEnabled": False, "gcWaitTime": 300,
            "gcOverreplicatedLedgerWaitTime": 300, "httpServerEnabled": True,
            "httpServerPort": 0}
    c = cluster_factory(4, conf_overrides=conf)
    with bk.BookKeeper(c.metadata_uri) as client:
        lid = _ledger(client)
        md, version = c.store.read_ledger(lid)
        victim = md.ensembles[0][1][0]
        spare = next(b.bookie_id for b in c.bookies if b.bookie_id not in md.ensembles[0][1])
        before = c.entries_on(victim, lid)
        assert before
        # Replace the victim by a bookie that holds nothing: metadata only.
        ens = [spare if b == victim else b for b in md.ensembles[0][1]]
        c.store.write_ledger(md.replace(ensembles=[(0, ens)]), version)
        t0 = __import__("time").time()
        # Scans that saw the ledger as a candidate and kept it, twice over.
        seen = []

        def scanned_and_kept():
            s = _overrep_scans(c, victim, lid)
            if s and s["at"] > t0 and s.get("candidates") and s not in seen:
                assert s["claimed"] == 0, s
                seen.append(s)
            return len(seen) >= 2
        wait_until(scanned_and_kept, timeout=30, what="two over-replicated scans")
        assert c.entries_on(victim, lid) == before
        # Fill the replacement (what a replication worker does), then it is dropped.
        md = client.ledger_metadata(lid)
        shard = P.shard_of(lid, c.bookie(victim).num_shards)
        with BookieConnection(victim, shard=shard) as src, \
                BookieConnection(spare, shard=P.shard_of(lid, c.bookie(spare).num_shards)) as dst:
            for e in sorted(before):
                if spare not in md.write_set(e):
                    continue
                got = src.call(P.read(src.next_rid(), lid, e))
                assert got[2] == EOK
                from bk.client import digest as D
                r = dst.call(P.add(dst.next_rid(), lid, e, got[5], D.master_key(PW), got[6],
                                   got[7], True))
                assert r[2] == EOK
        wait_until(lambda: not c.entries_on(victim, lid), timeout=30,
                   what="the copy dropped once the new write sets hold everything")
        rh = client.open_ledger(lid, password=PW)
        assert [e.data for e in rh.read_entries(0, 19)] == [b"c%d" % i for i in range(20)]


def test_periodic_bookie_check_marks_a_lost_bookies_ledger_again(cluster_factory):
    """auditorPeriodicBookieCheckInterval: the auditor audits the lost bookies again
    on that period. A lost bookie's ledger is marked (there is no bookie to copy to,
    so the mark stays); the mark removed by hand comes back with the next periodic
    check, which `bkshell autorecovery` shows (its time, the lost bookie)."""
    c = cluster_factory(3, conf_overrides={
        **AR, "lostBookieRecoveryDelay": 0, "auditorPeriodicBookieCheckInterval": 2,
        "lockReleaseOfFailedLedgerGracePeriod": 3_600_000})
    uri = c.metadata_uri
    with bk.BookKeeper(uri) as client:
        lid = _ledger(client)
        wait_until(lambda: c.store.get_json(UR.AUDITOR)[0], timeout=30,
                   what="an auditor elected")
        auditor = c.store.get_json(UR.AUDITOR)[0]["id"]
        victim = next(b for b in c.bookies if b.bookie_id != auditor)
        victim.kill()

        def mark():
            return c.store.get_json(UR.ledger_rel(lid))[0]
        # marked at once (no delay); the repair fails (no bookie outside the
        # ensemble) and is not retried for an hour
        wait_until(lambda: (mark() or {}).get("error"), timeout=60,
                   what="the lost bookie's ledger marked, its repair failed")
        assert mark()["missing"] == [victim.bookie_id]
        c.store.delete_json(UR.ledger_rel(lid))
        removed = time.time()
        wait_until(lambda: mark() is not None, timeout=30,
                   what="the mark back after a periodic bookie check")
        assert mark()["missing"] == [victim.bookie_id]
        check = shell_json("--metadata", uri, "autorecovery", "--json")["checks"]["bookies"]
        assert check["at"] >= removed and check["lost"] == [victim.bookie_id]
        assert check["by"] == auditor
        text = shell_ok("--metadata", uri, "autorecovery").stdout
        assert f"1 lost ({victim.bookie_id})" in text, text
