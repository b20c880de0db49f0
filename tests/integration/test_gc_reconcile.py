"""The GC's full reconcile (bk.bookie.gc, existing_ledgers by ranges) interrupted at
the moment that matters, against real etcd and bookie processes: etcd stopped
(SIGSTOP) while a reconcile reads, the bookie killed -9 in the middle of one. No
ledger that exists loses an entry; the deleted ones, and entries that never had
metadata, are collected once etcd answers again or after the restart."""

from __future__ import annotations

import os
import signal

import bk
from bk.testing import closed_ledger, wait_until
from test_gc_watch import PW, add_to, gc_state, held, remembered_on_disk

# no round but those asked for (SIGUSR1); a stopped etcd fails a request in 2 s
CONF = {"gcWaitTime": 3_600_000, "metadataTimeoutMillis": 2000, "httpServerEnabled": True,
        "httpServerPort": 0}
ENTRIES = [b"e%d" % i for i in range(5)]


def setup_ledgers(c, b, client):
    """Closed ledgers on the one bookie (ids dense: one client's block), a few of
    them deleted, and entries of ids next to them that never had metadata: the
    reconcile's ranges cover all three kinds. Returns (kept, doomed, orphans)."""
    lids = [closed_ledger(client, ENTRIES, 1, 1, 1, password=PW) for _ in range(24)]
    doomed = lids[::6]
    for lid in doomed:
        client.delete_ledger(lid)
    orphans = [max(lids) + 1 + 2 * k for k in range(8)]    # never created
    for lid in orphans:
        assert add_to(b, lid, 0) == 0
    kept = [lid for lid in lids if lid not in doomed]
    gc_state(c, b)              # learn the bookie's HTTP port while etcd answers
    return kept, doomed, orphans


def assert_nothing_lost(b, kept, doomed=(), orphans=()):
    for lid in kept:
        assert held(b, lid) == set(range(5)), lid
    for lid in doomed:
        assert held(b, lid) == set(range(5)), lid    # not decided yet: still there
    for lid in orphans:
        assert held(b, lid) == {0}, lid


def reconciling(c, b) -> bool:
    return gc_state(c, b).get("reconciling") is not None


def collected(b, kept, doomed, orphans):
    wait_until(lambda: not any(held(b, lid) for lid in doomed + orphans), timeout=60,
               what="the deleted ledgers and the orphan entries collected")
    for lid in kept:
        assert held(b, lid) == set(range(5)), lid


def test_etcd_stopped_during_a_full_reconcile_drops_nothing_until_it_answers(cluster_factory):
    c = cluster_factory(1, conf_overrides=CONF)
    b = c.bookies[0]
    with bk.BookKeeper(c.metadata_uri) as client:
        kept, doomed, orphans = setup_ledgers(c, b, client)
        os.kill(c.etcd.pid, signal.SIGSTOP)
        try:
            os.kill(b.pid, signal.SIGUSR1)
            wait_until(lambda: reconciling(c, b), what="a full reconcile under way")

            def failed():
                st = gc_state(c, b)
                return (st.get("lastReconcile") or {}).get("complete") is False \
                    and st.get("reconciling") is None
            wait_until(failed, timeout=60, what="the reconcile failed on the stopped etcd")
            assert_nothing_lost(b, kept, doomed, orphans)
            assert remembered_on_disk(b) == 0
        finally:
            os.kill(c.etcd.pid, signal.SIGCONT)
        os.kill(b.pid, signal.SIGUSR1)
        collected(b, kept, doomed, orphans)
        wait_until(lambda: remembered_on_disk(b) > 0, what="the revision remembered")
        assert gc_state(c, b)["lastReconcile"]["complete"] is True


def test_bookie_killed_during_a_full_reconcile_collects_after_the_restart(cluster_factory):
    c = cluster_factory(1, conf_overrides=CONF)
    b = c.bookies[0]
    with bk.BookKeeper(c.metadata_uri) as client:
        kept, doomed, orphans = setup_ledgers(c, b, client)
        os.kill(c.etcd.pid, signal.SIGSTOP)     # holds the reconcile in its reads
        try:
            os.kill(b.pid, signal.SIGUSR1)
            wait_until(lambda: reconciling(c, b), what="a full reconcile under way")
            b.kill(signal.SIGKILL)
        finally:
            os.kill(c.etcd.pid, signal.SIGCONT)
        assert remembered_on_disk(b) == 0
        b.start()
        assert_nothing_lost(b, kept, doomed, orphans)
        os.kill(b.pid, signal.SIGUSR1)
        collected(b, kept, doomed, orphans)
        st = gc_state(c, b)
        assert st["reconciles"] >= 1 and st["lastReconcile"]["complete"] is True, st
