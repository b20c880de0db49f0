"""Recovery must never close a ledger before an acknowledged entry, also after an
earlier recovery of it failed half way (real etcd, real bookie processes)."""

import signal

import pytest

from bk import protocol as P
from bk.errors import EOK, BKError
from bk.meta.ledger import LedgerState
from bk.testing import BookieConnection, stop_bookie

pytestmark = pytest.mark.timeout(120)

PW = b"secret"


def test_failed_recovery_leaves_no_ensemble_change_that_hides_an_acknowledged_entry(
        cluster_factory, caplog):
    """E=Qw=Qa=2 on bookies B, C; entry 10 is acknowledged, so on both. C dies. A
    recovery finds entry 10 on B and writes it back, replacing C by D, but D hangs
    and no other bookie is left: the recovery fails. Had it stored that ensemble
    change (entry 10 on B, D), the next recovery, with B slow, would take D's "no
    such entry" (Qw - Qa + 1 = 1 negative) as proof that entry 10 never existed
    and close the ledger at 9. The change stays in memory until a recovery closes
    the ledger, so the next one reads entry 10 where its writer put it."""
    cluster = cluster_factory(2)
    B, C = cluster.bookies
    with cluster.client(timeout=1, addEntryTimeoutSec=30) as writer:
        lh = writer.create_ledger(2, 2, 2, password=PW)
        lid = lh.ledger_id
        for i in range(11):
            assert lh.add_entry(b"entry-%d" % i) == i
        writer_ensembles = lh.metadata.ensembles
    # D's lease outlives its hang, so the recovery picks it as C's replacement.
    D = cluster.add_bookie(registrationTtlSeconds=8)
    C.kill()
    stop_bookie(D)
    try:
        with cluster.client(timeout=1) as rc, caplog.at_level("INFO", logger="bk.client"):
            with pytest.raises(BKError):
                rc.open_ledger(lid, password=PW)
        # It did replace C by D for its write-back...
        assert any("ensemble from entry 10 is now" in r.getMessage()
                   and D.bookie_id in r.getMessage() for r in caplog.records)
        # ...and left the fragments as the writer left them.
        md = cluster.store.read_ledger(lid)[0]
        assert md.state == LedgerState.IN_RECOVERY and md.ensembles == writer_ensembles
    finally:
        D.kill()                      # crashes while hung: the write-back never reached it
    D.start()
    C.start()
    stop_bookie(B)                    # B slow: the next recovery hears from C and D first
    try:
        # C and D were just restarted: give their first write-back more than the
        # 1 s that replaces the hung B (under CI's load both once took longer, and
        # the recovery then had no bookie left).
        with cluster.client(timeout=1, addEntryTimeoutSec=3) as rc:
            rh = rc.open_ledger(lid, password=PW)
            assert rh.is_closed and rh.last_add_confirmed == 10
            assert [e.data for e in rh.read_entries(0, 10)] == \
                [b"entry-%d" % i for i in range(11)]
            md = rh.metadata
    finally:
        B.kill(signal.SIGCONT)
    # This recovery's own change (slow B replaced) is stored with the close, and
    # entry 10 is on every bookie of its write set there.
    assert md.ensembles[0] == writer_ensembles[0]
    assert md.ensembles[-1][0] == 10 and B.bookie_id not in md.ensembles[-1][1]
    for bid in md.write_set(10):
        b = cluster.bookie(bid)
        with BookieConnection(bid, shard=P.shard_of(lid, b.num_shards)) as c:
            r = c.call(P.read(c.next_rid(), lid, 10))
            assert r[2] == EOK and r[7] == b"entry-10", (bid, r[:5])
