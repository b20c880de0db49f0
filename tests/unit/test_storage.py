"""ShardStorage: statuses, ledger state, flushes, restarts, crashes, GC and compaction."""

from __future__ import annotations

import gc
import os
import threading

import pytest

from bk.bookie import flusher as F
from bk.bookie import journal as J
from bk.bookie.entrylog import HEADER_SIZE, JOURNAL_LOG, PACE_STEP, EntryLogs, WritePacer
from bk.bookie import storage as S
from bk.bookie.flusher import FLUSH_MIN_RATE
from bk.bookie.storage import ShardStorage, flush_rate
from bk.errors import EBADREQ, EFENCED, EIO, ENOENTRY, ENOLEDGER, EOK, EUA
from bk.testing import resident_pages as resident, wait_until

SEG = 64 * 1024
KEY = b"master-key-1"
OTHER = b"master-key-2"


@pytest.fixture(autouse=True, params=["copy", "adopt"])
def flush_mode(request, monkeypatch):
    """Every test runs twice: flushes that copy every entry into entry logs, and
    flushes that leave every in-order span in its journal segment (the long
    ones do in production, see bk.bookie.entrylog)."""
    monkeypatch.setattr(F, "ADOPT_MIN_BYTES", 1 if request.param == "adopt" else 1 << 62)
    return request.param


def open_storage(tmp_path, sync_data=True, size=SEG, **kw):
    kw.setdefault("flush_bytes", 1 << 30)          # flushes only when a test asks
    return ShardStorage(str(tmp_path / "journal"), str(tmp_path / "index"),
                        segment_size=size, sync_data=sync_data, **kw)


def crash(s):
    """Stop ``s`` like a killed process would: no final flush, no sync of what is
    staged. The caller then drops its reference (``del s``). A kill also ends
    the thread preparing the journal's next segment: it is waited for here (it
    leaves the segment made, as a kill after it would), else it renamed its
    ``.seg.tmp`` into place while the reopened journal was removing it as a
    crash's leftover (FileNotFoundError at the reopen, seen under load)."""
    prep = s._journal._prep
    if prep is not None:
        prep._thread.join()
    s._flusher.stop()
    s._index.close()
    s._logs.close()
    s._journal._lock.close()       # the kernel would release it; the staged tail is lost
    gc.collect()


def payload(ledger, entry, n=700):
    return (f"{ledger}/{entry}:".encode() * (n // 6 + 1))[:n]


def digest(ledger, entry):
    return f"d{ledger}.{entry}".encode().ljust(16, b"_")


def add(s, ledger, entry, lac=None, key=KEY, recovery=False, n=700):
    return s.add_entry(ledger, entry, entry - 1 if lac is None else lac, key,
                       digest(ledger, entry), payload(ledger, entry, n), recovery)


def assert_entry(s, ledger, entry, lac=None, n=700):
    assert s.read_entry(ledger, entry) == (
        EOK, entry - 1 if lac is None else lac, digest(ledger, entry), payload(ledger, entry, n))


def log_bytes(tmp_path):
    d = tmp_path / "index" / "entrylogs"
    return sum(os.path.getsize(d / n) for n in os.listdir(d))


# --- statuses -------------------------------------------------------------------

def test_add_and_read(tmp_path):
    s = open_storage(tmp_path)
    for e in range(5):
        assert add(s, 1, e) == EOK
    s.sync()
    for e in range(5):
        assert_entry(s, 1, e)
    assert s.read_lac(1) == (EOK, 3, 4)
    assert s.lac(1) == 3
    assert s.check_master_key(1, KEY) == EOK
    assert s.ledgers() == [1]
    assert s.unsynced_bytes == 0
    s.close()


def test_missing_ledger_and_entry(tmp_path):
    s = open_storage(tmp_path)
    assert s.read_entry(9, 0) == (ENOLEDGER, -1, b"", b"")
    assert s.read_lac(9) == (ENOLEDGER, -1, -1)
    assert s.lac(9) == -1
    assert s.list_entries(9) == (ENOLEDGER, [])
    assert s.check_master_key(9, KEY) == ENOLEDGER
    assert s.write_lac(9, KEY, 3) == ENOLEDGER
    assert s.is_fenced(9) is False
    add(s, 1, 0)
    assert s.read_entry(1, 1) == (ENOENTRY, -1, b"", b"")
    assert s.read_entry(1, -1) == (ENOENTRY, -1, b"", b"")
    assert s.read_entry(1, 10**9) == (ENOENTRY, -1, b"", b"")
    s.close()


def test_wrong_master_key(tmp_path):
    s = open_storage(tmp_path)
    assert add(s, 1, 0) == EOK
    assert add(s, 1, 1, key=OTHER) == EUA
    assert s.read_entry(1, 1)[0] == ENOENTRY           # the refused add left nothing
    assert s.fence(1, OTHER) == EUA
    assert s.is_fenced(1) is False
    assert s.write_lac(1, OTHER, 5) == EUA
    assert s.check_master_key(1, OTHER) == EUA
    assert s.lac(1) == -1
    s.close()


def test_fenced_ledger_refuses_adds_but_not_recovery_adds(tmp_path):
    s = open_storage(tmp_path)
    for e in range(3):
        add(s, 1, e)
    before = s.unsynced_bytes
    assert s.fence(1, KEY) == EOK
    assert s.unsynced_bytes > before              # the FENCE is in the journal, to be synced
    s.sync()
    assert s.is_fenced(1)
    assert add(s, 1, 3) == EFENCED
    assert s.read_entry(1, 3)[0] == ENOENTRY
    assert add(s, 1, 3, recovery=True) == EOK
    assert_entry(s, 1, 3)
    # fencing again appends nothing
    s.sync()
    assert s.fence(1, KEY) == EOK and s.unsynced_bytes == 0
    # re-adding an existing entry (recovery) repoints the index to the new copy
    assert s.add_entry(1, 1, 7, KEY, b"new-digest", b"new payload", True) == EOK
    assert s.read_entry(1, 1) == (EOK, 7, b"new-digest", b"new payload")
    assert s.read_lac(1) == (EOK, 7, 3)
    assert s.stats()["entries"] == 4
    s.close()


def test_fence_of_an_unknown_ledger_creates_it(tmp_path):
    s = open_storage(tmp_path)
    assert s.fence(5, KEY) == EOK
    assert s.ledgers() == [5] and s.is_fenced(5)
    assert s.read_lac(5) == (EOK, -1, -1)
    assert s.check_master_key(5, KEY) == EOK
    assert add(s, 5, 0, key=OTHER, recovery=True) == EUA
    assert add(s, 5, 0) == EFENCED
    assert add(s, 5, 0, recovery=True) == EOK
    s.close()


def test_write_lac_and_read_lac(tmp_path):
    s = open_storage(tmp_path)
    add(s, 1, 0, lac=-1)
    add(s, 1, 1, lac=0)
    assert s.read_lac(1) == (EOK, 0, 1)
    assert s.write_lac(1, KEY, 1) == EOK
    assert s.read_lac(1) == (EOK, 1, 1)
    assert s.write_lac(1, KEY, 0) == EOK          # never goes backwards
    assert s.lac(1) == 1
    add(s, 1, 2, lac=1)
    assert s.read_lac(1) == (EOK, 1, 2)
    s.close()


def test_list_entries_of_a_striped_ledger(tmp_path):
    s = open_storage(tmp_path)
    for e in (0, 1, 2, 5, 6, 9, 12, 13):
        assert add(s, 3, e, n=10) == EOK
    assert s.list_entries(3) == (EOK, [0, 2, 5, 6, 9, 9, 12, 13])
    assert s.read_lac(3) == (EOK, 12, 13)
    assert s.read_entry(3, 4)[0] == ENOENTRY
    assert s.stats()["entries"] == 8
    s.close()


def test_bad_entry_ids(tmp_path):
    s = open_storage(tmp_path)
    assert add(s, 1, -1) == EBADREQ
    assert s.ledgers() == [] and s.unsynced_bytes == 0     # no state, no MASTER_KEY record
    assert add(s, 1, 0) == EOK
    assert add(s, 1, -5) == EBADREQ
    assert add(s, 1, 10**12) == EBADREQ           # would allocate a gigantic index
    assert s.add_entry(1, 1, 0, KEY, b"", bytes(SEG), False) == EBADREQ   # larger than a segment
    assert s.list_entries(1) == (EOK, [0, 0])
    s.close()


def test_index_starts_where_the_bookie_joined(tmp_path):
    # A bookie that joins a long ledger late (ensemble change at entry 10**12)
    # indexes from there; re-replication may later bring older entries.
    s = open_storage(tmp_path)
    first = 10**12
    for e in range(first, first + 5):
        assert add(s, 2, e) == EOK
    assert add(s, 2, first - 3) == EOK              # an older entry (re-replication)
    assert add(s, 2, 0) == EOK                      # even 10**12 below costs nothing
    assert s.list_entries(2) == (EOK, [0, 0, first - 3, first - 3, first, first + 4])
    assert s.read_entry(2, first + 4)[0] == EOK and s.read_entry(2, first - 1)[0] == ENOENTRY
    assert s.read_lac(2)[2] == first + 4
    s.checkpoint()
    add(s, 2, first + 5)
    s.sync()
    crash(s)                                         # flushed index + replayed tail
    del s
    s = open_storage(tmp_path)
    assert s.list_entries(2) == (EOK, [0, 0, first - 3, first - 3, first, first + 5])
    assert s.read_entry(2, first - 3)[0] == EOK and s.read_entry(2, 0)[0] == EOK
    s.close()


# --- restarts -------------------------------------------------------------------

def _populate(s):
    for e in range(40):
        assert add(s, 1, e) == EOK
    for e in range(0, 30, 3):
        assert add(s, 2, e, key=OTHER) == EOK
    assert s.fence(2, OTHER) == EOK
    assert s.write_lac(1, KEY, 38) == EOK
    assert s.fence(3, b"k3") == EOK


def _check_populated(s):
    assert s.ledgers() == [1, 2, 3]
    for e in range(40):
        assert_entry(s, 1, e)
    for e in range(0, 30, 3):
        assert_entry(s, 2, e)
    assert s.read_lac(1) == (EOK, 38, 39)
    assert s.read_lac(2) == (EOK, 26, 27)
    assert s.list_entries(2) == (EOK, [e for x in range(0, 30, 3) for e in (x, x)])
    assert not s.is_fenced(1) and s.is_fenced(2) and s.is_fenced(3)
    assert add(s, 2, 30, key=OTHER) == EFENCED
    assert add(s, 1, 40, key=OTHER) == EUA
    assert s.fence(2, KEY) == EUA
    assert s.check_master_key(3, b"k3") == EOK and s.check_master_key(3, KEY) == EUA
    assert s.stats()["entries"] == 50


def test_state_survives_close_and_reopen(tmp_path):
    s = open_storage(tmp_path)
    _populate(s)
    s.close()
    s.close()                      # idempotent
    s = open_storage(tmp_path)
    assert s.stats()["replayed_records"] == 0          # all from the index
    _check_populated(s)
    s.close()


@pytest.mark.parametrize("sync_data", [True, False])
def test_state_survives_a_crash(tmp_path, sync_data):
    s = open_storage(tmp_path, sync_data=sync_data)
    _populate(s)
    s.sync()
    crash(s)
    del s
    s = open_storage(tmp_path, sync_data=sync_data)
    assert s.stats()["replayed_records"] > 50
    _check_populated(s)
    s.close()


def test_checkpoint_then_more_adds_then_crash(tmp_path):
    s = open_storage(tmp_path)
    for e in range(20):
        add(s, 1, e)
    s.checkpoint()
    mark = s.stats()["last_mark"]
    for e in range(20, 150):                # several segment rolls after the checkpoint
        add(s, 1, e)
    s.fence(1, KEY)
    add(s, 1, 150, recovery=True)
    s.sync()
    crash(s)
    del s
    s = open_storage(tmp_path)
    st = s.stats()
    assert st["replayed_records"] == 132          # only what followed the mark
    assert st["segments"] > 1 and st["last_mark"] == mark
    for e in range(151):
        assert_entry(s, 1, e)
    assert s.is_fenced(1)
    s.checkpoint()
    assert s.stats()["segments"] == 1             # flushed: the older segments are gone
    s.close()


def test_restart_does_not_rescan_with_a_checkpoint(tmp_path, monkeypatch):
    s = open_storage(tmp_path)
    for e in range(200):
        add(s, 1, e)
    s.close()
    scanned = []
    real_scan = J._scan

    def counting_scan(mv, size, off, full):
        for item in real_scan(mv, size, off, full):
            scanned.append(item)
            yield item
    monkeypatch.setattr(J, "_scan", counting_scan)
    s = open_storage(tmp_path)
    assert len(scanned) == 1                # just the clean end after the mark
    assert_entry(s, 1, 199)
    s.close()


def test_torn_tail_loses_only_the_unsynced_last_add(tmp_path):
    s = open_storage(tmp_path)
    for e in range(10):
        add(s, 1, e)
    s.sync()
    pos_last = s._wc[1].get(9)
    crash(s)
    del s
    seq, off = J.split_position(pos_last)
    with open(tmp_path / "journal" / J.segment_name(seq), "r+b") as f:
        f.seek(off + 100)
        f.write(b"\x00" * 50)                  # the tail of the last add never made it
    s = open_storage(tmp_path)
    for e in range(9):
        assert_entry(s, 1, e)
    assert s.read_entry(1, 9)[0] == ENOENTRY
    assert s.read_lac(1) == (EOK, 7, 8)
    assert add(s, 1, 9) == EOK
    s.close()
    s = open_storage(tmp_path)
    assert_entry(s, 1, 9)
    s.close()


# --- flushes ----------------------------------------------------------------------

@pytest.mark.parametrize("flush_mode", ["copy"], indirect=True)   # entry-log layout
def test_flush_moves_entries_to_sorted_entry_logs_and_is_incremental(tmp_path):
    s = open_storage(tmp_path)
    for e in range(100):                       # three ledgers interleaved in the journal
        for lid in (3, 1, 2):
            assert add(s, lid, e, n=100) == EOK
    assert s._wc[1].spans is None              # one entry a span: not worth keeping spans
    s.checkpoint()
    first = s.stats()
    assert first["entries"] == 300 and first["write_cache_entries"] == 0
    assert first["last_flush_bytes"] > 300 * 100
    # in the entry log each ledger's entries lie together, in entry order
    runs = s._index.runs_of(1) + s._index.runs_of(2) + s._index.runs_of(3)
    assert [(r.ledger, r.first, r.count) for r in runs] == [(1, 0, 100), (2, 0, 100),
                                                           (3, 0, 100)]
    assert runs[0].off + runs[0].nbytes == runs[1].off
    for e in range(10):
        add(s, 1, 100 + e, n=100)
    s.checkpoint()
    # the second flush wrote only what came after the first
    assert s.stats()["last_flush_bytes"] < first["last_flush_bytes"] / 10
    for lid in (1, 2, 3):
        for e in range(100):
            assert_entry(s, lid, e, n=100)
    s.close()


def test_reads_and_writes_go_on_while_a_flush_runs(tmp_path):
    s = open_storage(tmp_path, flush_bytes=256 * 1024, write_cache_bytes=64 << 20)
    n = 0
    flushes = 0
    while flushes < 3:
        assert add(s, 1, n) == EOK
        n += 1
        s.maintain()
        if s._flushing is not None:
            # the swapped tail is still readable while the flusher copies it
            assert_entry(s, 1, n - 1)
            assert_entry(s, 1, 0)
        flushes = s.stats()["checkpoints"]
    s.sync()
    for e in range(n):
        assert_entry(s, 1, e)
    s.close()


@pytest.mark.parametrize("flush_mode", ["copy"], indirect=True)   # entry-log layout
def test_more_entries_than_the_caches_hold(tmp_path):
    """Memory is the write cache and the read-ahead cache: a shard holding far more
    serves old entries from entry logs, with read-ahead."""
    s = open_storage(tmp_path, size=1 << 20, flush_bytes=None, write_cache_bytes=2 << 20,
                     read_cache_bytes=64 * 1024, read_ahead_entries=10)
    for e in range(6000):                      # ~4.4 MB: several flushes
        for lid in (5, 6):
            assert add(s, lid, e) == EOK
        if e % 500 == 0:
            s.sync()
            s.maintain()
    s.checkpoint()
    st = s.stats()
    assert st["checkpoints"] >= 3 and st["entries"] == 12000
    assert st["write_cache_entries"] == 0
    for e in range(0, 6000, 7):
        assert_entry(s, 5, e)
    for e in range(100, 140):                  # sequential: mostly read-ahead hits
        assert_entry(s, 6, e)
    st = s.stats()
    assert st["read_cache_hits"] >= 30 and st["read_cache_bytes"] <= 64 * 1024
    status, nxt, got = s.read_range(6, 0, 5999, 10 << 20, max_count=5000)
    assert status == EOK and nxt == 5000 and got[0::4] == list(range(5000))
    assert got[3::4][4321] == payload(6, 4321)
    s.close()


def test_read_range_over_index_and_tail_with_a_stride(tmp_path):
    s = open_storage(tmp_path)
    for e in range(0, 60, 3):
        add(s, 4, e, n=50)                     # a stripe: every third entry
    s.checkpoint()
    for e in range(60, 90, 3):
        add(s, 4, e, n=50)                     # still in the write cache
    status, nxt, got = s.read_range(4, 0, 200, 1 << 20, stride=3, offset=0)
    assert status == EOK and got[0::4] == list(range(0, 90, 3)) and nxt == 201
    status, nxt, got = s.read_range(4, 0, 200, 1 << 20, stride=6, offset=3)
    assert got[0::4] == list(range(3, 90, 6))
    status, nxt, got = s.read_range(4, 10, 40, 120)          # the byte budget
    assert got[0::4] == [12, 15] and nxt == 18
    assert s.read_range(4, 1, 2, 1 << 20) == (EOK, 3, [])
    s.close()


def test_a_range_budget_is_of_payload_in_the_write_cache_and_the_entry_logs(tmp_path):
    """``max_bytes`` of a READ_RANGE is of payload, the same answer before and
    after a flush: uniform records, a stride over them, and records of varied
    sizes. Counting digests too once flushed cut each answer one entry short,
    and a reader that sizes its requests by its entries followed every one up."""
    s = open_storage(tmp_path)
    size = {5: lambda e: 600, 6: lambda e: 100 + 6 * e}     # 16-byte digests

    def data(lid, e):
        return bytes([e]) * size[lid](e)
    for e in range(40):
        for lid in (5, 6):
            assert s.add_entry(lid, e, e - 1, KEY, digest(lid, e), data(lid, e), False) == EOK

    def budget(lid, entries):
        return sum(size[lid](e) for e in entries)
    cases = [((5, 0, 39, budget(5, range(10))), list(range(10)), 10),
             ((5, 0, 39, budget(5, range(0, 10, 2)), 2, 0), list(range(0, 10, 2)), 9),
             ((6, 3, 39, budget(6, range(3, 10))), list(range(3, 10)), 10)]
    for flushed in (False, True):
        if flushed:
            s.checkpoint()
            assert s.stats()["write_cache_entries"] == 0
        for args, entries, nxt in cases:
            status, got_nxt, got = s.read_range(*args)
            assert (status, got_nxt, got[0::4]) == (EOK, nxt, entries), (flushed, args)
            assert got[3::4] == [data(args[0], e) for e in entries]
    s.close()


def catch_up(s, ledger, first, last, budget, stride=1, offset=0):
    """Read ``first..last`` with successive READ_RANGEs, as a catch-up reader
    does: each from the ``next`` of the previous answer."""
    got = []
    e = first
    while e <= last:
        status, nxt, entries = s.read_range(ledger, e, last, budget, stride, offset)
        assert status == EOK and nxt > e
        assert entries[0::4] == sorted(entries[0::4]) and all(x >= e for x in entries[0::4])
        got += entries
        e = nxt
    return got


def test_prefetch_asks_for_every_run_once_and_walks_the_index_seldom(tmp_path):
    """A catch-up reader's READ_RANGEs have the disk start on every byte of the
    ledger's runs before they are read, each byte once, and the index is walked
    for that far less often than once a request."""
    s = open_storage(tmp_path, flush_bytes=None, write_cache_bytes=2 << 20,
                     log_size_limit=1 << 20, read_cache_bytes=64 << 10)
    for e in range(0, 2000, 10):              # ten entries of each ledger at a time
        for lid in (21, 22, 23):
            for x in range(e, e + 10):
                assert add(s, lid, x, n=200) == EOK
        s.sync()
        s.maintain()
    s.checkpoint()
    hinted = []
    walks = 0
    logs_prefetch, runs_from = s._logs.prefetch, s._index.runs_from

    def prefetch(log_id, off, n):
        hinted.append((log_id, off, n))
        logs_prefetch(log_id, off, n)

    def counted_runs_from(*a):
        nonlocal walks
        walks += 1
        return runs_from(*a)
    s._logs.prefetch = prefetch
    s._index.runs_from = counted_runs_from
    requests = 0
    e = 0
    read = set()
    while e <= 1999:
        status, nxt, got = s.read_range(22, e, 1999, 8 << 10)
        assert status == EOK and got[0::4] == list(range(e, nxt))
        read.update(got[0::4])
        requests += 1
        e = nxt
    assert read == set(range(2000))
    spans = sorted(hinted)
    for (la, oa, na), (lb, ob, nb) in zip(spans, spans[1:]):
        assert la != lb or oa + na <= ob, "a byte was hinted twice"
    runs = s._index.runs_of(22)
    need = sum(r.rel(r.count) for r in runs)
    assert sum(n for _, _, n in hinted) == need      # every byte of every run
    walks -= requests                             # one of each request's is its read
    assert walks * 3 <= requests, (walks, requests)   # was one walk a request
    s.close()


def test_catch_up_over_many_runs_with_prefetch(tmp_path, monkeypatch):
    """A ledger written among others lies in many runs over several entry logs:
    successive READ_RANGEs (prefetching the next runs) return every entry once,
    intact, cut at their byte budgets, with and without a stride; the prefetch
    positions kept are bounded."""
    monkeypatch.setattr(S, "PREFETCH_LEDGERS", 3)
    s = open_storage(tmp_path, flush_bytes=None, write_cache_bytes=2 << 20,
                     log_size_limit=1 << 20, read_cache_bytes=256 << 10)
    assert s.prefetch_bytes == 256 << 10
    ledgers = (11, 12, 13, 14, 15)
    for e in range(0, 1500, 10):             # ten entries of each ledger at a time
        for lid in ledgers:
            for x in range(e, e + 10):
                assert add(s, lid, x, n=300 + x % 7) == EOK   # sizes vary: offset tables
        s.sync()
        s.maintain()
    s.checkpoint()
    runs = s._index.runs_of(12)
    assert len(runs) >= 3 and len({r.log for r in runs}) >= 2
    for lid in ledgers:
        got = catch_up(s, lid, 0, 1499, budget=50_000)
        assert got[0::4] == list(range(1500))
        assert got[1::4] == [x - 1 for x in range(1500)]
        assert all(got[2 + 4 * x] == digest(lid, x) for x in range(1500))
        assert all(got[3 + 4 * x] == payload(lid, x, 300 + x % 7) for x in range(1500))
    assert len(s._ahead) <= 3
    got = catch_up(s, 13, 5, 1400, budget=20_000, stride=3, offset=2)
    assert got[0::4] == list(range(5, 1401, 3))
    assert all(got[3 + 4 * i] == payload(13, x, 300 + x % 7)
               for i, x in enumerate(range(5, 1401, 3)))
    # a budget smaller than one entry still returns one entry per request
    status, nxt, got = s.read_range(14, 700, 1499, 1)
    assert status == EOK and got[0::4] == [700] and nxt == 701
    s.close()


def test_a_corrupt_record_ends_a_range_before_it(tmp_path):
    """READ_RANGE returns the good records before a corrupt one, then EIO for
    it: the client reads that entry from another replica."""
    s = open_storage(tmp_path)
    for e in range(50):
        assert add(s, 21, e, n=500) == EOK
    s.checkpoint()
    run = s._index.lookup(21, 30)
    i = run.index_of(30)
    at = run.off + run.rel(i) + J.ADD_OVERHEAD + len(digest(21, 30)) + 100
    fd = os.open(s._logs.path(run.log), os.O_RDWR)
    try:
        b = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), at)      # one flipped payload byte
    finally:
        os.close(fd)
    status, nxt, got = s.read_range(21, 0, 49, 1 << 20)
    assert status == EOK and nxt == 30 and got[0::4] == list(range(30))
    assert got[3::4] == [payload(21, x, 500) for x in range(30)]
    assert s.read_range(21, 30, 49, 1 << 20)[0] == EIO
    assert s.read_entry(21, 30)[0] == EIO
    status, nxt, got = s.read_range(21, 31, 49, 1 << 20)
    assert status == EOK and got[0::4] == list(range(31, 50))
    s.close()


@pytest.mark.parametrize("flush_mode", ["copy"], indirect=True)   # entry-log layout
def test_catch_up_reads_racing_a_compaction(tmp_path, monkeypatch):
    """A catch-up reader's READ_RANGEs while a compaction copies its runs, after
    the compaction's index commit and after its old logs are gone all return
    the same intact entries."""
    s = open_small_logs(tmp_path)
    _two_ledgers(s, n=1200)
    assert s.delete_ledgers([7]) == 1
    copied = threading.Event()
    go_on = threading.Event()
    commit = s._index.write

    def held_commit():
        copied.set()                           # the live runs are copied, not committed
        assert go_on.wait(30)
        return commit()
    monkeypatch.setattr(s._index, "write", held_commit)

    def read_all():
        got = catch_up(s, 8, 0, 1199, budget=64 << 10)
        assert got[0::4] == list(range(1200))
        assert got[3::4] == [payload(8, x) for x in range(1200)]
    assert s.start_compaction(0.6)
    assert copied.wait(30)
    read_all()                                 # old runs, while the copies are being made
    go_on.set()
    # the commit is done, not yet taken back by the loop
    wait_until(lambda: not s._flusher.done.empty(), timeout=30, step=0.001,
               what="the compaction's commit")
    read_all()                                 # this snapshot of the index: old logs
    stats = s.compaction_result()
    assert stats["logs_removed"] >= 1 and stats["entries_moved"] > 0
    read_all()                                 # the new runs, old logs forgotten
    _check_survivor(s, n=1200)
    s.close()


def test_an_entry_rewritten_after_a_flush_is_merged(tmp_path):
    """Re-replication filling a gap of a flushed run, and a recovery add rewriting
    a flushed entry: the runs stay disjoint and the newest copy is served."""
    s = open_storage(tmp_path)
    for e in (0, 1, 2, 6, 7, 8):
        add(s, 9, e, n=30)
    s.checkpoint()
    assert_entry(s, 9, 6, n=30)              # reads 7 and 8 ahead into the cache
    assert s.stats()["read_cache_bytes"] > 0
    for e in (3, 4, 5):
        add(s, 9, e, n=30)
    assert s.add_entry(9, 7, 6, KEY, b"new", b"rewritten", True) == EOK
    s.checkpoint()
    runs = s._index.runs_of(9)
    assert [(r.first, r.last) for r in runs] == [(0, 2), (3, 8)]    # disjoint
    assert s.read_entry(9, 7) == (EOK, 6, b"new", b"rewritten")
    for e in (0, 3, 5, 8):
        assert_entry(s, 9, e, n=30)
    assert s.list_entries(9) == (EOK, [0, 8]) and s.stats()["entries"] == 9
    s.close()


@pytest.mark.parametrize("flush_mode", ["copy"], indirect=True)   # entry-log layout
def test_entry_logs_spread_over_ledger_directories(tmp_path):
    dirs = [str(tmp_path / "d1"), str(tmp_path / "d2")]
    s = open_storage(tmp_path, ledger_dirs=dirs, log_size_limit=1 << 20)
    for e in range(4000):
        add(s, 1, e)
        if e % 1000 == 999:
            s.checkpoint()
    s.checkpoint()
    counts = [len(os.listdir(os.path.join(d, "entrylogs"))) for d in dirs]
    assert all(counts) and sum(counts) == s.stats()["entry_logs"] >= 2
    s.close()
    s = open_storage(tmp_path, ledger_dirs=dirs)
    for e in range(0, 4000, 13):
        assert_entry(s, 1, e)
    s.close()


def test_a_crash_during_a_flush_loses_nothing(tmp_path, monkeypatch):
    """The flusher dies after writing the entry log, before its index commit: the
    journal still has everything, the log bytes are unreferenced and removed."""
    s = open_storage(tmp_path)
    for e in range(50):
        add(s, 1, e)
    s.checkpoint()
    for e in range(50, 120):
        add(s, 1, e)
    s.sync()

    def die(*a, **k):
        raise OSError("simulated crash before the index commit")
    monkeypatch.setattr(s._index, "write", die)
    with pytest.raises(J.JournalError):
        s.checkpoint()
    monkeypatch.undo()
    for e in range(120):                       # still served, from the journal
        assert_entry(s, 1, e)
    crash(s)
    del s
    s = open_storage(tmp_path)
    assert s.stats()["replayed_records"] == 70
    for e in range(120):
        assert_entry(s, 1, e)
    s.close()


# --- deletion and compaction -------------------------------------------------------

def _two_ledgers(s, n=200):
    """Interleave a doomed ledger 7 and a surviving ledger 8 over several entry logs."""
    for e in range(n):
        assert add(s, 7, e) == EOK
        assert add(s, 8, e, key=OTHER) == EOK
        if e % 50 == 49:
            s.checkpoint()
    assert s.fence(8, OTHER) == EOK
    assert s.write_lac(8, OTHER, n - 1) == EOK
    s.checkpoint()


def _check_survivor(s, n=200):
    assert s.ledgers() == [8]
    for e in range(n):
        assert_entry(s, 8, e)
    assert s.read_lac(8) == (EOK, n - 1, n - 1)
    assert s.is_fenced(8)
    assert add(s, 8, n, key=OTHER) == EFENCED
    assert add(s, 8, n, key=KEY, recovery=True) == EUA


def open_small_logs(tmp_path, **kw):
    return open_storage(tmp_path, log_size_limit=1 << 20, **kw)


@pytest.mark.parametrize("flush_mode", ["copy"], indirect=True)   # entry-log layout
def test_delete_then_compact_gives_space_back(tmp_path):
    s = open_small_logs(tmp_path)
    _two_ledgers(s, n=1200)                    # ~1.7 MB over two entry logs
    before = log_bytes(tmp_path)
    assert s.stats()["entry_logs"] >= 2
    assert s.compact(0.5)["logs_removed"] == 0          # everything is live
    assert s.delete_ledgers([7, 99]) == 1
    assert s.read_entry(7, 0)[0] == ENOLEDGER
    stats = s.compact(0.6)
    assert stats["logs_removed"] >= 1 and stats["entries_moved"] > 0
    after = log_bytes(tmp_path)
    assert after < before * 0.75 and stats["bytes_freed"] > 0
    assert s.stats()["entry_log_bytes"] == after
    _check_survivor(s, n=1200)
    s.close()
    s = open_small_logs(tmp_path)
    _check_survivor(s, n=1200)
    s.close()


def test_unreferenced_logs_are_simply_removed(tmp_path):
    s = open_small_logs(tmp_path)
    for e in range(1600):
        add(s, 7, e)
    s.checkpoint()
    add(s, 8, 0)
    s.checkpoint()
    s.delete_ledgers([7])
    stats = s.compact(0.01)
    assert stats["logs_removed"] >= 1 and stats["entries_moved"] == 0
    assert_entry(s, 8, 0)
    s.close()


def test_compaction_max_bytes_bounds_each_call(tmp_path):
    s = open_storage(tmp_path, log_size_limit=1 << 20)
    for e in range(3000):                      # ~2.2 MB: three logs, each with ledger 8
        add(s, 7, e)
        add(s, 8, e, key=OTHER)
        if e % 700 == 699:
            s.checkpoint()
    s.checkpoint()
    s.delete_ledgers([7])
    first = s.compact(0.6, max_bytes=1)
    assert first["logs_removed"] == 1            # one log per call at most
    for e in range(3000):
        assert_entry(s, 8, e)
    s.close()


def test_a_crash_during_compaction_loses_nothing(tmp_path, monkeypatch):
    s = open_small_logs(tmp_path)
    _two_ledgers(s, n=1200)
    s.delete_ledgers([7])

    def die(*a, **k):
        raise OSError("simulated crash before the compaction's commit")
    monkeypatch.setattr(s._index, "write", die)
    stats = s.compact(0.6)
    assert "error" in stats and stats["logs_removed"] == 0
    monkeypatch.undo()
    _check_survivor(s, n=1200)
    crash(s)
    del s
    s = open_small_logs(tmp_path)
    _check_survivor(s, n=1200)
    assert s.compact(0.6)["logs_removed"] >= 1
    _check_survivor(s, n=1200)
    s.close()


def test_stats(tmp_path):
    s = open_storage(tmp_path)
    for e in range(10):
        add(s, 1, e)
    s.sync()
    for e in range(10, 15):
        add(s, 1, e)
    s.sync()
    st = s.stats()
    assert st["ledgers"] == 1 and st["entries"] == 15
    assert st["syncs"] == 2
    assert st["synced_records"] == 16              # 15 adds + the MASTER_KEY
    assert st["segments"] == 1 and st["journal_bytes"] == SEG
    assert st["journal_mark"].startswith("1:")
    s.close()
    # after close (the worker's last heartbeat): the counts at the end
    assert s.stats()["entries"] == 15 and s.stats()["syncs"] >= 2


# --- tombstones ---------------------------------------------------------------------

def test_deleted_ledger_stays_fenced(tmp_path):
    s = open_storage(tmp_path)
    for e in range(3):
        assert add(s, 5, e) == EOK
    assert s.delete_ledgers([5]) == 1
    assert add(s, 5, 3) == EFENCED                    # the old writer
    assert add(s, 5, 3, recovery=True) == EFENCED     # nor a recovery write
    assert add(s, 5, 0) == EFENCED                    # nor from the start
    assert s.fence(5, KEY) == ENOLEDGER               # fencing creates nothing
    assert s.read_entry(5, 0)[0] == ENOLEDGER
    assert s.read_lac(5)[0] == ENOLEDGER
    assert 5 not in s.ledgers()
    assert s.stats()["tombstones"] == 1
    assert add(s, 6, 0) == EOK                        # other ledgers are untouched
    s.close()


@pytest.mark.parametrize("how", ["close", "crash", "compacted"])
def test_tombstone_survives_restart_replay_and_compaction(tmp_path, how):
    s = open_small_logs(tmp_path)
    _two_ledgers(s, n=1200)
    s.delete_ledgers([7])
    if how == "compacted":
        assert s.compact(0.6)["logs_removed"] > 0
    if how == "crash":
        crash(s)
        del s
    else:
        s.close()
    s = open_small_logs(tmp_path)
    assert add(s, 7, 10_000) == EFENCED
    assert s.fence(7, KEY) == ENOLEDGER
    assert 7 not in s.ledgers()
    _check_survivor(s, n=1200)
    s.close()


def test_a_crash_between_tombstone_and_delete_record_deletes(tmp_path, monkeypatch):
    s = open_storage(tmp_path)
    for e in range(3):
        assert add(s, 5, e) == EOK
    s.sync()
    s._tomb.add([5])                                  # the tombstone made it, nothing else
    crash(s)
    del s
    s = open_storage(tmp_path)
    assert 5 not in s.ledgers() and add(s, 5, 3) == EFENCED
    s.close()


def test_many_tombstones_are_compact(tmp_path):
    s = open_storage(tmp_path)
    ids = list(range(1 << 40, (1 << 40) + 200_000, 2))
    s._tomb.add(ids)
    assert os.path.getsize(tmp_path / "index" / "tombstones") == 8 + 8 * len(ids)
    assert s._tomb._ids.itemsize * len(s._tomb._ids) == 8 * len(ids)
    s.close()
    s = open_storage(tmp_path)
    assert s.tombstones == len(ids)
    assert (1 << 40) + 2 in s._tomb and (1 << 40) + 3 not in s._tomb
    s.close()


def test_torn_tombstone_append_keeps_the_whole_ids(tmp_path):
    s = open_storage(tmp_path)
    s._tomb.add([11, 12])
    s.close()
    with open(tmp_path / "index" / "tombstones", "ab") as f:
        f.write(b"\x01\x02\x03")                      # half an id: a torn append
    s = open_storage(tmp_path)
    assert s.tombstones == 2 and 11 in s._tomb
    assert add(s, 11, 0) == EFENCED
    s.close()


# --- over-replicated ledgers (dropped entries, no tombstone) -----------------------------

@pytest.mark.parametrize("how", ["live", "close", "crash", "no-checkpoint"])
def test_dropped_ledger_stays_fenced_without_a_tombstone(tmp_path, monkeypatch, how):
    s = open_storage(tmp_path)
    for e in range(5):
        assert add(s, 5, e) == EOK
    assert add(s, 6, 0) == EOK
    if how == "no-checkpoint":
        # A crash after the DROP record, before the index forgot: the replay applies it.
        s.checkpoint()
        monkeypatch.setattr(s, "_forget", lambda lid, st: None)
    assert s.drop_ledgers([5]) == 1
    if how == "close":
        s.close()
    elif how in ("crash", "no-checkpoint"):
        monkeypatch.undo()
        crash(s)
        del s
    if how != "live":
        s = open_storage(tmp_path)
    assert s.read_entry(5, 0)[0] == ENOENTRY          # its entries are gone
    assert s.list_entries(5)[1] == []
    assert add(s, 5, 5) == EFENCED                    # an old writer is still refused
    assert s.tombstones == 0                          # but nothing is buried:
    assert add(s, 5, 2, recovery=True) == EOK         # re-replication to it is taken
    assert_entry(s, 5, 2)
    assert_entry(s, 6, 0)                             # other ledgers untouched
    s.close()
    s = open_storage(tmp_path)                        # and that survives a restart
    assert_entry(s, 5, 2)
    assert s.read_entry(5, 0)[0] == ENOENTRY
    assert add(s, 5, 6) == EFENCED
    s.close()


# --- batched adds (ADD_BATCH) ----------------------------------------------------------

def _batch(s, ents, key=KEY, recovery=False):
    """Append (ledger, entry, lac, digest, payload) entries as one ADD_BATCH."""
    from bk import protocol as P
    recs = b"".join(P.add_record_head(l, e, a, d, len(p)) + p for l, e, a, d, p in ents)
    acked, errors = [], []
    failed = s.add_batch(recs, len(ents), key, recovery, acked, errors)
    assert failed == len(errors) // 3
    return acked, errors


def test_add_batch_is_add_entry_entry_by_entry(tmp_path):
    """Same entries as single adds and as batches (two ledgers interleaved, runs that
    roll segments): the same index, accounting, LAC and data, also after a restart."""
    a = open_storage(tmp_path / "a", sync_data=False)
    b = open_storage(tmp_path / "b", sync_data=False)
    ents = [(lid, e, e - 2, digest(lid, e), payload(lid, e, 100 + e % 300))
            for e in range(400) for lid in (3, 4)]
    for lid, e, lac, d, p in ents:
        assert a.add_entry(lid, e, lac, KEY, d, p, False) == EOK
    for k in range(0, len(ents), 77):
        acked, errors = _batch(b, ents[k:k + 77])
        assert not errors
    for s in (a, b):
        s.sync()
    for lid in (3, 4):
        la, lb = a._ledgers[lid], b._ledgers[lid]
        assert (la.lac, la.last, la.fenced) == (lb.lac, lb.last, False)
        assert a._wc[lid].items() != [] and len(a._wc[lid].items()) == len(b._wc[lid].items())
        for e in range(400):
            assert a.read_entry(lid, e) == b.read_entry(lid, e)
    assert a.stats()["entries"] == b.stats()["entries"] == 800
    assert len(b._journal.segments()) > 2
    b.close()
    b = open_storage(tmp_path / "b", sync_data=False)
    assert b.read_entry(4, 399) == a.read_entry(4, 399)


def test_add_batch_statuses_per_entry(tmp_path):
    s = open_storage(tmp_path)
    ents = [(7, e, e - 1, digest(7, e), payload(7, e)) for e in range(6)]
    acked, errors = _batch(s, ents[:3])
    assert acked == [7, 0, 2] and errors == []
    assert s.fence(7, KEY) == EOK
    acked, errors = _batch(s, ents[3:])                      # after the fence: each refused
    assert acked == [] and errors == [7, 3, EFENCED, 7, 4, EFENCED, 7, 5, EFENCED]
    acked, errors = _batch(s, ents[3:5], recovery=True)      # recovery adds go in
    assert acked == [7, 3, 4] and errors == []
    acked, errors = _batch(s, ents[5:], key=OTHER, recovery=True)
    assert acked == [] and errors == [7, 5, EUA]
    # a gap and a rewrite of an old entry go through the general path, same ack runs
    acked, errors = _batch(s, [(8, 0, -1, b"d", b"x"), (8, 5, 0, b"d", b"y"),
                               (8, 2, 0, b"d", b"z")])
    assert acked == [8, 0, 0, 8, 5, 5, 8, 2, 2] and errors == []
    assert_entry(s, 7, 4)
    assert s.read_entry(7, 5)[0] == ENOENTRY
    assert [s.read_entry(8, e)[3] for e in (0, 2, 5)] == [b"x", b"z", b"y"]
    assert s.read_entry(8, 1)[0] == ENOENTRY


def test_add_batch_refuses_only_the_entry_too_large_for_a_segment(tmp_path):
    """A run of a ledger's next entries with one larger than a segment in it: that
    one is refused (EBADREQ, as a single ADD of it), the ones around it go in."""
    s = open_storage(tmp_path)
    ents = [(9, e, e - 1, digest(9, e), payload(9, e)) for e in range(6)]
    ents[3] = (9, 3, 2, digest(9, 3), bytes(SEG))
    acked, errors = _batch(s, ents[:1])
    acked, errors = _batch(s, ents[1:])              # the fast path: a known ledger
    assert errors == [9, 3, EBADREQ] and acked == [9, 1, 2, 9, 4, 5]
    s.sync()
    for e in (0, 1, 2, 4, 5):
        assert_entry(s, 9, e)
    assert s.read_entry(9, 3)[0] == ENOENTRY
    assert (s._ledgers[9].lac, s._ledgers[9].last) == (4, 5)
    s.close()
    s = open_storage(tmp_path)
    assert [s.read_entry(9, e)[0] for e in range(6)] == [EOK, EOK, EOK, ENOENTRY, EOK, EOK]
    s.close()


def _records(ents):
    from bk import protocol as P
    return b"".join(P.add_record_head(l, e, a, d, len(p)) + p for l, e, a, d, p in ents)


@pytest.mark.parametrize("case", ["truncated-last", "truncated-head", "count-short",
                                  "count-long", "negative-entry", "negative-ledger",
                                  "gap-then-truncated"])
def test_add_batch_malformed_records(tmp_path, case):
    """The one-pass walk refuses what ``protocol.split_add_batch`` refuses
    (ProtocolError), wherever in the batch and whether the record is in a run
    of the fast path or not; the entries before it are whole in the journal
    (the connection is closed, none acknowledged) and nothing after it is."""
    from bk.errors import ProtocolError
    s = open_storage(tmp_path)
    ents = [(5, e, e - 1, digest(5, e), payload(5, e)) for e in range(8)]
    _batch(s, ents[:1])                        # ledger 5 known: the next ones are a run
    good = ents[1:6]
    recs, count = _records(good), len(good)
    if case == "truncated-last":
        recs = recs[:-10]
    elif case == "truncated-head":
        recs = recs + _records(ents[6:7])[:20]
        count += 1
    elif case == "count-short":
        count += 1
    elif case == "count-long":
        count -= 2                             # carries two more whole records
    elif case == "negative-entry":
        recs += _records([(5, -1, 0, b"d", b"x")])
        count += 1
    elif case == "negative-ledger":
        recs += _records([(-5, 6, 0, b"d", b"x")])
        count += 1
    elif case == "gap-then-truncated":         # a gap (the slow path), then a torn one
        recs = _records(good[:2] + [ents[7]]) + _records(ents[6:7])[:-1]
        count = 4
    with pytest.raises(ProtocolError):
        s.add_batch(recs, count, KEY, False, [], [])
    s.sync()
    last = s._ledgers[5].last
    assert s.stats()["entries"] == sum(p >= 0 for p in s._wc[5].pos)   # all accounted for
    for e in range(0, last + 1):
        st = s.read_entry(5, e)
        if st[0] == EOK:
            assert st[3] == payload(5, e)
    assert s.read_entry(5, 6)[0] == ENOENTRY   # never the torn or negative record
    if case == "count-long":                   # all five went in before the count was off
        assert last == 5 and [s.read_entry(5, e)[0] for e in range(6)] == [EOK] * 6
    s.close()
    s = open_storage(tmp_path)                 # and what went in replays whole
    for e in range(0, last + 1):
        st = s.read_entry(5, e)
        assert st[0] in (EOK, ENOENTRY) and (st[0] != EOK or st[3] == payload(5, e))
    s.close()


def test_add_batch_runs_across_ledgers_rolls_and_gaps(tmp_path):
    """Runs of the one-pass walk broken every way (another ledger, a gap, a
    rewrite, a new ledger, a segment roll): every entry acknowledged in order,
    each readable with its payload, also after a restart."""
    s = open_storage(tmp_path, sync_data=False)
    for lid in (1, 2):
        _batch(s, [(lid, 0, -1, digest(lid, 0), payload(lid, 0))])
    ents = []
    for e in range(1, 120):
        ents.append((1, e, e - 1, digest(1, e), payload(1, e, 300 + e * 7 % 900)))
        if e % 3 == 0:
            ents.append((2, e // 3, e // 3 - 1, digest(2, e // 3), payload(2, e // 3)))
    ents.insert(50, (3, 0, -1, digest(3, 0), payload(3, 0)))        # a new ledger
    ents.insert(70, (1, 200, 0, digest(1, 200), payload(1, 200)))   # a gap
    ents.insert(90, (1, 5, 4, digest(1, 5), payload(1, 5)))         # a rewrite
    acked, errors = [], []
    for k in range(0, len(ents), 37):
        a, err = _batch(s, ents[k:k + 37])
        acked += a
        errors += err
    assert errors == []
    got = set()
    for i in range(0, len(acked), 3):
        got |= {(acked[i], e) for e in range(acked[i + 1], acked[i + 2] + 1)}
    assert got == {(l, e) for l, e, *_ in ents}
    assert len(s._journal.segments()) > 1
    want = {(l, e): p for l, e, _lac, _d, p in ents}     # a rewrite: the last one read
    for _ in range(2):
        for (l, e), p in want.items():
            st = s.read_entry(l, e)
            assert st[0] == EOK and st[3] == p, (l, e)
        s.close()
        s = open_storage(tmp_path, sync_data=False)
    s.close()


# --- journal segments used as entry logs ---------------------------------------------

def _batches(s, lid, first, count, per=40, key=KEY):
    for a in range(first, first + count, per):
        ents = [(lid, e, e - 1, digest(lid, e), payload(lid, e))
                for e in range(a, min(first + count, a + per))]
        acked, errors = _batch(s, ents, key=key)
        assert not errors


@pytest.mark.parametrize("flush_mode", ["adopt"], indirect=True)
def test_long_in_order_spans_stay_in_their_journal_segment(tmp_path, monkeypatch):
    """A long stretch of one ledger's records in the journal is indexed where it is;
    the segments it lies in outlive the flushed mark, restarts and crashes, and
    compaction removes them once their entries are deleted."""
    monkeypatch.setattr(F, "ADOPT_MIN_BYTES", 16 * 1024)
    seg = 256 * 1024
    s = open_storage(tmp_path, size=seg)
    for b in range(20):                        # 40-entry batches (~29 KB) of ledger 1,
        _batches(s, 1, 40 * b, 40)             # one entry of ledger 2 between them
        assert add(s, 2, b, key=OTHER) == EOK
    assert s._wc[1].spans is not None          # batches split by a roll are still spans
    s.checkpoint()
    runs1, runs2 = s._index.runs_of(1), s._index.runs_of(2)
    assert sum(r.count for r in runs1) == 800
    # (the short ends of batches split by a roll are copied)
    assert sum(r.count for r in runs1 if r.log >= JOURNAL_LOG) >= 700
    assert all(r.log < JOURNAL_LOG for r in runs2)      # short spans are copied, sorted
    st = s.stats()
    assert st["journal_segments_as_logs"] >= 2 and st["entry_log_bytes"] < 800 * 100
    assert st["journal_segments_as_logs_bytes"] == seg * st["journal_segments_as_logs"]
    adopted = sorted(s._adopted)
    mark_seq = s._flushed_mark[0]
    assert adopted[0] < mark_seq               # kept past the mark: the index reads it

    def check(s):
        for e in range(800):
            assert_entry(s, 1, e)
        for e in range(20):
            assert s.read_entry(2, e)[3] == payload(2, e)
        status, nxt, ents = s.read_range(1, 0, 799, 1 << 30)
        assert status == EOK and ents[0::4] == list(range(800)) and nxt == 800
        assert ents[3::4] == [payload(1, e) for e in range(800)]

    check(s)
    s.close()
    s = open_storage(tmp_path, size=seg)
    check(s)
    _batches(s, 1, 800, 200)                   # and after more, a crash
    s.sync()
    crash(s)
    del s
    s = open_storage(tmp_path, size=seg)
    check(s)
    for e in range(800, 1000):
        assert_entry(s, 1, e)
    segdir = tmp_path / "journal"
    before = [seq for seq in adopted if seq < mark_seq]
    assert all((segdir / J.segment_name(seq)).exists() for seq in before)
    # deleted: the segments it kept are compacted away (not the one with the mark)
    assert s.delete_ledgers([1]) == 1
    s.checkpoint()
    assert s.compact(0.5)["logs_removed"] >= len(before)
    assert not any((segdir / J.segment_name(seq)).exists() for seq in before)
    assert all(seq >= s._flushed_mark[0] for seq in s._adopted)
    for e in range(20):
        assert s.read_entry(2, e)[3] == payload(2, e)
    s.close()
    s = open_storage(tmp_path, size=seg)
    assert s.read_entry(1, 0)[0] == ENOLEDGER
    for e in range(20):
        assert s.read_entry(2, e)[3] == payload(2, e)
    s.close()


@pytest.mark.parametrize("flush_mode", ["copy"], indirect=True)
def test_record_sizes_are_found_uniform_in_bulk_exactly():
    """The flusher's bulk check that journal positions step by one record size
    (big-integer lanes) agrees with the entry-by-entry check, off by one or not."""
    import random
    from array import array
    rnd = random.Random(18)
    for trial in range(2000):
        n = rnd.choice([2, 3, 100, 4096, 4097, 9000])
        r = rnd.randint(1, 5000)
        p0 = rnd.randint(0, 1 << 45)
        pa = array("q", [7] * 3 + list(range(p0, p0 + n * r, r)) + [9] * 2)
        if trial % 2:
            pa[3 + rnd.randrange(n)] += rnd.choice([-1, 1, r, -r, 1 << 33])
        want = all(pa[3 + i + 1] - pa[3 + i] == r for i in range(n - 1))
        assert F._steps_by(pa, 3, n, r) == want, (trial, n, r)


@pytest.mark.parametrize("flush_mode", ["copy"], indirect=True)
def test_segments_left_by_a_crash_before_their_removal_go_at_open(tmp_path, monkeypatch):
    """The flusher thread unlinks the segments a flush made useless; a crash
    before it did leaves them, wholly before the mark: the next open removes
    them, and every entry reads back."""
    monkeypatch.setattr(F.RemoveJob, "run", lambda self, fl: None)   # "crashed" before
    s = open_storage(tmp_path)
    for e in range(300):                       # ~230 KB over several 64 KiB segments
        assert add(s, 1, e) == EOK
        assert add(s, 2, e, key=OTHER) == EOK
    s.checkpoint()
    segdir = tmp_path / "journal"
    names = sorted(n for n in os.listdir(segdir) if n.endswith(".seg"))
    assert len(names) > len(s._journal.segments()) >= 1     # forgotten, not deleted
    crash(s)
    del s
    monkeypatch.undo()
    s = open_storage(tmp_path)
    left = sorted(n for n in os.listdir(segdir) if n.endswith(".seg"))
    assert len(left) == len(s._journal.segments()) < len(names)
    for e in range(300):
        assert_entry(s, 1, e)
    s.close()


_REMOVE_RUN = F.RemoveJob.run


def test_logs_compaction_emptied_and_a_crash_left_go_at_open(tmp_path, monkeypatch, flush_mode):
    """Compaction's emptied logs (entry logs, or journal segments used as logs) are
    unlinked by the flusher thread; a crash before it did leaves files the index
    no longer names: the next open removes them and the survivor reads back."""
    s = open_small_logs(tmp_path)
    _two_ledgers(s, n=1200)
    s.delete_ledgers([7])
    monkeypatch.setattr(F.RemoveJob, "run", lambda self, fl: None)   # "crashed" before

    def files():
        return sorted(os.listdir(tmp_path / "index" / "entrylogs")) + sorted(
            n for n in os.listdir(tmp_path / "journal") if n.endswith(".seg"))
    stats = s.compact(0.6)
    assert stats["logs_removed"] >= 1
    left = files()
    crash(s)
    del s
    monkeypatch.setattr(F.RemoveJob, "run", _REMOVE_RUN)
    s = open_small_logs(tmp_path)
    assert len(files()) <= len(left) - stats["logs_removed"]
    _check_survivor(s, n=1200)
    s.close()



# --- pacing of flush writes --------------------------------------------------------

class _Clock:
    """A clock that only moves when the pacer sleeps."""

    def __init__(self):
        self.t = 100.0
        self.sleeps = []

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.sleeps.append(s)
        self.t += s


def test_a_paced_job_is_held_to_its_rate_in_bounded_steps():
    clock = _Clock()
    p = WritePacer(clock=clock, sleep=clock.sleep)
    p.start(rate=1 << 20, seq=1)                 # 1 MiB/s
    for _ in range(8):
        p.wrote(256 << 10)                       # 2 MiB in all
    assert clock.t - 100.0 == pytest.approx(2.0)
    assert p.slept == pytest.approx(2.0)
    assert max(clock.sleeps) <= PACE_STEP        # a hurry is seen within one step


def test_a_hurried_job_is_not_held_back_even_when_the_hurry_came_first():
    clock = _Clock()
    p = WritePacer(clock=clock, sleep=clock.sleep)
    p.hurry(upto=2)                              # the loop waits for jobs 1 and 2
    p.start(rate=1 << 20, seq=2)
    p.wrote(4 << 20)
    assert clock.sleeps == [] and p.slept == 0.0
    p.start(rate=1 << 20, seq=3)                 # a later job is paced again
    p.wrote(1 << 20)
    assert p.slept == pytest.approx(1.0)


def test_a_gentle_job_pauses_as_long_as_the_disk_was_busy():
    clock = _Clock()
    p = WritePacer(clock=clock, sleep=clock.sleep)
    p.start(rate=1 << 40, seq=1)                 # the rate alone would never hold it
    assert p.gentle()
    p.wrote(64 << 10, busy=0.004)
    assert p.slept == pytest.approx(0.004)
    p.hurry(upto=1)
    assert not p.gentle()
    p.wrote(64 << 10, busy=0.004)
    assert p.slept == pytest.approx(0.004)


def test_a_gentle_log_writer_syncs_each_piece_and_a_hurried_one_does_not(tmp_path):
    clock = _Clock()
    p = WritePacer(clock=clock, sleep=clock.sleep)
    logs = EntryLogs([str(tmp_path)], 1 << 30)
    w = logs.new_writer(p)
    try:
        p.start(rate=1 << 40, seq=1)
        w.append_pieces([b"g" * (1 << 20)])
        assert w._synced_to == w._written == HEADER_SIZE + (1 << 20)   # all of it synced
        assert w._unsynced == 0
        p.hurry(upto=1)
        w.append_pieces([b"h" * (1 << 20)])
        assert w._unsynced > 0                   # writeback started, not synced
        w.sync()
        with open(w.path, "rb") as f:
            data = f.read()
        assert data[-(2 << 20):] == b"g" * (1 << 20) + b"h" * (1 << 20)
    finally:
        w.close()
        logs.close()


def test_an_unpaced_job_never_sleeps():
    clock = _Clock()
    p = WritePacer(clock=clock, sleep=clock.sleep)
    p.start(rate=0.0, seq=1)
    p.wrote(64 << 20)
    assert clock.sleeps == []


def test_a_flush_is_written_in_half_the_time_its_tail_took_to_fill():
    assert flush_rate(256 << 20, 8.0) == 64 << 20              # busy: twice the fill rate
    assert flush_rate(32 << 20, 60.0) == FLUSH_MIN_RATE        # idle: the floor
    assert flush_rate(1 << 20, 0.0) == 0.0                     # no time measured: unpaced


def test_each_swap_comes_at_a_new_random_point_of_the_last_quarter(tmp_path):
    """The bookies of an ensemble receive the same bytes: a fixed flush threshold
    made their flushes fall on the same moment. Every swap draws its own point
    in the last quarter below flush_bytes, never above it; the first one (the
    shards of bookies started together start in phase) anywhere below it."""
    fb = 64 << 10
    s = open_storage(tmp_path, sync_data=False, size=1 << 20, flush_bytes=fb,
                     write_cache_bytes=1 << 20)
    sizes = []
    start = s._start_flush

    def recording_start():
        sizes.append(s._journal_bytes() - s._swap_at)
        start()
    s._start_flush = recording_start
    try:
        e = 0
        while len(sizes) < 12:
            assert add(s, 3, e) == EOK
            e += 1
            seen = len(sizes)
            s.maintain()
            if len(sizes) > seen:
                s._wait_flusher()             # the next tail is measured from this swap
        rec = 800                             # one record's bytes, at most
        assert 0 < sizes[0] <= fb + rec
        later = sizes[1:]
        assert all(fb - fb // 4 <= n <= fb + rec for n in later), sizes
        assert max(later) - min(later) > 4 * rec, sizes     # drawn anew each time
        s.checkpoint()
        for x in (0, e // 2, e - 1):
            assert_entry(s, 3, x)
    finally:
        s.close()
    firsts = []                               # the first swap's point: below all of it
    for k in range(8):
        t = open_storage(tmp_path / str(k), flush_bytes=fb, write_cache_bytes=1 << 20)
        firsts.append(t._flush_at)
        t.close()
    assert all(0 < x <= fb for x in firsts), firsts
    assert min(firsts) < fb - fb // 4, firsts     # 8 draws all in the last quarter: 1.5e-5


def test_a_flush_the_loop_waits_for_is_not_held_to_its_rate(tmp_path, monkeypatch):
    """A flush started by the loop is paced (here at 1 byte/s: it would never
    end); the back-pressure wait and a checkpoint hurry it, so every entry is
    flushed and read back, and the new tail's flush is not paced either."""
    monkeypatch.setattr(S, "FLUSH_MIN_RATE", 1)
    s = open_storage(tmp_path, flush_bytes=64 << 10, write_cache_bytes=1 << 20)
    try:
        for e in range(200):
            assert add(s, 7, e) == EOK
        s._journal.sync()
        s._last_swap -= 1e6                       # a tail that took ~11 days to fill...
        s.maintain()                              # ...starts a flush held to 1 byte/s
        assert s._flusher.pending == 1
        assert s._flushing is not None
        for e in range(200, 2000):                # the next tail fills: back-pressure
            assert add(s, 7, e) == EOK
            s._journal.sync()
            s.maintain()
        s.checkpoint()                            # without the hurries: never returns
        for e in (0, 199, 200, 1999):
            assert_entry(s, 7, e)
        assert s._wc_entries == 0 and s._flushing is None
    finally:
        s.close()


# --- the journal's page cache ----------------------------------------------------

def test_flushed_journal_leaves_the_page_cache_one_flush_later(tmp_path):
    """After each flush the journal up to the mark of the flush before it is
    dropped from the page cache (journalRemovePagesFromCache): what the last
    flush took and the tail stay cached, the rest is read from disk, correctly."""
    s = open_storage(tmp_path, size=8 << 20)
    marks = []
    for b in range(4):
        _batches(s, 1, 1000 * b, 1000)
        s.checkpoint()                          # waits for the flusher's jobs too
        marks.append(s._flushed_mark)
    assert {seq for seq, _ in marks} == {1}     # one segment: (the "copy" mode keeps it too)
    path = str(tmp_path / "journal" / J.segment_name(1))
    page = os.sysconf("SC_PAGE_SIZE")
    dropped_to = marks[2][1] - marks[2][1] % page          # the flush before the last one
    assert dropped_to > 2 << 20
    assert resident(path, 0, dropped_to) == 0
    lo = marks[2][1] + page - marks[2][1] % page           # the last flush's whole pages
    hi = marks[3][1] - marks[3][1] % page
    assert resident(path, lo, hi) == (hi - lo) // page > 100
    assert s.uncached_bytes >= dropped_to
    for e in range(4000):                       # from the disk now, for the most part
        assert_entry(s, 1, e)
    _batches(s, 1, 4000, 500)                   # then a crash: replay from the mark reads
    s.sync()                                    # the journal from the disk
    crash(s)
    del s
    s = open_storage(tmp_path, size=8 << 20)
    for e in range(4500):
        assert_entry(s, 1, e)
    s.close()


def test_a_flushed_range_whose_segment_is_gone_is_skipped(tmp_path, caplog):
    """Small segments, flushed often: in the "copy" mode the old segments are
    removed before their pages are advised away (the job skips them); in the
    "adopt" mode they are kept and advised. Nothing fails and nothing is lost."""
    s = open_storage(tmp_path, size=256 * 1024)
    for b in range(12):
        _batches(s, 1, 300 * b, 300)
        assert add(s, 2, b, key=OTHER) == EOK
        s.checkpoint()
    assert s._flush_failed is None and s.uncached_bytes > 0
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    for e in range(3600):
        assert_entry(s, 1, e)
    for e in range(12):
        assert s.read_entry(2, e)[3] == payload(2, e)
    s.close()


def test_uncache_journal_false_keeps_the_pages(tmp_path):
    s = open_storage(tmp_path, size=8 << 20, uncache_journal=False)
    for b in range(3):
        _batches(s, 1, 1000 * b, 1000)
        s.checkpoint()
    path = str(tmp_path / "journal" / J.segment_name(1))
    end = s._flushed_mark[1]
    assert resident(path, 0, end) == (end + os.sysconf("SC_PAGE_SIZE") - 1) // os.sysconf(
        "SC_PAGE_SIZE")
    assert s.uncached_bytes == 0
    s.close()
