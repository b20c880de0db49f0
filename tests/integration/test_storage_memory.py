"""A shard's memory is bounded by its configured caches, not by its index: a real
bookie whose LMDB index is many times ``dbStorage_rocksDB_blockCacheSize`` keeps
the index's mapped pages resident under that cap (read from the worker's
``/proc/<pid>/smaps``) while it serves every entry. Real etcd and bookie."""

from __future__ import annotations

import os

from bk import protocol as P
from bk.bench.scale import _Filler
from bk.bookie.index import mapped_resident
from bk.errors import EOK
from bk.meta.ledger import LedgerMetadata
from bk.testing import BookieConnection, wait_until

from test_checkpoints import shard_info

CAP = 128 << 10
LEDGERS = 1000
ENTRIES = 100_000              # 100 per ledger, interleaved: a run of ~7 per ledger per flush


def _data_mdb(b) -> str:
    for d, _, names in os.walk(b.dir):
        if "data.mdb" in names and os.path.basename(d) == "index":
            return os.path.join(d, "data.mdb")
    raise AssertionError(f"no index under {b.dir}")


def _read_all(b, ids, per_ledger, payload) -> int:
    """READ_RANGE every entry of every ledger; all there, all intact."""
    n = 0
    with BookieConnection(b.bookie_id, 0) as c:
        for lid in ids:
            first = 0
            while first < per_ledger:
                r = c.call(P.read_range(c.next_rid(), lid, first, per_ledger - 1, 4 << 20))
                assert r[2] == EOK, r[:3]
                got = r[5]
                assert got[0::4] == list(range(first, first + len(got) // 4))
                assert all(p == payload for p in got[3::4])
                n += len(got) // 4
                first = r[4]
    return n


def test_index_pages_stay_under_the_configured_cache(cluster_factory):
    c = cluster_factory(1, num_shards=1, conf_overrides={
        "dbStorage_rocksDB_blockCacheSize": CAP, "dbStorage_writeCacheMaxSizeMb": 2,
        "flushIntervalBytes": 1 << 20, "dbStorage_readAheadCacheMaxSizeMb": 0})
    b = c.bookies[0]
    ids = []
    for _ in range(LEDGERS):
        ids.append(c.store.new_ledger_id())
        c.store.create_ledger(LedgerMetadata(ids[-1], 1, 1, 1, [(0, [b.bookie_id])]))
    filler = _Filler(b.bookie_id, ids, 100)
    try:
        filler.fill(ENTRIES)
    finally:
        filler.close()
    # Everything flushed (a flush every MiB of journal): the index holds it all.
    wait_until(lambda: shard_info(b, 0)["write_cache_entries"] < ENTRIES // 10, timeout=60)
    data = _data_mdb(b)
    assert os.path.getsize(data) >= 8 * CAP, os.path.getsize(data)
    worker = str(b.worker_pids()[0])

    def resident():
        return sum(m[3] for m in mapped_resident(data, worker))

    per = ENTRIES // LEDGERS
    trims = shard_info(b, 0)["index_trims"]
    assert _read_all(b, ids, per, filler.payload) == ENTRIES
    # The reads mapped the index in, past the cap; the shard drops it back under.
    wait_until(lambda: shard_info(b, 0)["index_trims"] > trims, timeout=30)
    wait_until(lambda: resident() <= CAP, timeout=30)
    trims = shard_info(b, 0)["index_trims"]
    assert _read_all(b, ids, per, filler.payload) == ENTRIES         # and still serves
    wait_until(lambda: shard_info(b, 0)["index_trims"] > trims, timeout=30)
    wait_until(lambda: resident() <= CAP, timeout=30)
