"""Ensemble placement: which bookies store a ledger (or replace a failed one).

Never two slots on one bookie, never a bookie the caller excludes (already in
the ensemble, or known to have failed). The policy (``ensemblePlacementPolicy``,
BookKeeper's names):

* ``random``: any writable bookies.
* ``rackaware``: every write quorum (the Qw consecutive slots, cyclically, that
  an entry is written to) spans at least ``minNumRacksPerWriteQuorum`` racks
  (at most Qw), and the ensemble spreads over as many racks as it can.
* ``regionaware``: the same with regions (the first part of ``/region/rack``)
  in place of racks, and racks to break ties: each write quorum spans
  ``minNumRacksPerWriteQuorum`` regions, so a region lost leaves a copy.

Theory of operation (rack-aware): slots are filled one at a time. A candidate
is acceptable for a slot when every write quorum through that slot can still
reach the rack count: its distinct racks so far (with the candidate) plus its
slots still empty. Among acceptable candidates the one whose rack is used
least in the ensemble wins, ties broken at random. Slots are filled in order,
so the racks repeat with a period of the rack count, which meets the policy
whenever some placement can (E a multiple of it, enough bookies per rack). Replacing a bookie is the
same fill with the other slots fixed. A fill that dead-ends is retried in
another random order a few times; what still cannot meet the policy (too few
racks) either raises :class:`NotEnoughBookiesError` naming the racks it had
(``enforceMinNumRacksPerWriteQuorum=true``) or falls back to the best spread
it found and logs why.
"""

from __future__ import annotations

import logging
import random as _random
from typing import Callable, Iterable, Mapping

from bk.errors import ConfigError, NotEnoughBookiesError
from bk.meta.racks import DEFAULT_RACK, region_of

log = logging.getLogger("bk.client")

POLICIES = ("random", "rackaware", "regionaware")
_TRIES = 8


def _not_enough(size, candidates, excluded):
    return NotEnoughBookiesError(
        f"need {size} writable bookies, found {len(candidates)}"
        + (f" ({', '.join(candidates)})" if candidates else "")
        + (f" after excluding {', '.join(sorted(excluded))}" if excluded else ""))


def choose_ensemble(writable: Iterable[str], size: int, exclude: Iterable[str] = (),
                    rng=_random) -> list[str]:
    """``size`` distinct bookies from ``writable`` minus ``exclude``, at random."""
    excluded = set(exclude)
    candidates = sorted(set(writable) - excluded)
    if len(candidates) < size:
        raise _not_enough(size, candidates, excluded)
    return rng.sample(candidates, size)


def replace_bookies(writable: Iterable[str], ensemble: list[str], failed: Iterable[str],
                    exclude: Iterable[str] = (), rng=_random) -> tuple[list[str], dict]:
    """A copy of ``ensemble`` with every ``failed`` bookie replaced, at random.

    Returns ``(new_ensemble, {old: new})``. Replacements are writable bookies in
    neither the ensemble nor ``exclude``.
    """
    failed = [b for b in ensemble if b in set(failed)]
    if not failed:
        return list(ensemble), {}
    picks = choose_ensemble(writable, len(failed), set(ensemble) | set(exclude), rng)
    mapping = dict(zip(failed, picks))
    return [mapping.get(b, b) for b in ensemble], mapping


def write_quorum_racks(ensemble: list[str], qw: int, rack_of: Callable[[str], str]) -> list[int]:
    """The number of distinct racks of each write quorum (slot i .. i+Qw-1, cyclic)."""
    E = len(ensemble)
    return [len({rack_of(ensemble[(i + k) % E]) for k in range(min(qw, E))}) for i in range(E)]


class PlacementPolicy:
    """Chooses ensembles and replacements; ``racks`` is bookie id -> ``/region/rack``
    (a bookie not in it is in the default rack)."""

    def __init__(self, name: str = "random", min_racks: int = 2, enforce: bool = False):
        if name not in POLICIES:
            raise ConfigError(f"bad value {name!r} for ensemblePlacementPolicy: expected "
                              f"one of {', '.join(POLICIES)}")
        self.name = name
        self.min_racks = int(min_racks)
        self.enforce = bool(enforce)

    @classmethod
    def from_conf(cls, conf) -> "PlacementPolicy":
        return cls(conf.ensemblePlacementPolicy, conf.minNumRacksPerWriteQuorum,
                   conf.enforceMinNumRacksPerWriteQuorum)

    @property
    def rack_aware(self) -> bool:
        return self.name != "random"

    def _domain(self, racks: Mapping[str, str]) -> Callable[[str], str]:
        """What a write quorum must spread over: racks, or regions."""
        if self.name == "regionaware":
            return lambda b: region_of(racks.get(b, DEFAULT_RACK))
        return lambda b: racks.get(b, DEFAULT_RACK)

    def new_ensemble(self, writable: Iterable[str], size: int, qw: int,
                     racks: Mapping[str, str] | None = None, exclude: Iterable[str] = (),
                     rng=_random) -> list[str]:
        """An ensemble of ``size`` bookies for write quorums of ``qw``."""
        if not self.rack_aware:
            return choose_ensemble(writable, size, exclude, rng)
        return self._fill([None] * size, writable, qw, racks or {}, set(exclude), rng)

    def replace_bookies(self, writable: Iterable[str], ensemble: list[str],
                        failed: Iterable[str], qw: int, racks: Mapping[str, str] | None = None,
                        exclude: Iterable[str] = (), rng=_random) -> tuple[list[str], dict]:
        """``ensemble`` with every ``failed`` bookie replaced: ``(new, {old: new})``."""
        if not self.rack_aware:
            return replace_bookies(writable, ensemble, failed, exclude, rng)
        failed = set(failed)
        slots = [None if b in failed else b for b in ensemble]
        if all(s is not None for s in slots):
            return list(ensemble), {}
        new = self._fill(slots, writable, qw, racks or {},
                         set(exclude) | set(ensemble), rng)
        return new, {o: n for o, n in zip(ensemble, new) if o != n}

    def adheres(self, ensemble: list[str], qw: int, racks: Mapping[str, str],
                available_domains: int | None = None) -> bool:
        """Whether every write quorum of ``ensemble`` spans the racks it should (with
        ``available_domains`` racks to choose from, when fewer than that)."""
        if not self.rack_aware:
            return True
        want = min(self.min_racks, qw, len(ensemble))
        if available_domains is not None:
            want = min(want, available_domains)
        return min(write_quorum_racks(ensemble, qw, self._domain(racks))) >= want

    # --- the fill ------------------------------------------------------------------
    def _fill(self, slots: list, writable, qw: int, racks: Mapping[str, str], excluded: set,
              rng) -> list[str]:
        rack_of = self._domain(racks)
        candidates = sorted(set(writable) - excluded - {s for s in slots if s})
        empty = [i for i, s in enumerate(slots) if s is None]
        if len(candidates) < len(empty):
            raise _not_enough(len(empty), candidates, excluded)
        E = len(slots)
        qw = min(qw, E)
        domains = {rack_of(b) for b in candidates} | {rack_of(s) for s in slots if s}
        want = min(self.min_racks, qw)
        best, best_score = None, -1
        for _ in range(_TRIES):
            got = self._fill_once(list(slots), empty, candidates, qw, want, rack_of, rng)
            score = min(write_quorum_racks(got, qw, rack_of))
            if score >= want:
                return got
            if score > best_score:
                best, best_score = got, score
        # the tries differ only in ties: an exact search over the racks of the empty
        # slots before giving up (E is small)
        got = self._search(list(slots), empty, candidates, qw, want, rack_of, rng)
        if got is not None:
            return got
        # every rack counted, with the bookies it has: the free candidates and the
        # ensemble's kept ones (listing the candidates alone said "3 racks" and named one)
        members: dict = {}
        for b in candidates:
            members.setdefault(rack_of(b), []).append(str(b))
        for s in slots:
            if s:
                members.setdefault(rack_of(s), []).append(f"{s} (kept)")
        where = ", ".join(f"{d}: {sorted(v)}" for d, v in sorted(members.items()))
        kind = "regions" if self.name == "regionaware" else "racks"
        why = (f"cannot place {E} bookies so that every write quorum of {qw} spans "
               f"{want} {kind} (minNumRacksPerWriteQuorum={self.min_racks}); "
               f"{len(domains)} {kind} have writable bookies ({where or 'none'})")
        if self.enforce:
            raise NotEnoughBookiesError(why + "; enforceMinNumRacksPerWriteQuorum=true "
                                        "refuses it")
        log.warning("placement: %s; using the best spread found (%d %s per write quorum)",
                    why, best_score, kind)
        return best

    @staticmethod
    def _search(slots, empty, candidates, qw, want, rack_of, rng):
        """Fill the ``empty`` slots so that every write quorum spans ``want`` racks,
        by backtracking over the racks (the fullest first), then picking a random
        free bookie of each chosen rack; None if no spread exists. Exhaustive, so
        it finds what the fill's ranked tries miss (rack0 x3, rack1, rack2, E=4,
        Qw=2: r0 r1 r0 r2)."""
        E = len(slots)
        left: dict = {}
        for b in candidates:
            left.setdefault(rack_of(b), []).append(b)
        for v in left.values():
            rng.shuffle(v)
        count = {r: len(v) for r, v in left.items()}
        rk = [rack_of(b) if b is not None else None for b in slots]

        def fits(s):
            starts = [0] if qw == E else range(s - qw + 1, s + 1)
            for start in starts:
                members = [rk[(start + k) % E] for k in range(qw)]
                if None not in members and len(set(members)) < want:
                    return False
            return True

        def go(i):
            if i == len(empty):
                return True
            s = empty[i]
            for r in sorted(count, key=lambda r: -count[r]):
                if not count[r]:
                    continue
                rk[s] = r
                count[r] -= 1
                if fits(s) and go(i + 1):
                    return True
                count[r] += 1
                rk[s] = None
            return False

        if not go(0):
            return None
        for s in empty:
            slots[s] = left[rk[s]].pop()
        return slots

    @staticmethod
    def _fill_once(slots, empty, candidates, qw, want, rack_of, rng):
        E = len(slots)
        pool = list(candidates)
        rng.shuffle(pool)
        # in slot order: a quorum's racks then repeat with period m, which fits
        # whenever the racks have enough bookies
        for s in empty:
            used: dict = {}
            for b in slots:
                if b is not None:
                    used[rack_of(b)] = used.get(rack_of(b), 0) + 1

            def room(b):
                # the least slack over the write quorums through slot s, with b in it
                slack = None
                r = rack_of(b)
                for start in range(s - qw + 1, s + 1):
                    members = [slots[(start + k) % E] for k in range(qw)
                               if (start + k) % E != s]
                    if qw == E:
                        members = [slots[k] for k in range(E) if k != s]
                    have = {rack_of(m) for m in members if m is not None} | {r}
                    free = sum(1 for m in members if m is None)
                    v = len(have) + free - want
                    slack = v if slack is None else min(slack, v)
                    if qw == E:
                        break
                return slack

            ranked = sorted(pool, key=lambda b: (room(b) < 0, used.get(rack_of(b), 0)))
            pick = ranked[0]
            slots[s] = pick
            pool.remove(pick)
        return slots
