"""Rack-aware placement finds a spread whenever one exists (soak19).

The soak with --racks 3 (seed 1902) logged 'cannot place 4 bookies so that every
write quorum of 2 spans 2 racks' with rack0 holding three writable bookies and
rack1 and rack2 one each: r0 r1 r0 r2 is such a placement. The fill goes slot by
slot and ranks the candidates by how few bookies of their rack the ensemble has
(so at slot 2 of r0 r1 _ _ it takes the rack2 bookie, and slot 3 is left with
rack0 beside rack0); its eight tries differ only in ties. With
enforceMinNumRacksPerWriteQuorum the create is refused, without it the ensemble
has a write quorum on one rack. When the tries fail, the policy now searches the
racks of the empty slots exhaustively (``PlacementPolicy._search``: E is small)
before it gives up."""

from __future__ import annotations

import collections
import itertools
import random


from bk.client.placement import PlacementPolicy, write_quorum_racks
from bk.errors import NotEnoughBookiesError


def feasible(counts, E, qw, want) -> bool:
    """Whether ``E`` slots can take racks (rack i at most ``counts[i]`` times) so
    that every write quorum of ``qw`` spans ``want`` racks: every assignment."""
    for a in itertools.product(range(len(counts)), repeat=E):
        c = collections.Counter(a)
        if any(c[i] > counts[i] for i in c):
            continue
        if min(len({a[(s + k) % E] for k in range(qw)}) for s in range(E)) >= want:
            return True
    return False


def test_the_soaks_racks_are_always_placed_when_the_spread_exists():
    racks = {"a1": "r0", "a2": "r0", "a3": "r0", "b1": "r1", "c1": "r2"}
    assert feasible([3, 1, 1], 4, 2, 2)
    policy = PlacementPolicy("rackaware", min_racks=2, enforce=True)
    refused = []
    for seed in range(200):
        try:
            ens = policy.new_ensemble(list(racks), 4, 2, racks, rng=random.Random(seed))
        except NotEnoughBookiesError:
            refused.append(seed)
            continue
        assert min(write_quorum_racks(ens, 2, racks.__getitem__)) == 2, ens
    assert refused == []


def test_every_feasible_spread_of_up_to_six_bookies_over_three_racks_is_found():
    """Ensembles of 3-6, every write quorum size, racks of 0-3 bookies: wherever
    some placement spreads every write quorum over min(2, Qw, racks) racks, the
    policy finds one (60 seeds each)."""
    policy = PlacementPolicy("rackaware", min_racks=2)
    missed = collections.Counter()
    for E in range(3, 7):
        for qw in range(2, E + 1):
            for counts in itertools.product(range(4), repeat=3):
                want = min(2, qw, sum(1 for c in counts if c))
                if sum(counts) < E or not feasible(counts, E, qw, want):
                    continue
                racks = {f"b{r}{j}": f"r{r}" for r, c in enumerate(counts) for j in range(c)}
                for seed in range(60):
                    ens = policy.new_ensemble(list(racks), E, qw, racks,
                                              rng=random.Random(seed))
                    if min(write_quorum_racks(ens, qw, racks.__getitem__)) < want:
                        missed[(E, qw, counts)] += 1
    assert dict(missed) == {}
