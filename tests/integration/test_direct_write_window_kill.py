"""kill -9 at a slide of the journal's window (``journalDirectMemoryMB``: direct
writes from a window smaller than a segment), with real etcd and bookie
processes. The hook shrinks the windows to 32 KiB, so that the writers' groups
(up to hundreds of KiB) slide them in the middle of appends, while the group
before is being written from the window (AIO):

* ``slide-inflight``: a slide that found that write still in flight, before it
  waited for it: the worker stops itself there (SIGSTOP) and the test kills
  the bookie -9, or the worker kills itself -9 there;
* ``slide-moved``: right after a slide moved the window's base (the records
  before it now read from the file, the next group's write not begun).

One case has the shard's sync thread write instead of AIO, each write slowed
by 5 ms (so that slides surely find one in flight).

Small segments make rolls frequent too. After the restart every acknowledged
entry reads back intact, and what the bookie serves of each ledger is entries
0..n without a hole, each with its payload (nothing torn is served); a slide
that did not wait for the write in flight rewrites its source bytes, and the
restarted bookie would truncate the journal at the torn record."""

from __future__ import annotations

import pytest

from bk.testing import KILL_TEST_CONF, hook_env, kill_while_writing, served_after_restart, \
    site_hook, wait_until

PAYLOAD = bytes(range(256)) * 4          # 1 KiB
KEY = b"w" * 20
BATCH = 16
# KILL_TEST_CONF with the windows' setting at its smallest (the hook shrinks them
# further) and a larger write cache, so that flushes do not come before the slides.
CONF = dict(KILL_TEST_CONF, journalDirectMemoryMB=1, dbStorage_writeCacheMaxSizeMb=4,
            flushIntervalBytes=2 << 20)

HOOK = r'''
import os, threading, time
import bk.bookie.journal as j
from bk.testing import hook_setting, stop_here

SITE = hook_setting("site")
AT = int(hook_setting("at", "0"))
_seen = [0]


j.MIN_WINDOW = 4096
_probe = j.Journal._probe_direct


def probe(self):
    self._memory = 64 << 10            # two windows of 32 KiB
    return _probe(self)


_slide = j.Journal._slide


def slide(self, n=0):
    job = self._inflight
    if SITE == "slide-inflight" and job is not None and job.seq == self.active_seq \
            and not job.done.is_set():
        _seen[0] += 1
        if _seen[0] == AT:
            stop_here({"inflight_end": job.end, "offset": job.offset, "wbase": self._wbase})
    before = self._wbase
    _slide(self, n)
    if SITE == "slide-moved" and self._wbase != before:
        _seen[0] += 1
        if _seen[0] == AT:
            stop_here({"wbase": self._wbase, "wend": self._wend, "off": self._off})


_pwritev = os.pwritev


def slow_pwritev(*args):            # the sync thread's writes stay in flight a while
    if threading.current_thread() is not threading.main_thread():
        time.sleep(0.005)
    return _pwritev(*args)


if AT:
    j.Journal._probe_direct = probe
    j.Journal._slide = slide
    if hook_setting("slow"):
        os.pwritev = slow_pwritev
'''


@pytest.mark.parametrize("site,how,at,writer", [("slide-inflight", "stop", 30, "aio"),
                                                ("slide-inflight", "kill", 60, "aio"),
                                                ("slide-inflight", "stop", 30, "thread"),
                                                ("slide-moved", "stop", 100, "aio")])
def test_kill9_at_a_slide_of_the_journals_window(cluster_factory, tmp_path, site, how, at,
                                                 writer):
    out = tmp_path / "stopped.json"
    conf, slow = dict(CONF), ""
    if writer == "thread":        # the sync thread writes, each write slowed by 5 ms
        conf["journalSyncThroughAio"] = False
        slow = "1"
    with site_hook(tmp_path, HOOK, hook_env(out, site=site, at=at, how=how, slow=slow)):
        c = cluster_factory(1, num_shards=1, conf_overrides=conf)   # (a restart: no hook)
    b = c.bookies[0]
    lids = [(1 << 50) + 71 + i for i in range(3)]
    # the bookie -9 once its worker stopped there (or killed itself there)
    stopped, acked = kill_while_writing(b, lids, out, KEY, PAYLOAD, BATCH, how=how,
                                        what=f"the worker at the {site} hook")
    if site == "slide-inflight":          # the write in flight reads the window's blocks
        assert stopped["offset"] >= stopped["wbase"] and stopped["inflight_end"] > stopped["offset"]
    got = {(lid, e) for lid, per in zip(lids, acked) for _l, e in per}
    assert len(got) > 100
    b.start()

    served_after_restart(b, lids, acked, KEY, PAYLOAD)


def test_journal_direct_memory_sizes_every_shards_windows(cluster_factory):
    """``journalDirectMemoryMB`` reaches each shard's journal: two windows of half
    of it each, whatever the segment size, said once per shard in the log."""
    c = cluster_factory(1, num_shards=2, conf_overrides={"journalDirectWrites": True,
                                                         "journalPreAllocSizeMB": 64,
                                                         "journalDirectMemoryMB": 6})
    b = c.bookies[0]

    def lines():
        with open(b.log_file, errors="replace") as f:
            return [ln for ln in f if "direct writes (O_DIRECT" in ln]
    wait_until(lambda: len(lines()) == 2, what="both shards' journals opened")
    assert all("their two windows take 6.0 MiB of memory" in ln for ln in lines()), lines()
