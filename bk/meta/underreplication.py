"""Under-replication records and auto-recovery settings in etcd.

Keys under the store's prefix (every write a transaction):

``underreplication/ledgers/<id, 20 digits>``  ``{"missing": [bookie ids], "ctime": t}``:
                                             the ledger has fragments on bookies that
                                             were lost; merged by CAS (``mark``). A
                                             failed repair adds ``"error"`` and
                                             ``"retryAt"`` (back-off, listed by
                                             ``bkshell listunderreplicated``).
``underreplication/locks/<id>``              a replication worker's LeaseLock (also
                                             taken by a bookie's over-replicated GC)
``underreplication/checks``                  ``{"ledgers": {...}, "replicas": {...}}``:
                                             when each periodic check last finished,
                                             how many ledgers it saw and marked
``underreplication/candidates/<id>``         ``{"id": ..., "since": t}``, bound to the
                                             lease of a process that runs
                                             auto-recovery (an auditor candidate and
                                             a worker): while any is there, a moment
                                             with no auditor is a hand-over, not a
                                             cluster without auto-recovery
``auditor``                                  the elected auditor (an Election)
``autorecovery``                             ``{"enabled": bool, "lostBookieRecoveryDelay":
                                             s or null, "trigger": n}``: what
                                             ``bkshell autorecovery`` and friends set

Writes made on behalf of the auditor or a worker carry its guard (epoch or
lock token, see :mod:`bk.meta.recipes`), so a deposed one changes nothing.
"""

from __future__ import annotations

import time
from typing import Iterator

from bk.errors import MetadataVersionError
from bk.retry import retry_cas

LEDGERS = "underreplication/ledgers/"
LOCKS = "underreplication/locks/"
AUDITOR = "auditor"
SETTINGS = "autorecovery"
CHECKS = "underreplication/checks"
CANDIDATES = "underreplication/candidates/"


def ledger_rel(ledger_id: int) -> str:
    return f"{LEDGERS}{ledger_id:020d}"


def lock_rel(ledger_id: int) -> str:
    return f"{LOCKS}{ledger_id:020d}"


def mark(store, ledger_id: int, missing, guards=()) -> bool:
    """Add ``missing`` bookies to the ledger's record (creating it); True if it
    changed. A failed repair's back-off is cleared: there is news."""
    rel = ledger_rel(ledger_id)

    def attempt() -> bool:
        cur, version = store.get_json(rel)
        old = set(cur.get("missing", ())) if cur else set()
        new = old | set(missing)
        if cur is not None and new == old:
            return False
        rec = {"missing": sorted(new), "ctime": cur.get("ctime") if cur else time.time()}
        store.cas_json(rel, rec, version, guards=guards)
        return True
    return retry_cas(f"mark ledger {ledger_id} under-replicated", attempt)


def list_marked(store) -> Iterator[tuple[int, dict, int]]:
    """``(ledger id, record, version)`` of every under-replicated ledger, by id."""
    for rel, rec, version in store.list_json(LEDGERS):
        try:
            yield int(rel[len(LEDGERS):]), rec, version
        except ValueError:
            continue


def marked(store, ledger_id: int) -> tuple[dict | None, int | None]:
    """``(record, version)`` of the ledger's mark, ``(None, None)`` if it has none."""
    rec, version = store.get_json(ledger_rel(ledger_id))
    return (rec, version) if isinstance(rec, dict) else (None, None)


def unmark(store, ledger_id: int, version: int) -> bool:
    """Remove the record if it is still at ``version`` (marked again since: kept)."""
    try:
        return store.delete_json(ledger_rel(ledger_id), version)
    except MetadataVersionError:
        return False


def record_failure(store, ledger_id: int, version: int, reason: str, retry_in: float,
                   guards=()) -> None:
    """Note why the ledger could not be repaired now and when to try again."""
    cur, v = store.get_json(ledger_rel(ledger_id))
    if cur is None or v != version:
        return
    cur.update(error=reason, retryAt=time.time() + retry_in)
    try:
        store.cas_json(ledger_rel(ledger_id), cur, version, guards=guards)
    except MetadataVersionError:
        pass


def settings(store) -> dict:
    value, _ = store.get_json(SETTINGS)
    return value if isinstance(value, dict) else {}


def _update_dict(rel: str, store, changes: dict, guards=()) -> dict:
    """CAS ``changes`` into the JSON object at ``rel``; returns the new object."""
    def attempt() -> dict:
        value, version = store.get_json(rel)
        value = dict(value) if isinstance(value, dict) else {}
        value.update(changes)
        store.cas_json(rel, value, version, guards=guards)
        return value
    return retry_cas(f"update {rel}", attempt)


def update_settings(store, **changes) -> dict:
    """Change auto-recovery settings by CAS; returns them."""
    return _update_dict(SETTINGS, store, changes)


def record_check(store, name: str, record: dict, guards=()) -> None:
    """Keep when the periodic check ``name`` last finished (and what it found)."""
    _update_dict(CHECKS, store, {name: record}, guards)


def checks(store) -> dict:
    """The last run of each periodic check (see :func:`record_check`)."""
    value, _ = store.get_json(CHECKS)
    return value if isinstance(value, dict) else {}


def candidates(store) -> list[str]:
    """The ids of the processes that run auto-recovery now (their lease lives)."""
    return sorted(v.get("id", rel.rsplit("/", 1)[1]) if isinstance(v, dict)
                  else rel.rsplit("/", 1)[1] for rel, v, _ in store.list_json(CANDIDATES))
