"""kill -9 and SIGSTOP at a journal roll at a group's start (direct writes:
``Journal._roll_ahead``, "Rolls at a group's start" in ``bk.bookie.journal``),
with real etcd and bookie processes:

* ``rolled``: the group's write, the old segment's last, was just submitted
  through Linux AIO and the journal has rolled to the next segment: the write
  is in flight through the old segment's descriptor, the new segment holds
  nothing on disk and takes the next group's appends in memory;
* ``first-write``: the new segment's first write was just submitted (the
  old segment's last write completed, its group not answered yet).

The worker stops itself there (SIGSTOP) and the test kills the bookie -9, or
it kills itself -9. The hook makes ``ROLL_AHEAD`` large (a quarter of a 1 MiB
segment) so that rolls come at a group's start rather than in an append.
After the restart every acknowledged entry reads back intact, the stopped
group's entries were never acknowledged, what the bookie serves of each ledger
is 0..n without a hole, nothing was quarantined (no segment after a torn one
held records: the roll order held), and the bookie takes adds again."""

from __future__ import annotations

import os
import threading

import pytest

from bk.bookie import journal as J
from bk.testing import hooked_stop, pump_ledger_until_hooked, served_after_restart, site_hook

PAYLOAD = bytes(range(256)) * 4          # 1 KiB
KEY = b"a" * 20
BATCH = 16
CONF = {"journalDirectWrites": True, "journalPreAllocSizeMB": 1,
        "nettyMaxFrameSizeBytes": 512 << 10, "dbStorage_writeCacheMaxSizeMb": 2,
        "flushIntervalBytes": 1 << 20, "flushInterval": 3_600_000, "gcWaitTime": 3_600_000}

HOOK = r'''
import json, os, signal
import bk.bookie.worker as w
import bk.bookie.journal as j
from bk.testing import acknowledged_entries as entries

SITE = os.environ.get("RA_TEST_SITE", "")
AT = int(os.environ.get("RA_TEST_AT", "0"))
HOW = os.environ.get("RA_TEST_HOW", "stop")
OUT = os.environ.get("RA_TEST_OUT")
j.ROLL_AHEAD = 0.25
_state = {"seen": 0, "rolls": 0, "after_roll": False}


def stop_here(report):
    report["pid"] = os.getpid()
    with open(OUT + ".tmp", "w") as f:
        json.dump(report, f)
    os.rename(OUT + ".tmp", OUT)
    os.kill(os.getpid(), signal.SIGSTOP if HOW == "stop" else signal.SIGKILL)


_submit = w.ShardWorker._submit_sync


def submit(self, job):
    _submit(self, job)
    jr = self.storage._journal
    rolled = jr.rolls_ahead > _state["rolls"]
    _state["rolls"] = jr.rolls_ahead
    first = _state["after_roll"]
    _state["after_roll"] = rolled
    if not (self._aio is not None and self._aio.busy and self.sync_job is job
            and job.parts is not None):
        return                          # not a write in flight through AIO
    hit = rolled if SITE == "rolled" else first and job.seq == jr.active_seq
    if hit:
        _state["seen"] += 1
        if _state["seen"] == AT:
            stop_here({"entries": entries(self.inflight), "seq": job.seq, "end": job.end,
                       "active": jr.active_seq})


if AT:
    w.ShardWorker._submit_sync = submit
'''


@pytest.mark.parametrize("site,how", [("rolled", "stop"), ("rolled", "kill"),
                                      ("first-write", "stop")])
def test_kill9_at_a_roll_at_a_groups_start(cluster_factory, tmp_path, site, how):
    out = tmp_path / "stopped.json"
    env = {"RA_TEST_SITE": site, "RA_TEST_AT": 2, "RA_TEST_HOW": how, "RA_TEST_OUT": out}
    with site_hook(tmp_path, HOOK, env):     # a restarted bookie runs without it
        c = cluster_factory(1, num_shards=1, conf_overrides=CONF)
    b = c.bookies[0]
    jdir = os.path.join(b.dir, "journal", "shard-0")
    lids = [(1 << 50) + 41 + i for i in range(3)]
    acked: list[list] = [[] for _ in lids]
    stop = threading.Event()
    threads = [threading.Thread(target=pump_ledger_until_hooked,
                                args=(b, lid, stop, a, out, KEY, PAYLOAD, BATCH))
               for lid, a in zip(lids, acked)]
    for t in threads:
        t.start()
    try:
        stopped = hooked_stop(out, how, what=f"the worker at the {site} hook")
        stop.set()
        b.kill()                   # the bookie -9 (its worker stopped there, or dead)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads), "a writer did not end after the kill"
    if site == "rolled":           # the write in flight was the old segment's
        assert stopped["active"] == stopped["seq"] + 1, stopped
    else:
        assert stopped["active"] == stopped["seq"], stopped
    got = {(lid, e) for lid, per in zip(lids, acked) for _l, e in per}
    assert len(got) > 100
    inflight = set(map(tuple, stopped["entries"]))
    assert inflight, "the write in flight covered no batched entry"
    assert not inflight & got, "entries of a write in flight were acknowledged"
    b.start()
    assert not os.path.exists(os.path.join(jdir, J.QUARANTINE_DIR)), \
        "a segment after a torn one held records: the roll order did not hold"

    served_after_restart(b, lids, acked, KEY, PAYLOAD)
