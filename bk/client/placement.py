"""Ensemble placement: which bookies store a ledger (or replace a failed one).

Random among the writable bookies, never two slots on one bookie, never a
bookie the caller excludes (already in the ensemble, or known to have failed).
"""

from __future__ import annotations

import random as _random
from typing import Iterable

from bk.errors import NotEnoughBookiesError


def choose_ensemble(writable: Iterable[str], size: int, exclude: Iterable[str] = (),
                    rng=_random) -> list[str]:
    """``size`` distinct bookies from ``writable`` minus ``exclude``."""
    excluded = set(exclude)
    candidates = sorted(set(writable) - excluded)
    if len(candidates) < size:
        raise NotEnoughBookiesError(
            f"need {size} writable bookies, found {len(candidates)}"
            + (f" ({', '.join(candidates)})" if candidates else "")
            + (f" after excluding {', '.join(sorted(excluded))}" if excluded else ""))
    return rng.sample(candidates, size)


def replace_bookies(writable: Iterable[str], ensemble: list[str], failed: Iterable[str],
                    exclude: Iterable[str] = (), rng=_random) -> tuple[list[str], dict]:
    """A copy of ``ensemble`` with every ``failed`` bookie replaced.

    Returns ``(new_ensemble, {old: new})``. Replacements are writable bookies in
    neither the ensemble nor ``exclude``.
    """
    failed = [b for b in ensemble if b in set(failed)]
    if not failed:
        return list(ensemble), {}
    picks = choose_ensemble(writable, len(failed), set(ensemble) | set(exclude), rng)
    mapping = dict(zip(failed, picks))
    return [mapping.get(b, b) for b in ensemble], mapping
