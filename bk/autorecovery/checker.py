"""What a ledger's bookies should hold, and what they lack: the checks behind
the auditor's periodic audits and a bookie's over-replicated GC.

Which entries a bookie must hold follows from the metadata alone: entry ``e``
of the fragment ``(first, ensemble)`` lives on the write set of ``e`` (Qw
bookies of that ensemble, round robin). A fragment's last entry is the next
fragment's first minus one; the last fragment ends at ``last_entry_id`` when
the ledger is closed and is unknown while it is open, so open ledgers are
checked up to their last complete fragment only (or up to ``last`` when the
caller knows a safe bound, e.g. the LAC).

* :func:`fragment_problems` (the periodic *ledger* check, BookKeeper's
  LedgerChecker): per fragment and bookie, the first and the last entry that
  bookie should hold are read. Cheap (two reads per bookie and fragment,
  whatever the ledger's size); catches a bookie that lost a ledger or the
  tail of one.
* :func:`replica_problems` (the *replicas* check): one GET_LIST_OF_ENTRIES
  per bookie, compared entry by entry with the write sets. Exact, costs the
  size of each bookie's index of the ledger.

* :func:`claim_overreplicated` (a bookie's GC): which ledgers the bookie holds
  but no longer belongs to, and may drop because every bookie of their write
  sets holds their entries.

The checks answer ``{bookie: [entry ids it lacks]}``; a bookie that could not be
asked at all is under ``unreachable`` (the auditor's lost-bookie audit deals
with bookies that are gone; a check does not mark a ledger for a bookie that
merely timed out). "Lacks" means the bookie answered and said so.
"""

from __future__ import annotations

from bk import protocol as P
from bk.errors import EOK, ENOENTRY, ENOLEDGER, BKError, NoSuchLedgerError
from bk.meta import underreplication as UR
from bk.meta.recipes import LeaseLock

__all__ = ["expected_entries", "fragment_problems", "replica_problems", "CheckResult",
           "claim_overreplicated", "owned_entries"]


class CheckResult:
    """What one check of one ledger found."""

    __slots__ = ("ledger_id", "missing", "unreachable")

    def __init__(self, ledger_id: int):
        self.ledger_id = ledger_id
        self.missing: dict[str, list[int]] = {}      # bookie -> entries it lacks
        self.unreachable: dict[str, str] = {}         # bookie -> why it could not be asked

    @property
    def ok(self) -> bool:
        return not self.missing and not self.unreachable

    def __repr__(self):
        return (f"CheckResult({self.ledger_id}, missing={self.missing}, "
                f"unreachable={self.unreachable})")


def expected_entries(md, last: int | None = None) -> dict[str, list[tuple[int, int, int]]]:
    """``{bookie: [(fragment index, first, last) ...]}``: per bookie, the id range
    of each fragment it belongs to (entries of that range whose write set holds
    the bookie are its own). Open ledgers: the last fragment up to ``last`` only
    (left out when ``last`` is None)."""
    out: dict[str, list] = {}
    for i, (_, ens) in enumerate(md.ensembles):
        lo, hi = md.fragment_bounds(i, last)
        if hi is None or hi < lo:
            continue
        for b in ens:
            out.setdefault(b, []).append((i, lo, hi))
    return out


def owned_entries(md, bookie: str, lo: int, hi: int) -> list[int]:
    """Entry ids of [lo, hi] whose write set holds ``bookie``."""
    ens = md.ensemble_for(lo)
    n, qw = len(ens), md.write_quorum_size
    idx = ens.index(bookie)
    # write_set(e) = ens[(e + k) % n] for k < qw: bookie idx holds e iff
    # (idx - e) % n < qw.
    return [e for e in range(lo, hi + 1) if (idx - e) % n < qw]


def fragment_problems(pool, md, last: int | None = None) -> CheckResult:
    """Read, on each bookie of each fragment, the first and the last entry of
    the fragment it should hold; those it answers "no such entry/ledger" for
    are missing."""
    res = CheckResult(md.ledger_id)
    lid = md.ledger_id
    for bookie, frags in sorted(expected_entries(md, last).items()):
        probes = []
        for _, lo, hi in frags:
            mine = owned_entries(md, bookie, lo, hi)
            if mine:
                probes.extend({mine[0], mine[-1]})
        if not probes:
            continue
        try:
            rids = pool.rids(bookie, lid, len(probes))
            resps = pool.calls(bookie, lid, [P.read(r, lid, e) for r, e in zip(rids, probes)])
        except BKError as e:
            res.unreachable[bookie] = str(e)
            continue
        lacks = sorted(e for e, r in zip(probes, resps) if r[2] in (ENOENTRY, ENOLEDGER))
        if lacks:
            res.missing[bookie] = lacks
    return res


def replica_problems(pool, md, last: int | None = None) -> CheckResult:
    """Ask every bookie of the ledger for the list of its entries and compare it
    with the write sets."""
    res = CheckResult(md.ledger_id)
    lid = md.ledger_id
    for bookie, frags in sorted(expected_entries(md, last).items()):
        try:
            r = pool.call(bookie, lid, P.get_list_of_entries, lid)
        except BKError as e:
            res.unreachable[bookie] = str(e)
            continue
        if r[2] == EOK:
            have = P.ranges_to_ids(r[4]) if r[4] else []
        elif r[2] == ENOLEDGER:
            have = []
        else:
            res.unreachable[bookie] = f"GET_LIST_OF_ENTRIES answered status {r[2]}"
            continue
        have = set(have)
        lacks = [e for _, lo, hi in frags for e in owned_entries(md, bookie, lo, hi)
                 if e not in have]
        if lacks:
            res.missing[bookie] = lacks
    return res


def claim_overreplicated(store, pool, bookie_id: str, ledger_ids, ttl: int = 10,
                         stats: dict | None = None, stop=None):
    """The ledgers among ``ledger_ids`` (held by ``bookie_id``) that it may drop,
    each with its under-replication lock held: closed, ``bookie_id`` in none of
    their ensembles, not marked under-replicated, and every bookie of every write
    set answering that it holds its entries. The caller drops them, then
    releases the locks (a replication worker copying one of them back to
    ``bookie_id`` holds the same lock, so the two never overlap). ``stats`` gets
    ``candidates`` (ledgers it no longer belongs to) and ``claimed``.

    ``stop`` (a callable), when it answers true before a candidate, ends the scan
    there (``stats["stopped"]``) with what is claimed so far: a bookie that
    stops waits for one candidate's check, not for every candidate's."""
    local = set(ledger_ids)
    marked = {lid for lid, _, _ in UR.list_marked(store)}
    # Only the metadata of the ledgers the bookie holds, a group of ids per request:
    # the cost follows what this bookie holds, not the cluster's size.
    candidates = [md.ledger_id for md, _ in store.read_ledgers(local)
                  if md.ledger_id not in marked and md.is_closed
                  and not any(bookie_id in ens for _, ens in md.ensembles)]
    claimed = []
    if stats is not None:
        stats["candidates"] = len(candidates)
    for lid in candidates:
        if stop is not None and stop():
            if stats is not None:
                stats["stopped"] = True
            break
        lock = LeaseLock(store, UR.lock_rel(lid), {"owner": bookie_id, "gc": True}, ttl=ttl)
        if not lock.try_acquire():
            continue                    # a worker is repairing it: not now
        keep = False
        try:
            md, _ = store.read_ledger(lid)
            rec, _ = store.get_json(UR.ledger_rel(lid))
            if (rec is None and md.is_closed
                    and not any(bookie_id in ens for _, ens in md.ensembles)
                    and replica_problems(pool, md).ok):
                keep = True
        except NoSuchLedgerError:
            pass                        # deleted: the ordinary GC drops it
        except BKError:
            pass                        # cannot tell now: keep the copy, retry next scan
        finally:
            if keep:
                claimed.append((lid, lock))
            else:
                lock.release()
    if stats is not None:
        stats["claimed"] = len(claimed)
    return claimed
