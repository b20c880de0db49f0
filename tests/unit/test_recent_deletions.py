"""RecentDeletions (bk.bookie.storage): the ids of deleted ledgers a shard held
nothing of, refused for a while, within a bound on memory."""

from __future__ import annotations

from bk.bookie.storage import RecentDeletions
from bk.testing import wait_until


def test_ids_are_kept_for_keep_seconds_then_forgotten():
    gone = RecentDeletions(keep=0.2)
    gone.add([30, 10, 20, 10])
    assert 10 in gone and 20 in gone and 30 in gone and 15 not in gone
    assert len(gone) == 3
    wait_until(lambda: 10 not in gone, timeout=5, what="the ids forgotten")
    assert 20 not in gone and len(gone) == 0


def test_rounds_expire_in_order_and_the_limit_drops_the_oldest():
    gone = RecentDeletions(keep=3600, limit=5)
    gone.add([1, 2, 3])
    gone.add([4, 5])
    assert all(i in gone for i in range(1, 6))
    gone.add([6, 7])                  # 7 ids > 5: the oldest round goes
    assert [i in gone for i in (1, 2, 3)] == [False, False, False]
    assert all(i in gone for i in (4, 5, 6, 7)) and len(gone) == 4
    gone.add([])
    assert len(gone) == 4
