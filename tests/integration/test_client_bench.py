"""bench_writes' load generator against real bookies: at a fixed rate it never
submits ahead of the rate, with several ledgers it writes them round-robin, and
every add it counts was acknowledged without error and read back."""

import pytest

from bk.bench.writes import bench_writes

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("ledgers,rate,window", [(1, 3000, 1000), (2, None, 64)])
def test_bench_writes_paces_and_counts(shared_cluster, ledgers, rate, window):
    with shared_cluster.client(timeout=5, throttle=window) as client:
        before = set(client.list_ledgers())
        res = bench_writes(shared_cluster.metadata_uri, duration=1.0, warmup=0.2, rate=rate,
                           window=window, ledgers=ledgers, client=client)
        assert res["errors"] == 0
        assert res["entries"] > 0 and res["latency_ms"]["p50"] > 0
        new = sorted(set(client.list_ledgers()) - before)
        assert len(new) == ledgers
        lasts = [client.ledger_metadata(lid).last_entry_id for lid in new]
        total = sum(last + 1 for last in lasts)
        assert total >= res["entries"]
        # round-robin: the ledgers' counts differ by at most one
        assert max(lasts) - min(lasts) <= 1
        if rate:
            # open loop: never ahead of the rate over the whole run (warm-up
            # included), whatever the machine's speed
            assert total <= rate * (1.0 + 0.2 + 0.5) + 1
        for lid in new:
            rh = client.open_ledger_no_recovery(lid, password=b"bench")
            entries = rh.read_entries(0, rh.last_add_confirmed)
            assert [e.entry_id for e in entries] == list(range(rh.last_add_confirmed + 1))
            assert all(e.data == bytes(1024) for e in entries)
