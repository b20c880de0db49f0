"""Checkpoints under sustained load and long replays: a shard that never goes
idle still checkpoints (by journal bytes), a kill -9 during the load loses no
acknowledged entry, and a replay longer than workerTimeoutMSec does not fail the
boot because the worker reports progress. Real etcd and bookie processes."""

from __future__ import annotations

import threading
import time

from bk import protocol as P
from bk.errors import EOK, BKError
from bk.testing import BookieConnection

KEY = b"k" * 20
PAYLOAD = bytes(range(256)) * 4          # 1 KiB


# The tests add to ledgers that have no metadata (raw ADDs): to the bookie's GC they
# are deleted ledgers. No GC round during a test (it took the ledger away from
# under a pump slowed past gcWaitTime's 60 s by a loaded machine: EFENCED).
NO_GC = {"gcWaitTime": 3_600_000}


def pump(b, lid, first, count, window=256, stop=None, acked=None, payload=PAYLOAD):
    """Pipelined adds of entries first.. (at most ``window`` outstanding); appends the
    ids acknowledged with EOK, in order, to ``acked`` (returned). Stops early when
    ``stop`` is set; then a connection broken by a killed bookie ends it quietly."""
    acked = [] if acked is None else acked
    try:
        _pump(b, lid, first, count, window, stop, acked, payload)
    except (OSError, BKError):
        if not (stop and stop.is_set()):
            raise
    return acked


def _pump(b, lid, first, count, window, stop, acked, payload):
    with BookieConnection(b.bookie_id, shard=P.shard_of(lid, b.num_shards)) as c:
        sent = first
        outstanding = 0
        while sent < first + count or outstanding:
            while outstanding < window and sent < first + count and not (stop and stop.is_set()):
                c.send(P.add(c.next_rid(), lid, sent, sent - 1, KEY, b"", payload))
                sent += 1
                outstanding += 1
            if not outstanding:
                break
            r = c.recv()
            outstanding -= 1
            assert r[0] == P.ADD and r[2] == EOK, r
            acked.append(r[4])


def pump_batches(b, lid, count, batch=1000, window=8, payload=PAYLOAD):
    """Entries 0..count-1 in pipelined ADD_BATCH frames of ``batch`` (at most
    ``window`` frames outstanding): the same journal records as single adds, for a
    fraction of the client's and the bookie's CPU. Returns the last entry id once
    every entry was acknowledged with EOK, in order."""
    with BookieConnection(b.bookie_id, shard=P.shard_of(lid, b.num_shards)) as c:
        sent = acked = outstanding = 0
        while acked < count:
            while outstanding < window and sent < count:
                n = min(batch, count - sent)
                c.send_raw(P.encode_add_batch(c.next_rid(), KEY, 0, [
                    (lid, e, e - 1, b"", payload) for e in range(sent, sent + n)]))
                sent += n
                outstanding += n
            r = c.recv()
            assert r[0] == P.ADD_BATCH and r[4] == [], r
            runs = r[3]
            for i in range(0, len(runs), 3):
                assert runs[i] == lid and runs[i + 1] == acked, (acked, runs)
                acked = runs[i + 2] + 1
                outstanding -= runs[i + 2] + 1 - runs[i + 1]
    return acked - 1


def shard_info(b, shard):
    with BookieConnection(b.bookie_id, shard=shard) as c:
        return c.call(P.get_bookie_info(c.next_rid()))[3]


def test_checkpoint_taken_during_sustained_load_and_kill9_loses_nothing(cluster_factory):
    c = cluster_factory(1, conf_overrides={**NO_GC, "flushIntervalBytes": 1 << 20,
                                           "flushInterval": 3_600_000})
    b = c.bookies[0]
    lid = (1 << 50) + 3
    shard = P.shard_of(lid, b.num_shards)
    before = shard_info(b, shard)["checkpoints"]
    stop = threading.Event()
    acked: list[int] = []
    seen = []

    def load():
        pump(b, lid, 0, 1_000_000, stop=stop, acked=acked)

    t = threading.Thread(target=load)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = shard_info(b, shard)
            seen.append(info["checkpoints"])
            if info["checkpoints"] >= before + 3:
                break
            time.sleep(0.1)
        # The shard checkpointed while the load never let it go idle.
        assert seen[-1] >= before + 3, seen
        assert t.is_alive(), "the load ended before the checkpoints were seen"
        stop.set()
        b.kill()                      # kill -9 in the middle of the load
    finally:
        stop.set()
        t.join(30)
    assert len(acked) > 1000
    b.start()
    with BookieConnection(b.bookie_id, shard=shard) as conn:
        for eid in acked[:: max(1, len(acked) // 500)] + [acked[-1]]:
            r = conn.call(P.read(conn.next_rid(), lid, eid))
            assert r[2] == EOK and r[7] == PAYLOAD, (eid, r[2])
        entries = conn.call(P.get_list_of_entries(conn.next_rid(), lid))
    assert entries[2] == EOK and P.ranges_to_ids(entries[4])[: len(acked)] == acked


def test_long_replay_reports_progress(cluster_factory):
    # No checkpoint during the writes: a restart replays all 500,000 records,
    # reporting progress (to the arbiter and the log) every half second.
    c = cluster_factory(1, num_shards=1, conf_overrides={
        **NO_GC, "flushIntervalBytes": 1 << 40, "flushInterval": 3_600_000,
        "dbStorage_writeCacheMaxSizeMb": 1024, "journalPreAllocSizeMB": 64})
    b = c.bookies[0]
    lid = (1 << 50) + 5
    last = pump_batches(b, lid, 500_000, payload=b"p" * 32)
    b.kill()
    b.start(timeout=120)
    with open(b.log_file) as f:
        progress = [line for line in f if "replaying its journal" in line]
    assert progress, "no replay progress was logged"
    with BookieConnection(b.bookie_id, shard=0) as conn:
        r = conn.call(P.read(conn.next_rid(), lid, last))
        assert r[2] == EOK and r[7] == b"p" * 32
