"""Journal with direct writes (``journalDirectWrites``): the journal's tests again
with the setting on, and what is the direct path's own: reads from the images,
the partial last block, the write in flight, a roll, AIO, the fallback where
O_DIRECT is refused (the storage's tests with it: test_storage_direct.py)."""

from __future__ import annotations

import errno
import gc
import logging
import os
import threading

import pytest

import test_journal as base
from bk.bookie import aiosync
from bk.bookie import journal as J
from bk.bookie.journal import Journal, JournalError, iter_records

SEG = base.SEG

# The journal's tests, every one with direct writes, but for those about the
# buffered path's own staging buffer, sync descriptor and pwrite (their direct
# counterparts are below).
_BUFFERED_ONLY = {"test_groups_larger_than_the_staging_buffer_and_huge_records",
                  "test_a_sync_thread_keeps_its_segment_open_and_follows_rolls",
                  "test_a_failed_write_out_poisons_the_journal"}
for _name in dir(base):
    if _name.startswith("test_") and _name not in _BUFFERED_ONLY:
        globals()["test_journal_" + _name[5:]] = getattr(base, _name)

_real_probe = Journal._probe_direct


@pytest.fixture(autouse=True)
def direct_by_default(monkeypatch):
    """Journals opened by these tests write directly unless told otherwise; each
    test checks that they really did."""
    monkeypatch.setattr(Journal.__init__, "__defaults__", (True, J.ROLL_STAGGER, True))
    opened = []
    real = _real_probe

    def probe(self):
        ok = real(self)
        opened.append(ok)
        return ok
    monkeypatch.setattr(Journal, "_probe_direct", probe)
    yield
    assert all(opened), "a journal of this test fell back to buffered writes"


def open_journal(path, mark=None, size=SEG):
    j = Journal(str(path), size, True, J.ROLL_STAGGER, True)
    assert j.direct
    return j, list(j.replay(mark))


def file_bytes(path, seq, lo, hi):
    fd = os.open(os.path.join(path, J.segment_name(seq)), os.O_RDONLY)
    try:
        return os.pread(fd, hi - lo, lo)
    finally:
        os.close(fd)


def commit(j):
    job = j.begin_sync()
    job.run()
    j.end_sync(job)
    return job


def test_reads_of_the_active_previous_and_older_segments_match_the_files(tmp_path):
    j, _ = open_journal(tmp_path)
    pos = []
    for g in range(40):                          # ~1 KB records, 64 KiB segments: rolls
        for _ in range(7):
            pos.append(j.append_add(5, len(pos), len(pos) - 1, b"dg",
                                    base.add_payload(g, 900 + g)))
        job = commit(j)
        assert job.parts is None and job.error is None     # released by end_sync
    segs = j.segments()
    assert len(segs) >= 4
    active, prev, older = j._segs[segs[-1]], j._segs[segs[-2]], j._segs[segs[-3]]
    assert active.image is not None and prev.image is not None and older.image is None
    assert active.image is not prev.image and len(j._images) == 2
    # every record as the disk has it (the files read back, not the journal's memory)
    disk = {r.position: r.fields for r in iter_records(str(tmp_path))}
    assert sorted(disk) == pos
    for i, p in enumerate(pos):
        assert j.read_add(p) == disk[p]
        assert j.read(p) == (J.ADD, disk[p])
        assert j.read_add(p)[1] == i
    # the image is byte for byte what the file holds, up to the last record
    end = j.mark[1]
    assert file_bytes(tmp_path, active.seq, 0, end) == bytes(active.mm[:end])
    # and after it the file holds zeros (the last block was written padded)
    assert file_bytes(tmp_path, active.seq, end, -(-end // 4096) * 4096) == \
        bytes(-end % 4096)
    scanned = [p for s in segs for p, *_ in j.scan_segment(s)]
    assert scanned == pos
    j.close()


def test_a_group_ending_mid_block_then_another_rewrites_that_block(tmp_path):
    j, _ = open_journal(tmp_path)
    p1 = j.append_add(1, 0, -1, b"d", b"a" * 1001)
    j.sync()
    end1 = j.mark[1]
    assert end1 % 4096 and j._wend == end1
    p2 = j.append_add(1, 1, 0, b"d", b"b" * 3001)       # the rest of that block and beyond
    p3 = j.append_add(1, 2, 1, b"d", b"c" * 5)
    job = j.begin_sync()
    assert job.offset == 0 and job.offset < end1        # the shared block is written again
    job.run()
    j.end_sync(job)
    assert file_bytes(tmp_path, 1, 0, j.mark[1]) == bytes(j._segs[1].mm[:j.mark[1]])
    del j                    # "crash": no close; replay reads what the disk has
    gc.collect()
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == [p1, p2, p3]
    assert j.read_add(p2)[4] == b"b" * 3001
    p4 = j.append_add(1, 3, 2, b"d", b"d" * 77)         # appends continue in the image
    j.sync()
    j.close()
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == [p1, p2, p3, p4]
    j.close()


def test_a_crash_loses_the_records_not_written_out_and_nothing_before(tmp_path):
    j, _ = open_journal(tmp_path)
    synced = [j.append_add(2, i, -1, b"", base.add_payload(i)) for i in range(30)]
    commit(j)
    lost = [j.append_add(2, 30 + i, -1, b"", base.add_payload(i)) for i in range(5)]
    assert j.read_add(lost[-1])[1] == 34                # readable from memory meanwhile
    del j
    gc.collect()
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == synced
    j.close()


def test_a_write_out_waits_for_the_direct_write_in_flight(tmp_path, monkeypatch):
    """write_out (a flush's) writes the block a handed-out write writes too: it must
    wait for that write, or the older copy of the block could land last."""
    j, _ = open_journal(tmp_path)
    [j.append_add(4, i, -1, b"", base.add_payload(i, 700)) for i in range(10)]
    job = j.begin_sync()
    assert job.parts is not None
    later = [j.append_add(4, 10 + i, -1, b"", base.add_payload(i, 700)) for i in range(3)]
    inside, go = threading.Event(), threading.Event()
    real = os.pwritev

    def held_write(*args):        # the sync thread's write, held until write_out waits
        if threading.current_thread() is runner:
            inside.set()
            go.wait(30)
        return real(*args)
    monkeypatch.setattr(os, "pwritev", held_write)

    class Done(threading.Event):
        def wait(self, timeout=None):
            go.set()
            return super().wait(timeout)
    job.done = Done()
    runner = threading.Thread(target=job.run)
    runner.start()
    try:
        assert inside.wait(30)
        j.write_out()
        assert job.done.is_set(), "write_out did not wait for the write in flight"
    finally:
        go.set()
        runner.join()
    j.end_sync(job)
    end = j.mark[1]
    assert file_bytes(tmp_path, 1, 0, end) == bytes(j._segs[1].mm[:end])
    j.sync()
    j.close()
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs][-3:] == later
    j.close()


def test_a_write_nobody_started_is_run_by_the_next_write_on_the_journals_thread(tmp_path):
    """A job handed out but never started (handed to a thread that has not taken it,
    or a failure between begin_sync and the submit) is written by the journal
    itself before its next write of those blocks, once: the thread that takes it
    later finds it done. Waiting for it instead would wait for ever."""
    j, _ = open_journal(tmp_path)
    pos = [j.append_add(4, i, -1, b"", base.add_payload(i, 700)) for i in range(10)]
    job = j.begin_sync()
    pos += [j.append_add(4, 10 + i, -1, b"", base.add_payload(i, 700)) for i in range(3)]
    writes = j.direct_writes
    j.write_out()                           # runs the job here, then writes the rest
    assert job.done.is_set() and job.error is None and j.direct_writes == writes + 1
    assert j._synced == job.end             # the job's write was durable (RWF_DSYNC)
    job.run()                               # the sync thread, late: nothing to do
    j.end_sync(job)
    j.sync()
    j.close()
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos
    j.close()


def test_a_roll_waits_for_the_write_in_flight_and_syncs_the_old_tail(tmp_path):
    j, _ = open_journal(tmp_path)
    pos = [j.append_add(6, i, -1, b"", base.add_payload(i)) for i in range(20)]
    job = j.begin_sync()
    waited = []

    def reap(jb, timeout):                  # as the worker's AIO waiter: the write completes
        waited.append(jb)
        os.pwritev(jb.fd, [v for _, v in jb.parts], jb.offset, os.RWF_DSYNC)
        jb.done.set()
    job.started(reap)                       # as if submitted to Linux AIO
    seq = j.active_seq
    while j.active_seq == seq:                  # appends until one rolls
        pos.append(j.append_add(6, len(pos), -1, b"", base.add_payload(len(pos))))
    assert waited == [job] and job.done.is_set()
    j.end_sync(job)
    j.sync()
    del j
    gc.collect()
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos
    j.close()


def test_a_failed_direct_write_poisons_the_journal(tmp_path):
    j, _ = open_journal(tmp_path)
    j.append(J.FENCE, 1)
    os.close(j._dfd)            # the next write fails with EBADF, as an I/O error would
    with pytest.raises(JournalError, match="write to journal"):
        j.sync()
    with pytest.raises(JournalError):
        j.append(J.FENCE, 2)
    j._dfd = -1
    j.close()


def test_a_failed_write_in_flight_poisons_the_journal(tmp_path):
    j, _ = open_journal(tmp_path)
    j.append(J.FENCE, 1)
    job = j.begin_sync()
    job.started(lambda jb, timeout: None)      # as if submitted to Linux AIO...
    job.error = OSError(errno.EIO, "injected")   # ...which reaped an I/O error
    job.done.set()
    j.append(J.FENCE, 2)
    with pytest.raises(JournalError, match="injected"):
        j.write_out()
    with pytest.raises(JournalError):
        j.append(J.FENCE, 3)
    j.close()


def test_direct_writes_through_linux_aio(tmp_path):
    aio = aiosync.open_context()
    assert aio is not None
    try:
        j, _ = open_journal(tmp_path)
        pos = []
        for g in range(25):                      # rolls too
            pos += [j.append_add(8, len(pos), -1, b"", base.add_payload(g, 1500))
                    for _ in range(5)]
            job = j.begin_sync()
            aio.submit_write(job.fd, job.parts, job.offset)
            job.started(lambda jb, timeout: None)    # (not waited for here)
            res = aio.reap(wait=True)
            assert res == sum(len(v) for _, v in job.parts)
            job.done.set()
            j.end_sync(job)
        j.close()
        j, recs = open_journal(tmp_path)
        assert [p for p, *_ in recs] == pos
        assert j.read_add(pos[-1])[4] == base.add_payload(24, 1500)
        j.close()
    finally:
        aio.close()


def test_without_o_direct_the_journal_writes_through_the_page_cache(tmp_path, monkeypatch,
                                                                  caplog):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)
    monkeypatch.setattr(os, "open", no_direct)
    monkeypatch.setattr(Journal, "_probe_direct", _real_probe)
    with caplog.at_level(logging.WARNING, logger="bk.journal"):
        j = Journal(str(tmp_path), SEG, True, J.ROLL_STAGGER, True)
    assert not j.direct
    assert "refuses O_DIRECT" in caplog.text
    list(j.replay())
    pos = [j.append_add(1, i, -1, b"", base.add_payload(i)) for i in range(100)]   # rolls
    j.sync()
    j.close()
    j = Journal(str(tmp_path), SEG, True, J.ROLL_STAGGER, True)
    assert [p for p, *_ in j.replay()] == pos
    j.close()



def test_without_sync_data_there_are_no_direct_writes(tmp_path):
    j = Journal(str(tmp_path), SEG, False, J.ROLL_STAGGER, True)
    assert not j.direct
    j.close()


def test_the_images_are_reused_and_freed_at_close(tmp_path):
    j, _ = open_journal(tmp_path)
    images = set()
    for i in range(400):                       # a dozen rolls
        j.append_add(9, i, -1, b"", base.add_payload(i, 1200))
        if i % 10 == 9:
            commit(j)
        images.add(id(j._image))
    assert len(j.segments()) > 4 and len(images) == 2 and len(j._images) == 2
    ims = list(j._images)
    j.close()
    assert all(im.mm.closed for im in ims)


def test_segments_larger_than_the_images_get_larger_images(tmp_path):
    """The images are made for the segment the journal opens with; a later,
    larger segment (journalPreAllocSizeMB raised between runs) gets its own."""
    j, _ = open_journal(tmp_path, size=SEG)
    pos = [j.append_add(3, i, -1, b"", base.add_payload(i)) for i in range(10)]
    j.sync()
    j.close()
    j, recs = open_journal(tmp_path, size=4 * SEG)       # continues in the small segment
    assert [p for p, *_ in recs] == pos
    while len(j.segments()) < 3 or j.mark[1] < 2 * SEG:  # into a large one, past SEG
        pos.append(j.append_add(3, len(pos), -1, b"", base.add_payload(len(pos))))
        if len(pos) % 20 == 0:
            j.sync()
    j.sync()
    assert j._segs[j.active_seq].size == 4 * SEG and len(j._image.mm) == 4 * SEG
    j.close()
    j, recs = open_journal(tmp_path, size=4 * SEG)
    assert [p for p, *_ in recs] == pos
    assert j.read_add(pos[-1])[1] == len(pos) - 1
    j.close()


# --- close with a direct write still handed out (after a failure) -------------------

def test_a_closing_journal_writes_a_job_nobody_started(tmp_path):
    """A healthy close finishes the group's write handed out and not started (no
    thread took it): written here, durable, and not waited for in vain."""
    j, _ = open_journal(tmp_path)
    pos = [j.append_add(5, i, -1, b"", base.add_payload(i)) for i in range(8)]
    job = j.begin_sync()
    j.close()
    assert job.done.is_set() and job.error is None
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == pos
    j.close()


def test_a_failed_journal_cancels_at_close_a_job_nobody_started(tmp_path):
    """After a failure the close does not write: the job nobody started is cancelled
    (it never runs, so its image can go), and the close returns."""
    j, _ = open_journal(tmp_path)
    kept = [j.append_add(5, i, -1, b"", base.add_payload(i)) for i in range(4)]
    j.sync()
    [j.append_add(5, 4 + i, -1, b"", base.add_payload(i)) for i in range(4)]
    job = j.begin_sync()
    j._fail(OSError(errno.EIO, "injected"))       # e.g. a flush's write-out failed
    j.close()
    assert job.done.is_set() and job.error.errno == errno.ECANCELED
    assert job.parts is None                       # its views of the image let go
    job.run()                                      # a sync thread taking it late: no write
    assert job.error.errno == errno.ECANCELED
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == kept
    j.close()


def test_a_close_waits_a_bounded_time_for_a_write_that_never_completes(tmp_path, monkeypatch,
                                                                   caplog):
    """A started write whose completion never comes (a device that stopped answering,
    a waiter with nothing left to reap) is waited for CLOSE_WAIT seconds; then the
    close logs it and returns, the lock released, the image left mapped (the kernel
    may still read it)."""
    monkeypatch.setattr(J, "CLOSE_WAIT", 0.2)
    j, _ = open_journal(tmp_path)
    [j.append_add(5, i, -1, b"", base.add_payload(i)) for i in range(4)]
    job = j.begin_sync()
    waits = []
    job.started(lambda jb, timeout: waits.append(timeout))   # reaps nothing, ever
    j._fail(OSError(errno.EIO, "injected"))
    n = len(J._ABANDONED)
    with caplog.at_level(logging.ERROR, logger="bk.journal"):
        j.close()
    assert waits == [0.2] and not job.done.is_set()
    assert "did not complete" in caplog.text
    assert len(J._ABANDONED) == n + 1
    left, dfd, images, bounce = J._ABANDONED.pop()
    assert left is job and not any(im.mm.closed for im in images + [bounce])   # mapped
    assert job.offset == 0 and bytes(job.parts[0][1][:8]) == J.SEGMENT_MAGIC
    j2, _ = open_journal(tmp_path)                 # the lock was released all the same
    j2.close()
    job.release()
    os.close(dfd)
    for im in images + [bounce]:
        im.close()
