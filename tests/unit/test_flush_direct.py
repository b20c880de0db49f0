"""A flush started while a group's direct journal write is in flight (direct
writes: the write of the region's last records handed out in the same pass):
the flusher waits for that write, not the loop (``ShardStorage._release_flush``),
and the loop waiting for the flusher first waits for the write itself."""

from __future__ import annotations

import pytest

import test_storage as sbase
from bk.bookie import flusher as F
from bk.errors import EOK
from bk.testing import start_elsewhere


@pytest.fixture(autouse=True)
def copying(monkeypatch):
    """Flushes that copy every entry (the path that reads the journal's files)."""
    monkeypatch.setattr(F, "ADOPT_MIN_BYTES", 1 << 62)


def fill(s, n=40):
    for e in range(n):
        for lid in (1, 2):
            assert sbase.add(s, lid, e) == EOK


def test_a_flush_waits_for_the_groups_write_in_flight_not_the_loop(tmp_path):
    s = sbase.open_storage(tmp_path, direct_journal=True)
    assert s._journal.direct
    fill(s)
    job = s.begin_sync()                       # the group's write, handed out
    assert job.parts is not None
    waited = []
    start_elsewhere(job, waited)
    s._start_flush()
    assert waited == [], "the loop waited for the write in flight at the flush's start"
    flush = s._flush_write[1]
    s.maintain()                                # still in flight: nothing released
    assert not flush.written.is_set() and s._flusher.done.empty()
    job.wait()                                  # the write completes...
    s.end_sync(job)                             # ...and the loop takes it back
    s.maintain()
    assert flush.written.is_set() and not flush.abandoned and s._flush_write is None
    s.checkpoint()
    assert s.stats()["checkpoints"] >= 1 and s.stats()["write_cache_entries"] == 0
    for e in range(40):                         # read back from the entry log
        for lid in (1, 2):
            sbase.assert_entry(s, lid, e)
    s.close()


def test_waiting_for_the_flusher_first_waits_for_the_write(tmp_path):
    """checkpoint (or back-pressure, GC, close) waits for the flusher, which waits
    for a write only the loop takes back: the loop waits for the write first."""
    s = sbase.open_storage(tmp_path, direct_journal=True)
    fill(s)
    job = s.begin_sync()
    waited = []
    start_elsewhere(job, waited)
    s._start_flush()
    s.checkpoint()
    assert waited == [job]
    s.end_sync(job)
    for e in range(40):
        for lid in (1, 2):
            sbase.assert_entry(s, lid, e)
    s.close()


def test_a_failed_write_fails_the_flush_and_keeps_the_tail(tmp_path):
    s = sbase.open_storage(tmp_path, direct_journal=True)
    fill(s)
    before = s.stats()["checkpoints"]
    job = s.begin_sync()
    job.started(lambda jb, timeout=None: None)     # in flight, never completes here
    s._start_flush()
    flush = s._flush_write[1]
    job.error = OSError(5, "injected")           # the write failed
    s._journal._inflight = None                  # taken back (end_sync would raise)
    s.maintain()
    assert flush.abandoned and flush.written.is_set()
    s._wait_flusher()
    assert flush.error is not None and s.stats()["checkpoints"] == before
    assert s._flushing is None and s._wc_entries == 80     # merged back: nothing lost
    sbase.crash(s)
