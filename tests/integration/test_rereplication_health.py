"""Auto-recovery remembers the bookies a copy failed to reach, as a client does
(bk.client.health): a preference, never an exclusion (for writers, see
test_client.py::test_failed_bookie_that_came_back_is_picked_after_its_quarantine)."""

import signal

import bk
from bk.autorecovery.replicator import Replicator
from bk.rawclient import BookiePool
from bk.testing import closed_ledger, stop_bookie


def test_rereplication_avoids_a_target_it_could_not_reach(cluster_factory):
    """A registered bookie that the re-replicating process cannot reach (SIGSTOPped
    here: connects hang, as behind a silent partition) is avoided on the next run:
    before, the per-fragment pick chose the same dead end on every retry and the
    ledgers it picked for could never be re-replicated."""
    cluster = cluster_factory(3, conf_overrides={"registrationTtlSeconds": 120})
    with bk.BookKeeper(cluster.metadata_uri) as c:
        ledgers = [closed_ledger(c, [b"l%d-%d" % (i, j) for j in range(10)], 3, 3, 2)
                   for i in range(6)]
    victim = cluster.bookies[0].bookie_id
    cut = cluster.add_bookie()
    good = cluster.add_bookie()
    cluster.bookie(victim).kill()
    store = cluster.store
    rep = Replicator(store, BookiePool(store, timeout=1.5), cluster.metadata_uri,
                     bookie_timeout=1.5, quarantine_seconds=600)
    try:
        plan = rep.recover_bookie(victim, dry_run=True)
        picked = {f.ledger_id: f.replacement for f in plan.fragments}
        assert set(picked) == set(ledgers)
        if cut.bookie_id not in picked.values():      # the picks hash (ledger, fragment)
            cut, good = good, cut
        to_cut = sorted(lid for lid, b in picked.items() if b == cut.bookie_id)
        stop_bookie(cut)
        try:
            first = rep.recover_bookie(victim)
            # only the first ledger that tried the unreachable target failed; the
            # others of the same run already copied elsewhere
            assert len(first.failed) == 1 and set(first.failed) <= set(to_cut), \
                (first.failed, to_cut)
            second = rep.recover_bookie(victim)
            assert second.ok, second.to_dict()
            assert {f.replacement for f in second.fragments} == {good.bookie_id}
        finally:
            cut.kill(signal.SIGCONT)
    finally:
        rep.close()
    for lid in ledgers:
        md, _ = store.read_ledger(lid)
        assert victim not in md.last_ensemble
        assert all(set(range(10)) <= cluster.entries_on(b, lid) for b in md.last_ensemble)
