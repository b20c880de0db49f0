"""Which ledgers a shard reports *settled* to a full GC round (dropped already, no
entry since: the over-replicated scan skips them), against the entries it really
holds, through drops, crashes, journal replays and entries that come back."""

from __future__ import annotations

import pytest

from bk.bookie.journal import JournalError
from bk.errors import EIO, EOK
from test_storage import add, crash, open_storage


def journal_full(*args):
    raise JournalError("no space left on the journal's disk")


def holds(s, lid) -> bool:
    return bool(s.list_entries(lid)[1])


def assert_settled_is_exact(s):
    """settled() names exactly the fenced ledgers that hold no entry: never one a
    drop would take entries from (skipping it would leave them forever)."""
    settled = s.settled()
    for lid in s.ledgers():
        st = s._ledgers[lid]
        assert (lid in settled) == (st.fenced and not holds(s, lid)), lid


def reopen(s, tmp_path, how):
    if how == "close":
        s.close()
    else:
        crash(s)
    del s
    return open_storage(tmp_path)


@pytest.mark.parametrize("how", ["live", "close", "crash"])
def test_a_dropped_ledger_is_settled_until_entries_come_back(tmp_path, how):
    s = open_storage(tmp_path)
    for e in range(5):
        assert add(s, 5, e) == EOK
        assert add(s, 6, e) == EOK
    s.checkpoint()                     # some of 5 in the index, some in the journal only
    assert add(s, 5, 5) == EOK
    s.sync()
    assert s.settled() == set()
    assert s.drop_ledgers([5]) == 1
    if how != "live":
        s = reopen(s, tmp_path, how)   # the DROP record replayed over the older ADDs
    assert s.settled() == {5} and not holds(s, 5) and holds(s, 6)
    assert_settled_is_exact(s)
    # this bookie picked to hold it again (a recovery add): it holds an entry, so the
    # next scan must see it
    assert add(s, 5, 2, recovery=True) == EOK
    assert s.settled() == set()
    assert_settled_is_exact(s)
    s.sync()                           # acknowledged (the worker syncs, then answers)
    s = reopen(s, tmp_path, "crash")   # replay: ADDs, DROP, then the recovery ADD
    assert s.settled() == set() and s.list_entries(5)[1] == [2, 2]   # (runs)
    assert_settled_is_exact(s)
    s.checkpoint()                     # in the index now, not in the write cache
    assert 5 not in s._wc and s.settled() == set()
    assert_settled_is_exact(s)
    s = reopen(s, tmp_path, "close")
    assert s.settled() == set() and s.list_entries(5)[1] == [2, 2]
    assert s.drop_ledgers([5]) == 1
    assert s.settled() == {5}
    s.close()


def test_a_drop_killed_before_its_record_leaves_the_ledger_to_claim(tmp_path, monkeypatch):
    """Killed before the DROP record was synced: the entries are still there after
    the restart, and the ledger is not settled (the next scan claims it)."""
    s = open_storage(tmp_path)
    for e in range(3):
        assert add(s, 7, e) == EOK
    s.checkpoint()

    class Killed(Exception):
        pass

    def killed(*a):
        raise Killed()
    monkeypatch.setattr(s._journal, "sync", killed)
    with pytest.raises(Killed):
        s.drop_ledgers([7])
    monkeypatch.undo()
    s = reopen(s, tmp_path, "crash")
    assert s.list_entries(7)[1] == [0, 2]            # (runs: 0..2)
    assert 7 not in s.settled()
    s.checkpoint()
    assert 7 not in s._wc and 7 not in s.settled()
    assert_settled_is_exact(s)
    s.close()


def test_a_drop_killed_between_its_record_and_the_index_is_replayed(tmp_path, monkeypatch):
    """Killed after the DROP record, before the index forgot the entries: the replay
    drops them, and the ledger is settled (nothing left to drop)."""
    s = open_storage(tmp_path)
    for e in range(3):
        assert add(s, 8, e) == EOK
    s.checkpoint()
    monkeypatch.setattr(s, "_forget", lambda lid, st: None)
    s.drop_ledgers([8])
    monkeypatch.undo()
    s = reopen(s, tmp_path, "crash")
    assert not holds(s, 8) and s.settled() == {8}
    assert_settled_is_exact(s)
    s.close()


def test_unfenced_or_holding_ledgers_are_never_settled(tmp_path, monkeypatch):
    s = open_storage(tmp_path)
    # state and no entry, not fenced: a first add whose entry the journal refused
    # after its MASTER_KEY record (a drop would fence it: not settled)
    monkeypatch.setattr(s, "_append_add", journal_full)
    assert add(s, 12, 0) == EIO
    monkeypatch.undo()
    assert 12 in s.ledgers() and not holds(s, 12)
    assert add(s, 9, 0) == EOK                   # holds entries, not fenced
    assert add(s, 10, 0) == EOK
    assert s.fence(10, b"master-key-1") == EOK   # holds entries, fenced (recovered)
    assert s.fence(11, b"master-key-1") == EOK   # fenced, never held an entry
    s.checkpoint()
    assert not s._wc and s.settled() == {11}
    assert s.fence(12, b"master-key-1") == EOK      # (what a drop would do to it)
    assert s.settled() == {11, 12}
    assert_settled_is_exact(s)
    s.close()
