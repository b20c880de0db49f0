"""kill -9 at the moments the sync's hand-off makes matter. The loop begins a
group's sync through Linux AIO (bk.bookie.aiosync) where it can, through the
descriptor of the segment it keeps open from one group to the next, and hands
it to the sync thread otherwise (a deque and an eventfd, bk.park; the thread
keeps its own descriptor), where AIO is off or a group's sync covers the journal
directory too (a segment the roll had to create itself). The test uses 1 MiB
journal segments, so that rolls come often, and stops the shard worker (a hook
put first on the bookie's PYTHONPATH, ``sitecustomize``, as
tests/integration/test_group_commit_kill.py does) at the first group of a new
segment (through the sync thread, AIO off: its own new descriptor) or at its
second (AIO, the loop's descriptor moved to the new segment): just
after the loop began its sync (``handed``: it may or may not have completed)
or just after the sync completed, its answers not sent (``synced``). The worker is stopped with SIGSTOP and the whole bookie
killed with SIGKILL, or killed with SIGKILL alone (its arbiter restarts it,
which replays). Afterwards: the stopped group's entries were never
acknowledged, every acknowledged entry reads back, and once synced so do the
stopped group's. Real etcd and bookie processes."""

from __future__ import annotations

import threading

import pytest

from bk import protocol as P
from bk.errors import BKError, EOK
from bk.rawclient import BookieConnection
from bk.security import ClientSecurity
from bk.testing import hooked_stop, site_hook, wait_until

from test_group_commit_kill import KEY, PAYLOAD, pump
from test_storage_crash import read_back

STOP_AT = 3         # the first group of the third segment after the first

HOOK = r'''
import json, os, signal
import bk.bookie.worker as m

AT = int(os.environ.get("ST_TEST_STOP_AT", "0"))
OUT = os.environ.get("ST_TEST_OUT", "")
WHEN = os.environ.get("ST_TEST_WHEN", "")        # "handed" or "synced"
HOW = os.environ.get("ST_TEST_HOW", "")          # "stop" or "kill9"
NTH = int(os.environ.get("ST_TEST_NTH", "1"))    # 1: syncs the directory too (the thread)
_submit_sync = m.ShardWorker._submit_sync
_end_sync = m.ShardWorker._end_sync
_path = [None]
_nth = [0]
_seen = [0]


from bk.testing import acknowledged_entries as entries


_via = {}


def moment(job, answers):
    """The NTH job of a new segment covering answers: the AT-th such stops the worker."""
    if job is None or not answers or os.path.exists(OUT):
        return
    if job.path != _path[0]:
        _nth[0] = 0 if _path[0] is None else 1      # (the first segment does not count)
        _path[0] = job.path
    elif _nth[0]:
        _nth[0] += 1
    if _nth[0] != NTH:
        return
    _seen[0] += 1
    if _seen[0] != AT:
        return
    with open(OUT + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "entries": entries(answers),
                   "via": _via.get(id(job))}, f)
    os.rename(OUT + ".tmp", OUT)
    os.kill(os.getpid(), signal.SIGSTOP if HOW == "stop" else signal.SIGKILL)


def submit_sync(self, job):
    _submit_sync(self, job)
    _via.clear()
    _via[id(job)] = "aio" if self._aio is not None and self._aio.busy else "thread"
    if WHEN == "handed":
        moment(job, self.inflight)


def end_sync(self):
    job = self.sync_job
    done = _end_sync(self)
    if WHEN == "synced":
        moment(job, done[0])
    return done


if AT:
    m.ShardWorker._submit_sync = submit_sync
    m.ShardWorker._end_sync = end_sync
'''


class _Stop(threading.Event):
    """Set, or the worker reached the moment (killed with it, it closes the pumps'
    connections before the test can say so)."""

    def __init__(self, reached):
        super().__init__()
        self.reached = reached

    def is_set(self) -> bool:
        return super().is_set() or self.reached()


def readable(b, lid) -> bool:
    try:
        with BookieConnection(b.bookie_id, shard=0) as c:
            return c.call(P.read_range(c.next_rid(), lid, 0, 0, 1 << 20))[2] == EOK
    except (OSError, BKError):
        return False


@pytest.mark.parametrize("nth,when,how", [(1, "handed", "stop"), (1, "synced", "stop"),
                                          (2, "handed", "stop"), (2, "synced", "kill9")])
def test_kill9_at_a_segments_first_group_syncs(cluster_factory, tmp_path, nth, when,
                                               how):
    out = tmp_path / "stopped.json"
    # 1 MiB segments (frames of at most 512 KiB fit): a roll every ~1,000 entries.
    # The raw ledgers have no metadata: GC must not drop them while the test waits.
    env = {"ST_TEST_STOP_AT": STOP_AT, "ST_TEST_OUT": out, "ST_TEST_WHEN": when,
           "ST_TEST_HOW": how, "ST_TEST_NTH": nth}
    # The next segment is prepared (and its directory entry synced) off the loop, so
    # AIO takes a new segment's first group too; the sync thread's hand-off is the
    # one of a bookie without AIO (journalSyncThroughAio=false), tested at nth 1.
    with site_hook(tmp_path, HOOK, env):     # a restarted bookie runs without it
        c = cluster_factory(1, num_shards=1, conf_overrides={
            "gcWaitTime": 3_600_000, "journalPreAllocSizeMB": 1,
            "nettyMaxFrameSizeBytes": 512 << 10, "journalSyncThroughAio": nth != 1})
    b = c.bookies[0]
    lids = [(1 << 50) + 31 + i for i in range(3)]
    stop = _Stop(out.exists)
    acked: list[list] = [[] for _ in lids]
    threads = [threading.Thread(target=pump, args=(b, lid, ClientSecurity(), stop, acked[i]))
               for i, lid in enumerate(lids)]
    for t in threads:
        t.start()
    try:
        stopped = hooked_stop(out, how, what="the worker reaching a new segment's group")
        stop.set()
        if how == "stop":
            b.kill()                             # SIGKILL while the worker is stopped there
    finally:
        stop.set()
        if not out.exists():
            b.kill()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert stopped["via"] == ("thread" if nth == 1 else "aio"), stopped["via"]
    unanswered = {tuple(x) for x in stopped["entries"]}
    got = {(lid, e) for per in acked for lid, e in per}
    assert unanswered, "the stopped group held no batched entries"
    assert len(got) > 1000, "not a segment's worth of acknowledged entries"
    assert not unanswered & got, "entries of the stopped group were acknowledged"
    if how == "stop":
        b.start()
    else:                                        # the arbiter restarts the worker: it replays
        wait_until(lambda: readable(b, lids[0]), timeout=60, what="the worker restarted")
    for lid, per in zip(lids, acked):
        want = [e for _l, e in per]
        if when == "synced":                     # durable before the stop: there too
            want += [e for l2, e in unanswered if l2 == lid]
        if want:
            read_back(b, lid, want)
    # and the ledgers take their next entries after the restart
    with BookieConnection(b.bookie_id, shard=0) as conn:
        for lid, per in zip(lids, acked):
            nxt = max([e for _l, e in per] + [e for l2, e in unanswered if l2 == lid]
                      + [-1]) + 1
            r = conn.call(P.add(conn.next_rid(), lid, nxt, nxt - 1, KEY, b"", PAYLOAD))
            assert r[2] == EOK, r
