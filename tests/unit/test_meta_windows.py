"""How existing_ledgers cuts the ids it is asked about into requests
(bk.meta.store.block_windows, id_windows, _request_groups): a range only over a
span where the ids are dense, point reads elsewhere, bounded pages and groups."""

from __future__ import annotations

import random

from bk.meta.store import (GROUP_KEYS, ID_BLOCK_BITS, ID_GROUP, RANGE_SPAN, RANGE_WASTE,
                           SCAN_RATIO, _request_groups, block_windows, id_windows)


def spans_ok(windows, ids, waste):
    assert [lid for w in windows for lid in w] == ids          # every id once, in order
    for w in windows:
        span = w[-1] - w[0] + 1
        if len(w) > 1:
            assert span <= RANGE_SPAN and span <= waste * len(w), (w[0], w[-1], len(w))


def test_a_dense_block_is_one_window_and_lone_ids_are_point_reads():
    block = list(range(1 << 20, (1 << 20) + 1024))
    assert id_windows(block) == [block]
    far = [10, 10 + 10_000, 10 + 20_000]
    assert id_windows(far) == [[10], [10_010], [20_010]]
    mixed = sorted(far + block)
    assert id_windows(mixed) == [[10], [10_010], [20_010], block]


def test_every_other_id_of_a_block_is_one_window_but_one_in_a_hundred_is_not():
    half = list(range(0, 2048, 2))          # one shard of two: the other's keys in between
    assert id_windows(half) == [half]
    sparse = list(range(0, 100 * 100, 100))   # a bookie among many: point reads
    assert id_windows(sparse) == [[x] for x in sparse]


def test_no_window_spans_more_than_a_page_or_wastes_more_than_the_bound():
    rng = random.Random(7)
    for _ in range(50):
        ids = set()
        for _ in range(rng.randrange(1, 12)):          # blocks, some dense, some sparse
            base = rng.randrange(0, 1 << 40)
            step = rng.choice([1, 2, 3, 7, 20, 31, 40, 400])
            ids.update(range(base, base + rng.randrange(1, 30_000), step))
        ids = sorted(ids)
        for waste in (RANGE_WASTE, 8, 2, 1):
            spans_ok(id_windows(ids, waste), ids, waste)


def test_waste_zero_is_point_reads_only():
    ids = list(range(100))
    assert id_windows(ids, 0) == [[x] for x in ids]


def test_groups_bound_the_requests_and_the_keys_in_flight():
    windows = id_windows(list(range(0, 200_000)) + list(range(10**9, 10**9 + 5000, 100)))
    groups = list(_request_groups(windows))
    assert [w for g in groups for w in g] == windows
    for g in groups:
        assert len(g) <= ID_GROUP
        keys = sum(w[-1] - w[0] + 1 for w in g)
        assert keys <= GROUP_KEYS or len(g) == 1
    assert len(list(_request_groups(windows, max_keys=GROUP_KEYS // 10))) > len(groups)


BLOCK = 1 << ID_BLOCK_BITS


def test_a_block_with_one_held_id_in_forty_is_one_window_wherever_they_fall():
    # a bookie among 120 (E3): its ids scattered at random in each client's block;
    # the greedy runs of id_windows break at the first long gap, a block does not
    rng = random.Random(3)
    base = 77 * BLOCK
    held = sorted(rng.sample(range(base, base + BLOCK), BLOCK // 40))
    assert block_windows(held) == [held]
    assert len(id_windows(held)) > 1
    # one in a hundred of a block: not read whole (100 keys for each), only what
    # id_windows finds (point reads, a close pair)
    few = sorted(rng.sample(range(base, base + BLOCK), BLOCK // 100))
    assert block_windows(few) == id_windows(few) and len(block_windows(few)) > 1


def test_adjacent_dense_blocks_share_a_request_far_ones_do_not():
    a = list(range(5 * BLOCK, 6 * BLOCK, 10))
    b = list(range(6 * BLOCK, 7 * BLOCK, 10))
    far = list(range(900 * BLOCK, 901 * BLOCK, 10))
    assert block_windows(a + b + far) == [a + b, far]
    # a sparse block between two dense ones: its ids alone, and no merge across it
    sparse = [7 * BLOCK + 1, 7 * BLOCK + 900]
    c = list(range(8 * BLOCK, 9 * BLOCK, 10))
    assert block_windows(a + sparse + c) == [a, [sparse[0]], [sparse[1]], c]


def test_a_dense_run_in_a_sparse_block_is_still_a_range():
    run = list(range(3 * BLOCK + 100, 3 * BLOCK + 120))
    lone = [3 * BLOCK + 1023]
    ids = [3 * BLOCK] + run + lone
    assert block_windows(ids, ratio=4) == [[3 * BLOCK]] + [run] + [lone]


def test_block_windows_keep_every_id_once_and_the_bounds():
    rng = random.Random(11)
    for _ in range(50):
        ids = set()
        for _ in range(rng.randrange(1, 12)):
            base = rng.randrange(0, 1 << 30) * BLOCK
            step = rng.choice([1, 2, 7, 20, 40, 64, 65, 100, 400])
            ids.update(range(base, base + rng.randrange(1, 30_000), step))
        ids = sorted(ids)
        windows = block_windows(ids)
        assert [lid for w in windows for lid in w] == ids
        for w in windows:
            span = w[-1] - w[0] + 1
            if len(w) > 1:
                assert span <= RANGE_SPAN, (w[0], w[-1])
                assert span <= SCAN_RATIO * len(w) or span <= RANGE_WASTE * len(w), \
                    (w[0], w[-1], len(w))
