"""Auto-recovery on etcd: an elected auditor marks the ledgers of lost bookies
under-replicated; replication workers re-replicate them.

Theory of operation
-------------------
Every auto-recovery process (a bookie with ``autoRecoveryDaemonEnabled=true``,
or ``bookie autorecovery``) runs two threads:

* **Auditor candidate**. It campaigns for the ``auditor`` key
  (:class:`bk.meta.recipes.Election`, bound to its lease); the winner's epoch
  (the key's create_revision) guards every record it writes, so a deposed
  auditor (paused, partitioned) writes nothing. The leader compares the bookies
  the cluster knows (their cookies) with those registered, writable or
  read-only (a read-only bookie is not lost). A bookie missing for
  ``lostBookieRecoveryDelay`` seconds (at once when more than one is missing;
  a bookie back before that is forgotten) is *lost*: every ledger with a
  fragment on it is marked under ``underreplication/ledgers/<id>`` with the
  lost bookies (:mod:`bk.meta.underreplication`). ``bkshell triggeraudit``
  skips the delay. Another candidate takes over within the lease TTL when the
  leader dies.
* **Replication worker**. It walks the marked ledgers; for each it takes the
  ledger's LeaseLock (so two workers never repair one ledger at once), and for
  each missing bookie copies that bookie's entries of each fragment from a
  surviving replica to a writable bookie outside the fragment's ensemble and
  CASes the fragment's ensemble (:meth:`bk.admin.Admin.replicate_ledger`);
  every metadata CAS also compares the lock's token, so a worker paused past
  its lease changes nothing. Then it removes the record (only if nobody marked
  the ledger again meanwhile). A ledger still open whose *last* ensemble holds
  a lost bookie waits ``openLedgerRereplicationGracePeriod`` ms (an active
  writer replaces the bookie itself by ensemble change), then is recovery-opened
  (fenced and closed) and repaired. A deleted ledger is unmarked. A ledger that
  cannot be repaired now (no surviving replica, too few bookies) gets its
  reason and a retry time (``lockReleaseOfFailedLedgerGracePeriod`` ms) in its
  record and is skipped until then: no tight loop.

``bkshell autorecovery --disable`` pauses both (the ``autorecovery`` key).
"""

from __future__ import annotations

import logging
import threading
import time

from bk.errors import BKError, LockLostError, NoSuchLedgerError
from bk.meta import underreplication as UR
from bk.meta.recipes import Election, LeaseLock

log = logging.getLogger("bk.autorecovery")


class AutoRecovery:
    """The auditor candidate and the replication worker of one process."""

    def __init__(self, conf, identifier: str, metrics=None):
        self.conf = conf
        self.identifier = identifier
        self.metrics = metrics      # bk.metrics.BookieMetrics: the auditor reports there
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._admin = None

    # --- life cycle ---------------------------------------------------------------------
    def start(self) -> "AutoRecovery":
        from bk.admin import Admin

        self._admin = Admin(self.conf.metadataServiceUri,
                            timeout=self.conf.metadataTimeoutMillis / 1000.0)
        if self.metrics is not None:
            self.metrics.auditor = 0
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
        for t in self._threads:
            t.join(timeout)
        if self._admin is not None:
            self._admin.close()
            self._admin = None

    @property
    def store(self):
        return self._admin.store

    def _guarded(self, target):
        while not self._stop.is_set():
            try:
                target()
                return
            except Exception:        # keep the daemon alive: log, back off, go on
                log.exception("auto-recovery %s failed; retrying", target.__name__)
                self._stop.wait(1.0)

    def _enabled(self) -> bool:
        return UR.settings(self.store).get("enabled", True) is not False

    # --- auditor ------------------------------------------------------------------------
    def _auditor_loop(self):
        election = Election(self.store, UR.AUDITOR, self.identifier,
                            ttl=max(1, int(self.conf.registrationTtlSeconds)))
        while not self._stop.is_set():
            if not election.campaign(timeout=1.0):
                continue
            log.info("%s is the auditor (epoch %d)", self.identifier, election.epoch)
            if self.metrics is not None:
                self.metrics.auditor = 1
            try:
                self._lead(election)
            except LockLostError as e:
                log.warning("auditor %s deposed: %s", self.identifier, e)
            finally:
                election.resign()
                if self.metrics is not None:
                    self.metrics.under_replicated = None     # only the auditor reports
                    self.metrics.auditor = 0

    def _lead(self, election):
        store = self.store
        missing_since: dict[str, float] = {}
        audited: set[str] = set()
        trigger = UR.settings(store).get("trigger", 0)
        next_count = 0.0
        while not self._stop.wait(0.25) and election.is_leader:
            if self.metrics is not None and time.monotonic() >= next_count:
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
            if due - audited or (triggered and due):
                self._audit(due, election)
                audited |= due

    def _audit(self, lost: set, election):
        store = self.store
        marked = 0
        for md, _version in store.list_ledger_metadata():
            on = sorted(b for b in lost if any(b in ens for _, ens in md.ensembles))
            if on and UR.mark(store, md.ledger_id, on, guards=[election.lock.guard()]):
                marked += 1
        log.warning("auditor: bookies %s lost; %d ledgers marked under-replicated",
                    ", ".join(sorted(lost)), marked)

    # --- replication worker ----------------------------------------------------------------
    def _worker_loop(self):
        backoff = self.conf.rwRereplicateBackoffMs / 1000.0
        while not self._stop.is_set():
            busy = False
            if self._enabled():
                for lid, rec, version in list(UR.list_marked(self.store)):
                    if self._stop.is_set():
                        return
                    if rec.get("retryAt", 0) > time.time():
                        continue
                    busy |= self._take(lid, rec, version)
            self._stop.wait(0.05 if busy else min(backoff, 0.5))

    def _take(self, lid: int, rec: dict, version: int) -> bool:
        lock = LeaseLock(self.store, UR.lock_rel(lid), {"owner": self.identifier},
                         ttl=max(1, int(self.conf.registrationTtlSeconds)))
        if not lock.try_acquire():
            return False              # another worker repairs it
        try:
            self._replicate(lid, rec, version, lock)
        finally:
            lock.release()
        return True

    def _replicate(self, lid: int, rec: dict, version: int, lock):
        store = self.store
        try:
            md, _ = store.read_ledger(lid)
        except NoSuchLedgerError:
            UR.unmark(store, lid, version)        # deleted: nothing to repair
            return
        missing = [b for b in rec.get("missing", ()) if any(b in e for _, e in md.ensembles)]
        if not missing:
            UR.unmark(store, lid, version)
            return
        if not md.is_closed and any(b in md.last_ensemble for b in missing):
            grace = self.conf.openLedgerRereplicationGracePeriod / 1000.0
            if time.time() - rec.get("ctime", 0) < grace:
                return                        # an active writer replaces it itself
        try:
            for b in missing:
                report = self._admin.replicate_ledger(lid, b, guards=[lock.guard()])
                if self.metrics is not None:
                    self.metrics.replicated_entries += report.entries_copied
                    self.metrics.replicated_bytes += sum(f.bytes_copied
                                                         for f in report.fragments)
        except NoSuchLedgerError:
            UR.unmark(store, lid, version)
            return
        except LockLostError:
            raise
        except BKError as e:
            retry = self.conf.lockReleaseOfFailedLedgerGracePeriod / 1000.0
            log.warning("replication of ledger %d failed (retry in %.0fs): %s", lid, retry, e)
            UR.record_failure(store, lid, version, str(e), retry, guards=[lock.guard()])
            return
        UR.unmark(store, lid, version)
        log.info("ledger %d re-replicated (lost bookies %s)", lid, ", ".join(missing))
