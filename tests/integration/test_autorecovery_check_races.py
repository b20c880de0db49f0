"""The auditor's periodic checks mark a ledger for what they judged: its metadata
as listed. A ledger deleted, or whose metadata changed, between the listing and
the mark is left to the next check (real etcd and bookies; the check is run in
this process, at the moment that matters, by wrapping the per-ledger probe)."""

from __future__ import annotations

import types

import bk
from bk.autorecovery import checker
from bk.autorecovery.service import AutoRecovery
from bk.config import Config
from bk.meta import underreplication as UR
from bk.testing import closed_ledger, wait_until

PW = b"race"


class Leader:
    """An election this process always leads: the checks' guard is a comparison that
    holds while the cluster's layout key exists."""

    is_leader = True

    def __init__(self, store):
        key = store._key("layout")
        self.lock = types.SimpleNamespace(
            guard=lambda: store._client().transactions.create(key) > 0)


def auditor(c) -> AutoRecovery:
    UR.update_settings(c.store, enabled=False)      # its own loops stay idle
    return AutoRecovery(Config.load(overrides={"metadataServiceUri": c.metadata_uri}),
                        "checker").start()


def marked(c) -> set:
    return {lid for lid, _, _ in UR.list_marked(c.store)}


def test_a_ledger_deleted_after_the_listing_is_not_marked(cluster_factory):
    c = cluster_factory(3, conf_overrides={"gcWaitTime": 300})
    ar = auditor(c)
    try:
        with bk.BookKeeper(c.metadata_uri) as client:
            doomed = closed_ledger(client, [b"d%d" % i for i in range(10)], password=PW)
            kept = closed_ledger(client, [b"k%d" % i for i in range(10)], password=PW)
            holders = {b for _, ens in client.ledger_metadata(doomed).ensembles for b in ens}
            probed = []

            def probe(pool, md):
                # listed already; deleted now, and collected by every bookie's GC
                # before the probe asks them: they all lack its entries
                if md.ledger_id == doomed:
                    client.delete_ledger(doomed)
                    wait_until(lambda: not any(c.entries_on(b, doomed) for b in holders),
                               timeout=60, what="the deleted ledger collected by GC")
                res = checker.fragment_problems(pool, md)
                probed.append((md.ledger_id, sorted(res.missing)))
                return res

            ar._run_check(Leader(c.store), "ledgers", probe, False)
            assert dict(probed) == {doomed: sorted(holders), kept: []}
            assert marked(c) == set()
            assert UR.checks(c.store)["ledgers"]["marked"] == 0
    finally:
        ar.stop()


def test_a_ledger_changed_after_the_listing_is_not_marked_one_unchanged_is(cluster_factory):
    c = cluster_factory(3)
    ar = auditor(c)
    try:
        with bk.BookKeeper(c.metadata_uri) as client:
            changed = closed_ledger(client, [b"c%d" % i for i in range(10)], password=PW)
            same = closed_ledger(client, [b"s%d" % i for i in range(10)], password=PW)
            lacking = {}

            def probe(pool, md):
                # every bookie of the first fragment "lacks" entry 0 (as one that a
                # repair replaced would); the first ledger's metadata is rewritten
                # (a new version) before the probe answers
                if md.ledger_id == changed:
                    now, version = c.store.read_ledger(changed)
                    c.store.write_ledger(now, version)
                res = checker.CheckResult(md.ledger_id)
                res.missing = {b: [0] for b in md.ensembles[0][1]}
                lacking[md.ledger_id] = sorted(res.missing)
                return res

            ar._run_check(Leader(c.store), "ledgers", probe, False)
            assert set(lacking) == {changed, same}
            assert marked(c) == {same}
            rec, _ = UR.marked(c.store, same)
            assert rec["missing"] == lacking[same]
            assert UR.checks(c.store)["ledgers"]["marked"] == 1
    finally:
        ar.stop()


def test_an_audit_stops_marking_for_a_bookie_that_came_back(cluster_factory, monkeypatch):
    """A lost bookie's audit marks its ledgers one by one; one that registered again
    meanwhile (its disk with it) gets no more marks: its delay would have been
    cancelled had it come back before the audit began."""
    from bk.autorecovery import service
    c = cluster_factory(3)
    ar = auditor(c)
    try:
        with bk.BookKeeper(c.metadata_uri) as client:
            lids = sorted(closed_ledger(client, [b"a%d" % i for i in range(3)], ensemble=3,
                                        password=PW) for _ in range(6))
        victim = c.bookies[0]
        victim.stop()
        wait_until(lambda: victim.bookie_id not in c.store.list_bookies(),
                   what="the stopped bookie unregistered")
        monkeypatch.setattr(service, "AUDIT_RECHECK", 0.0)    # look before every ledger
        real_mark = UR.mark
        calls = []

        def mark(store, lid, missing, guards=()):
            calls.append((lid, list(missing)))
            done = real_mark(store, lid, missing, guards)
            if len(calls) == 2:
                victim.start()          # back (registered) before the next ledger
            return done

        monkeypatch.setattr(UR, "mark", mark)
        ar._audit({victim.bookie_id}, Leader(c.store))
        assert calls == [(lids[0], [victim.bookie_id]), (lids[1], [victim.bookie_id])]
        assert marked(c) == set(lids[:2])
    finally:
        ar.stop()
