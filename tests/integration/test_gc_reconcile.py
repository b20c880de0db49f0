"""The GC's full reconcile (bk.bookie.gc, existing_ledgers by ranges) interrupted at
the moment that matters, against real etcd and bookie processes: etcd stopped
(SIGSTOP) while a reconcile reads, the bookie killed -9 in the middle of one. No
ledger that exists loses an entry; the deleted ones, and entries that never had
metadata, are collected once etcd answers again or after the restart."""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import pytest

import bk
from bk.testing import closed_ledger, sigstop, site_hook, wait_until
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
        try:
            sigstop(c.etcd.pid)
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
        try:
            sigstop(c.etcd.pid)                 # holds the reconcile in its reads
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


# Stops the bookie's GC once, in its first full reconcile, between two groups of
# reads (the first group's ids read at the pinned revision, the others not yet),
# until the test creates "go": the moment cannot be missed, however loaded the
# machine (a test that throttled etcd to catch it missed it once in CI).
BETWEEN_HOOK = r'''
import json, os, time
DIR = os.environ.get("GC_BETWEEN_DIR")

if DIR:
    from bk.meta.store import MetadataStore
    _existing = MetadataStore.existing_ledgers
    paused = []

    def existing(self, ids, revision=None, progress=None):
        if progress is None or paused:  # not the reconcile's read, or done already
            return _existing(self, ids, revision=revision, progress=progress)

        def between(done, total):
            progress(done, total)       # the GC state shows how far it got
            if paused or done >= total:
                return
            paused.append(done)
            with open(os.path.join(DIR, "between.tmp"), "w") as f:
                json.dump({"pid": os.getpid(), "done": done, "total": total}, f)
            os.rename(os.path.join(DIR, "between.tmp"), os.path.join(DIR, "between"))
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(DIR, "go")) and time.monotonic() < deadline:
                time.sleep(0.02)
        return _existing(self, ids, revision=revision, progress=between)

    MetadataStore.existing_ledgers = existing
'''


@pytest.mark.parametrize("then", ["kill the bookie", "let the round fail"])
def test_interrupted_between_two_groups_of_reads_drops_nothing_that_exists(cluster_factory,
                                                                            tmp_path, then):
    """The moment that matters for reads by groups: some of a shard's ids were read at
    the pinned revision, the others not yet (the bookie's GC held there by a site
    hook), when etcd stops answering; then the bookie is killed -9 there, or its
    round goes on and fails. Ids held far apart (one in a hundred: a point read
    each, a hundred per group), half with metadata, half without."""
    d = tmp_path / "between"
    d.mkdir()
    with site_hook(tmp_path, BETWEEN_HOOK, {"GC_BETWEEN_DIR": d}):
        c = cluster_factory(1, conf_overrides=CONF)
    b = c.bookies[0]
    with bk.BookKeeper(c.metadata_uri) as client:
        model, _ = c.store.read_ledger(closed_ledger(client, ENTRIES[:1], 1, 1, 1,
                                                     password=PW))
    space = [lid for _ in range(30) for lid in c.store.reserve_ledger_ids()]
    sparse = space[::100]
    kept, orphans = sparse[::2], sparse[1::2]
    for lid in kept:
        c.store.create_ledger(dataclasses.replace(model, ledger_id=lid))
    for lid in sparse:
        assert add_to(b, lid, 0) == 0
    gc_state(c, b)
    os.kill(b.pid, signal.SIGUSR1)
    wait_until(lambda: (d / "between").exists(), timeout=60,
               what="the reconcile held between two groups of reads")
    at = json.loads((d / "between").read_text())
    # every id the bookie holds is asked about: the one closed ledger and the sparse
    assert at["total"] == len(sparse) + 1 and 0 < at["done"] < at["total"], at
    st = gc_state(c, b)["reconciling"]
    assert st["checked"] == at["done"] and st["ledgers"] == at["total"], st
    sigstop(c.etcd.pid)
    try:
        if then == "kill the bookie":
            b.kill(signal.SIGKILL)              # held there: between the two groups
        else:
            before = gc_state(c, b)["lastReconcile"]
            (d / "go").touch()                  # the next group's reads meet the stopped etcd
            # (the progress goes before the round's summary is recorded: wait for both)
            wait_until(lambda: (lambda st: st.get("reconciling") is None
                                and st["lastReconcile"] != before)(gc_state(c, b)),
                       timeout=60, what="the round failed on the stopped etcd")
            last = gc_state(c, b)["lastReconcile"]
            assert last["complete"] is False and last["dead"] == 0, last
            for lid in sparse:
                assert held(b, lid) == {0}, lid
    finally:
        os.kill(c.etcd.pid, signal.SIGCONT)
    assert remembered_on_disk(b) == 0
    if not b.alive:
        b.start()
    for lid in sparse:
        assert held(b, lid) == {0}, lid
    os.kill(b.pid, signal.SIGUSR1)
    wait_until(lambda: not any(held(b, lid) for lid in orphans), timeout=60,
               what="the entries without metadata collected")
    for lid in kept:
        assert held(b, lid) == {0}, lid


# Stops the bookie's GC at two moments of a full reconcile, each until the test
# creates a file: "listed" (every shard reported what it holds; no revision taken
# yet) and "pinned" (the member revision taken, no ledger read at it yet).
PAUSE_HOOK = r'''
import json, os, time
DIR = os.environ.get("GC_PAUSE_DIR")


def pause(name, **info):
    with open(os.path.join(DIR, name + ".tmp"), "w") as f:
        json.dump({"pid": os.getpid(), **info}, f)
    os.rename(os.path.join(DIR, name + ".tmp"), os.path.join(DIR, name))
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(DIR, "go-" + name)) and time.monotonic() < deadline:
        time.sleep(0.02)


if DIR:
    import bk.bookie.gc as G
    from bk.meta.store import MetadataStore
    _check, _existing = G.GarbageCollector.check, MetadataStore.existing_ledgers

    def check(self, rnd, held):
        pause("listed", shards=sorted(held), ledgers=sorted(set().union(*held.values())))
        return _check(self, rnd, held)

    def existing(self, ids, revision=None, progress=None):
        if progress is not None:        # the reconcile's read, not a round's candidates
            pause("pinned", revision=revision)
        return _existing(self, ids, revision=revision, progress=progress)

    G.GarbageCollector.check = check
    MetadataStore.existing_ledgers = existing
'''


def paused_at(d, name) -> dict:
    wait_until(lambda: (d / name).exists(), timeout=60, what=f"the reconcile paused: {name}")
    return json.loads((d / name).read_text())


@pytest.mark.parametrize("then", ["finish", "kill the bookie"])
def test_ledgers_deleted_and_created_around_the_pinned_revision(cluster_factory, tmp_path, then):
    """One check for the bookie's two shards at a revision taken after both lists:
    a listed ledger deleted before that revision is dropped, one deleted after it
    is not (it existed there; the watch nominates it later), a ledger created
    after the lists is not looked at. Killed -9 at the pinned revision instead,
    the bookie drops nothing that exists, and the next reconcile collects."""
    d = tmp_path / "pause"
    d.mkdir()
    with site_hook(tmp_path, PAUSE_HOOK, {"GC_PAUSE_DIR": d}):
        c = cluster_factory(1, num_shards=2, conf_overrides=CONF)
    b = c.bookies[0]
    with bk.BookKeeper(c.metadata_uri) as client:
        lids = [closed_ledger(client, ENTRIES, 1, 1, 1, password=PW) for _ in range(8)]
        assert {lid % 2 for lid in lids} == {0, 1}          # both shards hold some
        gc_state(c, b)
        os.kill(b.pid, signal.SIGUSR1)
        listed = paused_at(d, "listed")
        assert listed["shards"] == [0, 1] and set(lids) <= set(listed["ledgers"])
        before, after = lids[0], lids[1]          # deleted before / after the revision
        client.delete_ledger(before)
        born = closed_ledger(client, ENTRIES, 1, 1, 1, password=PW)   # not in the lists
        meanwhile = c.store.revision()
        (d / "go-listed").touch()
        pinned = paused_at(d, "pinned")
        assert pinned["revision"] >= meanwhile         # taken after the lists
        client.delete_ledger(after)
        if then == "kill the bookie":
            b.kill(signal.SIGKILL)
            (d / "go-pinned").touch()
            assert remembered_on_disk(b) == 0
            b.start()
            for lid in lids + [born]:                # nothing dropped yet
                assert held(b, lid) == set(range(5)), lid
            os.kill(b.pid, signal.SIGUSR1)
            collected(b, [lid for lid in lids + [born] if lid not in (before, after)],
                      [before, after], [])
            return
        (d / "go-pinned").touch()

        def done():
            last = gc_state(c, b).get("lastReconcile") or {}
            return last.get("complete") is True and gc_state(c, b).get("reconciling") is None
        wait_until(done, timeout=60, what="the reconcile finished")
        st = gc_state(c, b)["lastReconcile"]
        assert st["checked"] == len(listed["ledgers"]) and st["dead"] == 1, st
        wait_until(lambda: not held(b, before), what="the ledger deleted before dropped")
        assert held(b, after) == set(range(5))      # existed at the revision: kept
        for lid in lids[2:] + [born]:
            assert held(b, lid) == set(range(5)), lid
