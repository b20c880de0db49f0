"""kill -9 in the middle of an ADD_BATCH's run, at the moment the one-pass walk
(``Journal.append_wire_run``) rolls the journal to a new segment: the records of
the run before the roll are written and synced in the old segment, the record
that did not fit is not appended yet, nothing of the batch is acknowledged. The
shard worker stops itself (SIGSTOP) right after the roll through a hook put
first on the bookie's PYTHONPATH (``sitecustomize``, as in
test_group_commit_kill.py); the test then kills it with SIGKILL. After the
restart every acknowledged entry reads back with its own payload, every entry
the bookie returns has its own payload, the stopped ledger holds exactly the
entries appended before the roll, and the bookie takes the next adds. Real etcd
and bookie processes; two ledgers interleaved in runs of 8 in each batch."""

from __future__ import annotations


from bk import protocol as P
from bk.errors import EOK
from bk.rawclient import BookieConnection
from bk.testing import entries_read_back, kill_at_hook, pump_add_batches, site_hook


KEY = b"r" * 20
RUN = 8
BATCH = 48
STOP_AT = 3              # the third roll that happens inside a run

HOOK = r'''
import json, os, signal, sys
import bk.bookie.journal as j

AT = int(os.environ.get("RUN_TEST_STOP_AT", "0"))
OUT = os.environ.get("RUN_TEST_OUT")
_reserve = j.Journal._reserve
_seen = [0]


def reserve(self, n):
    caller = sys._getframe(1)
    seq = self.active_seq
    _reserve(self, n)
    if caller.f_code.co_name == "append_wire_run" and self.active_seq != seq:
        _seen[0] += 1
        if _seen[0] == AT:      # rolled inside a run: the record at eid is not appended
            loc = caller.f_locals
            with open(OUT + ".tmp", "w") as f:
                json.dump({"pid": os.getpid(), "ledger": loc["lid"], "entry": loc["eid"]}, f)
            os.rename(OUT + ".tmp", OUT)
            os.kill(os.getpid(), signal.SIGSTOP)


if AT:
    j.Journal._reserve = reserve
'''


def payload(lid: int, e: int) -> bytes:
    return (b"%d:%d;" % (lid, e) * 200)[:1000]


def pump(b, lids, stop, acked):
    """Batches of BATCH entries, the ledgers' next entries in runs of RUN (window of
    4 batches), until ``stop``; the acknowledged (ledger, entry) go to ``acked``."""
    nxt = dict.fromkeys(lids, 0)

    def next_batch():
        ents = []
        while len(ents) < BATCH:
            for lid in lids:
                e0 = nxt[lid]
                ents += [(lid, e, e - 1, b"", payload(lid, e)) for e in range(e0, e0 + RUN)]
                nxt[lid] = e0 + RUN
        return ents
    with BookieConnection(b.bookie_id, shard=0) as c:
        pump_add_batches(c, next_batch, stop, acked, KEY)


def entries_of(b, lid) -> list[int]:
    """Every entry id the bookie returns for ``lid``, each checked for its payload."""
    def check(e, _digest, data):
        assert data == payload(lid, e), (lid, e)
    with BookieConnection(b.bookie_id, shard=0) as c:
        return entries_read_back(c, lid, check)


def test_kill9_when_a_batch_run_rolls_the_journal(cluster_factory, tmp_path):
    out = tmp_path / "stopped.json"
    # 1 MiB segments (frames up to 512 KiB): a roll every ~20 batches; the raw
    # ledgers have no metadata, so no GC
    env = {"RUN_TEST_STOP_AT": STOP_AT, "RUN_TEST_OUT": out}
    with site_hook(tmp_path, HOOK, env):     # a restarted bookie runs without it
        c = cluster_factory(1, num_shards=1, conf_overrides={
            "journalPreAllocSizeMB": 1, "nettyMaxFrameSizeBytes": 512 * 1024,
            "gcWaitTime": 3_600_000})
    b = c.bookies[0]
    lids = [(1 << 50) + 31, (1 << 50) + 32]
    acked: list = []
    stopped = kill_at_hook(b, out, [lambda stop: pump(b, lids, stop, acked)],
                           "the worker stopping in a run")
    lid, eid = stopped["ledger"], stopped["entry"]
    assert lid in lids and eid > 0
    assert acked and all(e < eid for l2, e in acked if l2 == lid), \
        "an entry of the stopped run was acknowledged"
    b.start()
    got = {l2: entries_of(b, l2) for l2 in lids}
    for l2, e in acked:
        assert e in got[l2], (l2, e)
    # the run's records before the roll were written and synced with the old segment;
    # the one that did not fit (and everything after it) was never appended
    assert got[lid] == list(range(eid)), (eid, got[lid][-3:])
    # and the ledgers go on taking adds after the restart
    with BookieConnection(b.bookie_id, shard=0) as conn:
        for l2 in lids:
            nxt = max(got[l2]) + 1
            r = conn.call(P.add(conn.next_rid(), l2, nxt, nxt - 1, KEY, b"", payload(l2, nxt)))
            assert r[2] == EOK, r
        assert entries_of(b, lid)[-1] == eid
