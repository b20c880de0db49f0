"""kill -9 at the moments direct journal writes (``journalDirectWrites``) make
matter, with real etcd and bookie processes:

* ``aio-submit``: right after a group's direct write was submitted through Linux
  AIO (in flight; the loop goes on appending into the block it shares with the
  next group). The worker stops itself there (SIGSTOP), the test kills the
  bookie -9; or the worker kills itself -9 there.
* ``sync-write``: right before a direct write on the loop's own thread (a roll's
  write of the old segment's tail, a flush's write-out, an inline group commit),
  its records in the segment's image only.
* ``drain``: a roll or a flush's write-out found a group's write in flight and
  waited for it (``Journal._drain``, the worker reaping it from AIO), the third
  time that happened: the loop must have completed those groups as usual
  after the first two (else no third comes: the bookie would stall).

Small segments and a small write cache make rolls and flushes frequent. After
the restart every acknowledged entry reads back intact, the stopped group's
entries were never acknowledged, and what the bookie serves of each ledger is
entries 0..n without a hole, each with its payload (nothing torn is served)."""

from __future__ import annotations

import pytest

from bk.testing import KILL_TEST_CONF as CONF, hook_env, kill_while_writing, \
    served_after_restart, site_hook

PAYLOAD = bytes(range(256)) * 4          # 1 KiB
KEY = b"d" * 20
BATCH = 16

HOOK = r'''
import bk.bookie.worker as w
import bk.bookie.journal as j
from bk.testing import acknowledged_entries as entries, hook_setting, stop_here

SITE = hook_setting("site")
AT = int(hook_setting("at", "0"))
_seen = [0]


_submit = w.ShardWorker._submit_sync


def submit(self, job):
    _submit(self, job)
    aio = self._aio
    if job.parts is not None and aio is not None and aio.busy and self.sync_job is job:
        _seen[0] += 1
        if _seen[0] == AT:
            stop_here({"entries": entries(self.inflight), "end": job.end})


_write = j.Journal._direct_write


def direct_write(self, end, dsync):
    _seen[0] += 1
    if _seen[0] == AT:
        stop_here({"end": end, "dsync": dsync, "rolled": self.rolled_at})
    return _write(self, end, dsync)


_drain = j.Journal._drain


def drain(self):
    job = self._inflight
    _drain(self)
    if job is not None and job.waiter is not None:
        _seen[0] += 1
        if _seen[0] == AT:
            stop_here({"end": job.end})


if AT and SITE == "aio-submit":
    w.ShardWorker._submit_sync = submit
elif AT and SITE == "sync-write":
    j.Journal._direct_write = direct_write
elif AT and SITE == "drain":
    j.Journal._drain = drain
'''


@pytest.mark.parametrize("site,how,at", [("aio-submit", "stop", 150),
                                         ("aio-submit", "kill", 150),
                                         ("sync-write", "stop", 40),
                                         ("drain", "stop", 3)])
def test_kill9_at_a_direct_journal_write(cluster_factory, tmp_path, site, how, at):
    out = tmp_path / "stopped.json"
    with site_hook(tmp_path, HOOK, hook_env(out, site=site, at=at, how=how)):
        c = cluster_factory(1, num_shards=1, conf_overrides=CONF)   # (a restart: no hook)
    b = c.bookies[0]
    lids = [(1 << 50) + 31 + i for i in range(3)]
    # the bookie -9 once its worker stopped there (or killed itself there)
    stopped, acked = kill_while_writing(b, lids, out, KEY, PAYLOAD, BATCH, how=how,
                                        what=f"the worker at the {site} hook")
    got = {(lid, e) for lid, per in zip(lids, acked) for _l, e in per}
    assert len(got) > 100
    if site == "aio-submit":
        inflight = set(map(tuple, stopped["entries"]))
        assert inflight, "the write in flight covered no batched entry"
        assert not inflight & got, "entries of a write in flight were acknowledged"
    b.start()

    served_after_restart(b, lids, acked, KEY, PAYLOAD)
