"""Garbage collection that follows deletions (bk.bookie.gc) against real etcd and
bookie processes: a watch from a remembered revision, full reconciles when that
revision is gone, and no data dropped on the word of a watch alone."""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import bk
from bk import protocol as P
from bk.bookie.layout import GC_STATE_FILE
from bk.client.digest import master_key
from bk.errors import EFENCED, ENOLEDGER
from bk.testing import BookieConnection, closed_ledger, entries_held, wait_until

PW = b"gc"
QUIET = {"gcWaitTime": 300, "httpServerEnabled": True, "httpServerPort": 0}


_ports: dict = {}


def bookie_info(cluster, b) -> dict:
    """The bookie's HTTP info (its GC state, its shards' pids)."""
    key = (b.bookie_id, b.pid)
    if key not in _ports:
        _ports[key] = cluster.store.bookie_info(b.bookie_id)["httpPort"]
    port = _ports[key]
    return json.loads(urllib.request.urlopen(
        f"http://127.0.0.1:{port}/api/v1/bookie/info", timeout=5).read())


def gc_state(cluster, b) -> dict:
    """What the bookie's GC reports (bk.bookie.gc state, over its HTTP info)."""
    return bookie_info(cluster, b)["gc"] or {}


def remembered_on_disk(b) -> int:
    try:
        with open(os.path.join(b.dir, "ledgers", GC_STATE_FILE)) as f:
            return json.load(f)["revision"]
    except FileNotFoundError:
        return 0


def held(b, lid) -> set[int]:
    """Entry ids of ``lid`` on bookie ``b`` (asked directly: it may be unregistered)."""
    return entries_held(None, b.bookie_id, lid, num_shards=b.num_shards)


def add_to(b, lid, entry, recovery=False) -> int:
    """The status of an ADD of ``entry`` of ``lid`` sent straight to bookie ``b``
    (as a zombie writer, a re-replication or a recovery write-back sends it)."""
    with BookieConnection(b.bookie_id, shard=P.shard_of(lid, b.num_shards)) as conn:
        return conn.call(P.add(conn.next_rid(), lid, entry, entry - 1, master_key(PW), b"",
                               b"late", recovery=recovery))[2]


def ledger(client):
    return closed_ledger(client, [b"e%d" % i for i in range(5)], 1, 1, 1, password=PW)


def delete_while_down(c, client, after_delete=lambda: None) -> int:
    """Two ledgers on the single bookie, which remembers a first GC round, stops, has
    the first of them deleted (then ``after_delete()``) and restarts; once it dropped
    the deleted one, the other must be whole. Returns the revision of the deletion."""
    b = c.bookies[0]
    doomed, kept = ledger(client), ledger(client)
    wait_until(lambda: remembered_on_disk(b) > 0, what="a first round remembered")
    b.stop()
    client.delete_ledger(doomed)
    deleted_at = c.store.revision()
    after_delete()
    b.start()
    wait_until(lambda: not held(b, doomed),
               what="the ledger deleted while the bookie was down dropped")
    assert held(b, kept) == set(range(5))
    return deleted_at


def test_deleted_while_down_is_learned_from_the_remembered_revision(cluster_factory):
    c = cluster_factory(1, conf_overrides=QUIET)
    b = c.bookies[0]
    with bk.BookKeeper(c.metadata_uri) as client:
        deleted_at = delete_while_down(c, client)
        st = gc_state(c, b)
        # learned from the watch: no full reconcile was needed after the restart
        assert st["reconciles"] == 0, st
        wait_until(lambda: remembered_on_disk(b) >= deleted_at,
                   what="the remembered revision advanced past the deletion")


def test_deleted_while_down_and_compacted_falls_back_to_a_reconcile(cluster_factory):
    c = cluster_factory(1, conf_overrides=QUIET)
    b = c.bookies[0]

    def compacted():
        c.store.new_ledger_id()              # more history after the deletion
        c.store.compact(c.store.revision())  # the remembered revision is gone now

    with bk.BookKeeper(c.metadata_uri) as client:
        delete_while_down(c, client, compacted)
        st = gc_state(c, b)
        assert st["reconciles"] >= 1 and st["lastReconcile"]["reason"] == "compacted", st


def test_kill9_between_learning_a_deletion_and_remembering_it(cluster_factory):
    """The bookie learns of a deletion (the watch) but is killed before any round
    applied it and advanced the remembered revision: after the restart it learns
    it again from the old revision and drops the ledger then."""
    c = cluster_factory(1, conf_overrides={**QUIET, "gcWaitTime": 3600_000})
    b = c.bookies[0]
    with bk.BookKeeper(c.metadata_uri) as client:
        doomed, kept = ledger(client), ledger(client)
        os.kill(b.pid, signal.SIGUSR1)          # a first (full) round: a revision on disk
        wait_until(lambda: remembered_on_disk(b) > 0, what="a first round remembered")
        before = remembered_on_disk(b)
        client.delete_ledger(doomed)
        wait_until(lambda: gc_state(c, b)["candidates"] >= 1, what="the deletion learned")
        assert remembered_on_disk(b) == before
        assert held(b, doomed)       # not applied yet
        b.kill()
        b.write_conf(gcWaitTime=300)
        b.start()
        wait_until(lambda: not held(b, doomed),
                   what="the deletion learned again and applied")
        assert held(b, kept) == set(range(5))
        assert gc_state(c, b)["reconciles"] == 0
        wait_until(lambda: remembered_on_disk(b) > before, what="the revision remembered")


def test_a_reformatted_cluster_never_makes_the_watch_drop_data(cluster_factory):
    """metaformat --force deletes every key under the prefix: the watch reports every
    ledger deleted, and the bookie must still drop nothing (its cluster is gone)."""
    c = cluster_factory(1, conf_overrides=QUIET)
    b = c.bookies[0]
    with bk.BookKeeper(c.metadata_uri) as client:
        lids = [ledger(client) for _ in range(3)]
    wait_until(lambda: remembered_on_disk(b) > 0, what="a first round remembered")
    gc_state(c, b)                           # learn its HTTP port while it is registered
    c.store.format(force=True)
    wait_until(lambda: gc_state(c, b)["candidates"] >= 3, what="the deletions seen")
    rounds = gc_state(c, b)["rounds"]
    wait_until(lambda: gc_state(c, b)["rounds"] >= rounds + 3, what="three more GC rounds")
    for lid in lids:
        assert held(b, lid) == set(range(5))
    with open(b.log_file) as f:
        assert "garbage collection skipped, nothing deleted" in f.read()


def on_one_of_two(c, client):
    """A ledger written on one bookie of two: (its handle, that bookie, the other)."""
    lh = client.create_ledger(1, 1, 1, password=PW)
    lh.add_entries([b"d0", b"d1"])
    holder = c.bookie(lh.metadata.last_ensemble[0])
    return lh, holder, next(b for b in c.bookies if b is not holder)


def test_a_write_after_the_deletion_to_a_bookie_that_held_nothing_is_refused(cluster_factory):
    """A bookie applies a deletion it learned from the watch while it holds nothing of
    the ledger. Entries of that ledger arriving afterwards (a zombie writer after an
    ensemble change, a re-replication or recovery write-back in flight) are refused
    as a tombstone refuses them, instead of creating the ledger anew and staying on
    disk until the next full reconcile; nothing refused comes back after kill -9,
    and the bookie's other ledgers are untouched."""
    c = cluster_factory(2, conf_overrides=QUIET)
    with bk.BookKeeper(c.metadata_uri) as client:
        lh, holder, late = on_one_of_two(c, client)
        while True:                      # a live ledger on the other bookie
            kept = client.create_ledger(1, 1, 1, password=PW)
            if kept.metadata.last_ensemble == [late.bookie_id]:
                break
            kept.close()
        kept.add_entries([b"k%d" % i for i in range(5)])
        kept.close()
        lid = lh.ledger_id
        for b in (holder, late):             # past the full reconcile at start
            wait_until(lambda: remembered_on_disk(b) > 0, what="a first round remembered")
        client.delete_ledger(lid)
        deleted_at = c.store.revision()
        for b in (holder, late):
            wait_until(lambda: remembered_on_disk(b) >= deleted_at,
                       what=f"{b.bookie_id} applied the deletion")
        assert not held(holder, lid) and not held(late, lid)
        assert add_to(late, lid, 2) == EFENCED                  # a zombie writer's add
        assert add_to(late, lid, 0, recovery=True) == EFENCED   # a write-back, a re-replication
        with BookieConnection(late.bookie_id, shard=P.shard_of(lid, late.num_shards)) as conn:
            fence = conn.call(P.read_lac(conn.next_rid(), lid, fence=True,
                                         master_key=master_key(PW)))
        assert fence[2] == ENOLEDGER                        # a recovery's fence creates nothing
        assert not held(late, lid)
        late.kill()
        late.start()
        assert not held(late, lid)
        assert held(late, kept.ledger_id) == set(range(5))


def test_a_deletion_applied_just_before_a_kill_is_still_refused_after_the_restart(
        cluster_factory):
    """The moment that matters: a bookie verified a deletion of a ledger it holds
    nothing of and its remembered revision moved past it (the watch will not send
    it again), then it is killed -9. It restarts with no GC round due for an hour:
    the deletion, read back from gc-recent.bin, reaches the shard as soon as it is
    ready, so the zombie's entries are refused at once, as before the kill. A full
    round (SIGUSR1) then checks it again and keeps it; the other ledgers are
    untouched."""
    c = cluster_factory(2, conf_overrides=QUIET)
    with bk.BookKeeper(c.metadata_uri) as client:
        lh, holder, late = on_one_of_two(c, client)
        kept = closed_ledger(client, [b"k%d" % i for i in range(5)], 2, 2, 2, password=PW)
        lid = lh.ledger_id
        wait_until(lambda: remembered_on_disk(late) > 0, what="a first round remembered")
        client.delete_ledger(lid)
        deleted_at = c.store.revision()
        wait_until(lambda: remembered_on_disk(late) >= deleted_at,
                   what="the deletion applied and the revision past it")
        late.kill(signal.SIGKILL)
        late.write_conf(gcWaitTime=3_600_000)
        late.start()
        assert add_to(late, lid, 2) == EFENCED          # refused, as before the kill
        assert gc_state(c, late).get("rounds", 0) == 0  # by the replay, not by a round
        assert not held(late, lid)
        os.kill(late.pid, signal.SIGUSR1)               # a full round checks it again

        def a_round_done():
            st = gc_state(c, late)
            return st.get("rounds", 0) >= 1 and st["candidates"] == 0
        wait_until(a_round_done, what="a full GC round after the restart")
        assert gc_state(c, late)["recentDeletions"] >= 1
        assert add_to(late, lid, 2) == EFENCED
        assert not held(late, lid)
        assert held(late, kept) == set(range(5))


def test_a_respawned_shard_refuses_a_deletion_applied_just_before_it_died(cluster_factory):
    """The moment that matters for a shard alone: it applied a deletion of a ledger
    its bookie holds nothing of, the round is over (no round sends it again), and
    the shard is killed -9. The arbiter respawns it, and the deletion comes with the
    fork: the zombie writer's add is refused from the shard's first request, as a
    write-back's is; the arbiter, its other shard and the other ledgers carry on."""
    c = cluster_factory(2, conf_overrides=QUIET)
    with bk.BookKeeper(c.metadata_uri) as client:
        lh, holder, late = on_one_of_two(c, client)
        kept = closed_ledger(client, [b"k%d" % i for i in range(5)], 2, 2, 2, password=PW)
        lid = lh.ledger_id
        shard = P.shard_of(lid, late.num_shards)
        wait_until(lambda: remembered_on_disk(late) > 0, what="a first round remembered")
        client.delete_ledger(lid)
        deleted_at = c.store.revision()
        wait_until(lambda: remembered_on_disk(late) >= deleted_at,
                   what="the deletion applied and the revision past it")
        assert add_to(late, lid, 2) == EFENCED
        shards = {s["shard"]: s for s in bookie_info(c, late)["shards"]}
        os.kill(shards[shard]["pid"], signal.SIGKILL)

        def respawned():
            now = {s["shard"]: s for s in bookie_info(c, late)["shards"]}
            return (now[shard]["pid"] not in (0, shards[shard]["pid"]) and now[shard]["ready"]
                    and now[shard]["restarts"] == shards[shard]["restarts"] + 1)
        wait_until(respawned, what=f"shard {shard} respawned")
        assert add_to(late, lid, 2) == EFENCED                  # the zombie writer's add
        assert add_to(late, lid, 0, recovery=True) == EFENCED   # a write-back's
        assert not held(late, lid)
        info = bookie_info(c, late)
        assert info["pid"] == late.pid
        assert all(s["pid"] == shards[s["shard"]]["pid"] for s in info["shards"]
                   if s["shard"] != shard)
        assert held(late, kept) == set(range(5))
