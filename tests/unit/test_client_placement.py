import random

import pytest

from bk.client.placement import choose_ensemble, replace_bookies
from bk.errors import NotEnoughBookiesError

BOOKIES = [f"10.0.0.{i}:3181" for i in range(6)]


def test_choose_distinct_and_excluded():
    rng = random.Random(1)
    for _ in range(200):
        ens = choose_ensemble(BOOKIES, 4, exclude=[BOOKIES[0]], rng=rng)
        assert len(set(ens)) == 4 and BOOKIES[0] not in ens


def test_choose_spreads():
    rng = random.Random(2)
    seen = set()
    for _ in range(200):
        seen.update(choose_ensemble(BOOKIES, 2, rng=rng))
    assert seen == set(BOOKIES)


def test_not_enough():
    with pytest.raises(NotEnoughBookiesError) as ei:
        choose_ensemble(BOOKIES[:2], 3)
    assert "need 3" in str(ei.value)
    with pytest.raises(NotEnoughBookiesError):
        choose_ensemble(BOOKIES[:3], 3, exclude=BOOKIES[:1])


def test_replace_keeps_slots():
    ens = BOOKIES[:3]
    new, mapping = replace_bookies(BOOKIES, ens, [ens[1]], exclude=[BOOKIES[3]],
                                   rng=random.Random(3))
    assert new[0] == ens[0] and new[2] == ens[2]
    assert new[1] in BOOKIES[4:] and mapping == {ens[1]: new[1]}
    assert replace_bookies(BOOKIES, ens, ["elsewhere:1"]) == (ens, {})
    with pytest.raises(NotEnoughBookiesError):
        replace_bookies(BOOKIES[:3], ens, [ens[0]])


# --- rack- and region-aware placement ---------------------------------------------------
from bk.client.placement import PlacementPolicy, write_quorum_racks  # noqa: E402
from bk.errors import ConfigError  # noqa: E402
from bk.meta.racks import DEFAULT_RACK, check_rack  # noqa: E402

# three racks of three bookies, in two regions
RACKS = {f"10.1.{r}.{i}:3181": f"/{'east' if r < 2 else 'west'}/rack{r}"
         for r in range(3) for i in range(3)}
RACKED = sorted(RACKS)


def _spans(ens, qw, racks=RACKS, region=False):
    key = (lambda b: racks.get(b, DEFAULT_RACK).split("/")[1]) if region \
        else (lambda b: racks.get(b, DEFAULT_RACK))
    return min(write_quorum_racks(ens, qw, key))


@pytest.mark.parametrize("E,qw,m", [(3, 2, 2), (3, 3, 2), (3, 3, 3), (5, 3, 2), (6, 3, 3),
                                    (6, 2, 2), (4, 2, 2), (9, 3, 3)])
def test_rackaware_every_write_quorum_spans_racks(E, qw, m):
    p = PlacementPolicy("rackaware", min_racks=m, enforce=True)
    rng = random.Random(E * 100 + qw * 10 + m)
    for _ in range(100):
        ens = p.new_ensemble(RACKED, E, qw, RACKS, rng=rng)
        assert len(set(ens)) == E
        assert _spans(ens, qw) >= min(m, qw), ens
        assert p.adheres(ens, qw, RACKS)


def test_rackaware_replacement_keeps_the_spread():
    p = PlacementPolicy("rackaware", min_racks=2, enforce=True)
    rng = random.Random(7)
    for _ in range(100):
        ens = p.new_ensemble(RACKED, 3, 2, RACKS, rng=rng)
        lost = ens[1]
        new, mapping = p.replace_bookies(RACKED, ens, [lost], 2, RACKS, exclude=[], rng=rng)
        assert new[0] == ens[0] and new[2] == ens[2] and lost not in new
        assert mapping == {lost: new[1]}
        assert _spans(new, 2) >= 2


def test_rackaware_replacement_avoids_the_racks_of_the_quorum():
    # E3 Qw3 m3 over 3 racks: the replacement must come from the lost bookie's rack
    p = PlacementPolicy("rackaware", min_racks=3, enforce=True)
    ens = ["10.1.0.0:3181", "10.1.1.0:3181", "10.1.2.0:3181"]
    for seed in range(30):
        new, _ = p.replace_bookies(RACKED, ens, [ens[2]], 3, RACKS, rng=random.Random(seed))
        assert RACKS[new[2]] == "/west/rack2"


def test_rackaware_impossible_shapes_are_refused():
    # every 3 consecutive of 5 slots on 3 distinct racks: no 3-colouring of that exists
    p = PlacementPolicy("rackaware", min_racks=3, enforce=True)
    with pytest.raises(NotEnoughBookiesError):
        p.new_ensemble(RACKED, 5, 3, RACKS)


def test_rackaware_enforced_names_the_racks():
    two = {b: r for b, r in RACKS.items() if not r.endswith("rack2")}
    p = PlacementPolicy("rackaware", min_racks=3, enforce=True)
    with pytest.raises(NotEnoughBookiesError) as ei:
        p.new_ensemble(sorted(two), 3, 3, two)
    msg = str(ei.value)
    assert "/east/rack0" in msg and "/east/rack1" in msg and "enforce" in msg


def test_rackaware_falls_back_when_not_enforced(caplog):
    p = PlacementPolicy("rackaware", min_racks=2, enforce=False)
    one = {b: "/r/only" for b in RACKED[:4]}
    ens = p.new_ensemble(sorted(one), 3, 2, one, rng=random.Random(1))
    assert len(set(ens)) == 3
    assert "using the best spread" in caplog.text


def test_rackaware_unknown_bookies_are_in_the_default_rack():
    p = PlacementPolicy("rackaware", min_racks=2, enforce=True)
    racks = {RACKED[0]: "/east/rack0"}
    for seed in range(20):
        ens = p.new_ensemble(RACKED[:4], 2, 2, racks, rng=random.Random(seed))
        assert RACKED[0] in ens        # the only bookie not in the default rack


def test_regionaware_spreads_over_regions():
    p = PlacementPolicy("regionaware", min_racks=2, enforce=True)
    rng = random.Random(5)
    for _ in range(50):
        ens = p.new_ensemble(RACKED, 4, 2, RACKS, rng=rng)
        assert _spans(ens, 2, region=True) >= 2
    # E3 Qw3 over two regions: every quorum (the whole ensemble) has both
    for _ in range(50):
        ens = p.new_ensemble(RACKED, 3, 3, RACKS, rng=rng)
        assert {RACKS[b].split("/")[1] for b in ens} == {"east", "west"}


def test_random_policy_ignores_racks_and_bad_names():
    p = PlacementPolicy("random")
    assert not p.rack_aware and p.adheres(RACKED[:3], 3, {})
    with pytest.raises(ConfigError) as ei:
        PlacementPolicy("zoneaware")
    assert "ensemblePlacementPolicy" in str(ei.value)


def test_rack_paths():
    assert check_rack("/r1/a") == "/r1/a"
    assert check_rack("/a") == "/default-region/a"
    for bad in ("", "r1/a", "/a/b/c", "/a b", "//a"):
        with pytest.raises(ConfigError):
            check_rack(bad)


def test_rackaware_refusal_names_the_kept_bookies_racks_too():
    # a replacement: the ensemble keeps bookies on /a and /b, the only free
    # candidates are on /a; the refusal counts 2 racks and must name both,
    # the kept bookies marked as such (it once listed the candidates alone)
    racks = {"k1:1": "/r/a", "k2:1": "/r/b", "gone:1": "/r/c", "free1:1": "/r/a", "free2:1": "/r/a"}
    p = PlacementPolicy("rackaware", min_racks=3, enforce=True)
    with pytest.raises(NotEnoughBookiesError) as ei:
        p.replace_bookies(["k1:1", "k2:1", "free1:1", "free2:1"], ["k1:1", "k2:1", "gone:1"],
                          ["gone:1"], 3, racks, rng=random.Random(1))
    msg = str(ei.value)
    assert "2 racks have writable bookies" in msg
    assert "/r/b: ['k2:1 (kept)']" in msg
    assert "/r/a: ['free1:1', 'free2:1', 'k1:1 (kept)']" in msg
