"""The LMDB index of runs and the entry log codec, without a shard around them."""

from __future__ import annotations

import os

import pytest

from bk.bookie import index as I
from bk.bookie.entrylog import EntryLogError, EntryLogs, decode_records
from bk.bookie.journal import Journal


def test_make_runs_splits_by_step_and_size():
    entries = [0, 1, 2, 3, 10, 13, 16, 17]
    sizes = [50, 50, 50, 50, 60, 70, 60, 40]
    runs = I.make_runs(9, entries, sizes, log_id=4, off=100)
    assert [(r.first, r.count, r.step) for r in runs] == [(0, 4, 1), (10, 3, 3), (17, 1, 1)]
    assert runs[0].rlen == 50 and runs[0].offs is None          # fixed size: nothing per entry
    assert runs[1].rlen == 0 and list(runs[1].offs) == [0, 60, 130]
    assert [r.off for r in runs] == [100, 300, 490] and runs[1].nbytes == 190
    assert runs[1].index_of(13) == 1 and runs[1].index_of(14) == -1
    assert runs[1].index_of(19) == -1 and runs[1].last == 16
    s = runs[1].slice(1, 3)
    assert (s.first, s.count, s.off, s.nbytes, list(s.offs)) == (13, 2, 360, 130, [0, 70])


def test_make_runs_of_a_range_matches_the_list_form():
    # A dense tail hands make_runs a range (no per-entry walk); the runs must be
    # the ones the same entries as a list give, sizes varying and runs split at
    # MAX_RUN_ENTRIES.
    n = I.MAX_RUN_ENTRIES + 7
    sizes = [40 + (k % 3) for k in range(n)]
    fast = I.make_runs(3, range(100, 100 + n), sizes, 2, 64)
    slow = I.make_runs(3, list(range(100, 100 + n)), sizes, 2, 64)
    as_rows = [(r.first, r.count, r.step, r.off, r.nbytes, r.rlen,
                list(r.offs) if r.offs is not None else None) for r in fast]
    assert as_rows == [(r.first, r.count, r.step, r.off, r.nbytes, r.rlen,
                        list(r.offs) if r.offs is not None else None) for r in slow]
    assert [(r.first, r.count) for r in fast] == [(100, I.MAX_RUN_ENTRIES),
                                                  (100 + I.MAX_RUN_ENTRIES, 7)]
    assert list(fast[1].offs) == [0, 41, 83, 123, 164, 206, 246]
    assert fast[1].off == 64 + sum(sizes[:I.MAX_RUN_ENTRIES])


def test_a_huge_step_ends_a_run():
    runs = I.make_runs(1, [0, 10**12], [40, 40], 1, 64)
    assert [(r.first, r.count) for r in runs] == [(0, 1), (10**12, 1)]


def test_floor_lookups_and_accounting(tmp_path):
    idx = I.Index(str(tmp_path))
    with idx.write() as w:
        for run in I.make_runs(5, list(range(0, 100)), [30] * 100, 1, 64):
            w.put_run(run)
        for run in I.make_runs(6, list(range(50, 60)), [30] * 10, 2, 64):
            w.put_run(run)
        w.set_log(1, 0, 64 + 3000)
        w.set_log(2, 0, 64 + 300)
        w.set_mark((3, 4096))
        w.put_state(5, True, b"key", 98, 99)
    assert idx.lookup(5, 0).first == 0 and idx.lookup(5, 99).first == 0
    assert idx.lookup(5, 100) is None and idx.lookup(4, 0) is None
    assert idx.lookup(6, 49) is None and idx.lookup(6, 59).log == 2
    assert idx.lookup(7, 0) is None
    with idx.read_txn() as txn:
        assert [r.first for r in idx.runs_from(6, 55, txn)] == [50]
        assert [r.first for r in idx.runs_from(6, 0, txn)] == [50]
        assert list(idx.runs_from(7, 0, txn)) == []
        assert [r.ledger for r in idx.overlapping(5, 90, 200, txn)] == [5]
    assert idx.logs() == {1: [0, 3064, 3000], 2: [0, 364, 300]}
    assert idx.entries() == 110 and idx.mark() == (3, 4096)
    assert dict(idx.ledger_states()) == {5: [True, b"key", 98, 99]}
    with idx.write() as w:
        assert w.delete_runs_of(5) == 100
    assert idx.logs()[1][2] == 0 and idx.entries() == 10
    idx.close()
    assert I.read_mark(str(tmp_path))[0] == (3, 4096)
    assert I.read_mark(str(tmp_path / "nothing")) == (None, None)


def test_an_index_of_another_format_is_refused(tmp_path):
    idx = I.Index(str(tmp_path))
    with idx.env.begin(write=True, db=idx.meta) as txn:
        txn.put(b"version", b"9")
    idx.close()
    with pytest.raises(I.IndexFormatError, match="format version"):
        I.Index(str(tmp_path))


def test_entry_log_records_are_journal_records_and_are_checked(tmp_path):
    j = Journal(str(tmp_path / "j"), 1 << 20)
    for _ in j.replay(None):
        pass
    a = j.append_add(3, 7, 6, b"dg", b"payload-7")
    b = j.append_add(3, 8, 7, b"dg", b"payload-8")
    j.sync()
    seg = j.segment_view(a >> 32)
    start, end = a & 0xFFFFFFFF, (b & 0xFFFFFFFF) + (b & 0xFFFFFFFF) - (a & 0xFFFFFFFF)
    raw = bytes(seg[start:end])
    j.close()
    logs = EntryLogs([str(tmp_path / "d1"), str(tmp_path / "d2")], 1 << 20)
    w = logs.new_writer()
    off = w.append(raw)
    w.sync()
    w.close()
    out = []
    data = logs.read(w.id, off, len(raw))
    assert decode_records(data, 0, len(data), out) == 2
    assert out == [(3, 7, 6, b"dg", b"payload-7"), (3, 8, 7, b"dg", b"payload-8")]
    out = []
    assert decode_records(data, 0, len(data), out, want={8}) == 1 and out[0][1] == 8
    bad = bytearray(data)
    bad[-1] ^= 1
    with pytest.raises(EntryLogError, match="bad record"):
        decode_records(bytes(bad), 0, len(bad), [])
    assert os.listdir(tmp_path / ("d2" if w.id % 2 else "d1") / "entrylogs")
    assert logs.remove(w.id) > 0 and logs.ids() == []
    logs.close()


def test_trim_drops_the_mapped_index_over_the_cap(tmp_path):
    idx = I.Index(str(tmp_path))
    with idx.write() as w:
        for lid in range(300):                  # runs with per-entry offsets: ~4 MiB
            for run in I.make_runs(lid, range(3000), [30 + k % 5 for k in range(3000)], 1, 64):
                w.put_run(run)
    data = os.path.join(idx.path, "data.mdb")

    def smaps():                                # the kernel's own count, for comparison
        return sum(m[3] for m in I.mapped_resident(data))

    for lid in range(300):
        assert idx.lookup(lid, 2999).last == 2999
    before = idx.resident_bytes()
    assert before == smaps() and before > 2 << 20
    assert idx.trim(before) == before and idx.resident_bytes() == before   # at the cap: kept
    assert idx.trim(1 << 20) == before
    assert idx.resident_bytes() == smaps() < 1 << 20
    for lid in range(300):                      # the dropped pages map again on use
        run = idx.lookup(lid, 1234)
        assert (run.ledger, run.index_of(1234) >= 0) == (lid, True)
    idx.close()
