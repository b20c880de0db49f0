"""The shard worker's choice between an inline sync (a small group, no sync in
flight, recent syncs quick: pwrite + fdatasync on the loop's thread, answered at
once) and the pipelined sync thread, on a real worker with real storage and real
sockets (tests/unit/test_group_commit.py's step worker, inline syncs on; each test
with buffered and with direct journal writes, as there). Every
rule of the group commit still holds on the inline path: answered only after its
own sync, in order after the group before it, a failed sync answers nothing; and
a group gathered while a sync ran keeps the pipeline."""

from __future__ import annotations

import os

import pytest

from bk import protocol as P
from bk.bookie import worker as W
from bk.bookie.journal import JournalError
from bk.errors import EOK

from test_group_commit import KEY, LID, Client, make_worker, refuse_writes  # noqa: F401 (a fixture)


# The real syncs' times reach the moving average capped at this: on a loaded machine
# (a soak beside the suite) one fdatasync of 40 ms or more would otherwise send the
# next groups to the thread and fail the inline tests for the machine's sake. The
# slow-disk test feeds its slow sync in past the cap (ShardWorker._synced itself).
QUICK_SYNC = W.INLINE_MAX_SYNC / 10


@pytest.fixture
def inline_worker(make_worker):
    def make(**conf):
        w = make_worker(**conf)
        w.inline = True
        synced = w._synced
        w._synced = lambda latency, disk: synced(min(latency, QUICK_SYNC),
                                                 min(disk, QUICK_SYNC))
        return w
    return make


def durable(w) -> bool:
    j = w.storage._journal
    return j._synced == j._off and w.storage.unsynced_bytes == 0


def test_a_lone_add_is_synced_inline_and_answered_at_once(inline_worker):
    w = inline_worker()
    c = Client(w)
    syncs = w.storage._journal.syncs
    c.add(0)
    assert c.acked() == [] and not durable(w)              # appended, held
    w._start_sync()
    assert c.acked() == [(LID, 0)]
    assert w.sync_job is None and not w._sync_jobs and w.held == [] and w.inflight == []
    assert durable(w) and w.storage._journal.syncs == syncs + 1


def test_a_group_of_many_answers_takes_the_sync_thread(inline_worker):
    w = inline_worker()
    c = Client(w)
    c.add(*range(W.INLINE_MAX_ANSWERS + 1))
    w._start_sync()
    assert w.sync_job is not None and len(w._sync_jobs) == 1 and c.acked() == []
    w.complete()
    assert c.acked() == [(LID, e) for e in range(W.INLINE_MAX_ANSWERS + 1)]


def test_a_group_of_many_bytes_takes_the_sync_thread(inline_worker):
    w = inline_worker()
    c = Client(w)
    c.send(P.add(11, LID, 0, -1, KEY, b"", b"z" * (W.INLINE_MAX_BYTES + 1)))
    w._start_sync()
    assert w.sync_job is not None and c.acked() == []
    w.complete()
    assert c.acked() == [(LID, 0)]


# A batch of 1 KiB entries that fits the inline bounds (16 KiB: 14 entries).
SMALL_BATCH = W.INLINE_MAX_BYTES // 1100


def test_a_batch_within_the_bounds_is_synced_inline_and_answered_only_after_it(inline_worker):
    """One ADD_BATCH of 1 KiB entries within INLINE_MAX_BYTES (one answer: the
    connection's group acknowledgement) while the loop has spare time: synced on
    the loop's thread, no sync thread, and the acknowledgement of every entry
    leaves only once the journal is durable to its end."""
    w = inline_worker()
    c = Client(w)
    syncs = w.storage._journal.syncs
    c.send(P.encode_add_batch(12, KEY, 0, [(LID, e, e - 1, b"d" * 16, b"p" * 1024)
                                           for e in range(SMALL_BATCH)]))
    assert len(w.held) == 1 and c.acked() == [] and not durable(w)
    assert SMALL_BATCH * 1024 < w.storage.unsynced_bytes <= W.INLINE_MAX_BYTES
    sent = []
    release = w._release

    def watch(held):                      # durable when its answer is sent
        sent.append(durable(w))
        release(held)
    w._release = watch
    w._start_sync()
    assert sent == [True]
    assert w.sync_job is None and not w._sync_jobs and w.held == [] and w.inflight == []
    assert c.acked() == [(LID, e) for e in range(SMALL_BATCH)]
    assert w.storage._journal.syncs == syncs + 1


def test_a_failed_inline_sync_of_a_batch_answers_none_of_it(inline_worker):
    """The batch's inline sync (fdatasync, or its direct write) fails: not one of its
    entries is acknowledged."""
    w = inline_worker()
    c = Client(w)
    j = w.storage._journal
    good = refuse_writes(j)               # its next write or fdatasync fails
    try:
        c.send(P.encode_add_batch(13, KEY, 0, [(LID, e, e - 1, b"", b"q" * 1024)
                                               for e in range(SMALL_BATCH)]))
        with pytest.raises(JournalError):
            w._start_sync()
        assert w.sync_job is None and not w._sync_jobs      # it was the inline sync
        assert c.acked() == [] and w._failed and w.inflight == [] and w.held == []
        w._quiesce()
        assert c.acked() == []
    finally:
        os.close(good)


def test_a_small_group_gathered_during_a_pipelined_sync_keeps_the_pipeline(inline_worker):
    """Input that arrives while a sync runs goes on arriving: its group takes the
    thread too (begun before the synced group is answered), however small."""
    w = inline_worker()
    c = Client(w)
    big = W.INLINE_MAX_ANSWERS + 1
    c.add(*range(big))
    w._start_sync()
    first = w.sync_job
    c.add(big)                            # held while that sync runs
    assert c.acked() == []
    w.complete()
    assert c.acked() == [(LID, e) for e in range(big)]
    assert w.sync_job is not None and w.sync_job is not first       # the small one syncing
    w.complete()
    assert c.acked() == [(LID, big)]
    assert w.sync_job is None and durable(w)
    c.add(big + 1)                        # due with nothing in flight: inline again
    w._start_sync()
    assert w.sync_job is None and c.acked() == [(LID, big + 1)]


def test_a_big_group_held_behind_a_pipelined_sync_keeps_the_pipeline(inline_worker):
    w = inline_worker()
    c = Client(w)
    big = W.INLINE_MAX_ANSWERS + 1
    c.add(*range(big))
    w._start_sync()
    c.add(*range(big, 2 * big))
    w.complete()
    assert c.acked() == [(LID, e) for e in range(big)]
    assert w.sync_job is not None and len(w._sync_jobs) == 1        # the next one syncing
    w.complete()
    assert c.acked() == [(LID, e) for e in range(big, 2 * big)]


def test_a_slow_sync_sends_groups_to_the_thread_until_syncs_are_quick_again(inline_worker):
    w = inline_worker()
    c = Client(w)
    c.add(0)
    w._start_sync()
    assert c.acked() == [(LID, 0)]                          # inline
    slow = 2 * W.INLINE_MAX_SYNC / W.SYNC_AVG_WEIGHT     # one slow disk moment (80 ms)
    W.ShardWorker._synced(w, slow, slow)
    threaded = 0
    eid = 1
    while True:
        c.add(eid)
        w._start_sync()
        if w.sync_job is None:            # inline again
            assert c.acked() == [(LID, eid)]
            break
        threaded += 1
        assert c.acked() == []
        w.complete()                      # a quick sync, through the thread
        assert c.acked() == [(LID, eid)]
        eid += 1
        assert threaded < 100, "inline syncs never came back"
    assert threaded >= 1


def test_a_failed_inline_sync_answers_nothing_of_its_group_nor_later(inline_worker):
    w = inline_worker()
    c = Client(w)
    c.add(0)
    w._start_sync()
    assert c.acked() == [(LID, 0)]
    j = w.storage._journal
    good = refuse_writes(j)               # its next write or fdatasync fails
    try:
        c.add(1)
        with pytest.raises(JournalError):
            w._start_sync()
        assert c.acked() == [] and w._failed and w.inflight == [] and w.held == []
        c.add(2)                          # refused by the failed journal; held, never sent
        w._quiesce()                      # as the worker's exit does
        assert c.acked() == []
    finally:
        os.close(good)


def test_a_fence_synced_inline_is_answered_after_its_sync(inline_worker):
    w = inline_worker()
    c = Client(w)
    c.add(0)
    w._start_sync()
    c.acked()
    c.send(P.read_lac(21, LID, fence=True, master_key=KEY))
    assert c.received() == [] and not durable(w)           # the FENCE record, not synced
    w._start_sync()
    got = c.received()
    assert [(m[0], m[1], m[2]) for m in got] == [(P.READ_LAC, 21, EOK)] and durable(w)


def test_long_polls_wake_after_the_inline_sync_of_the_lac(inline_worker):
    w = inline_worker()
    c, tail = Client(w), Client(w)
    c.add(0, 1)
    w._start_sync()
    c.received()
    tail.send(P.read(31, LID, 1, long_poll=True, previous_lac=0, timeout_ms=60_000))
    assert tail.received() == []
    c.add(2)                              # carries LAC 1
    assert tail.received() == []          # not before its sync
    w._start_sync()
    got = tail.received()
    assert [(m[0], m[1], m[2], m[4], m[7]) for m in got] == [(P.READ, 31, EOK, 1, b"x1")]


def test_without_sync_data_nothing_is_synced_inline(inline_worker):
    w = inline_worker(journalSyncData=False)
    c = Client(w)
    c.add(0)
    w._start_sync()
    assert c.acked() == [(LID, 0)] and w.sync_job is None and not w._sync_jobs
    assert w._sync_avg == 0.0             # no sync ran at all


def test_a_busy_loop_keeps_the_pipeline(inline_worker):
    """A loop busy most of the last load window (one hot ledger at tens of thousands
    of entries/s) would queue its work behind an inline sync: the thread syncs."""
    w = inline_worker()
    c = Client(w)
    w._loop_load = W.INLINE_MAX_LOAD + 0.1
    c.add(0)
    w._start_sync()
    assert w.sync_job is not None and c.acked() == []
    w.complete()
    assert c.acked() == [(LID, 0)]
    w._loop_load = W.INLINE_MAX_LOAD / 2
    c.add(1)
    w._start_sync()
    assert w.sync_job is None and c.acked() == [(LID, 1)]
