"""A bookie stopped (SIGTERM) with a group's direct journal write failed or in
flight, and kill -9 between ``begin_sync`` handing a write out and its submit,
with real etcd and bookie processes (``journalDirectWrites``, the default):

* ``fail``: the worker's Nth group write through Linux AIO is given a
  descriptor that refuses writes (a sealed memfd: EPERM), as a failing device
  would answer, and the bookie is stopped at once (the worker's loop ends right
  there, as at SIGTERM, so that its drain is what meets the failed write; the
  arbiter is sent SIGTERM). The worker must answer
  nothing of that group nor of any later one, and exit in order (its drain
  goes on past the failed sync: no "drain failed", no kill by the arbiter
  after its 30 s wait).
* ``inflight``: stopped the same way right after the Nth write was submitted:
  the drain waits for it, and the bookie exits in order.
* ``before-submit``: the worker stops itself (SIGSTOP) after ``begin_sync``
  handed the Nth write out and before it is submitted; the test kills the
  bookie -9. Nothing of that group was acknowledged.

After the restart every acknowledged entry reads back intact and what the
bookie serves of each ledger is entries 0..n without a hole."""

from __future__ import annotations

import json
import os
import threading

import pytest

from bk.testing import (KILL_TEST_CONF as CONF, hook_env, kill_while_writing,
                        pump_ledger_until_hooked, served_after_restart, site_hook,
                        wait_until)

PAYLOAD = bytes(range(256)) * 4          # 1 KiB
KEY = b"s" * 20
BATCH = 16

HOOK = r'''
import fcntl, os, signal
import bk.bookie.worker as w
from bk.testing import acknowledged_entries as entries, hook_report, hook_setting, stop_here

SITE = hook_setting("site")
AT = int(hook_setting("at", "0"))
_seen = [0]


def refusing_fd():
    fd = os.memfd_create("refuses-writes", os.MFD_ALLOW_SEALING)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    return fd


_submit = w.ShardWorker._submit_sync


def submit(self, job):
    if job.parts is None or job.directory is not None or self._aio is None:
        return _submit(self, job)          # only a group's direct write through AIO
    _seen[0] += 1
    if _seen[0] != AT:
        return _submit(self, job)
    rep = {"entries": entries(self.inflight), "end": job.end}
    if SITE == "before-submit":
        stop_here(rep, "stop")
        return _submit(self, job)
    if SITE == "fail":
        job.fd = refusing_fd()             # the write fails (EPERM), as a device's error
    _submit(self, job)
    rep["aio"] = self._aio is not None and self._aio.busy
    hook_report(rep)
    self.stopping = True                   # as its SIGTERM does: the drain meets the write
    os.kill(os.getppid(), signal.SIGTERM)  # and the bookie is stopped now


if AT and SITE:
    w.ShardWorker._submit_sync = submit
'''


@pytest.mark.parametrize("site", ["fail", "inflight", "before-submit"])
def test_a_stop_or_kill_with_a_direct_write_failed_in_flight_or_not_submitted(
        cluster_factory, tmp_path, site):
    out = tmp_path / "hooked.json"
    with site_hook(tmp_path, HOOK, hook_env(out, site=site, at=60)):   # (a restart: no hook)
        c = cluster_factory(1, num_shards=1, conf_overrides=CONF)
    b = c.bookies[0]
    log_start = os.path.getsize(b.log_file)
    lids = [(1 << 50) + 41 + i for i in range(3)]
    if site == "before-submit":     # -9 while its worker is stopped there
        hooked, acked = kill_while_writing(b, lids, out, KEY, PAYLOAD, BATCH,
                                           what="the worker between begin_sync and submit")
    else:
        acked = [[] for _ in lids]
        stop = threading.Event()
        threads = [threading.Thread(target=pump_ledger_until_hooked,
                                    args=(b, lid, stop, a, out, KEY, PAYLOAD, BATCH))
                   for lid, a in zip(lids, acked)]
        for t in threads:
            t.start()
        try:
            wait_until(out.exists, timeout=120, what="the worker at the hooked submit")
            # the bookie stops by itself (SIGTERM): in order, within the arbiter's wait
            wait_until(lambda: not b.alive, timeout=25, what="the bookie's exit after SIGTERM")
            stop.set()
            hooked = json.loads(out.read_text())
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not any(t.is_alive() for t in threads), "a writer did not end"
    got = {(lid, e) for lid, per in zip(lids, acked) for _l, e in per}
    assert len(got) > 100
    mine = set(map(tuple, hooked["entries"]))
    assert mine, "the hooked group covered no batched entry"
    if site != "inflight":
        assert not mine & got, "entries of a failed or unsubmitted write were acknowledged"
    if site != "before-submit":
        assert hooked["aio"], "the hooked write did not go through Linux AIO"
        with open(b.log_file, "rb") as f:
            f.seek(log_start)
            text = f.read().decode(errors="replace")
        assert "drain failed" not in text and "did not stop; killing it" not in text, text[-3000:]
        if site == "fail":
            assert "Operation not permitted" in text        # the write did fail
    b.start()

    served_after_restart(b, lids, acked, KEY, PAYLOAD)
