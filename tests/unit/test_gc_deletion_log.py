"""DeletionLog (bk.bookie.gc): the deletions GC verified lately, saved atomically
and bounded, read back at start by the same cluster only."""

from __future__ import annotations

import os

from bk.bookie.gc import DeletionLog
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
