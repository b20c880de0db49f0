"""existing_ledgers, the read behind a GC full reconcile, against a real etcd: range
reads where the asked ids are dense, point reads where they are sparse, the same
answer as point reads alone, at the pinned revision, with etcd's errors."""

from __future__ import annotations

import random
import re
import urllib.request

import pytest

from bk.bench.metadata import bench_reconcile, bench_reconcile_cluster
from bk.errors import MetadataCompactedError, MetadataError
from bk.meta import store as store_mod
from bk.meta.etcd_server import EtcdServer
from bk.meta.ledger import LedgerMetadata
from bk.meta.store import MetadataStore, ledger_key_name


def range_calls(etcd) -> int:
    """etcd's count of Range requests it answered (its /metrics)."""
    with urllib.request.urlopen(etcd.client_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return int(sum(float(m) for m in re.findall(
        r'^grpc_server_handled_total\{[^}]*grpc_method="Range"[^}]*\} (\S+)$', text, re.M)))


def put(store, ids):
    c = store._client()
    ids = list(ids)
    for i in range(0, len(ids), 100):
        store._txn_full("put", [], [c.transactions.put(store._key(ledger_key_name(lid)),
                                                       b'{"state":"CLOSED"}')
                                    for lid in ids[i:i + 100]])


def point_reads(store, ids, revision=None) -> set[int]:
    return {store._ledger_id_of(kv.key)
            for kv in store._ledger_kvs("check", ids, True, revision, waste=0)}


@pytest.fixture
def layout(store):
    """Two blocks of ids as clients hand them out, most created, some skipped (a
    client that stopped), with other ledgers far away; returns (existing ids, the
    id sets to ask about by name)."""
    a, b = store.reserve_ledger_ids(), store.reserve_ledger_ids()
    store.new_ledger_id()
    far = store.reserve_ledger_ids()
    created = [x for x in a if x % 7 != 3] + list(b[:600]) + list(far[::97])
    put(store, created)
    never = [a[3 + 7 * k] for k in range(5)] + [b[-1], far[5], b[-1] + (1 << 30)]
    asks = {
        "dense": list(a),                                   # a whole block: ranges
        "half": [x for x in list(a) + list(b) if x % 2],    # a shard of two
        "sparse": list(a[::100]) + list(far[::97]),         # a bookie among many
        "mixed": list(b[:300]) + list(a[::40]) + never + [far[0], far[-1]],
    }
    return set(created), asks


def test_existing_ledgers_is_what_point_reads_say_for_dense_sparse_and_mixed_ids(store,
                                                                                    layout):
    created, asks = layout
    for name, ids in asks.items():
        got = store.existing_ledgers(ids)
        assert got == point_reads(store, ids) == created & set(ids), name


def test_dense_ids_cost_one_range_request_sparse_ones_a_point_read_each(store, etcd, layout):
    created, asks = layout
    sent = store.rpc_counts["ledger ranges"]        # the Range requests this store sent
    r0 = range_calls(etcd)
    assert store.existing_ledgers(asks["dense"]) == created & set(asks["dense"])
    assert store.rpc_counts["ledger ranges"] - sent == 1      # 1,024 ids: one range
    assert range_calls(etcd) - r0 == 1              # etcd counts the same (no one else asks)
    sent = store.rpc_counts["ledger ranges"]
    point_reads(store, asks["dense"])
    assert store.rpc_counts["ledger ranges"] - sent == 1024
    # one in a hundred of a block and one in 97 of another: sparser than one in 64
    # of their spans, and no two within RANGE_WASTE of each other: a point read each
    sent = store.rpc_counts["ledger ranges"]
    store.existing_ledgers(asks["sparse"])
    assert store.rpc_counts["ledger ranges"] - sent == len(asks["sparse"])


def test_ids_scattered_one_in_forty_of_a_block_cost_one_range_request(store, etcd, layout):
    # a bookie among 120 (E3): one ledger in 40 of each client's block, at random
    created, asks = layout
    scattered = sorted(random.Random(5).sample(asks["dense"], len(asks["dense"]) // 40))
    sent = store.rpc_counts["ledger ranges"]
    got = store.existing_ledgers(scattered)
    assert store.rpc_counts["ledger ranges"] - sent == 1
    assert got == created & set(scattered) == point_reads(store, scattered)


def test_the_pinned_revision_wins_over_deletions_and_creations_since(store, layout):
    created, asks = layout
    ids = asks["mixed"] + asks["dense"]
    before = store.revision()
    at_before = created & set(ids)
    gone = sorted(at_before)[::9]
    for lid in gone:
        store.delete_json(ledger_key_name(lid))
    born = [lid for lid in ids if lid not in created][:3]     # asked, created after
    put(store, born)
    assert store.existing_ledgers(ids, revision=before) == at_before
    assert point_reads(store, ids, before) == at_before
    now = (at_before - set(gone)) | set(born)
    assert store.existing_ledgers(ids) == now


def test_a_span_holding_more_keys_than_a_page_is_read_page_by_page(store, layout,
                                                                   monkeypatch):
    created, asks = layout
    # keys under ledgers/ that are not ids, inside the span: skipped, not counted
    a0 = asks["dense"][0]
    store.put_json(ledger_key_name(a0 + 10) + "x", {"stray": True})
    monkeypatch.setattr(store_mod, "RANGE_PAGE", 7)
    seen = []
    got = store.existing_ledgers(asks["half"], progress=lambda d, t: seen.append((d, t)))
    assert got == created & set(asks["half"])
    assert seen[-1] == (len(set(asks["half"])),) * 2
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_a_compacted_revision_raises_metadata_compacted_error(store, layout):
    created, asks = layout
    before = store.revision()
    doomed = min(created & set(asks["dense"]))
    store.delete_json(ledger_key_name(doomed))
    assert store.revision() > before
    store.compact(store.revision())
    for name in ("dense", "sparse", "mixed"):
        with pytest.raises(MetadataCompactedError):
            store.existing_ledgers(asks[name], revision=before)
    assert store.existing_ledgers(asks["dense"], revision=store.revision()) == \
        created & set(asks["dense"]) - {doomed}


def test_etcd_refusals_are_metadata_errors_with_its_reason(store, layout, tmp_path):
    created, asks = layout
    with pytest.raises(MetadataError, match="future revision") as e:
        store.existing_ledgers(asks["dense"], revision=store.revision() + 1000)
    assert not isinstance(e.value, MetadataCompactedError)
    with EtcdServer(str(tmp_path / "gone")) as other:
        uri = other.uri("x")
    with MetadataStore(uri, timeout=1) as dead:
        with pytest.raises(MetadataError, match="check ledgers"):
            dead.existing_ledgers(asks["dense"], revision=5)


def test_the_reconcile_bench_runs_old_and_new_and_they_agree(tmp_path):
    """scripts/bench_metadata.py --reconcile at a small size: both paths found the
    same ledgers (it raises otherwise), and each sent the requests the layout
    implies (the store's own count: one per window, no page, no retry). Every
    ledger held: the new way reads each block once (one range), the old way once
    per shard; one in 40 held, scattered: still one range a block for the new
    way, the old way a request per window of each shard's ids (mostly alone)."""
    out = bench_reconcile([5000], rounds=1, base_dir=str(tmp_path), progress=lambda r: None)
    row = out["steps"][0]
    assert row["ledgers"] == row["held"] == 5000
    # one writer's blocks of 1024, the first fresh: 5000 ids fill 5 of them
    assert row["blocks"] == 5, row
    assert row["new"]["requests"] == row["blocks"], row
    assert row["old"]["requests"] == row["old_windows"] == 2 * row["blocks"], row
    out = bench_reconcile([20000], rounds=1, share=40, base_dir=str(tmp_path),
                          progress=lambda r: None)
    row = out["steps"][0]
    # the bench draws one in 40 with random.Random(40), one draw per id in id order
    pick = random.Random(40)
    assert row["held"] == sum(pick.randrange(40) == 0 for _ in range(20000)), row
    assert row["blocks"] == -(-20000 // 1024), row      # every block holds some
    assert row["new"]["requests"] == row["blocks"], row
    assert row["old"]["requests"] == row["old_windows"], row
    assert row["old_windows"] > row["held"] // 4, row   # mostly point reads


def test_read_ledgers_by_ranges_reads_what_each_read_ledger_reads(store):
    """read_ledgers (the over-replicated scan) shares the windows: values and
    versions as point reads give them, in id order, nothing of the ids between."""
    block = store.reserve_ledger_ids()
    made = [lid for lid in block if lid % 3]
    for lid in made:
        store.create_ledger(LedgerMetadata(lid, 1, 1, 1, [(0, ["127.0.0.1:3181"])]))
    ask = made[:200:2] + list(block[600:700]) + made[-1:] + [block[-1] + (1 << 30)]
    got = [(md.ledger_id, md.to_json(), v) for md, v in store.read_ledgers(ask)]
    want = []
    for lid in sorted(set(ask) & set(made)):
        md, v = store.read_ledger(lid)
        want.append((lid, md.to_json(), v))
    assert got == want


def test_the_real_bookie_reconcile_bench_times_one_reconcile(tmp_path):
    """scripts/bench_metadata.py --reconcile-cluster at a small size, this code only:
    one reconcile of a real bookie checks exactly the ledgers it holds, with one
    range request per block of their ids (the bookie's own count, in its GC state:
    etcd's counts also hold the other bookies' and the bookie's other reads)."""
    out = bench_reconcile_cluster(600, rounds=1, base_dir=str(tmp_path),
                                  progress=lambda n, r: None)
    (row,) = out["runs"]["this"]
    # one entry per ledger on 2 of the 3 bookies (Qw2): the bookie holds those whose
    # write set names it (about two thirds); every one of them exists: none dropped
    held = out["held_ids"]
    assert held and row["checked"] == len(held), (row, len(held))
    assert row["dead"] == 0, row
    # one client's ids, its blocks reserved far apart (creates in between), each
    # held one in 64 of its span or denser: one range request a block
    blocks = {lid >> store_mod.ID_BLOCK_BITS for lid in held}
    assert all(sum(lid >> store_mod.ID_BLOCK_BITS == blk for lid in held)
               * store_mod.SCAN_RATIO >= 1 << store_mod.ID_BLOCK_BITS for blk in blocks)
    assert row["requests"] == len(blocks), (row, sorted(blocks))


def test_the_real_bookie_reconcile_bench_with_scattered_ledgers(tmp_path):
    """--reconcile-cluster --share 20: the bookie holds one ledger in 20 of the
    cluster's, scattered in each block; its reconcile reads a block a request."""
    out = bench_reconcile_cluster(3000, rounds=1, share=20, base_dir=str(tmp_path),
                                  progress=lambda n, r: None)
    (row,) = out["runs"]["this"]
    # the bench draws one ledger in 20 with random.Random(20), one draw per id in
    # id order: the bookie holds exactly as many ledgers as those draws picked
    pick = random.Random(20)
    assert out["held"] == sum(pick.randrange(20) == 0 for _ in range(3000)), out
    assert row["checked"] == out["held"] and row["dead"] == 0, (out, row)
    # 3000 ids are three blocks of 1024 reserved apart (their other ids filled
    # between the reservations), each holding ~50 of the bookie's: a range a block
    # (a point read each would be one per ledger held)
    blocks = {lid >> store_mod.ID_BLOCK_BITS for lid in out["held_ids"]}
    assert len(blocks) == 3, sorted(blocks)
    assert row["requests"] == len(blocks), (out["held"], row)
