"""DeletionLog (bk.bookie.gc): the deletions GC verified lately, saved atomically
and bounded, read back at start by the same cluster only; ShardDeletions: those
the arbiter hands each shard with its fork."""

from __future__ import annotations

import os
from types import SimpleNamespace

from bk import protocol as P
from bk.bookie.gc import DeletionLog, ShardDeletions
from bk.testing import wait_until


def test_saved_ids_are_read_back_by_the_same_cluster_only(tmp_path):
    path = str(tmp_path / "gc-recent.bin")
    d = DeletionLog(path, "cluster-a", keep=3600)
    assert d.add([30, 10, 20]) and d.add([5])
    d.save()
    assert not os.path.exists(path + ".tmp")
    assert sorted(DeletionLog(path, "cluster-a", keep=3600).load().ids()) == [5, 10, 20, 30]
    assert DeletionLog(path, "cluster-b", keep=3600).load().ids() == []   # a wiped etcd
    assert DeletionLog(str(tmp_path / "absent"), "cluster-a", keep=3600).load().ids() == []


def test_a_damaged_file_is_ignored(tmp_path):
    path = str(tmp_path / "gc-recent.bin")
    d = DeletionLog(path, "c", keep=3600)
    d.add(range(100))
    d.save()
    with open(path, "r+b") as f:
        f.seek(40)
        f.write(b"\xff\xff")
    assert DeletionLog(path, "c", keep=3600).load().ids() == []
    with open(path, "wb") as f:
        f.write(b"BK")
    assert DeletionLog(path, "c", keep=3600).load().ids() == []


def test_ids_expire_after_keep_seconds_also_across_a_reload(tmp_path):
    path = str(tmp_path / "gc-recent.bin")
    d = DeletionLog(path, "c", keep=0.3)
    d.add([1, 2])
    d.save()
    assert DeletionLog(path, "c", keep=0.3).load().ids() == [1, 2]
    wait_until(lambda: DeletionLog(path, "c", keep=0.3).load().ids() == [], timeout=5,
               what="the saved ids expired")
    assert d.add([]) and len(d) == 0          # expiry alone is a change worth saving


def test_the_limit_drops_the_oldest_rounds_and_reloaded_ids_keep_their_expiry(tmp_path):
    path = str(tmp_path / "gc-recent.bin")
    d = DeletionLog(path, "c", keep=3600, limit=5)
    d.add([1, 2, 3])
    d.add([4, 5])
    d.add([6, 7])                             # 7 ids > 5: the oldest round goes
    assert sorted(d.ids()) == [4, 5, 6, 7]
    d.save()
    again = DeletionLog(path, "c", keep=3600, limit=5).load()
    expiry = [e for e, _ in again.rounds]
    assert again.add([4, 6, 8])               # the round after a restart verifies them again
    assert sorted(again.ids()) == [4, 5, 6, 7, 8]
    assert [e for e, _ in again.rounds][:2] == expiry and len(again.rounds) == 3
    assert not again.add([])                  # nothing new, nothing expired: no write


def test_shard_deletions_start_from_the_file_split_by_shard_and_expire(tmp_path):
    d = DeletionLog(str(tmp_path / "gc-recent.bin"), "c", keep=3600)
    d.add(range(1, 41))
    d.save()
    conf = SimpleNamespace(gcFullReconcileIntervalSeconds=3600)
    handed = ShardDeletions.remembered(conf, "c", str(tmp_path), 4)
    for shard in range(4):
        assert list(handed.of(shard)) == [i for i in range(1, 41) if P.shard_of(i, 4) == shard]
    assert not ShardDeletions.remembered(conf, "other", str(tmp_path), 4).of(0)
    handed.keep = 0.3
    handed.add(1, [1000, 999, 1000])
    assert list(handed.of(1)[-2:]) == [999, 1000]
    handed.add(2, [])
    wait_until(lambda: 999 not in handed.of(1), what="the round added last expired")
    assert len(handed.of(1)) == 10


def test_shard_deletions_keep_at_most_limit_ids_a_shard_oldest_rounds_first():
    handed = ShardDeletions(keep=3600, num_shards=2, limit=5)
    handed.add(0, [1, 2, 3])
    handed.add(0, [4, 5, 6])
    assert list(handed.of(0)) == [4, 5, 6]
    handed.add(1, range(10, 20))        # one round over the limit is kept whole
    assert list(handed.of(1)) == list(range(10, 20)) and list(handed.of(0)) == [4, 5, 6]
