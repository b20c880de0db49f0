"""What ``/api/v1/autorecovery/status`` and ``bkshell autorecovery --status`` report.

Auto-recovery keeps its state in the metadata store (the auditor's key, the
cluster-wide switch, the marks and the periodic checks'
times, :mod:`bk.meta.underreplication`), so any process can report it.
"""

from __future__ import annotations

from bk.meta import underreplication as UR


def auditor_id(store) -> str | None:
    """The elected auditor's id (a bookie id, or a standalone process's), or None."""
    value, _ = store.get_json(UR.AUDITOR)
    return value.get("id") if isinstance(value, dict) else None


def status(store, here: bool | None = None) -> dict:
    """The cluster's auto-recovery state; ``here`` (when given): whether the process
    that answers runs auto-recovery."""
    auditor = auditor_id(store)
    out = {"running": auditor is not None,
           "enabled": UR.settings(store).get("enabled", True) is not False,
           "auditor": auditor,
           "underReplicatedLedgers": sum(1 for _ in UR.list_marked(store)),
           "checks": UR.checks(store)}
    if here is not None:
        out["here"] = here
    if auditor is None:
        out["message"] = "no auditor is elected: auto-recovery runs nowhere"
    return out
