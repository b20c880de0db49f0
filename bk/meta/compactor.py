"""Compaction of etcd's history by one elected component per cluster.

Theory of operation
-------------------
etcd keeps every revision of every key until someone compacts: each ledger
create, close, ensemble change, mark and delete stays in its db forever, and a
cluster that creates ten ledgers a second fills etcd's 2 GiB default quota in
about two days (then etcd raises NOSPACE and refuses every write). bk made that
history, so bk compacts it, as the Kubernetes API server does for its own
(``--etcd-compaction-interval``, 5 minutes):

* Every bookie runs a :class:`Compactor` candidate; one wins the
  :class:`~bk.meta.recipes.Election` on ``compactor`` (a key bound to its
  lease). The others wait, looking every half TTL; one of them takes over
  within one and a half TTLs when the leader dies.
* Every ``metadataCompactionIntervalSeconds`` the leader reads etcd's
  current revision and compacts to the revision it read one interval earlier,
  so at least one interval of history always stays: a watch or a paged read at
  one revision (GC's reconcile, a listing) that started less than an interval
  ago is never cut short, and a watcher that fell further behind learns it
  (etcd answers "compacted") and resynchronises.
* The revision to compact to next is kept in ``compaction`` in etcd, written
  by a transaction that compares the leader's epoch (a deposed, paused leader
  writes nothing and so compacts nothing); a new leader continues from it
  instead of starting over.
* Only the leader exports the compaction metrics (its count and etcd's db
  size, read when it wins and after each compaction). A leader that resigns,
  or whose lease its keep-alive finds expired (it was paused or cut off past
  its TTL, and another may lead), stops exporting them at once, not at its
  next turn an interval later, so that a scrape never sees a deposed leader's
  last db size beside the new leader's.

Compaction only marks old revisions free inside etcd's db file; the file gives
the space back only on a defragmentation (``bkshell metacompact --defrag``),
which blocks the member while it runs and is therefore left to operators.
"""

from __future__ import annotations

import logging
import threading
import time

from bk.errors import LockLostError, MetadataError, MetadataVersionError
from bk.meta.recipes import Election

log = logging.getLogger("bk.meta.compactor")

ELECTION = "compactor"        # the election key (relative to the prefix)
RECORD = "compaction"         # {"next": revision, "at": time, "by": id, "compacted": rev}


class Compactor:
    """A candidate for compacting etcd's history every ``interval`` seconds."""

    def __init__(self, store, identifier: str, interval: float, ttl: int = 10, metrics=None):
        if interval <= 0:
            raise ValueError(f"compaction interval must be > 0, not {interval!r}")
        self.store = store
        self.identifier = identifier
        self.interval = float(interval)
        self.ttl = max(1, int(ttl))
        self.metrics = metrics          # bk.metrics.BookieMetrics (compactions, db size)
        self.compactions = 0
        self.last: dict | None = None   # what the last step did
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._election: Election | None = None

    def start(self) -> "Compactor":
        self._thread = threading.Thread(target=self._run, daemon=True, name="bk-compactor")
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    @property
    def is_leader(self) -> bool:
        e = self._election
        return e is not None and e.is_leader

    def _run(self) -> None:
        # One candidate for the thread's life, so that its looks stay paced over the
        # campaign() calls. It looks every half TTL (half the interval if shorter, at
        # least Election.LOOK_EVERY): a compaction every few minutes loses nothing
        # when a new leader comes seconds late, and each waiting bookie's look is an
        # etcd read (docs/performance-log.md, "What etcd's CPU per ledger is made of").
        look = max(Election.LOOK_EVERY, min(self.interval, self.ttl) / 2)
        election = self._election = Election(self.store, ELECTION, self.identifier,
                                             ttl=self.ttl, look_every=look,
                                             on_lost=self._unexport)
        while not self._stop.is_set():
            try:
                if not election.campaign(timeout=1.0):
                    continue
                log.info("%s compacts etcd's history every %gs (epoch %d)", self.identifier,
                         self.interval, election.epoch)
                self._export()
                while not self._stop.is_set() and election.is_leader:
                    wait = self.step(election)
                    self._stop.wait(wait)
            except LockLostError as e:
                log.info("compactor %s deposed: %s", self.identifier, e)
            except MetadataError as e:
                log.warning("compactor %s: %s; retrying", self.identifier, e)
                self._stop.wait(min(self.interval, 5.0))
            except Exception:  # pragma: no cover - the thread must not die silently
                log.exception("compactor %s failed; retrying", self.identifier)
                self._stop.wait(min(self.interval, 5.0))
            finally:
                election.resign()
                self._unexport()        # resigned (stopped, or its write was refused)

    def _export(self) -> None:
        """Export the count and etcd's db size now (a failed status read leaves them
        as they are: the next compaction tries again)."""
        if self.metrics is None:
            return
        try:
            size, in_use = self.store.db_sizes()
        except MetadataError as e:
            log.warning("compactor %s: %s", self.identifier, e)
            return
        self.metrics.metadata_compactions = self.compactions
        self.metrics.metadata_db_size_in_use = in_use
        self.metrics.metadata_db_size = size
        if not self.is_leader:      # lost meanwhile: its on_lost may have run before us
            self._unexport()

    def _unexport(self) -> None:
        """Stop exporting the leader's metrics (the exposition shows them only
        while the db size is set); the count is kept for a later term."""
        if self.metrics is not None:
            self.metrics.metadata_db_size = None
            self.metrics.metadata_db_size_in_use = None

    def step(self, election: Election) -> float:
        """One turn of the leader: compact if an interval has passed since the
        recorded revision was read; returns the seconds until the next turn."""
        store = self.store
        rec, version = store.get_json(RECORD)
        rec = rec if isinstance(rec, dict) else {}
        now = time.time()
        due = rec.get("at", 0) + self.interval
        if rec and now < due:
            return min(self.interval, max(0.05, due - now))
        target = rec.get("next") if isinstance(rec.get("next"), int) else None
        current = store.revision()
        # Fenced by the epoch: a deposed leader's write fails (LockLostError) and it
        # compacts nothing.
        try:
            store.cas_json(RECORD, {"next": current, "at": now, "by": self.identifier,
                                    "compacted": target}, version,
                           guards=[election.lock.guard()])
        except MetadataVersionError:
            return 0.05     # written meanwhile (a leader before us): read it again

        if target:
            store.compact(target)
            self.compactions += 1
            self._export()
            log.info("compacted etcd's history to revision %d (now %d)", target, current)
        self.last = {"at": now, "compacted": target, "next": current}
        return self.interval
