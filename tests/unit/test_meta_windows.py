"""How existing_ledgers cuts the ids it is asked about into requests
(bk.meta.store.id_windows, _request_groups): a range only over a span where the
ids are dense, point reads elsewhere, bounded pages and groups."""

from __future__ import annotations

import random

from bk.meta.store import (GROUP_KEYS, ID_GROUP, RANGE_SPAN, RANGE_WASTE, _request_groups,
                           id_windows)


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
