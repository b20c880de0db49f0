"""The journal's roll at the start of a group commit, with direct writes
(``Journal._roll_ahead``, "Direct writes" in ``bk.bookie.journal``): the roll
writes nothing itself, the old segment's last write (the group's own) goes on
in flight through the old descriptor, and the new segment's first write waits
for it (an older segment durable before a newer one gets anything)."""

from __future__ import annotations

import gc
import os
import threading

import test_journal as base
from bk.bookie import journal as J
from bk.bookie.journal import Journal, iter_records
from bk.testing import start_elsewhere

SEG = 64 * 1024


def open_journal(path, mark=None):
    j = Journal(str(path), SEG, True, J.ROLL_STAGGER, True)
    assert j.direct
    return j, list(j.replay(mark))


def fill_to_the_ahead_point(j, pos, ledger=7):
    """Append ~1 KiB ADDs, a group commit every 5, until the active segment is
    past the point where a group's start rolls; its last group (1 to 5 records:
    their count is returned) is left unsynced.
    It stops at the first record past that point, so that the segment keeps
    room for another small one (ROLL_AHEAD leaves ~2 KiB past it in a 64 KiB
    segment: checked after each group of five, ~5.5 KiB, the last one could end
    anywhere up to the roll point, and a test's next small append rolled in the
    append, 1 run in ~30, the roll point being drawn at random)."""
    while True:
        for k in range(1, 6):
            pos.append(j.append_add(ledger, len(pos), len(pos) - 1, b"d",
                                    base.add_payload(len(pos))))
            if j.mark[1] > j._ahead_at:
                assert j._size - j.mark[1] > 512      # room for a small record
                if j._prep is not None:  # its preparation done: the roll takes it now
                    j._prep.result()
                return k
        job = j.begin_sync()
        job.run()
        j.end_sync(job)


def test_a_group_start_past_the_ahead_point_rolls_and_writes_nothing_itself(tmp_path):
    j, _ = open_journal(tmp_path)
    pos: list[int] = []
    fill_to_the_ahead_point(j, pos)
    seq, end = j.mark
    assert end <= j._size                      # before the segment's roll point
    writes = j.direct_writes
    job = j.begin_sync()                        # the old segment's last write, handed out
    assert job.seq == seq and job.end == end and job.parts is not None
    assert j.active_seq == seq + 1 and j.mark == (seq + 1, J.HEADER_SIZE)
    assert j.rolls_ahead == 1 and j.rolled_at == J.make_position(seq, end)
    assert j.direct_writes == writes, "the roll wrote on the loop's thread"
    # the write in flight goes through the old segment's descriptor, still open
    assert job.fd != j._dfd and job.fd == j._retired_dfd
    later = [j.append_add(7, len(pos) + i, -1, b"d", base.add_payload(i)) for i in range(4)]
    assert j.read_add(pos[-1])[1] == len(pos) - 1        # the old tail, from its image
    assert j.read_add(later[0])[1] == len(pos)
    job.run()
    assert job.error is None
    j.end_sync(job)
    pos += later
    job = j.begin_sync()                        # the new segment's first write
    assert job.seq == seq + 1
    job.run()
    j.end_sync(job)
    del j                                       # "crash": replay reads what the disk has
    gc.collect()
    assert [r.position for r in iter_records(str(tmp_path))] == pos
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos
    assert not os.path.exists(os.path.join(str(tmp_path), J.QUARANTINE_DIR))
    j.close()


def test_the_new_segments_first_write_waits_for_the_old_ones(tmp_path):
    """A sync (or a flush's write-out) after a roll ahead, with the old segment's
    last write still in flight: the new segment's records must not reach the disk
    before it. The first direct write to the new segment comes after it."""
    j, _ = open_journal(tmp_path)
    pos: list[int] = []
    fill_to_the_ahead_point(j, pos)
    job = j.begin_sync()
    assert j.rolls_ahead == 1
    pos.append(j.append_add(7, len(pos), -1, b"d", base.add_payload(1)))
    entered = threading.Event()

    class Done(threading.Event):
        def wait(self, timeout=None):
            entered.set()
            return super().wait(timeout)
    job.done = Done()
    order = []
    write = j._direct_write

    def direct_write(end, dsync):
        order.append(("new segment's write", job.done.is_set()))
        return write(end, dsync)
    j._direct_write = direct_write
    runner = threading.Thread(target=lambda: (entered.wait(30), job.run()))
    runner.start()
    try:
        j.sync()
    finally:
        entered.set()
        runner.join()
    assert order == [("new segment's write", True)]
    j.end_sync(job)
    j.close()
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos
    j.close()


def test_a_write_out_waits_for_the_old_segments_last_write(tmp_path):
    """Right after a roll ahead the new segment holds nothing to write, but a
    flush will read the old segment's tail from its file: write_out waits for
    the write that puts it there."""
    j, _ = open_journal(tmp_path)
    pos: list[int] = []
    fill_to_the_ahead_point(j, pos)
    seq, end = j.mark
    job = j.begin_sync()
    assert j.rolls_ahead == 1 and j.mark == (seq + 1, J.HEADER_SIZE)
    waited = []
    start_elsewhere(job, waited)
    j.write_out()
    assert waited == [job] and job.done.is_set()
    assert base.add_payload(len(pos) - 1) in bytes(
        open(os.path.join(str(tmp_path), J.segment_name(seq)), "rb").read()[:end])
    j.end_sync(job)
    j.close()


def test_a_crash_with_the_old_segments_last_write_lost(tmp_path):
    """Killed after the roll ahead, that write never done: its group is lost (it was
    never acknowledged), everything before it replays, the new segment is empty
    (no quarantine), and appends go on in it."""
    j, _ = open_journal(tmp_path)
    pos: list[int] = []
    unsynced = fill_to_the_ahead_point(j, pos)
    synced = pos[:-unsynced]
    seq = j.active_seq
    j.begin_sync()                               # handed out, never run
    j.append_add(7, len(pos), -1, b"d", b"x" * 10)
    del j
    gc.collect()
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == synced
    assert not os.path.exists(os.path.join(str(tmp_path), J.QUARANTINE_DIR))
    assert j.segments() == list(range(1, seq + 2))    # the new one empty, kept
    p = j.append_add(7, 99, -1, b"", b"y")
    j.sync()
    j.close()
    j, recs = open_journal(tmp_path)
    assert [q for q, *_ in recs] == synced + [p]
    j.close()


def test_an_inline_sync_past_the_ahead_point_rolls_too(tmp_path):
    j, _ = open_journal(tmp_path)
    pos: list[int] = []
    fill_to_the_ahead_point(j, pos)
    seq = j.active_seq
    j.sync()
    assert j.active_seq == seq + 1 and j.rolls_ahead == 1
    assert j._retired_dfd == -1                 # nothing in flight: closed at once
    pos.append(j.append_add(7, len(pos), -1, b"", b"z" * 100))
    j.sync()
    j.close()
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos
    j.close()


def test_a_group_start_does_not_wait_for_the_next_segments_preparation(tmp_path):
    """Past the ahead point with the next segment still being prepared (a restart
    near a segment's end): no roll and no wait at that group's start; a later
    group's start rolls once it is ready."""
    j, _ = open_journal(tmp_path)
    pos: list[int] = []
    fill_to_the_ahead_point(j, pos)
    seq = j.active_seq
    gate = threading.Event()
    real = j._prep

    class Slow:                      # the preparation's thread, not finished yet
        seq = real.seq

        def done(self):
            return gate.is_set()

        def result(self):
            return real.result()
    j._prep = Slow()
    job = j.begin_sync()
    assert j.active_seq == seq and j.rolls_ahead == 0
    job.run()
    j.end_sync(job)
    pos.append(j.append_add(7, len(pos), -1, b"", b"q" * 50))
    gate.set()
    job = j.begin_sync()
    assert j.active_seq == seq + 1 and j.rolls_ahead == 1
    job.run()
    j.end_sync(job)
    j.close()
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos
    j.close()


def test_without_direct_writes_a_group_start_never_rolls(tmp_path):
    j = Journal(str(tmp_path), SEG, True, J.ROLL_STAGGER, False)
    list(j.replay())
    pos = []
    while j.active_seq == 1:
        pos.append(j.append_add(7, len(pos), -1, b"", base.add_payload(len(pos))))
        if len(pos) % 5 == 0:
            job = j.begin_sync()
            job.run()
            j.end_sync(job)
    assert j.rolls_ahead == 0
    j.sync()
    j.close()
    assert [r.position for r in iter_records(str(tmp_path))] == pos
