"""Direct writes through a window smaller than a segment (``journalDirectMemoryMB``):
the journal's and the direct path's tests again with windows of a few blocks,
so that every one of them slides, and what is the window's own: slides at a
group's start and in an append, with a write in flight (AIO and the sync
thread) at that moment, reads of every record inside and outside the window
and of the records its base cuts (read from the file: they end at or before
the written mark), a record larger than the window, the
memory it takes whatever the segment size (the storage's tests with small
windows: test_storage_window.py)."""

from __future__ import annotations

import gc
import logging
import os
import random
import threading

import pytest

import test_journal as base
import test_journal_direct as direct
from bk.bookie import aiosync
from bk.bookie import journal as J
from bk.bookie.journal import Journal, iter_records

direct_by_default = direct.direct_by_default     # (autouse: direct writes, checked)
WINDOW = 8192                       # two blocks: the base tests' records slide it often

# The journal's and the direct path's tests, with such windows; but for the one
# about images as large as the segment (a window does not grow with segments),
# and the one that holds a write in flight while appending more than such a
# window holds (the append's slide runs the write nobody started yet; the
# window's own tests below hold one in flight through a slide).
_NOT_HERE = direct._BUFFERED_ONLY | {
    "test_segments_larger_than_the_images_get_larger_images",
    "test_a_write_out_waits_for_the_direct_write_in_flight"}
for _mod, _prefix in ((base, "test_journal_"), (direct, "test_direct_")):
    for _name in dir(_mod):
        if _name.startswith("test_") and _name not in _NOT_HERE \
                and not (_mod is direct and _name.startswith("test_journal_")):
            globals()[_prefix + _name[5:]] = getattr(_mod, _name)


@pytest.fixture(autouse=True)
def small_windows(monkeypatch):
    """Journals opened here take two windows of WINDOW bytes unless told otherwise."""
    monkeypatch.setattr(J, "MIN_WINDOW", 4096)
    monkeypatch.setattr(Journal.__init__, "__kwdefaults__", {"direct_memory": 2 * WINDOW})


def open_journal(path, size=1 << 20, memory=2 * WINDOW):
    j = Journal(str(path), size, True, J.ROLL_STAGGER, True, direct_memory=memory)
    assert j.direct
    return j, list(j.replay())


def payload(i: int) -> bytes:
    """Entry i's payload: its size and bytes both follow from i."""
    n = 50 + (i * 7919) % 1500
    return bytes((i + k) % 251 for k in range(16)) * (n // 16) + bytes([i % 256]) * (n % 16)


def check_all(j, pos, tmp_path, lid=7):
    """Every record read back through the journal (window, file or both) is the one
    appended, byte for byte, and is what the disk holds."""
    disk = {r.position: r.fields for r in iter_records(str(tmp_path))}
    for i, p in enumerate(pos):
        want = (lid, i, i - 1, b"dg", payload(i))
        assert j.read_add(p) == want, i
        assert j.read(p) == (J.ADD, want)
        assert j.record_length(p) == J.ADD_OVERHEAD + 2 + len(payload(i))
        if p in disk:
            assert disk[p] == want, i


def cut_records(j, pos):
    """The records of the active segment that its window's base cuts."""
    seg = j._segs[j.active_seq]
    out = []
    for p in pos:
        if p >> 32 == seg.seq:
            off = p & 0xFFFFFFFF
            if off < seg.wbase < off + j.record_length(p):
                out.append(p)
    return out


class HeldWrites:
    """The sync thread's direct writes, each held before its pwritev until the
    journal waits for it (``SyncJob.wait``): a write surely in flight while the
    journal appends, slides and reads."""

    def __init__(self, monkeypatch):
        self.runner = None
        self.inside = threading.Event()
        self.go = threading.Event()
        self.waited = []
        real = os.pwritev

        def held(*args):
            if threading.current_thread() is self.runner:
                self.inside.set()
                assert self.go.wait(30)
            return real(*args)
        monkeypatch.setattr(os, "pwritev", held)

    def start(self, job):
        go = self.go
        waited = self.waited
        go.clear()
        self.inside.clear()

        class Done(threading.Event):
            def wait(self, timeout=None):
                waited.append(job)
                go.set()
                return super().wait(timeout)
        job.done = Done()
        self.runner = threading.Thread(target=job.run)
        self.runner.start()
        assert self.inside.wait(30)

    def finish(self):
        self.go.set()
        self.runner.join(30)


def test_a_slide_in_an_append_waits_for_the_write_in_flight_on_the_sync_thread(
        tmp_path, monkeypatch):
    """A group larger than the window's free part slides it in the middle of an
    append, while the group before it is being written from the window's first
    blocks: the move would overwrite them, so the slide waits for that write,
    and the records stay readable from memory until it completed."""
    held = HeldWrites(monkeypatch)
    j, _ = open_journal(tmp_path, memory=2 * 65536)
    pos = []

    def add():
        pos.append(j.append_add(7, len(pos), len(pos) - 1, b"dg", payload(len(pos))))
    while j.position & 0xFFFFFFFF < 40000:       # a group from the window's start
        add()
    job = j.begin_sync()
    assert job.parts is not None and job.offset == 0 and j._wbase == 0
    held.start(job)                              # held in its pwritev
    first = len(pos)
    while j.slides == 0:
        add()
        if j.slides == 0:     # every record readable meanwhile, the held ones from memory
            check_all(j, pos, tmp_path)
    assert held.waited == [job] and job.done.is_set() and job.error is None
    assert j.slide_waits == 1 and j._wbase > 0
    for _ in range(20):
        add()
    held.finish()
    j.end_sync(job)
    j.sync()
    assert cut_records(j, pos), "no record is cut by the window's base"
    check_all(j, pos, tmp_path)
    assert len(pos) > first + 20
    del j                                        # a crash: replay reads the disk
    gc.collect()
    j, recs = open_journal(tmp_path, memory=2 * 65536)
    assert [p for p, *_ in recs] == pos
    check_all(j, pos, tmp_path)
    j.close()


@pytest.mark.parametrize("how", ["aio", "thread"])
def test_many_slides_with_writes_in_flight_read_back_byte_for_byte(tmp_path, how):
    """Far more than the window through hundreds of slides, pipelined as the worker
    does it (each group's write in flight while the next group is appended, some
    groups larger than the window's free half, so that they slide in an append
    with the write in flight), segments rolling: every record reads back byte for
    byte, from the window, the file or both, and the disk holds each."""
    aio = aiosync.open_context() if how == "aio" else None
    assert how == "thread" or aio is not None
    rng = random.Random(21)
    j, _ = open_journal(tmp_path, size=256 << 10, memory=2 * 32768)
    pos = []
    job = None
    runner = None
    try:
        while len(pos) < 3000:
            for _ in range(rng.choice([2, 5, 9, 30])):     # 30: ~23 KiB, > half a window
                pos.append(j.append_add(7, len(pos), len(pos) - 1, b"dg",
                                        payload(len(pos))))
            if job is not None and job.parts is not None:   # the write in flight completes
                if aio is not None:
                    if not job.done.is_set():    # (else reaped by a slide's or a roll's wait)
                        assert aio.reap(wait=True) == sum(len(v) for _, v in job.parts)
                        job.done.set()
                else:
                    runner.join(30)
            if job is not None:
                j.end_sync(job)
                assert job.error is None
            job = j.begin_sync()
            if job.parts is None:
                job.run()
            elif aio is not None:
                aio.submit_write(job.fd, job.parts, job.offset)
                job.started(lambda jb, timeout, a=aio: (a.reap(wait=True), jb.done.set()))
            else:
                runner = threading.Thread(target=job.run)
                runner.start()
            if len(pos) % 500 < 9:
                check_all(j, pos, tmp_path)
        if job.parts is not None and aio is not None and not job.done.is_set():
            aio.reap(wait=True)
            job.done.set()
        elif runner is not None:
            runner.join(30)
        j.end_sync(job)
        # (not pinned: whether a group rolls at its start depends on the preparing
        # thread's progress, and with it where the windows slide)
        assert j.slides > 100 and j.slide_waits > 20 and len(j.segments()) > 10
        assert len(j._images) == 2 and {len(im.mm) for im in j._images} == {32768}
        check_all(j, pos, tmp_path)
        j.close()
        j, recs = open_journal(tmp_path, size=256 << 10, memory=2 * 32768)
        assert [p for p, *_ in recs] == pos
        check_all(j, pos, tmp_path)
        j.close()
    finally:
        if aio is not None:
            aio.close()


def test_slides_at_a_groups_start_wait_for_nothing_and_keep_the_last_eighth(tmp_path):
    """Groups smaller than the window's free quarter slide it at their start, where
    no write is in flight: no slide waits, however many there are; and each
    slide keeps the last eighth of the window (to its block) readable from
    memory, for tailing readers."""
    j, _ = open_journal(tmp_path, size=4 << 20, memory=2 * 65536)
    pos = []
    slides = 0
    for g in range(1500):
        for _ in range(3):
            pos.append(j.append_add(7, len(pos), len(pos) - 1, b"dg", payload(len(pos))))
        direct.commit(j)
        if j.slides > slides:
            slides = j.slides
            kept = (j.position & 0xFFFFFFFF) - j._wbase
            assert kept >= 65536 >> 3, (g, kept)      # (the base: a block before that)
            assert j.read_add(pos[-4])[1] == len(pos) - 4
    assert j.slides == slides and slides > 40 and j.slide_waits == 0
    check_all(j, pos, tmp_path)
    j.close()


def test_the_previous_segments_tail_is_read_from_its_window_then_from_its_file(tmp_path):
    j, _ = open_journal(tmp_path, size=64 << 10)
    pos = []
    while len(j.segments()) < 2:
        pos.append(j.append_add(7, len(pos), len(pos) - 1, b"dg", payload(len(pos))))
        if len(pos) % 4 == 0:
            direct.commit(j)
    prev = j._segs[j.segments()[0]]
    assert prev.image is not None and prev.end > prev.wbase > 0
    check_all(j, pos, tmp_path)
    while len(j.segments()) < 3:
        pos.append(j.append_add(7, len(pos), len(pos) - 1, b"dg", payload(len(pos))))
        if len(pos) % 4 == 0:
            direct.commit(j)
    assert prev.image is None                  # its window went to the new segment
    j.sync()
    check_all(j, pos, tmp_path)
    j.close()


def test_a_record_larger_than_the_window_grows_it(tmp_path, caplog):
    j, _ = open_journal(tmp_path)
    a = j.append_add(7, 0, -1, b"dg", b"a" * 1000)
    direct.commit(j)
    with caplog.at_level(logging.WARNING, logger="bk.journal"):
        big = j.append_add(7, 1, 0, b"dg", b"b" * (3 * WINDOW))
    assert "the window grows" in caplog.text
    assert len(j._image.mm) >= 3 * WINDOW and len(j._images) == 2
    c = j.append_add(7, 2, 1, b"dg", b"c" * 100)
    assert j.read_add(big)[4] == b"b" * (3 * WINDOW)
    j.sync()
    assert [j.read_add(p)[4] for p in (a, big, c)] == [b"a" * 1000, b"b" * (3 * WINDOW),
                                                      b"c" * 100]
    j.close()
    j, recs = open_journal(tmp_path)
    assert [p for p, *_ in recs] == [a, big, c]
    j.close()


def test_the_windows_memory_is_set_by_the_setting_not_the_segment_size(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="bk.journal"):
        j, _ = open_journal(tmp_path, size=64 << 20, memory=16 << 20)
    assert [len(im.mm) for im in j._images] == [8 << 20, 8 << 20]
    assert "two windows take 16.0 MiB" in caplog.text
    j.close()
    # a window never exceeds a segment: the whole segment, no slide
    j, _ = open_journal(tmp_path / "small", size=1 << 20, memory=16 << 20)
    assert [len(im.mm) for im in j._images] == [1 << 20, 1 << 20]
    j.close()


def test_a_crash_after_many_slides_replays_every_synced_record(tmp_path):
    j, _ = open_journal(tmp_path, size=128 << 10)
    pos = []
    for g in range(150):
        for _ in range(1 + g % 7):
            pos.append(j.append_add(7, len(pos), len(pos) - 1, b"dg", payload(len(pos))))
        direct.commit(j)
    synced = list(pos)
    for _ in range(4):                          # appended, not written: lost in a crash
        pos.append(j.append_add(7, len(pos), len(pos) - 1, b"dg", payload(len(pos))))
    check_all(j, pos, tmp_path)
    assert j.slides > 20
    del j
    gc.collect()
    j, recs = open_journal(tmp_path, size=128 << 10)
    assert [p for p, *_ in recs] == synced
    check_all(j, synced, tmp_path)
    j.close()
