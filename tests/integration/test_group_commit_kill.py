"""kill -9 at the moment the pipelined group commit makes matter: a group's sync
has completed, the next group's sync has begun, and the first group is not
answered yet. The shard worker stops itself (SIGSTOP) at exactly that moment
through a hook put first on the bookie's PYTHONPATH (``sitecustomize``, as
scripts/trace_adds.py does); the test then kills the bookie with SIGKILL while it
is stopped. Every entry acknowledged before the kill reads back after the
restart, the stopped group's entries were not acknowledged, and they too read
back (their sync had completed). Plaintext and TLS (the answers are encrypted on
the path that now overlaps the next sync). Real etcd and bookie processes."""

from __future__ import annotations


import pytest

from bk import protocol as P
from bk.errors import EOK
from bk.rawclient import BookieConnection
from bk.config import Config
from bk.security import ClientSecurity, pki
from bk.testing import kill_at_hook, pump_add_batches, site_hook

from test_storage_crash import read_back

PAYLOAD = bytes(range(256)) * 4          # 1 KiB
KEY = b"g" * 20
BATCH = 16
STOP_AT = 60        # the 60th answer given with the next sync in flight (how often that moment
                    # comes depends on the machine: idle, syncs are quick and it is rarer)

HOOK = r'''
import json, os, signal
import bk.bookie.worker as m

AT = int(os.environ.get("GC_TEST_STOP_AT", "0"))
OUT = os.environ.get("GC_TEST_OUT")
_answer = m.ShardWorker._answer
_seen = [0]


from bk.testing import acknowledged_entries as entries


def answer(self, done):
    if self.sync_job is not None and done[0]:    # the next group is syncing: the moment
        _seen[0] += 1
        if _seen[0] == AT:
            with open(OUT + ".tmp", "w") as f:
                json.dump({"pid": os.getpid(), "entries": entries(done[0])}, f)
            os.rename(OUT + ".tmp", OUT)
            os.kill(os.getpid(), signal.SIGSTOP)
    return _answer(self, done)


if AT:
    m.ShardWorker._answer = answer
'''


def pump(b, lid, security, stop, acked):
    """Batches of BATCH entries (window of 8 batches) until ``stop``; the entries
    acknowledged with EOK go to ``acked``. A connection broken by the kill ends it."""
    nxt = [0]

    def next_batch():
        eid = nxt[0]
        nxt[0] = eid + BATCH
        return [(lid, e, e - 1, b"", PAYLOAD) for e in range(eid, eid + BATCH)]
    with BookieConnection(b.bookie_id, shard=P.shard_of(lid, b.num_shards),
                          security=security) as c:
        pump_add_batches(c, next_batch, stop, acked, KEY, window=8)


@pytest.mark.parametrize("mode", ["plaintext", "tls"])
def test_kill9_between_a_groups_sync_and_its_answers(cluster_factory, tmp_path, mode):
    out = tmp_path / "stopped.json"
    # the raw ledgers have no metadata: GC must not drop them while the test waits
    conf, security = {"gcWaitTime": 3_600_000}, ClientSecurity()
    if mode == "tls":
        ca = pki.make_ca(str(tmp_path / "ca"))
        crt, key = ca.issue("bookie", ["127.0.0.1"])
        conf.update(tlsCertificatePath=crt, tlsKeyStore=key, tlsRequired=False)
        security = ClientSecurity.from_conf(Config.load(env={}, overrides={
            "tlsEnabled": True, "tlsTrustStore": ca.cert_path}))
    env = {"GC_TEST_STOP_AT": STOP_AT, "GC_TEST_OUT": out}
    with site_hook(tmp_path, HOOK, env):     # a restarted bookie runs without it
        c = cluster_factory(1, num_shards=1, conf_overrides=conf)
    b = c.bookies[0]
    lids = [(1 << 50) + 21 + i for i in range(3)]
    acked: list[list] = [[] for _ in lids]
    stopped = kill_at_hook(
        b, out, [lambda stop, lid=lid, a=a: pump(b, lid, security, stop, a)
                 for lid, a in zip(lids, acked)], "the worker stopping at the moment")
    done = set(map(tuple, stopped["entries"]))
    assert done, "the stopped group held no batched entries"
    got = {(lid, e) for per in acked for lid, e in per}
    assert len(got) > STOP_AT
    assert not done & got, "entries of the unanswered group were acknowledged"
    b.start()
    for lid, per in zip(lids, acked):
        want = [e for _lid, e in per] + [e for l2, e in done if l2 == lid]
        if want:
            read_back(b, lid, want)
    # and the bookie goes on taking adds of those ledgers after the restart
    with BookieConnection(b.bookie_id, shard=0, security=security) as conn:
        for lid, per in zip(lids, acked):
            nxt = max([e for _l, e in per] + [e for l2, e in done if l2 == lid] + [-1]) + 1
            r = conn.call(P.add(conn.next_rid(), lid, nxt, nxt - 1, KEY, b"", PAYLOAD))
            assert r[2] == EOK, r

