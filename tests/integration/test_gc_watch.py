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
from bk.errors import EOK
from bk.testing import BookieConnection, wait_until

PW = b"gc"
QUIET = {"gcWaitTime": 300, "httpServerEnabled": True, "httpServerPort": 0}


_ports: dict = {}


def gc_state(cluster, b) -> dict:
    """What the bookie's GC reports (bk.bookie.gc state, over its HTTP info)."""
    key = (b.bookie_id, b.pid)
    if key not in _ports:
        _ports[key] = cluster.store.bookie_info(b.bookie_id)["httpPort"]
    port = _ports[key]
    info = json.loads(urllib.request.urlopen(
        f"http://127.0.0.1:{port}/api/v1/bookie/info", timeout=5).read())
    return info["gc"] or {}


def remembered_on_disk(b) -> int:
    try:
        with open(os.path.join(b.dir, "ledgers", GC_STATE_FILE)) as f:
            return json.load(f)["revision"]
    except FileNotFoundError:
        return 0


def entries_held(_store, bookie_id, lid, b=None) -> set[int]:
    """Entry ids of ``lid`` on the bookie (asked directly: it may be unregistered)."""
    shards = 2
    with BookieConnection(bookie_id, shard=P.shard_of(lid, shards)) as conn:
        r = conn.call(P.get_list_of_entries(conn.next_rid(), lid))
    return set(P.ranges_to_ids(r[4])) if r[2] == EOK and r[4] else set()


def ledger(client, n=5):
    lh = client.create_ledger(1, 1, 1, password=PW)
    lh.add_entries([b"e%d" % i for i in range(n)])
    lh.close()
    return lh.ledger_id


def test_deleted_while_down_is_learned_from_the_remembered_revision(cluster_factory):
    c = cluster_factory(1, conf_overrides=QUIET)
    b = c.bookies[0]
    with bk.BookKeeper(c.metadata_uri) as client:
        doomed, kept = ledger(client), ledger(client)
        wait_until(lambda: remembered_on_disk(b) > 0, what="a first round remembered")
        b.stop()
        client.delete_ledger(doomed)
        deleted_at = c.store.revision()
        b.start()
        wait_until(lambda: not entries_held(c.store, b.bookie_id, doomed),
                   what="the ledger deleted while the bookie was down dropped")
        assert entries_held(c.store, b.bookie_id, kept) == set(range(5))
        st = gc_state(c, b)
        # learned from the watch: no full reconcile was needed after the restart
        assert st["reconciles"] == 0, st
        wait_until(lambda: remembered_on_disk(b) >= deleted_at,
                   what="the remembered revision advanced past the deletion")


def test_deleted_while_down_and_compacted_falls_back_to_a_reconcile(cluster_factory):
    c = cluster_factory(1, conf_overrides=QUIET)
    b = c.bookies[0]
    with bk.BookKeeper(c.metadata_uri) as client:
        doomed, kept = ledger(client), ledger(client)
        wait_until(lambda: remembered_on_disk(b) > 0, what="a first round remembered")
        b.stop()
        client.delete_ledger(doomed)
        c.store.new_ledger_id()              # more history after the deletion
        c.store.compact(c.store.revision())  # the remembered revision is gone now
        b.start()
        wait_until(lambda: not entries_held(c.store, b.bookie_id, doomed),
                   what="the ledger deleted while the bookie was down dropped")
        assert entries_held(c.store, b.bookie_id, kept) == set(range(5))
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
        assert entries_held(c.store, b.bookie_id, doomed)       # not applied yet
        b.kill()
        b.write_conf(gcWaitTime=300)
        b.start()
        wait_until(lambda: not entries_held(c.store, b.bookie_id, doomed),
                   what="the deletion learned again and applied")
        assert entries_held(c.store, b.bookie_id, kept) == set(range(5))
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
        assert entries_held(c.store, b.bookie_id, lid) == set(range(5))
    with open(b.log_file) as f:
        assert "garbage collection skipped, nothing deleted" in f.read()
