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

import pytest

from bk.bookie import journal as J
from bk.testing import KILL_TEST_CONF as CONF, hook_env, kill_while_writing, \
    served_after_restart, site_hook

PAYLOAD = bytes(range(256)) * 4          # 1 KiB
KEY = b"a" * 20
BATCH = 16

HOOK = r'''
import bk.bookie.worker as w
import bk.bookie.journal as j
from bk.testing import acknowledged_entries as entries, hook_setting, stop_here

SITE = hook_setting("site")
AT = int(hook_setting("at", "0"))
j.ROLL_AHEAD = 0.25
_state = {"seen": 0, "rolls": 0, "after_roll": False}


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
    with site_hook(tmp_path, HOOK, hook_env(out, site=site, at=2, how=how)):
        c = cluster_factory(1, num_shards=1, conf_overrides=CONF)   # (a restart: no hook)
    b = c.bookies[0]
    jdir = os.path.join(b.dir, "journal", "shard-0")
    lids = [(1 << 50) + 41 + i for i in range(3)]
    # the bookie -9 once its worker stopped there (or killed itself there)
    stopped, acked = kill_while_writing(b, lids, out, KEY, PAYLOAD, BATCH, how=how,
                                        what=f"the worker at the {site} hook")
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
