"""kill -9 while lone first adds are in flight: each ledger gets one ADD_BATCH of
one entry (as ledger create + one entry + close makes it), so every add takes
a shard's first-add path (its MASTER_KEY record, then the entry, in one group).
After the bookie is killed and restarted, every acknowledged entry reads back,
and each of those ledgers still knows its master key (a wrong key is refused,
the right one takes the next entry). Real etcd and bookie processes."""

from __future__ import annotations

import threading

from bk import protocol as P
from bk.errors import BKError, EOK, EUA
from bk.rawclient import BookieConnection
from bk.testing import wait_until

KEY = b"f" * 20
OTHER = b"o" * 20
PAYLOAD = b"first entry " * 8
THREADS = 4
KILL_AFTER = 300                         # acknowledged first adds before the kill


def pump(b, base, stopping, acked):
    """Ledgers ``base``, ``base + 1``, ...: one entry each, one at a time per shard
    connection, until the kill breaks the connection (``stopping()`` is true just
    before it); the ledgers whose add was acknowledged go to ``acked``."""
    conns = {}
    try:
        for shard in range(b.num_shards):
            conns[shard] = BookieConnection(b.bookie_id, shard=shard)
        lid = base
        while True:
            c = conns[P.shard_of(lid, b.num_shards)]
            c.send_raw(P.encode_add_batch(c.next_rid(), KEY, 0, [(lid, 0, -1, b"", PAYLOAD)]))
            r = c.recv()
            assert r[0] == P.ADD_BATCH and r[2] == EOK and r[4] == [], r[:5]
            assert r[3] == [lid, 0, 0], r[3]
            acked.append(lid)
            lid += 1
    except (OSError, BKError):
        if not stopping():
            raise
    finally:
        for c in conns.values():
            c.close()


def test_kill9_during_lone_first_adds_keeps_every_acknowledged_one(cluster_factory):
    c = cluster_factory(1, num_shards=2)
    b = c.bookies[0]
    killing = threading.Event()
    acked: list[list[int]] = [[] for _ in range(THREADS)]
    threads = [threading.Thread(target=pump, args=(b, (1 << 51) + i * 1_000_000, killing.is_set, acked[i]))
               for i in range(THREADS)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: sum(map(len, acked)) >= KILL_AFTER, timeout=120,
                   what=f"{KILL_AFTER} acknowledged first adds")
    finally:
        killing.set()
        b.kill()                                 # SIGKILL with adds in flight
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads)
    ledgers = [lid for per in acked for lid in per]
    assert len(ledgers) >= KILL_AFTER
    b.start()
    conns = [BookieConnection(b.bookie_id, shard=s) for s in range(b.num_shards)]
    try:
        for lid in ledgers:
            conn = conns[P.shard_of(lid, b.num_shards)]
            r = conn.call(P.read_range(conn.next_rid(), lid, 0, 0, 1 << 20))
            assert r[2] == EOK and r[5][3::4] == [PAYLOAD], (lid, r[:5])
        # the master key survived with the entry: enforced, and the ledger goes on
        for lid in ledgers[:20] + ledgers[-20:]:
            conn = conns[P.shard_of(lid, b.num_shards)]
            r = conn.call(P.add(conn.next_rid(), lid, 1, 0, OTHER, b"", PAYLOAD))
            assert r[2] == EUA, (lid, r[:3])
            r = conn.call(P.add(conn.next_rid(), lid, 1, 0, KEY, b"", PAYLOAD))
            assert r[2] == EOK, (lid, r[:3])
    finally:
        for conn in conns:
            conn.close()
