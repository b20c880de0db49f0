"""kill -9 of a shard worker in the middle of a run of an ADD_BATCH, right after
``Journal.append_wire_run`` packed a *chunk* of equal-sized records into the
staging buffer (its bulk path: one ``pack_into`` for many records), with
records of the run still to come. The worker stops itself (SIGSTOP) there
through a hook put first on the bookie's PYTHONPATH (``sitecustomize``, as in
test_batch_run_kill.py); the test kills it with SIGKILL. After the restart
every acknowledged entry reads back exactly once with its own payload, each
ledger holds a gap-free prefix of its entries (no duplicate, no hole), none
of the stopped chunk's entries is there (staged, never written, never
acknowledged), and the bookie takes the next adds. Real etcd and bookie
processes; two ledgers interleaved in runs of 40 (a chunk of 32, then 8)."""

from __future__ import annotations


from bk import protocol as P
from bk.errors import EOK
from bk.rawclient import BookieConnection
from bk.testing import entries_read_back, kill_at_hook, pump_add_batches, site_hook


KEY = b"c" * 20
RUN = 40
STOP_AT = 25             # the 25th chunk packed

HOOK = r'''
import json, os, signal, struct
import bk.bookie.journal as j

AT = int(os.environ.get("CHUNK_TEST_STOP_AT", "0"))
OUT = os.environ.get("CHUNK_TEST_OUT")
_structs = j._run_structs
_seen = [0]


def run_structs(w, k):
    heads, bodies, pack = _structs(w, k)

    def pack_and_stop(buf, i, *args):
        pack(buf, i, *args)
        _seen[0] += 1
        if _seen[0] == AT:          # the chunk is staged, the rest of its run is not
            ledger, entry = struct.unpack_from("<qq", args[3])    # its first body
            with open(OUT + ".tmp", "w") as f:
                json.dump({"pid": os.getpid(), "ledger": ledger, "entry": entry, "k": k}, f)
            os.rename(OUT + ".tmp", OUT)
            os.kill(os.getpid(), signal.SIGSTOP)

    return heads, bodies, pack_and_stop


if AT:
    j._run_structs = run_structs
'''


def payload(lid: int, e: int) -> bytes:
    return (b"%d:%d;" % (lid, e) * 200)[:1000]


def pump(b, lids, stop, acked):
    """Batches of the ledgers' next RUN entries each (window of 4 batches) until
    ``stop``; the acknowledged (ledger, entry) go to ``acked``."""
    nxt = dict.fromkeys(lids, 0)

    def next_batch():
        ents = []
        for lid in lids:
            e0 = nxt[lid]
            ents += [(lid, e, e - 1, b"dg", payload(lid, e)) for e in range(e0, e0 + RUN)]
            nxt[lid] = e0 + RUN
        return ents
    with BookieConnection(b.bookie_id, shard=0) as c:
        pump_add_batches(c, next_batch, stop, acked, KEY)


def entries_of(b, lid) -> list[int]:
    """Every entry id the bookie returns for ``lid``, each checked for its payload."""
    def check(e, digest, data):
        assert digest == b"dg" and data == payload(lid, e), (lid, e)
    with BookieConnection(b.bookie_id, shard=0) as c:
        return entries_read_back(c, lid, check)


def test_kill9_after_a_chunk_of_a_run_is_staged(cluster_factory, tmp_path):
    out = tmp_path / "stopped.json"
    env = {"CHUNK_TEST_STOP_AT": STOP_AT, "CHUNK_TEST_OUT": out}
    with site_hook(tmp_path, HOOK, env):     # a restarted bookie runs without it
        c = cluster_factory(1, num_shards=1, conf_overrides={"gcWaitTime": 3_600_000})
    b = c.bookies[0]
    lids = [(1 << 50) + 41, (1 << 50) + 42]
    acked: list = []
    stopped = kill_at_hook(b, out, [lambda stop: pump(b, lids, stop, acked)],
                           "the worker stopping after a chunk")
    lid, eid, k = stopped["ledger"], stopped["entry"], stopped["k"]
    assert lid in lids and eid > 0 and k > 1
    assert acked and all(e < eid for l2, e in acked if l2 == lid), \
        "an entry of the stopped chunk was acknowledged"
    b.start()
    got = {l2: entries_of(b, l2) for l2 in lids}
    for l2 in lids:
        # a gap-free prefix, each entry once: nothing replayed twice, nothing skipped
        assert got[l2] == list(range(len(got[l2]))), (l2, got[l2][-3:])
        top = max((e for l3, e in acked if l3 == l2), default=-1)
        assert len(got[l2]) > top, (l2, top, len(got[l2]))
    # the chunk was only staged: none of it (nor what followed) reached the journal
    assert len(got[lid]) <= eid, (eid, len(got[lid]))
    with BookieConnection(b.bookie_id, shard=0) as conn:
        for l2 in lids:
            nxt = len(got[l2])
            r = conn.call(P.add(conn.next_rid(), l2, nxt, nxt - 1, KEY, b"dg", payload(l2, nxt)))
            assert r[2] == EOK, r
        assert entries_of(b, lid)[-1] == len(got[lid])
