"""A shard worker's cyclic collector never walks what the fork inherited or what
boot built (both frozen, see bk.bookie.arbiter), and the arbiter's own objects
are not left frozen: a full collection in a fresh fork walked ~31,000 objects
and copied every inherited page (19-31 ms of a stalled loop on this VM)."""

import json
import os

from bk import protocol as P
from bk.errors import EOK
from bk.rawclient import BookieConnection
from bk.testing import site_hook, wait_until


KEY = b"g" * 20

HOOK = r'''
import gc, json, os
import bk.bookie.arbiter as a
import bk.bookie.worker as w

OUT = os.environ["GC_TEST_OUT"]


def _dump(name, info):
    path = os.path.join(OUT, name)
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.rename(path + ".tmp", path)


_fork = a.Arbiter._fork


def fork(self, wk, *args):
    before = len(gc.get_objects())            # what the arbiter holds, about to fork
    me = os.getpid()
    try:
        return _fork(self, wk, *args)
    finally:
        if os.getpid() == me:
            _dump("arbiter-%d" % wk.shard, {"before": before, "frozen": gc.get_freeze_count()})


a.Arbiter._fork = fork
_boot = w.ShardWorker._boot


def boot(self):
    inherited = gc.get_freeze_count()         # frozen by the fork, before boot's own
    _boot(self)
    _dump("worker-%d" % self.shard, {"inherited": inherited, "frozen": gc.get_freeze_count(),
                                     "walked": len(gc.get_objects())})


w.ShardWorker._boot = boot
'''


def test_workers_freeze_what_they_inherit_and_what_boot_built(cluster_factory, tmp_path):
    out = tmp_path / "gc"
    out.mkdir()
    with site_hook(tmp_path, HOOK, {"GC_TEST_OUT": out}):
        c = cluster_factory(1, num_shards=2)
    b = c.bookies[0]
    names = {"arbiter-0", "arbiter-1", "worker-0", "worker-1"}
    wait_until(lambda: names <= set(os.listdir(out)), timeout=30,
               what="both workers booted under the hook")
    info = {n: json.loads((out / n).read_text()) for n in names}
    for shard in (0, 1):
        arb, wk = info[f"arbiter-{shard}"], info[f"worker-{shard}"]
        # the arbiter collects its own objects as before: nothing left frozen
        assert arb["frozen"] == 0, arb
        # the worker inherited everything frozen, before boot could collect (within
        # the few temporaries freed between the hook's count and the fork; 0 unfrozen)...
        assert arb["before"] > 10_000 and wk["inherited"] >= 0.99 * arb["before"], (arb, wk)
        # ...and froze what boot built too...
        assert wk["frozen"] > wk["inherited"], wk
        # ...so its collector walks only what the loop makes from here on
        assert wk["walked"] < 1_000, wk
    # and the frozen workers serve: an add and its read back on each shard
    for shard in (0, 1):
        lid = next(i for i in range(1, 100) if P.shard_of(i, 2) == shard)
        with BookieConnection(b.bookie_id, shard=shard) as conn:
            r = conn.call(P.add(conn.next_rid(), lid, 0, -1, KEY, b"dg", b"entry %d" % lid))
            assert r[2] == EOK, r
            r = conn.call(P.read(conn.next_rid(), lid, 0))
            assert r[2] == EOK and r[7] == b"entry %d" % lid, r
