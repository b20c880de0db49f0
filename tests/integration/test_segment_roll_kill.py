"""kill -9 and SIGSTOP at the moments the journal's segment roll makes matter,
now that the next segment is prepared by a thread of the journal's own (see
"Preparing the next segment" in ``bk.bookie.journal``):

* ``preparing``: the next segment is a fallocated ``.seg.tmp`` with its header
  fsync'd, not renamed yet;
* ``prepared``: it has been renamed into place and the directory fsync'd, and
  no record has reached it;
* ``roll``: a roll is about to activate the prepared one, the old segment's
  tail written and synced (or, with direct writes at a group's start, its last
  write handed out: see ``test_kill_at_an_early_roll_loses_nothing``).

The shard worker stops itself (SIGSTOP, every thread of it) at the second such
moment through a hook put first on the bookie's PYTHONPATH (``site_hook``). With
``kill`` the bookie is then killed with SIGKILL; with ``stop`` it is continued,
takes more adds, and is killed later. After the restart every acknowledged entry
reads back exactly once, the journal holds each entry's ADD record at most once,
no ``.seg.tmp`` is left and the segments' sequence numbers have no gap. Real etcd
and bookie processes; 1 MiB segments, so that rolls come every ~1000 entries."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from bk import protocol as P
from bk.bookie import journal as J
from bk.config import SETTINGS
from bk.errors import BKError, EOK
from bk.rawclient import BookieConnection
from bk.testing import hooked_stop, site_hook, wait_until


PAYLOAD = bytes(range(256)) * 4          # 1 KiB
KEY = b"r" * 20
BATCH = 16

HOOK = r'''
import json, os, signal, threading
import bk.bookie.journal as J

WHERE = os.environ.get("ROLL_TEST_WHERE", "")
OUT = os.environ.get("ROLL_TEST_OUT")
_seen = [0]
if os.environ.get("ROLL_TEST_EARLY"):    # every segment rolls at the lowest point of its draw
    J.roll_point = lambda size, rng, spread=J.ROLL_STAGGER: (
        size - int((size - J.HEADER_SIZE) * spread))
# How the worker commits every group: "pipelined", its write handed out (begin_sync)
# and submitted after, or "inline", written and synced on the loop (sync); unset,
# as the worker decides (the disk's recent speed, the group's size)
SYNC = os.environ.get("ROLL_TEST_SYNC")
if SYNC:
    import bk.bookie.worker as W
    W.ShardWorker._may_sync_inline = lambda self, inline=SYNC == "inline": inline


def moment(what, directory=None, **more):
    _seen[0] += 1
    if _seen[0] == 2:                    # the second: data in more than one segment
        with open(OUT + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "where": what,
                       "thread": threading.current_thread().name,
                       "names": sorted(os.listdir(directory)) if directory else [],
                       **more}, f)
        os.rename(OUT + ".tmp", OUT)
        # directed at this thread: it stops before going on (a process-directed
        # SIGSTOP may be taken by another thread while this one runs on a while)
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


if WHERE == "preparing":
    _rename = os.rename

    def rename(src, dst, *a, **kw):
        if str(src).endswith(".seg.tmp") and threading.current_thread().name.startswith(
                "journal-prep"):
            moment("preparing", os.path.dirname(str(src)))
        return _rename(src, dst, *a, **kw)
    os.rename = rename
elif WHERE == "prepared":
    _make = J._make_segment

    def make(directory, seq, size, sync_dir):
        out = _make(directory, seq, size, sync_dir)
        if sync_dir:
            moment("prepared")
        return out
    J._make_segment = make
elif WHERE == "roll":
    _take = J.Journal._take_prepared

    def take(self):
        # a roll at a group's start (direct writes): the old segment's last write is
        # handed out, maybe not even submitted; a kill now may leave it unwritten
        job = self._inflight
        pending = (job is not None and job.seq == self.active_seq and job.parts is not None
                   and not job.done.is_set())
        moment("roll", seq=self.active_seq, pending_from=job.offset if pending else None,
               pending_end=job.end if pending else None, block=self._bs)
        return _take(self)
    J.Journal._take_prepared = take
'''


def pump(b, lid, stop, acked, first=0, window=8):
    """Batches of BATCH entries (``window`` batches) from ``first`` until ``stop``;
    the entries acknowledged with EOK go to ``acked``. A connection broken by the
    kill ends it. The window counts entries: one group acknowledgement covers every
    batch of the group (bk.protocol), so counting answers as batches would wait, at
    the stop, for answers that never come (the connection's 10 s timeout)."""
    try:
        with BookieConnection(b.bookie_id, shard=P.shard_of(lid, b.num_shards)) as c:
            eid, outstanding = first, 0
            while not stop.is_set() or outstanding:
                while outstanding < window * BATCH and not stop.is_set():
                    c.send_raw(P.encode_add_batch(c.next_rid(), KEY, 0, [
                        (lid, e, e - 1, b"", PAYLOAD) for e in range(eid, eid + BATCH)]))
                    eid += BATCH
                    outstanding += BATCH
                r = c.recv()
                assert r[0] == P.ADD_BATCH and r[2] == EOK and r[4] == [], r[:3]
                runs = r[3]
                for i in range(0, len(runs), 3):
                    acked += list(range(runs[i + 1], runs[i + 2] + 1))
                    outstanding -= runs[i + 2] + 1 - runs[i + 1]
    except (OSError, BKError):
        if not stop.is_set():
            raise


def run_pump(b, lid, acked, first=0, window=8):
    """Start pumping (see :func:`pump`): the thread and its stop event."""
    stop = threading.Event()
    t = threading.Thread(target=pump, args=(b, lid, stop, acked, first, window))
    t.start()
    return t, stop


def read_all(b, lid, last):
    """The entry ids READ_RANGE returns for 0..last, in order, with their payloads checked."""
    got = []
    with BookieConnection(b.bookie_id, shard=P.shard_of(lid, b.num_shards)) as c:
        first = 0
        while first <= last:
            r = c.call(P.read_range(c.next_rid(), lid, first, last, 4 << 20))
            assert r[2] == EOK, r[:3]
            entries = r[5]
            assert all(p == PAYLOAD for p in entries[3::4])
            got += entries[0::4]
            first = r[4]
    return got


def check_journal(jdir, lid):
    names = os.listdir(jdir)
    assert not [n for n in names if n.endswith(".tmp")], names
    seqs = sorted(int(n[:16]) for n in names if n.endswith(".seg"))
    assert seqs and seqs == list(range(seqs[0], seqs[-1] + 1)), seqs
    adds = [r.fields[1] for r in J.iter_records(jdir)
            if r.type == J.ADD and r.fields[0] == lid]
    assert len(adds) == len(set(adds)), "an entry's ADD record is in the journal twice"
    return seqs


@pytest.mark.parametrize("how", ["kill", "stop"])
@pytest.mark.parametrize("where", ["preparing", "prepared", "roll"])
def test_kill_or_stop_at_a_segment_roll_loses_nothing(cluster_factory, tmp_path, where, how):
    kill_or_stop_at_a_roll(cluster_factory, tmp_path, where, how)


@pytest.mark.parametrize("sync", ["pipelined", "inline"])
def test_kill_at_an_early_roll_loses_nothing(cluster_factory, tmp_path, sync):
    """The same with every segment rolled at the lowest point its roll can be
    drawn at (the last eighth of its room, ``bk.bookie.journal.roll_point``):
    killed at the second such roll (the first segment closed early, the second
    written out to its early end, or about to be), the records of both replay,
    and the restarted bookie (without the hook: its draws are random again)
    goes on in the second and across further rolls.

    Direct writes roll at a group's start, once the segment is past the point
    ``ROLL_AHEAD`` of its room before the roll point (``Journal._roll_ahead``).
    One batch of adds at a time makes every group smaller than that stretch, so
    that no group outgrows the roll point and every roll is such a roll; and the
    hook has the worker commit every group one way:

    * ``pipelined``: the roll comes in ``begin_sync``, right after the group's
      write (the old segment's last) is handed out and before the worker submits
      it: the kill takes that write, whose adds were never answered, and the
      segment ends where the write before it ended, inside the block the lost
      write starts with;
    * ``inline``: the roll comes in ``sync``, once the group's write is durable:
      the segment ends past that point, at most at its roll point."""
    lowest = (1 << 20) - int(((1 << 20) - J.HEADER_SIZE) * J.ROLL_STAGGER)
    ahead = int(((1 << 20) - J.HEADER_SIZE) * J.ROLL_AHEAD)
    assert SETTINGS["journalDirectWrites"].default
    assert BATCH * (len(PAYLOAD) + 64) < ahead      # a group fits the stretch
    killed = []

    def check(jdir, lid, stopped):
        ends = {}
        for r in J.iter_records(jdir):
            if r.type == J.ADD and r.fields[0] == lid:
                ends[r.seq] = r.offset + r.length
        killed.append(ends)
        assert len(ends) >= 2, ends
        pending = stopped["pending_from"]
        assert (pending is not None) == (sync == "pipelined"), stopped
        for seq, e in ends.items():
            if seq == stopped["seq"] and pending is not None:
                # the lost write's records are not there; all before them are
                assert pending <= e < pending + stopped["block"], (seq, e, stopped)
                assert e < stopped["pending_end"], (seq, e, stopped)
            else:
                # rolled once a group's write was durable: past the point ROLL_AHEAD
                # before the roll point, not past the roll point
                assert lowest - ahead < e <= lowest, (ends, lowest)

    kill_or_stop_at_a_roll(cluster_factory, tmp_path, "roll", "kill", early=True,
                           after_kill=check, sync=sync, window=1)
    assert killed


def kill_or_stop_at_a_roll(cluster_factory, tmp_path, where, how, early=False,
                           after_kill=None, sync=None, window=8):
    out = tmp_path / "stopped.json"
    # No flush: a flush deletes the segments wholly before its mark but keeps those
    # the index adopted as entry logs, which leaves gaps that check_journal's test
    # of the sequence numbers cannot tell from a lost segment (the first swap after
    # an open is drawn anywhere below flushIntervalBytes: here 1 in ~400 would come
    # within the test's ~10 MiB, against 1 in 3-10 with the defaults).
    conf = {"gcWaitTime": 3_600_000, "journalPreAllocSizeMB": 1,
            "nettyMaxFrameSizeBytes": 512 * 1024, "dbStorage_writeCacheMaxSizeMb": 8192,
            "flushIntervalBytes": 4 << 30, "flushInterval": 3_600_000}
    env = {"ROLL_TEST_WHERE": where, "ROLL_TEST_OUT": out}
    if early:
        env["ROLL_TEST_EARLY"] = "1"
    if sync:
        env["ROLL_TEST_SYNC"] = sync
    with site_hook(tmp_path, HOOK, env):
        c = cluster_factory(1, num_shards=1, conf_overrides=conf)
    b = c.bookies[0]
    jdir = os.path.join(b.dir, "journal", "shard-0")
    lid = (1 << 50) + 31
    acked: list[int] = []
    t, stop = run_pump(b, lid, acked, window=window)
    try:
        stopped = hooked_stop(out, "stop", what=f"the worker stopping at {where}")
        assert stopped["where"] == where
        names = os.listdir(jdir)
        if where == "preparing":          # the moment: made, not renamed into place yet
            assert any(n.endswith(".seg.tmp") for n in names), names
        if how == "stop":
            os.kill(stopped["pid"], signal.SIGCONT)
            n = len(acked)
            wait_until(lambda: len(acked) > n + 3000, timeout=120,
                       what="adds acknowledged after the worker went on")
        stop.set()
        b.kill()
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()
    assert acked, "nothing was acknowledged"
    if after_kill is not None:
        after_kill(jdir, lid, stopped)
    b.start()
    seqs = check_journal(jdir, lid)
    assert len(seqs) >= 2
    got = read_all(b, lid, max(acked))
    assert len(got) == len(set(got)), "an entry read back twice"
    assert set(acked) <= set(got), sorted(set(acked) - set(got))[:10]
    # and the bookie goes on taking adds of that ledger, across further rolls
    more: list[int] = []
    first = max(got) + 1
    t, stop = run_pump(b, lid, more, first)
    try:
        wait_until(lambda: len(more) > 3000, timeout=120, what="adds after the restart")
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()
    assert more[0] == first
    b.stop()
    after = check_journal(jdir, lid)
    assert after[-1] > seqs[-1]
    return jdir
