"""Journal: record round-trips, replay, torn tails, segment rolls, foreign files."""

from __future__ import annotations

import gc
import logging
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from bk.bookie import journal as J
from bk.bookie.journal import (HEADER_SIZE, ForeignSegmentError, Journal, JournalError,
                               RecordTooLargeError, format_mark, iter_records, parse_mark,
                               segment_name, split_position)

SEG = 64 * 1024


def open_journal(path, mark=None, size=SEG, sync_data=True, stagger=J.ROLL_STAGGER):
    j = Journal(str(path), size, sync_data, stagger)
    recs = list(j.replay(mark))
    return j, recs


def seg_files(path):
    return sorted(n for n in os.listdir(path) if n.endswith(".seg"))


def corrupt(path, seq, offset, data):
    with open(os.path.join(path, segment_name(seq)), "r+b") as f:
        f.seek(offset)
        f.write(data)


def read_bytes(path, seq, offset, n):
    with open(os.path.join(path, segment_name(seq)), "rb") as f:
        f.seek(offset)
        return f.read(n)


def add_payload(i, n=1000):
    return bytes([i % 251]) * n


# --- round trips ---------------------------------------------------------------

def test_each_record_type_round_trips(tmp_path):
    j, recs = open_journal(tmp_path)
    assert recs == []
    p_add = j.append(J.ADD, 7, 3, 2, b"digest", b"payload bytes")
    p_fence = j.append(J.FENCE, 7)
    p_key = j.append(J.MASTER_KEY, 7, b"\x00secret\xff")
    p_lac = j.append(J.WRITE_LAC, 7, -1)
    p_state = j.append(J.STATE, 9, True, 41, b"k")
    p_state_nokey = j.append(J.STATE, 10, False, -1, None)
    p_del = j.append(J.DELETE, 11)
    assert j.read(p_add) == (J.ADD, (7, 3, 2, b"digest", b"payload bytes"))
    assert j.read_add(p_add) == (7, 3, 2, b"digest", b"payload bytes")
    assert j.read(p_fence) == (J.FENCE, (7,))
    assert j.read(p_key) == (J.MASTER_KEY, (7, b"\x00secret\xff"))
    assert j.read(p_lac) == (J.WRITE_LAC, (7, -1))
    assert j.read(p_state) == (J.STATE, (9, True, 41, b"k"))
    assert j.read(p_state_nokey) == (J.STATE, (10, False, -1, None))
    assert j.read(p_del) == (J.DELETE, (11,))
    # positions: first record right after the header of segment 1, in append order
    assert split_position(p_add) == (1, HEADER_SIZE)
    assert p_add < p_fence < p_key < p_lac < p_state < p_state_nokey < p_del
    # an ADD with an empty digest and payload is still a record
    p_empty = j.append_add(1, 0, -1, b"", b"")
    assert j.read_add(p_empty) == (1, 0, -1, b"", b"")
    j.close()


def test_read_add_of_a_non_add_record_is_refused(tmp_path):
    j, _ = open_journal(tmp_path)
    p = j.append(J.FENCE, 1)
    with pytest.raises(J.CorruptRecordError):
        j.read_add(p)
    with pytest.raises(J.CorruptRecordError):
        j.read(p + 3)          # not a record boundary: CRC cannot match
    j.close()


def test_replay_after_reopen_yields_every_record_in_order(tmp_path):
    j, _ = open_journal(tmp_path)
    expected = []
    for i in range(20):
        expected.append((j.append_add(1, i, i - 1, b"d", add_payload(i, 100)), J.ADD, (1, i, i - 1)))
    expected.append((j.append(J.FENCE, 1), J.FENCE, (1,)))
    j.sync()
    j.close()
    j, recs = open_journal(tmp_path)
    assert [(pos, t, f) for pos, _, t, f in recs] == expected
    # appends continue after the last record
    nxt = j.append(J.FENCE, 2)
    assert nxt == expected[-1][0] + recs[-1][1]
    for i in range(20):
        assert j.read_add(expected[i][0])[4] == add_payload(i, 100)
    j.close()


def test_replay_from_a_mark_skips_what_precedes_it(tmp_path):
    j, _ = open_journal(tmp_path)
    for i in range(5):
        j.append_add(1, i, -1, b"", b"x")
    mark = j.mark
    later = [j.append_add(1, i, -1, b"", b"y") for i in range(5, 8)]
    j.close()
    j, recs = open_journal(tmp_path, mark=mark)
    assert [pos for pos, *_ in recs] == later
    assert [f[1] for *_, f in recs] == [5, 6, 7]
    j.close()
    assert parse_mark(format_mark(mark)) == mark
    assert parse_mark(list(mark)) == mark


def test_sync_accounting(tmp_path):
    j, _ = open_journal(tmp_path)
    assert j.unsynced_bytes == 0
    j.append_add(1, 0, -1, b"dd", b"p" * 10)
    j.append(J.FENCE, 1)
    assert j.unsynced_bytes == J.ADD_OVERHEAD + 12 + 17
    j.sync()
    assert j.unsynced_bytes == 0 and j.syncs == 1 and j.synced_records == 2
    j.sync()                       # nothing to do: not counted
    assert j.syncs == 1
    j.close()


def test_sync_data_false_still_survives_a_process_crash(tmp_path):
    j, _ = open_journal(tmp_path, sync_data=False)
    pos = [j.append_add(3, i, -1, b"", add_payload(i)) for i in range(150)]   # rolls too
    j.sync()
    del j
    gc.collect()                   # "crash": no close; the page cache keeps the data
    j, recs = open_journal(tmp_path, sync_data=False)
    assert [p for p, *_ in recs] == pos
    assert j.read_add(pos[-1])[4] == add_payload(149)
    j.close()


# --- torn and corrupt tails -------------------------------------------------------

def _write_records(path, n=10, size=SEG):
    j, _ = open_journal(path, size=size)
    pos = [j.append_add(1, i, -1, b"dg", add_payload(i, 200)) for i in range(n)]
    j.sync()
    end = j.mark
    j.close()
    return pos, end


def test_torn_last_record_is_truncated_and_appends_continue(tmp_path, caplog):
    pos, _ = _write_records(tmp_path)
    seq, off = split_position(pos[-1])
    # tear the last record: its second half never reached the disk
    corrupt(tmp_path, seq, off + 120, bytes(200))
    with caplog.at_level(logging.WARNING, logger="bk.journal"):
        j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos[:-1]
    warnings = [r for r in caplog.records if r.name == "bk.journal"]
    assert len(warnings) == 1
    assert segment_name(seq) in warnings[0].getMessage()
    assert f"offset {off}" in warnings[0].getMessage()
    assert read_bytes(tmp_path, seq, off, SEG - off) == bytes(SEG - off)   # tail zeroed
    # the next append takes the torn record's place
    new = j.append_add(1, 9, -1, b"dg", b"again")
    assert new == pos[-1]
    j.sync()
    j.close()
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos
    assert j.read_add(pos[-1])[4] == b"again"
    for i in range(9):
        assert j.read_add(pos[i]) == (1, i, -1, b"dg", add_payload(i, 200))
    j.close()


def test_garbage_after_valid_records_is_truncated(tmp_path, caplog):
    pos, (seq, end) = _write_records(tmp_path)
    corrupt(tmp_path, seq, end, os.urandom(300))
    with caplog.at_level(logging.WARNING, logger="bk.journal"):
        j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos
    assert f"offset {end}" in caplog.text
    assert j.mark == (seq, end)
    assert read_bytes(tmp_path, seq, end, 300) == bytes(300)
    j.append(J.FENCE, 1)
    j.close()
    j, recs = open_journal(tmp_path)
    assert [t for _, _, t, _ in recs] == [J.ADD] * 10 + [J.FENCE]
    j.close()


def test_garbage_far_after_a_zero_length_is_not_a_clean_end(tmp_path, caplog):
    # a lost page in the middle (zeros) followed by surviving bytes: replay must
    # not leave those bytes for later appends to run into
    pos, (seq, end) = _write_records(tmp_path)
    corrupt(tmp_path, seq, end + 5000, b"\x01\x02\x03")
    with caplog.at_level(logging.WARNING, logger="bk.journal"):
        j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos
    assert "non-zero" in caplog.text
    assert read_bytes(tmp_path, seq, end + 5000, 3) == bytes(3)
    j.close()


def test_bad_crc_in_the_middle_of_the_tail_ends_replay_there(tmp_path, caplog):
    pos, _ = _write_records(tmp_path)
    seq, off = split_position(pos[4])
    corrupt(tmp_path, seq, off + 50, b"\xee")          # a flipped payload byte
    with caplog.at_level(logging.WARNING, logger="bk.journal"):
        j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos[:4]
    assert "CRC mismatch" in caplog.text
    for i in range(4):
        assert j.read_add(pos[i])[4] == add_payload(i, 200)
    with pytest.raises(J.CorruptRecordError):
        j.read(pos[6])          # after the bad record: zeroed
    j.close()


def test_corrupt_length_running_past_the_segment(tmp_path, caplog):
    pos, _ = _write_records(tmp_path)
    seq, off = split_position(pos[7])
    corrupt(tmp_path, seq, off + 4, (SEG * 2).to_bytes(4, "little"))
    with caplog.at_level(logging.WARNING, logger="bk.journal"):
        j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos[:7]
    assert "runs past" in caplog.text
    j.close()


def test_zero_length_is_the_clean_end(tmp_path, caplog):
    pos, end = _write_records(tmp_path)
    with caplog.at_level(logging.WARNING, logger="bk.journal"):
        j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos and j.mark == end
    assert caplog.records == []
    j.close()
    # a zero length whose CRC field is not zero is garbage, not an end
    seq, off = end
    corrupt(tmp_path, seq, off, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    with caplog.at_level(logging.WARNING, logger="bk.journal"):
        j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos
    assert "zero length" in caplog.text
    j.close()


def test_iter_records_reads_without_truncating(tmp_path):
    pos, (seq, end) = _write_records(tmp_path)
    corrupt(tmp_path, seq, end, b"garbage!")
    recs = list(iter_records(str(tmp_path)))
    assert [r.position for r in recs] == pos
    assert recs[3].type_name == "ADD"
    assert recs[3].fields == (1, 3, -1, b"dg", add_payload(3, 200))
    assert read_bytes(tmp_path, seq, end, 8) == b"garbage!"        # untouched
    from_mark = list(iter_records(str(tmp_path), start_mark=format_mark(split_position(pos[5]))))
    assert [r.position for r in from_mark] == pos[5:]


# --- segments ---------------------------------------------------------------------

def test_records_span_several_segments(tmp_path):
    j, _ = open_journal(tmp_path)
    pos = [j.append_add(2, i, i - 1, b"d" * 16, add_payload(i)) for i in range(300)]
    j.sync()
    segs = {split_position(p)[0] for p in pos}
    assert len(segs) >= 4 and segs == set(j.segments())
    # the last sync may have begun preparing the next segment (off the loop): let
    # it finish; its file is on disk but not one of the journal's segments yet
    prepared = set()
    if j._prep is not None:
        j._prep.result()
        prepared = {segment_name(j._prep.seq)}
    assert set(seg_files(tmp_path)) == {segment_name(s) for s in segs} | prepared
    assert all(os.path.getsize(tmp_path / n) == SEG for n in seg_files(tmp_path))
    for i, p in enumerate(pos):
        assert j.read_add(p) == (2, i, i - 1, b"d" * 16, add_payload(i))
    assert j.disk_usage() == len(segs) * SEG
    assert J.journal_disk_usage(str(tmp_path)) == (len(segs) + len(prepared)) * SEG
    j.close()
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos
    assert [f[1] for *_, f in recs] == list(range(300))
    for i, p in enumerate(pos):
        assert j.read_add(p)[4] == add_payload(i)
    # removing a closed segment frees its file; the active one cannot go
    first = j.segments()[0]
    assert j.remove_segment(first) == SEG
    assert segment_name(first) not in seg_files(tmp_path)
    with pytest.raises(JournalError, match="active"):
        j.remove_segment(j.active_seq)
    j.close()


def test_record_bigger_than_a_segment_is_refused(tmp_path):
    j, _ = open_journal(tmp_path)
    with pytest.raises(RecordTooLargeError, match="does not fit"):
        j.append_add(1, 0, -1, b"", bytes(SEG))
    # the journal is still usable, and nothing was written
    p = j.append_add(1, 0, -1, b"", b"ok")
    assert split_position(p) == (1, HEADER_SIZE)
    # the largest record that fits goes in a segment of its own
    big = SEG - HEADER_SIZE - J.ADD_OVERHEAD
    p2 = j.append_add(1, 1, -1, b"", bytes(big))
    assert split_position(p2) == (2, HEADER_SIZE)
    assert len(j.read_add(p2)[4]) == big
    j.close()


def test_foreign_segment_file_is_refused(tmp_path):
    j, _ = open_journal(tmp_path)
    j.append(J.FENCE, 1)
    j.close()
    bad = tmp_path / segment_name(5)
    bad.write_bytes(b"this is not a journal segment" * 100)
    with pytest.raises(ForeignSegmentError, match="not a bk journal segment"):
        Journal(str(tmp_path), SEG)
    bad.unlink()
    (tmp_path / "notes.seg").write_bytes(b"x")
    with pytest.raises(ForeignSegmentError, match="notes.seg"):
        Journal(str(tmp_path), SEG)
    (tmp_path / "notes.seg").unlink()
    # other names are not ours to judge: ignored
    (tmp_path / "README").write_text("hello")
    j, recs = open_journal(tmp_path)
    assert [t for _, _, t, _ in recs] == [J.FENCE]
    j.close()


def test_truncated_or_renamed_segment_is_refused(tmp_path):
    j, _ = open_journal(tmp_path)
    j.append(J.FENCE, 1)
    j.close()
    os.rename(tmp_path / segment_name(1), tmp_path / segment_name(2))
    with pytest.raises(ForeignSegmentError, match="header says segment 1"):
        Journal(str(tmp_path), SEG)
    os.truncate(tmp_path / segment_name(2), SEG // 2)
    with pytest.raises(ForeignSegmentError):
        Journal(str(tmp_path), SEG)
    os.truncate(tmp_path / segment_name(2), 10)
    with pytest.raises(ForeignSegmentError, match="too short"):
        Journal(str(tmp_path), SEG)


def test_second_open_of_the_same_directory_is_refused(tmp_path):
    j, _ = open_journal(tmp_path)
    with pytest.raises(JournalError, match="in use"):
        Journal(str(tmp_path), SEG)
    j.close()
    j2, _ = open_journal(tmp_path)
    j2.close()


def test_mark_naming_a_missing_segment_is_an_error(tmp_path):
    j, _ = open_journal(tmp_path)
    j.close()
    j = Journal(str(tmp_path), SEG)
    with pytest.raises(JournalError, match="does not exist"):
        list(j.replay((7, HEADER_SIZE)))
    j.close()


def test_appends_refused_before_replay_and_after_a_failed_sync(tmp_path):
    j = Journal(str(tmp_path), SEG)
    with pytest.raises(JournalError, match="replay"):
        j.append(J.FENCE, 1)
    list(j.replay())
    j.append(J.FENCE, 1)
    j._fail(OSError(5, "Input/output error"))
    with pytest.raises(JournalError, match="failed"):
        j.append(J.FENCE, 2)
    with pytest.raises(JournalError, match="failed"):
        j.sync()
    j.close()


def test_torn_record_in_an_earlier_segment_quarantines_later_data(tmp_path, caplog):
    j, _ = open_journal(tmp_path)
    pos = [j.append_add(1, i, -1, b"", add_payload(i)) for i in range(200)]
    j.sync()
    j.close()
    seqs = sorted({split_position(p)[0] for p in pos})
    assert len(seqs) >= 3
    first_of_2 = next(i for i, p in enumerate(pos) if split_position(p)[0] == seqs[1])
    bad = first_of_2 + 2
    seq, off = split_position(pos[bad])
    corrupt(tmp_path, seq, off + 30, b"\x99")
    with caplog.at_level(logging.WARNING, logger="bk.journal"):
        j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos[:bad]
    assert seg_files(tmp_path) == [segment_name(s) for s in seqs[:2]]
    quarantined = sorted(os.listdir(tmp_path / J.QUARANTINE_DIR))
    assert quarantined == [segment_name(s) for s in seqs[2:]]
    # appends continue in the torn segment; new segments never reuse a quarantined number
    assert j.mark == (seq, off)
    while j.active_seq == seq:
        j.append_add(1, 999, -1, b"", add_payload(0))
    assert j.active_seq == seqs[-1] + 1
    j.close()


def test_empty_later_segment_after_a_torn_record_is_removed(tmp_path):
    j, _ = open_journal(tmp_path)
    pos = [j.append_add(1, i, -1, b"", add_payload(i)) for i in range(50)]
    j.sync()
    j.close()
    last_seq = split_position(pos[-1])[0]
    # the sync (past PREPARE_AT of the segment) prepared the next segment, which
    # no record reached: as a crash right after its preparation leaves it
    assert j.prepared == 1
    j.close()
    assert seg_files(tmp_path) == [segment_name(s) for s in range(1, last_seq + 2)]
    seq, off = split_position(pos[-1])
    corrupt(tmp_path, seq, off + 20, b"\x42")
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos[:-1]
    assert seg_files(tmp_path) == [segment_name(s) for s in range(1, last_seq + 1)]
    assert not os.path.exists(tmp_path / J.QUARANTINE_DIR)
    # and the next segment takes the number of the removed one: no gap
    while j.active_seq == last_seq:
        j.append_add(1, 999, -1, b"", add_payload(0))
    assert j.active_seq == last_seq + 1
    j.close()


def test_leftover_tmp_segment_from_a_crashed_roll_is_removed(tmp_path):
    j, _ = open_journal(tmp_path)
    j.append(J.FENCE, 1)
    j.close()
    (tmp_path / (segment_name(2) + ".tmp")).write_bytes(b"half made")
    j, recs = open_journal(tmp_path)
    assert len(recs) == 1
    assert seg_files(tmp_path) == [segment_name(1)]
    assert not (tmp_path / (segment_name(2) + ".tmp")).exists()
    j.close()


# --- property: whatever is appended reads back and replays identically -------------

_record = hs.one_of(
    hs.tuples(hs.just(J.ADD), hs.integers(0, 2**62), hs.integers(0, 2**40), hs.integers(-1, 2**40),
              hs.binary(max_size=40), hs.binary(max_size=3000)),
    hs.tuples(hs.just(J.FENCE), hs.integers(0, 2**62)),
    hs.tuples(hs.just(J.MASTER_KEY), hs.integers(0, 2**62), hs.binary(max_size=64)),
    hs.tuples(hs.just(J.WRITE_LAC), hs.integers(0, 2**62), hs.integers(-1, 2**62)),
    hs.tuples(hs.just(J.STATE), hs.integers(0, 2**62), hs.booleans(), hs.integers(-1, 2**62),
              hs.one_of(hs.none(), hs.binary(max_size=64))),
    hs.tuples(hs.just(J.DELETE), hs.integers(0, 2**62)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=hs.lists(_record, max_size=60))
def test_round_trip_property(tmp_path_factory, records):
    path = tmp_path_factory.mktemp("j")
    size = 2 * 4096       # tiny segments: many rolls
    j, _ = open_journal(path, size=size)
    positions = [j.append(r[0], *r[1:]) for r in records]
    j.sync()
    for p, r in zip(positions, records):
        assert j.read(p) == (r[0], tuple(r[1:]))
    j.close()
    j, recs = open_journal(path, size=size)
    assert [p for p, *_ in recs] == positions
    assert [t for _, _, t, _ in recs] == [r[0] for r in records]
    full = list(iter_records(str(path)))
    assert [(x.type, x.fields) for x in full] == [(r[0], tuple(r[1:])) for r in records]
    j.close()


# --- the staging buffer: records are built in memory and pwritten per group ---------

def test_staged_records_are_readable_before_any_sync(tmp_path):
    j, _ = open_journal(tmp_path)
    p1 = j.append_add(5, 0, -1, b"d", b"first")
    p2 = j.append(J.FENCE, 5)
    # Not yet written to the file: reads (e.g. a recovery read of the open group)
    # and record_length still see them.
    assert j.record_length(p2) == 8 + 1 + 8
    assert j.read_add(p1)[4] == b"first"
    assert j.read(p2) == (J.FENCE, (5,))
    assert j.record_length(p2) == 8 + 1 + 8
    j.close()


def test_groups_larger_than_the_staging_buffer_and_huge_records(tmp_path):
    size = 3 * J.STAGING_SIZE
    j, _ = open_journal(tmp_path, size=size)
    small = [j.append_add(1, i, -1, b"dg", add_payload(i, 4000)) for i in range(1500)]
    huge = j.append_add(1, 1500, -1, b"dg", b"H" * (J.STAGING_SIZE + 123))   # > the buffer
    after = j.append_add(1, 1501, -1, b"dg", b"tail")
    assert len(j._buf) == J.STAGING_SIZE        # back to the normal buffer after a write-out
    job = j.begin_sync()
    job.run()
    j.end_sync(job)
    j.close()
    j, recs = open_journal(tmp_path, size=size)
    got = {p: f for p, _, _, f in recs}
    assert [got[p][1] for p in small + [huge, after]] == list(range(1502))
    assert j.read_add(small[777])[4] == add_payload(777, 4000)
    assert j.read_add(huge)[4] == b"H" * (J.STAGING_SIZE + 123)
    assert j.read_add(after)[4] == b"tail"
    j.close()


def test_a_sync_thread_keeps_its_segment_open_and_follows_rolls(tmp_path):
    """SyncJob.run with a SyncFile: one descriptor for the jobs of a segment, a new
    one (the old closed) once a roll put the next job in the next segment; every
    job's records are durable and replay."""
    j, _ = open_journal(tmp_path)
    keep = J.SyncFile()
    pos, fds = [], []
    for g in range(12):                        # ~1 KB records, 64 KiB segments: rolls
        pos += [j.append_add(3, len(pos), -1, b"", add_payload(g, 1000)) for _ in range(20)]
        job = j.begin_sync()
        job.run(keep)
        j.end_sync(job)
        assert job.error is None and keep.path == job.path
        assert os.readlink(f"/proc/self/fd/{keep.fd}") == job.path
        fds.append((keep.path, keep.fd))
    paths = [p for p, _ in fds]
    assert len(set(paths)) >= 3                # it followed the rolls...
    for (p0, fd0), (p1, fd1) in zip(fds, fds[1:]):
        assert p0 != p1 or fd0 == fd1          # ...and kept its descriptor in between
    keep.close()
    assert keep.fd == -1 and keep.path is None
    j.close()
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos
    j.close()


def test_a_crash_loses_only_records_never_written_out(tmp_path):
    j, _ = open_journal(tmp_path)
    synced = [j.append_add(2, i, -1, b"", b"x" * 100) for i in range(5)]
    job = j.begin_sync()          # writes the group out, then the sync thread's fdatasync
    job.run()
    j.end_sync(job)
    j.append_add(2, 5, -1, b"", b"never synced, never acknowledged")
    del j, job
    gc.collect()                  # "crash" before the next group was written out
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == synced
    j.close()


def test_a_failed_write_out_poisons_the_journal(tmp_path):
    j, _ = open_journal(tmp_path)
    j.append(J.FENCE, 1)
    os.close(j._fd)               # the next pwrite fails with EBADF, as an I/O error would
    with pytest.raises(JournalError, match="write to journal"):
        j.begin_sync()
    with pytest.raises(JournalError, match="failed"):
        j.append(J.FENCE, 2)
    j._fd = -1
    j.close()


def _wire(ents):
    from bk import protocol as P
    return b"".join(P.add_record_head(l, e, a, d, len(p)) + p for l, e, a, d, p in ents)


def test_a_wire_run_writes_the_same_records_as_single_adds(tmp_path):
    """``append_wire_run`` (an ADD_BATCH's run, its CRC continued from the (length,
    type) CRC over the received body) writes byte for byte the ADD records that
    ``append_add`` writes, across sizes that change mid-run and a roll; it stops
    at another ledger, a gap and a truncated record, and returns the greatest
    LAC; the records replay and read back."""
    ents = [(4, e, (e * 7) % 11, b"d%d" % e, add_payload(e, 200 + e * 137 % 1500))
            for e in range(100)]
    a, _ = open_journal(tmp_path / "a", stagger=0)     # the same roll points
    b, _ = open_journal(tmp_path / "b", stagger=0)
    pa = [a.append_add(*x) for x in ents]
    src = _wire(ents) + _wire([(5, 0, -1, b"", b"x")])
    pb = []
    off, lac = b.append_wire_run(memoryview(src), 0, 4, 0, pb)
    assert pb == pa and lac == 10 and off == len(_wire(ents))
    a.sync()
    b.sync()
    assert len(b.segments()) > 1
    for seq in b.segments():
        n = b.segment_size_of(seq)
        assert read_bytes(tmp_path / "a", seq, 0, n)[HEADER_SIZE:] == \
            read_bytes(tmp_path / "b", seq, 0, n)[HEADER_SIZE:]
    for p, x in zip(pb, ents):
        assert b.read_add(p) == x
    # a gap, then a record cut short: each ends the run before it
    more = _wire([(4, 100, 0, b"", b"y"), (4, 102, 0, b"", b"z")])
    off, _ = b.append_wire_run(memoryview(more), 0, 4, 100, pb)
    assert len(pb) == 101 and off == len(_wire([(4, 100, 0, b"", b"y")]))
    cut = _wire([(4, 102, 0, b"", b"w" * 100)])[:-1]
    off, _ = b.append_wire_run(memoryview(_wire([(4, 101, 0, b"", b"v")]) + cut), 0, 4, 101,
                                pb)
    assert len(pb) == 102 and off == len(_wire([(4, 101, 0, b"", b"v")]))
    b.sync()
    b.close()
    a.close()
    b, recs = open_journal(tmp_path / "b")
    got = [(r[2], r[3][:3]) for r in recs]
    assert got == [(J.ADD, (4, e, lac)) for e, lac in
                   [(x[1], x[2]) for x in ents] + [(100, 0), (101, 0)]]
    b.close()


def test_a_wire_run_cut_by_a_record_too_large_counts_what_went_in(tmp_path):
    """A record larger than a segment in the middle of a run raises
    RecordTooLargeError; the records before it are appended, each counted once
    in the unsynced bytes and records (as single appends count them), and sync."""
    ents = [(4, e, e - 1, b"d", add_payload(e, 300)) for e in range(5)]
    ents[3] = (4, 3, 2, b"d", bytes(SEG))
    a, _ = open_journal(tmp_path / "a", stagger=0)
    b, _ = open_journal(tmp_path / "b", stagger=0)
    for x in ents[:3]:
        a.append_add(*x)
    pb = []
    with pytest.raises(J.RecordTooLargeError):
        b.append_wire_run(memoryview(_wire(ents)), 0, 4, 0, pb)
    assert len(pb) == 3
    assert (b.unsynced_bytes, b._unsynced_records) == (a.unsynced_bytes, a._unsynced_records)
    b.sync()
    assert [b.read_add(p) for p in pb] == ents[:3]
    a.close()
    b.close()


def _reference_run(ents, i0):
    """How many entries from ``ents[i0]`` one ``append_wire_run`` takes: the same
    ledger's next entries (the walk's rule, record by record)."""
    k = 1
    while i0 + k < len(ents) and ents[i0 + k][0] == ents[i0][0] \
            and ents[i0 + k][1] == ents[i0][1] + k:
        k += 1
    return k


@pytest.mark.parametrize("staging", [J.STAGING_SIZE, 5000])
def test_chunks_of_equal_records_write_what_single_adds_write(tmp_path, monkeypatch, staging):
    """Runs of equal-sized records go in chunks (``append_wire_run``'s bulk
    path): byte for byte the records ``append_add`` writes, the same positions,
    the greatest LAC (not the last one), across run lengths around the chunk
    sizes, runs that end inside a chunk (another ledger, a gap, a size that
    changes), a gap whose chunk's last head still looks right, a record whose
    (plen, dlen) differ at the same size, a staging buffer that fills inside
    a run, and rolls; every record replays and reads back."""
    monkeypatch.setattr(J, "STAGING_SIZE", staging)
    ents = []
    nxt = {}

    def run(lid, k, size=300, dlen=3, lacs=None):
        for m in range(k):
            e = nxt.get(lid, 0)
            nxt[lid] = e + 1
            lac = lacs[m] if lacs else e - 1
            ents.append((lid, e, lac, b"d" * dlen, add_payload(e, size)))

    for k in (1, 2, 3, 7, 8, 9, 63, 64, 65, 130):
        run(4, k)
        run(5, 1)
    run(4, 20, lacs=[10**9 if m == 5 else m for m in range(20)])   # the max LAC mid-chunk
    run(4, 5)
    run(4, 6, size=301)                 # the size changes: the chunk ends there
    run(4, 6, size=300, dlen=4)         # same dlen + plen as 301/3: not one chunk
    run(6, 5)
    nxt[6] += 1                         # a gap inside what would be a chunk of 8
    run(6, 2)
    ents.append((6, 7, 0, b"ddd", add_payload(7, 300)))   # (its last head: entry 7)
    a, _ = open_journal(tmp_path / "a", stagger=0)
    b, _ = open_journal(tmp_path / "b", stagger=0)
    pa = [a.append_add(*x) for x in ents]
    src = memoryview(_wire(ents))
    pb = []
    off = i = 0
    lacs = []
    while i < len(ents):
        k = _reference_run(ents, i)
        n0 = len(pb)
        off, lac = b.append_wire_run(src, off, ents[i][0], ents[i][1], pb)
        assert len(pb) - n0 == k, (i, k, len(pb) - n0)
        lacs.append(lac)
        assert lac == max(x[2] for x in ents[i:i + k]), i
        assert off == len(_wire(ents[:i + k]))
        i += k
    assert 10**9 in lacs
    assert pb == pa
    a.sync()
    b.sync()
    assert len(b.segments()) > 1
    assert (b.unsynced_bytes, b._unsynced_records, b.synced_records) == \
        (a.unsynced_bytes, a._unsynced_records, a.synced_records)
    for seq in b.segments():
        n = b.segment_size_of(seq)
        assert read_bytes(tmp_path / "a", seq, 0, n)[HEADER_SIZE:] == \
            read_bytes(tmp_path / "b", seq, 0, n)[HEADER_SIZE:]
    for p, x in zip(pb, ents):
        assert b.read_add(p) == x
    a.close()
    b.close()
    b, recs = open_journal(tmp_path / "b")
    assert [(r[2], r[3][:3]) for r in recs] == [(J.ADD, x[:3]) for x in ents]
    b.close()


def test_a_torn_chunk_is_truncated_at_its_first_bad_record(tmp_path):
    """A chunk's records are ordinary ADD records, each with its own CRC: a
    write torn inside a chunk (a byte flipped in its fifth record's payload)
    ends replay there, the four before it stay, the rest of the segment is
    zeroed, and appends continue at the tear."""
    ents = [(4, e, e - 1, b"dg", add_payload(e, 500)) for e in range(16)]
    j, _ = open_journal(tmp_path)
    pos = []
    j.append_wire_run(memoryview(_wire(ents)), 0, 4, 0, pos)
    assert len(pos) == 16
    j.sync()
    j.close()
    seq, off = J.split_position(pos[4])
    corrupt(tmp_path, seq, off + 100, b"\xff")
    j, recs = open_journal(tmp_path)
    assert [r[3] for r in recs] == [x[:3] for x in ents[:4]]
    assert j.position == pos[4]
    assert read_bytes(tmp_path, seq, off, pos[15] - pos[4]) == bytes(pos[15] - pos[4])
    assert j.read_add(pos[3]) == ents[3]
    j.close()


def test_the_chunk_structs_stay_few(tmp_path):
    """Runs of many record sizes do not keep a struct per size forever."""
    j, _ = open_journal(tmp_path)
    pos = []
    for size in range(100, 400, 3):
        ents = [(4, len(pos) + m, 0, b"", add_payload(m, size)) for m in range(4)]
        j.append_wire_run(memoryview(_wire(ents)), 0, 4, len(pos), pos)
        j.sync()
    assert len(pos) == 400
    assert 0 < len(J._RUN_STRUCTS) <= 64
    j.close()


# --- the next segment, prepared off the loop -------------------------------------

def _fill_past_prepare_at(j, ledger=3):
    """Append and group-commit until the active segment is past PREPARE_AT: the
    positions appended."""
    out = []
    while j.mark[1] <= SEG * J.PREPARE_AT:
        out.append(j.append_add(ledger, len(out), -1, b"", add_payload(len(out))))
        job = j.begin_sync()
        job.run()
        j.end_sync(job)
    return out


def _wait_prepared(j):
    j._prep._thread.join(30)
    assert not j._prep._thread.is_alive()


def test_the_roll_takes_the_segment_prepared_off_the_loop(tmp_path):
    j, _ = open_journal(tmp_path)
    pos = _fill_past_prepare_at(j)
    assert j.prepared == 1
    _wait_prepared(j)
    # made, renamed into place and synced, but not a segment of the journal yet
    assert seg_files(tmp_path) == [segment_name(1), segment_name(2)]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert j.segments() == [1] and j.disk_usage() == SEG
    prepared_ino = os.stat(tmp_path / segment_name(2)).st_ino
    while j.active_seq == 1:
        pos.append(j.append_add(3, len(pos), -1, b"", add_payload(len(pos))))
    assert j.segments() == [1, 2]
    assert os.stat(tmp_path / segment_name(2)).st_ino == prepared_ino   # that very file
    assert not j._dir_dirty                 # its preparation synced the directory
    j.sync()
    assert [j.read_add(p)[1] for p in pos] == list(range(len(pos)))
    j.close()
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos
    assert [split_position(p)[0] for p in pos][-1] == 2
    j.close()


def test_a_prepared_segment_left_by_a_crash_is_where_appends_continue(tmp_path):
    j, _ = open_journal(tmp_path)
    pos = _fill_past_prepare_at(j)
    _wait_prepared(j)
    j._prep.result()[1].close()
    del j
    gc.collect()                  # "crash" after the preparation, before any record reached it
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos
    assert j.segments() == [1, 2] and j.active_seq == 2 and j.mark == (2, HEADER_SIZE)
    p = j.append_add(3, len(pos), -1, b"", add_payload(0))
    assert split_position(p) == (2, HEADER_SIZE)
    j.close()
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos + [p]
    assert seg_files(tmp_path) == [segment_name(1), segment_name(2)]
    j.close()


def test_a_failed_preparation_leaves_the_roll_to_create_the_segment(tmp_path, monkeypatch,
                                                                   caplog):
    made = J._make_segment

    def failing(directory, seq, size, sync_dir):
        if sync_dir:              # the preparing thread's call
            path, mm = made(directory, seq, size, sync_dir)   # renamed into place, then fails
            mm.close()
            raise OSError(28, "No space left on device")
        return made(directory, seq, size, sync_dir)

    monkeypatch.setattr(J, "_make_segment", failing)
    j, _ = open_journal(tmp_path)
    pos = _fill_past_prepare_at(j)
    with caplog.at_level(logging.WARNING, logger="bk.journal"):
        while j.active_seq == 1:
            pos.append(j.append_add(3, len(pos), -1, b"", add_payload(len(pos))))
    assert "preparing segment 0000000000000002.seg failed" in caplog.text
    assert j.active_seq == 2 and j._dir_dirty     # made at the roll, under the same number
    j.close()
    assert seg_files(tmp_path) == [segment_name(1), segment_name(2)]
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos
    j.close()


# --- staggered rolls ----------------------------------------------------------

def test_each_segment_rolls_at_its_own_point_in_its_last_eighth(tmp_path):
    """Every segment rolls at a point drawn anew in the last ROLL_STAGGER of its
    room (the bookies of an ensemble receive the same bytes: with one fixed
    point they rolled at once), never past its size; the records replay in
    order across the early rolls."""
    j, _ = open_journal(tmp_path)
    j._rng = random.Random(7)
    ents = [(3, e, e - 1, b"dd", add_payload(e, 300)) for e in range(4000)]
    pos = [j.append_add(*x) for x in ents]
    j.sync()
    n = split_position(pos[1])[1] - split_position(pos[0])[1]     # one record's bytes
    ends = {}
    for p in pos:
        seq, off = split_position(p)
        ends[seq] = off + n
    last = max(ends)
    full = [ends[s] for s in sorted(ends) if s != last]
    assert len(full) >= 15
    lowest = SEG - (SEG - HEADER_SIZE) * J.ROLL_STAGGER
    for end in full:
        assert lowest - n < end <= SEG, (end, lowest)
    assert len(set(full)) >= len(full) // 2, full       # drawn, not one fixed point
    j.close()
    j, recs = open_journal(tmp_path)
    assert [(r[2], r[3][:3]) for r in recs] == [(J.ADD, x[:3]) for x in ents]
    for p, x in zip(pos, ents):
        assert j.read_add(p) == x
    j.close()


def test_a_fresh_segment_takes_any_record_that_fits_a_segment(tmp_path):
    """A roll point drawn below a record that fits a segment does not refuse it:
    the largest record a segment can hold goes into a fresh segment whatever
    its draw; one byte more is RecordTooLargeError."""
    j, _ = open_journal(tmp_path)

    class Low:                           # every draw at the bottom of the eighth
        def random(self):
            return 0.999
    j._rng = Low()
    p0 = j.append_add(3, 0, -1, b"", b"x")
    p1 = j.append_add(3, 1, 0, b"", b"y")
    n = split_position(p1)[1] - split_position(p0)[1] - 1     # a record's bytes besides its payload
    big = add_payload(2, SEG - HEADER_SIZE - n)
    with pytest.raises(RecordTooLargeError):
        j.append_add(3, 2, 1, b"", big + b"z")
    p2 = j.append_add(3, 2, 1, b"", big)
    assert split_position(p2) == (split_position(p1)[0] + 1, HEADER_SIZE)
    p3 = j.append_add(3, 3, 2, b"", b"w")                # the segment is full: rolls
    assert split_position(p3) == (split_position(p2)[0] + 1, HEADER_SIZE)
    j.sync()
    j.close()
    j, recs = open_journal(tmp_path)
    assert [r[3][1] for r in recs if r[2] == J.ADD] == [0, 1, 2, 3]
    assert j.read_add(p2)[4] == big
    j.close()
