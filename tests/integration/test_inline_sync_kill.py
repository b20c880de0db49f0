"""kill -9 at the moment an inline group commit makes matter: a small group's
records are appended and its sync runs on the shard worker's own loop thread,
its answers not yet sent. A hook put first on the bookie's PYTHONPATH
(``sitecustomize``, as tests/integration/test_group_commit_kill.py does) stops
the worker there, just before the sync or just after it returned, either with
SIGSTOP (the test then kills the whole bookie with SIGKILL and starts it again)
or with SIGKILL of the worker itself (its arbiter restarts it, which replays).
The load is lone first adds (a new ledger per entry, one at a time per
connection), the load whose groups are synced inline. Afterwards: the stopped
group's entries were never acknowledged, every acknowledged entry reads back,
and (the sync having completed) so do the stopped group's. Real etcd and bookie
processes."""

from __future__ import annotations

import threading

import pytest

from bk import protocol as P
from bk.errors import BKError, EOK
from bk.rawclient import BookieConnection
from bk.testing import hooked_stop, site_hook, wait_until

from test_bookie_add_first import KEY, PAYLOAD, pump
from test_storage_crash import read_back

THREADS = 4
STOP_AT = 100        # the 100th inline sync that covers answers

HOOK = r'''
import json, os, signal
import bk.bookie.worker as m
import bk.bookie.storage as s

AT = int(os.environ.get("IS_TEST_STOP_AT", "0"))
OUT = os.environ.get("IS_TEST_OUT", "")
WHEN = os.environ.get("IS_TEST_WHEN", "")        # "before" or "after" the sync
HOW = os.environ.get("IS_TEST_HOW", "")          # "stop" or "kill9"
_sync_inline = m.ShardWorker._sync_inline
_sync = s.ShardStorage.sync
_worker = [None]
_seen = [0]


from bk.testing import acknowledged_entries as entries


def moment():
    w = _worker[0]
    if w is None or w.sync_job is not None or not w.inflight or os.path.exists(OUT):
        return                                   # not an inline sync of answers; or done
    _seen[0] += 1
    if _seen[0] != AT:
        return
    with open(OUT + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "entries": entries(w.inflight)}, f)
    os.rename(OUT + ".tmp", OUT)
    os.kill(os.getpid(), signal.SIGSTOP if HOW == "stop" else signal.SIGKILL)


def sync_inline(self):
    _worker[0] = self
    return _sync_inline(self)


def sync(self):
    if WHEN == "before":
        moment()
    _sync(self)
    if WHEN == "after":
        moment()


if AT:
    m.ShardWorker._sync_inline = sync_inline
    s.ShardStorage.sync = sync
'''


def readable(b, lid) -> bool:
    try:
        with BookieConnection(b.bookie_id, shard=0) as c:
            return c.call(P.read_range(c.next_rid(), lid, 0, 0, 1 << 20))[2] == EOK
    except (OSError, BKError):
        return False


@pytest.mark.parametrize("when,how", [("before", "stop"), ("after", "stop"),
                                      ("before", "kill9"), ("after", "kill9")])
def test_kill9_during_an_inline_sync(cluster_factory, tmp_path, when, how):
    out = tmp_path / "stopped.json"
    # the raw ledgers have no metadata: GC must not drop them while the test waits
    env = {"IS_TEST_STOP_AT": STOP_AT, "IS_TEST_OUT": out, "IS_TEST_WHEN": when,
           "IS_TEST_HOW": how}
    with site_hook(tmp_path, HOOK, env):     # a restarted bookie runs without it
        c = cluster_factory(1, num_shards=1, conf_overrides={"gcWaitTime": 3_600_000})
    b = c.bookies[0]
    acked: list[list[int]] = [[] for _ in range(THREADS)]
    threads = [threading.Thread(target=pump, args=(b, (1 << 51) + i * 1_000_000, out.exists,
                                                   acked[i]))
               for i in range(THREADS)]
    for t in threads:
        t.start()
    try:
        stopped = hooked_stop(out, how, what="the worker reaching the inline sync")
        if how == "stop":
            b.kill()                             # SIGKILL while the worker is stopped there
    finally:
        if not out.exists():
            b.kill()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads)
    unanswered = [(lid, e) for lid, e in stopped["entries"]]
    assert unanswered and all(e == 0 for _lid, e in unanswered), unanswered
    ledgers = [lid for per in acked for lid in per]
    assert len(ledgers) >= STOP_AT
    assert not {lid for lid, _e in unanswered} & set(ledgers), \
        "entries of the group stopped in its inline sync were acknowledged"
    if how == "stop":
        b.start()
    else:                                        # the arbiter restarts the worker: it replays
        wait_until(lambda: readable(b, ledgers[0]), timeout=60, what="the worker restarted")
    want = ledgers + ([lid for lid, _e in unanswered] if when == "after" else [])
    for lid in want:
        read_back(b, lid, [0], payload=PAYLOAD)
    # and the ledgers take their next entry after the restart
    with BookieConnection(b.bookie_id, shard=0) as conn:
        for lid in want[:10] + want[-10:]:
            r = conn.call(P.add(conn.next_rid(), lid, 1, 0, KEY, b"", PAYLOAD))
            assert r[2] == EOK, (lid, r[:3])


BATCH = 12                   # 1 KiB entries: a group within the inline bound (16 KiB)
BATCH_PAYLOAD = b"b" * 1024
BATCH_STOP_AT = 30


def pump_batches(b, lids, stopping, acked):
    """ADD_BATCH frames of BATCH entries of 1 KiB, an equal run of each ledger of
    ``lids`` (one shard) in each, the next one sent when the last was acknowledged:
    every group holds one batch, within the inline bounds, so every group is synced
    inline; until the kill breaks the connection. The acknowledged entry ids go to
    ``acked`` (a list per ledger)."""
    per = BATCH // len(lids)
    try:
        with BookieConnection(b.bookie_id, shard=P.shard_of(lids[0], b.num_shards)) as c:
            eid = 0
            while True:
                c.send_raw(P.encode_add_batch(c.next_rid(), KEY, 0, [
                    (lid, e, e - 1, b"", BATCH_PAYLOAD) for lid in lids
                    for e in range(eid, eid + per)]))
                r = c.recv()
                assert r[0] == P.ADD_BATCH and r[2] == EOK and r[4] == [], r[:5]
                runs = r[3]
                assert sorted(tuple(runs[i:i + 3]) for i in range(0, len(runs), 3)) == \
                    sorted((lid, eid, eid + per - 1) for lid in lids), runs
                for got in acked:
                    got.extend(range(eid, eid + per))
                eid += per
    except (OSError, BKError):
        if not stopping():
            raise


@pytest.mark.parametrize("when,how", [("before", "stop"), ("after", "stop"),
                                      ("before", "kill9"), ("after", "kill9")])
def test_kill9_during_an_inline_sync_of_a_batch(cluster_factory, tmp_path, when, how):
    """The same moments for groups of batched adds (one ADD_BATCH of 12 KiB, 6 entries
    of each of 2 ledgers, a group; answered by one group acknowledgement, synced
    inline): the stopped batch was never acknowledged, every acknowledged entry
    reads back after the restart (and the stopped batch too once its sync had
    returned), and the ledgers go on."""
    out = tmp_path / "stopped.json"
    env = {"IS_TEST_STOP_AT": BATCH_STOP_AT, "IS_TEST_OUT": out, "IS_TEST_WHEN": when,
           "IS_TEST_HOW": how}
    with site_hook(tmp_path, HOOK, env):
        c = cluster_factory(1, num_shards=1, conf_overrides={"gcWaitTime": 3_600_000})
    b = c.bookies[0]
    lids = [(1 << 52) + i for i in range(2)]
    acked: list[list[int]] = [[] for _ in lids]
    threads = [threading.Thread(target=pump_batches, args=(b, lids, out.exists, acked))]
    for t in threads:
        t.start()
    try:
        stopped = hooked_stop(out, how, what="the worker reaching the inline sync")
        if how == "stop":
            b.kill()
    finally:
        if not out.exists():
            b.kill()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads)
    unanswered = {(lid, e) for lid, e in stopped["entries"]}
    assert len(unanswered) >= BATCH, len(unanswered)          # at least one whole batch
    done = {(lid, e) for lid, per in zip(lids, acked) for e in per}
    assert sum(map(len, acked)) >= BATCH * (BATCH_STOP_AT - 1)
    assert not unanswered & done, "entries of the batch stopped in its sync were acknowledged"
    if how == "stop":
        b.start()
    else:
        wait_until(lambda: readable(b, lids[0]), timeout=60, what="the worker restarted")
    for lid, per in zip(lids, acked):
        want = set(per)
        if when == "after":
            want |= {e for lid2, e in unanswered if lid2 == lid}
        if want:
            read_back(b, lid, sorted(want), payload=BATCH_PAYLOAD)
    with BookieConnection(b.bookie_id, shard=0) as conn:   # and the ledgers go on
        for lid, per in zip(lids, acked):
            nxt = max([e for lid2, e in unanswered if lid2 == lid] + per + [-1]) + 1
            r = conn.call(P.add(conn.next_rid(), lid, nxt, nxt - 1, KEY, b"", BATCH_PAYLOAD))
            assert r[2] == EOK, (lid, r[:3])
