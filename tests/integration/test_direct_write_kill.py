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

import threading

import pytest

from bk.testing import hooked_stop, pump_ledger_until_hooked, served_after_restart, site_hook

PAYLOAD = bytes(range(256)) * 4          # 1 KiB
KEY = b"d" * 20
BATCH = 16
CONF = {"journalDirectWrites": True, "journalPreAllocSizeMB": 1, "nettyMaxFrameSizeBytes": 512 << 10,
        "dbStorage_writeCacheMaxSizeMb": 2, "flushIntervalBytes": 1 << 20,
        "flushInterval": 3_600_000, "gcWaitTime": 3_600_000}

HOOK = r'''
import json, os, signal
import bk.bookie.worker as w
import bk.bookie.journal as j

SITE = os.environ.get("DW_TEST_SITE", "")
AT = int(os.environ.get("DW_TEST_AT", "0"))
HOW = os.environ.get("DW_TEST_HOW", "stop")
OUT = os.environ.get("DW_TEST_OUT")
_seen = [0]


from bk.testing import acknowledged_entries as entries


def stop_here(report):
    report["pid"] = os.getpid()
    with open(OUT + ".tmp", "w") as f:
        json.dump(report, f)
    os.rename(OUT + ".tmp", OUT)
    os.kill(os.getpid(), signal.SIGSTOP if HOW == "stop" else signal.SIGKILL)


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
    env = {"DW_TEST_SITE": site, "DW_TEST_AT": at, "DW_TEST_HOW": how, "DW_TEST_OUT": out}
    with site_hook(tmp_path, HOOK, env):     # a restarted bookie runs without it
        c = cluster_factory(1, num_shards=1, conf_overrides=CONF)
    b = c.bookies[0]
    lids = [(1 << 50) + 31 + i for i in range(3)]
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
    got = {(lid, e) for lid, per in zip(lids, acked) for _l, e in per}
    assert len(got) > 100
    if site == "aio-submit":
        inflight = set(map(tuple, stopped["entries"]))
        assert inflight, "the write in flight covered no batched entry"
        assert not inflight & got, "entries of a write in flight were acknowledged"
    b.start()

    served_after_restart(b, lids, acked, KEY, PAYLOAD)
