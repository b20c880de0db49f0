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
