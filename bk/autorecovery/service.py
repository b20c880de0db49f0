"""The auto-recovery of one process (a bookie hosting it, or ``bookie autorecovery``):
an auditor candidate and a replication worker; the theory of operation is the
package's (:mod:`bk.autorecovery`)."""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from bk.autorecovery import checker
from bk.autorecovery.replicator import Replicator
from bk.client.placement import PlacementPolicy
from bk.errors import BKError, LockLostError, MetadataError, NoSuchLedgerError
from bk.meta import underreplication as UR
from bk.meta.recipes import Election, LeaseLock
from bk.meta.store import MetadataStore
from bk.metrics import AutoRecoveryMetrics
from bk.rawclient import BookiePool
from bk.security import ClientSecurity, client_settings
from bk.security.etcd import EtcdCredentials

log = logging.getLogger("bk.autorecovery")

# The longest the auditor or a worker sleeps without a watch waking it (a safety
# net: a watch being re-created after an etcd restart wakes them anyway).
IDLE_LOOK = 5.0
# How often an audit of lost bookies reads the registrations again while it marks
# their ledgers (one etcd range request), to stop marking for one that came back.
AUDIT_RECHECK = 1.0


class AutoRecovery:
    """The auditor candidate and the replication worker of one process."""

    def __init__(self, conf, identifier: str, metrics: AutoRecoveryMetrics | None = None):
        self.conf = conf
        self.identifier = identifier
        self.metrics = metrics if metrics is not None else AutoRecoveryMetrics()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.store: MetadataStore | None = None
        self._pool: BookiePool | None = None
        self._replicator: Replicator | None = None
        self._not_before: dict[int, float] = {}   # open ledgers left to their writer
        # set by etcd watches (see the module doc) and by stop()
        self._wake_auditor = threading.Event()
        self._wake_worker = threading.Event()
        self._cancel_watches: list = []
        # underreplication/candidates/<id> (bk.meta.underreplication): says that this
        # process runs auto-recovery, so that a tool finding no auditor elected at
        # some instant (a hand-over) waits for one (bkshell decommissionbookie)
        self._candidate: LeaseLock | None = None

    # --- life cycle ---------------------------------------------------------------------
    def start(self) -> "AutoRecovery":
        conf = self.conf
        self.store = MetadataStore(conf.metadataServiceUri,
                                   timeout=conf.metadataTimeoutMillis / 1000.0,
                                   credentials=EtcdCredentials.from_conf(conf))
        self.security = ClientSecurity.from_conf(conf)
        self._pool = BookiePool(self.store, security=self.security)
        self._replicator = Replicator(self.store, self._pool, conf.metadataServiceUri,
                                      timeout=conf.metadataTimeoutMillis / 1000.0,
                                      rate_bytes=conf.replicationRateByBytes,
                                      max_frame=conf.nettyMaxFrameSizeBytes,
                                      placement=PlacementPolicy.from_conf(conf),
                                      quarantine_seconds=conf.bookieQuarantineTimeSeconds,
                                      client_settings=client_settings(conf))
        self.metrics.auditor = 0
        both = lambda: (self._wake_auditor.set(), self._wake_worker.set())   # noqa: E731
        for rel, wake in (("bookies/", self._wake_auditor.set),
                          ("cookies/", self._wake_auditor.set),
                          (UR.SETTINGS, both), (UR.LEDGERS, self._wake_worker.set)):
            self._cancel_watches.append(self.store.watch_changes(rel, wake))
        for name, target in (("auditor", self._auditor_loop), ("replication", self._worker_loop)):
            t = threading.Thread(target=self._guarded, args=(target,), daemon=True,
                                 name=f"bk-{name}")
            t.start()
            self._threads.append(t)
        log.info("auto-recovery %s started (auditor candidate + replication worker)",
                 self.identifier)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake_auditor.set()
        self._wake_worker.set()
        for cancel in self._cancel_watches:
            cancel()
        self._cancel_watches = []
        for t in self._threads:
            t.join(timeout)
        if self._candidate is not None:
            self._candidate.release()
        if self._replicator is not None:
            self._replicator.close()
            self._pool.close()
            self.store.close()
            self._replicator = self._pool = self.store = None

    def _guarded(self, target):
        while not self._stop.is_set():
            try:
                target()
                return
            except MetadataError as e:
                # etcd unreachable or slow (a partition, an election): part of running,
                # one line as the compactor and the registration say it; a trace (and
                # ERROR) is for what nobody expected
                log.warning("auto-recovery %s: %s; retrying", target.__name__, e)
                self._stop.wait(1.0)
            except Exception:        # keep the daemon alive: log, back off, go on
                log.exception("auto-recovery %s failed; retrying", target.__name__)
                self._stop.wait(1.0)

    def _enabled(self) -> bool:
        return UR.settings(self.store).get("enabled", True) is not False

    # --- auditor ------------------------------------------------------------------------
    def _auditor_loop(self):
        ttl = max(1, int(self.conf.registrationTtlSeconds))
        election = Election(self.store, UR.AUDITOR, self.identifier, ttl=ttl)
        if self._candidate is None:         # (the loop may be run again after an error)
            self._candidate = LeaseLock(self.store, UR.CANDIDATES + self.identifier,
                                        {"id": self.identifier, "since": time.time()}, ttl)
        while not self._stop.is_set():
            if not self._candidate.held:
                # (a restarted bookie finds its former key until that lease expires;
                # a key whose lease expired under us, in an etcd outage, is taken anew)
                try:
                    if self._candidate.token is not None:
                        self._candidate.release()
                    self._candidate.try_acquire()
                except MetadataError as e:
                    log.debug("cannot register as an auto-recovery candidate: %s", e)
            if not election.campaign(timeout=1.0):
                continue
            log.info("%s is the auditor (epoch %d)", self.identifier, election.epoch)
            self.metrics.auditor = 1
            try:
                self._lead(election)
            except LockLostError as e:
                log.warning("auditor %s deposed: %s", self.identifier, e)
            finally:
                election.resign()
                self.metrics.under_replicated = None     # only the auditor reports
                self.metrics.not_adhering = None
                self.metrics.auditor = 0

    def _lead(self, election):
        checks = threading.Thread(target=self._guarded_checks, args=(election,), daemon=True,
                                  name="bk-auditor-checks")
        checks.start()
        try:
            self._watch_bookies(election)
        finally:
            checks.join(10.0)

    def _watch_bookies(self, election):
        store = self.store
        missing_since: dict[str, float] = {}
        audited: set[str] = set()
        trigger = UR.settings(store).get("trigger", 0)
        next_count = 0.0
        bookie_check = self.conf.auditorPeriodicBookieCheckInterval
        next_bookie_check = time.monotonic() + bookie_check
        wake = self._wake_auditor
        due_at = time.monotonic()
        while not self._stop.is_set() and election.is_leader:
            # until a watch fires, a deadline of ours comes, or IDLE_LOOK at most
            wake.wait(max(0.0, min(IDLE_LOOK, due_at - time.monotonic())))
            wake.clear()
            if self._stop.is_set() or not election.is_leader:
                break
            if time.monotonic() >= next_count:
                next_count = time.monotonic() + 5.0
                ctimes = [rec.get("ctime", 0) for _, rec, _ in UR.list_marked(store)]
                self.metrics.under_replicated = len(ctimes)
                self.metrics.under_replicated_age = \
                    max(0.0, time.time() - min(ctimes)) if ctimes else 0.0
            s = UR.settings(store)
            if s.get("enabled", True) is False:
                continue
            known = {rel.split("/", 1)[1] for rel, _, _ in store.list_json("cookies/")}
            (writable, readonly), _ = store._bookie_sets()
            lost = known - writable - readonly
            now = time.monotonic()
            for b in list(missing_since):
                if b not in lost:               # back within the delay: nothing to do
                    del missing_since[b]
                    audited.discard(b)
            for b in lost:
                missing_since.setdefault(b, now)
            delay = s.get("lostBookieRecoveryDelay")
            if delay is None:
                delay = self.conf.lostBookieRecoveryDelay
            triggered = s.get("trigger", 0) != trigger
            trigger = s.get("trigger", 0)
            due = {b for b, t in missing_since.items()
                   if triggered or len(missing_since) > 1 or now - t >= delay}
            periodic = bookie_check > 0 and now >= next_bookie_check
            if periodic:
                next_bookie_check = now + bookie_check
            # the next look: the metrics refresh, a missing bookie's delay, the check
            due_at = min([next_count] + [t + delay for b, t in missing_since.items()
                                         if b not in due]
                         + ([next_bookie_check] if bookie_check > 0 else []))
            marked = None
            if due - audited or (triggered and due) or (periodic and due):
                marked = self._audit(due, election)
                audited |= due
            if periodic:
                # kept like the other periodic checks' runs (bkshell autorecovery),
                # so an operator sees the check run on its period, lost bookies or not
                UR.record_check(store, "bookies", {
                    "at": time.time(), "lost": sorted(lost), "audited": sorted(due),
                    "marked": marked or 0, "by": self.identifier},
                    guards=[election.lock.guard()])

    def _audit(self, lost: set, election) -> int:
        """Mark every ledger with a fragment on a bookie of ``lost``; how many marks
        changed."""
        store = self.store
        lost = set(lost)
        audited = sorted(lost)
        back: set = set()
        marked = 0
        look = time.monotonic() + AUDIT_RECHECK
        for md, _version in store.list_ledger_metadata():
            if time.monotonic() >= look:
                # A bookie registered again while the audit ran came back with its
                # disk: the rest of its ledgers are not marked for it (its delay
                # would have been cancelled). An audit of thousands of ledgers takes
                # tens of seconds on a busy etcd: a soak's ended 25 s after the bookie
                # was back, having marked 994 ledgers, each then checked in place.
                look = time.monotonic() + AUDIT_RECHECK
                (writable, readonly), _ = store._bookie_sets()
                back |= lost & (writable | readonly)
                lost -= back
                if not lost:
                    break
            on = sorted(b for b in lost if any(b in ens for _, ens in md.ensembles))
            if on and UR.mark(store, md.ledger_id, on, guards=[election.lock.guard()]):
                marked += 1
        log.warning("auditor: bookies %s lost; %d ledgers marked under-replicated%s",
                    ", ".join(audited), marked,
                    f" (back before the audit ended, so marked no further: "
                    f"{', '.join(sorted(back))})" if back else "")
        return marked

    # --- periodic checks (while leading) --------------------------------------------------
    def _guarded_checks(self, election):
        while not self._stop.is_set() and election.is_leader:
            try:
                self._checks_loop(election)
                return
            except LockLostError:
                return
            except MetadataError as e:
                log.warning("auditor periodic checks: %s; retrying in 10 s", e)
                self._stop.wait(10.0)
            except Exception:
                log.exception("auditor periodic checks failed; retrying in 10 s")
                self._stop.wait(10.0)

    def _checks_loop(self, election):
        """Run each periodic check when its interval has passed since its last run
        (kept in etcd, so a new auditor does not start them all over)."""
        kinds = (("ledgers", self.conf.auditorPeriodicCheckInterval, checker.fragment_problems,
                  False),
                 ("replicas", self.conf.auditorReplicasCheckInterval, checker.replica_problems,
                  True))
        while not self._stop.wait(0.5) and election.is_leader:
            if not self._enabled():
                continue
            done, _ = self.store.get_json(UR.CHECKS)
            done = done if isinstance(done, dict) else {}
            for name, interval, fn, closed_only in kinds:
                if interval <= 0 or self._stop.is_set() or not election.is_leader:
                    continue
                last = done.get(name) or {}
                if time.time() - last.get("at", 0) < interval:
                    continue
                self._run_check(election, name, fn, closed_only)
            interval = self.conf.auditorPeriodicPlacementPolicyCheckInterval
            if interval > 0 and election.is_leader and \
                    time.time() - (done.get("placement") or {}).get("at", 0) >= interval:
                self._placement_check(election)

    def _placement_check(self, election):
        """Count the ledgers whose write quorums do not span the racks the placement
        policy asks (reported, not marked: re-replicating a healthy copy elsewhere
        is the operator's call, bkshell placementcheck lists them)."""
        t0 = time.time()
        rows = self._replicator.placement_check()
        n = len({r["ledger"] for r in rows})
        self.metrics.not_adhering = n
        record = {"at": time.time(), "started": t0, "seconds": round(time.time() - t0, 3),
                  "not_adhering": n, "by": self.identifier}
        UR.record_check(self.store, "placement", record, guards=[election.lock.guard()])
        if n:
            log.warning("auditor placement check: %d ledgers do not adhere to the "
                        "placement policy (bkshell placementcheck lists them)", n)

    def _run_check(self, election, name, fn, closed_only):
        store = self.store
        t0 = time.time()
        pools: dict[int, BookiePool] = {}
        lock = threading.Lock()

        def one(md):
            if self._stop.is_set() or not election.is_leader:
                return None
            tid = threading.get_ident()
            with lock:
                pool = pools.get(tid)
                if pool is None:
                    pool = pools[tid] = BookiePool(store, timeout=10.0,
                                                   security=self.security)
            return fn(pool, md)

        (writable, readonly), _ = store._bookie_sets()
        registered = writable | readonly
        marked = set(lid for lid, _, _ in UR.list_marked(store))
        n = found = 0
        window = self.conf.auditorMaxNumberOfConcurrentOpenLedgerOperations
        try:
            with ThreadPoolExecutor(max_workers=window,
                                    thread_name_prefix=f"bk-check-{name}") as ex:
                batch = []

                def drain():
                    nonlocal found
                    for (_md, version), res in zip(batch, ex.map(one, [m for m, _ in batch])):
                        if res is None:
                            continue
                        # Only bookies that answered "I lack it" and are registered: a
                        # lost one is the lost-bookie audit's.
                        bad = sorted(b for b in res.missing if b in registered)
                        if bad and self._still_as_listed(res.ledger_id, version) and \
                                UR.mark(store, res.ledger_id, bad,
                                        guards=[election.lock.guard()]):
                            found += 1
                            log.warning("auditor %s check: ledger %d lacks entries on %s "
                                        "(e.g. %s); marked", name, res.ledger_id,
                                        ", ".join(bad), res.missing[bad[0]][:5])
                    batch.clear()

                for md, version in store.list_ledger_metadata():
                    if self._stop.is_set() or not election.is_leader:
                        return
                    if md.ledger_id in marked or (closed_only and not md.is_closed):
                        continue
                    batch.append((md, version))
                    n += 1
                    if len(batch) >= window * 4:
                        drain()
                drain()
        finally:
            for p in pools.values():
                p.close()
        record = {"at": time.time(), "started": t0, "seconds": round(time.time() - t0, 3),
                  "ledgers": n, "marked": found, "by": self.identifier}
        UR.record_check(store, name, record, guards=[election.lock.guard()])
        log.info("auditor %s check: %d ledgers in %.1fs, %d marked", name, n,
                 record["seconds"], found)

    def _still_as_listed(self, ledger_id: int, version: int) -> bool:
        """Whether the ledger's metadata is still at the version the check listed
        and judged. A ledger deleted since lacks its entries on every bookie whose
        GC dropped it, and one changed since (a repair swapped a bookie in, a
        recovery closed it) may lack them on a bookie that no longer has to hold
        them: marking it would be a false alarm (a soak deleting small ledgers saw
        24 deleted ledgers marked "lacks entries", 2026-11-28). The next check
        judges the metadata as it is then."""
        try:
            _, now = self.store.read_ledger(ledger_id)
        except NoSuchLedgerError:
            return False
        return now == version

    # --- replication worker ----------------------------------------------------------------
    def _worker_loop(self):
        backoff = self.conf.rwRereplicateBackoffMs / 1000.0
        wake = self._wake_worker
        while not self._stop.is_set():
            wake.clear()
            busy = False
            next_due = time.time() + IDLE_LOOK
            if self._enabled():
                now = time.time()
                # each worker walks the marks in an order of its own: in ledger-id
                # order every worker raced for the same lock, ledger after ledger,
                # and the losers often took the lock just after the winner's repair
                # (hunt15's 6-bookie soak: 1,656 steps that found nothing left to do)
                marked = list(UR.list_marked(self.store))
                random.shuffle(marked)
                for lid, rec, version in marked:
                    if self._stop.is_set():
                        return
                    later = max(rec.get("retryAt", 0), self._not_before.get(lid, 0))
                    if later > now:
                        next_due = min(next_due, later)
                        continue
                    try:
                        done = self._take(lid, rec, version)
                    except LockLostError as e:
                        log.warning("replication of ledger %d abandoned: %s", lid, e)
                        continue
                    busy |= done
                    if not done:       # left to its writer, or locked by another worker
                        nb = self._not_before.get(lid)
                        next_due = min(next_due, nb if nb else time.time() + min(backoff, 0.5))
            if busy:
                self._stop.wait(0.05)
            else:        # a watch wakes us on new marks and switches; else the next due
                wake.wait(max(0.0, min(IDLE_LOOK, next_due - time.time())))

    def _take(self, lid: int, rec: dict, version: int) -> bool:
        """Repair one marked ledger under its lock; True if work was done."""
        store = self.store
        try:
            md, _ = store.read_ledger(lid)
        except NoSuchLedgerError:
            UR.unmark(store, lid, version)        # deleted: nothing to repair
            log.info("ledger %d was deleted; its mark is removed", lid)
            return True
        (writable, _readonly), _ = store._bookie_sets()
        missing = [b for b in rec.get("missing", ()) if any(b in e for _, e in md.ensembles)]
        # An open ledger whose last ensemble lost a bookie belongs to its writer for
        # the grace period (an active writer replaces the bookie by ensemble change,
        # after which only closed fragments need copying); then it is fenced and closed.
        if (not md.is_closed and
                any(b in md.last_ensemble and b not in writable for b in missing)):
            until = rec.get("ctime", 0) + self.conf.openLedgerRereplicationGracePeriod / 1000.0
            if time.time() < until:
                self._not_before[lid] = until
                return False
        self._not_before.pop(lid, None)
        lock = LeaseLock(store, UR.lock_rel(lid), {"owner": self.identifier},
                         ttl=max(1, int(self.conf.registrationTtlSeconds)))
        if not lock.try_acquire():
            return False              # another worker repairs it
        try:
            self._replicate(lid, rec, version, lock, writable)
        finally:
            lock.release()
        return True

    def _replicate(self, lid: int, rec: dict, version: int, lock, writable: set):
        store = self.store
        replicator = self._replicator
        # Every way out of a step under the lock names the ledger in the log: a worker
        # paused past its lease (the lock taken, the ledger not read yet) and resumed
        # after another repaired the ledger otherwise ended its step without a word.
        #
        # Under the lock, the mark as it is now: the listing the loop walks can be
        # seconds old, and another worker may have repaired the ledger since. A repair
        # in place leaves the ensembles as they were, so the metadata cannot tell;
        # every worker whose listing held the old mark repaired the ledger again and
        # then failed to unmark the old version (a 6-bookie soak after a partition:
        # 2,906 such repeats for 1,216 repairs, the marks emptied in 57 s).
        cur, cur_version = UR.marked(store, lid)
        if cur is None:
            log.info("ledger %d: nothing left to repair for %s (repaired meanwhile)", lid,
                     self.identifier)
            return
        if cur_version != version:
            rec, version = cur, cur_version
            if rec.get("retryAt", 0) > time.time():
                log.info("ledger %d: a repair failed meanwhile; %s leaves it to its "
                         "back-off", lid, self.identifier)
                return
        try:
            md, _ = store.read_ledger(lid)     # under the lock: what we repair is current
        except NoSuchLedgerError:
            UR.unmark(store, lid, version)
            log.info("ledger %d was deleted; its mark is removed", lid)
            return
        missing = [b for b in rec.get("missing", ()) if any(b in e for _, e in md.ensembles)]
        if not missing:                     # repaired meanwhile (by another worker)
            UR.unmark(store, lid, version)
            log.info("ledger %d: nothing left to repair for %s (repaired meanwhile)", lid,
                     self.identifier)
            return
        try:
            for b in missing:
                if not lock.held:
                    raise LockLostError(f"lock {lock.rel} lost")
                if b in writable:
                    # Registered and writable: it lost entries, not its place (a
                    # periodic check found it, or it came back after being marked).
                    # Copy back what it lacks; the ensembles stay as they are.
                    report = replicator.repair_in_place(lid, b)
                else:
                    report = replicator.replicate_ledger(lid, b, guards=[lock.guard()])
                self._count(report)
        except NoSuchLedgerError:
            UR.unmark(store, lid, version)
            log.info("ledger %d was deleted while %s repaired it; its mark is removed", lid,
                     self.identifier)
            return
        except (LockLostError, MetadataError) as e:
            # the loop logs the cause and retries; the ledger is named here
            log.warning("replication of ledger %d stopped: %s", lid, e)
            raise
        except BKError as e:
            retry = self.conf.lockReleaseOfFailedLedgerGracePeriod / 1000.0
            log.warning("replication of ledger %d failed (retry in %.0fs): %s", lid, retry, e)
            UR.record_failure(store, lid, version, str(e), retry, guards=[lock.guard()])
            return
        if UR.unmark(store, lid, version):
            log.info("ledger %d re-replicated by %s (bookies %s)", lid, self.identifier,
                     ", ".join(missing))
        else:
            log.info("ledger %d: its record changed while %s repaired it; looked at again",
                     lid, self.identifier)

    def _count(self, report):
        self.metrics.replicated_entries += report.entries_copied
        self.metrics.replicated_bytes += sum(f.bytes_copied for f in report.fragments)
