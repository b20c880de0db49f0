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
  lost bookies (:mod:`bk.meta.underreplication`); a bookie that registers again
  while that audit runs gets no more marks (the audit reads the registrations
  again every second). ``bkshell triggeraudit``
  skips the delay; every ``auditorPeriodicBookieCheckInterval`` the lost
  bookies are audited again (each such check kept in
  ``underreplication/checks`` as ``bookies``). Another candidate takes over within the lease TTL
  when the leader dies (within ~0.5 s, a look interval, when it stops
  cleanly). Each candidate also keeps ``underreplication/candidates/<id>``
  bound to a lease of its own: a tool that finds no auditor at some instant
  (``bkshell decommissionbookie``) knows from it whether one is coming.
* **Periodic checks** (a thread of the leader, :mod:`bk.autorecovery.checker`).
  Every ``auditorPeriodicCheckInterval`` the first and last entry each bookie
  of each fragment should hold are read on it; every
  ``auditorReplicasCheckInterval`` every bookie of each closed ledger lists its
  entries (GET_LIST_OF_ENTRIES) and the lists are compared with the write sets.
  A *registered* bookie that answers without an entry gets the ledger marked
  with it (an unreachable one is left to the lost-bookie audit), if the
  ledger's metadata is still at the version listed: one deleted or changed
  since (its bookies GC'd it, a repair replaced one) is the next check's. At most
  ``auditorMaxNumberOfConcurrentOpenLedgerOperations`` ledgers are examined at
  once, the metadata is read in pages, and when each check last finished is
  kept in ``underreplication/checks``, so a new auditor does not redo a check
  that is not due.
* **Replication worker**. It walks the marked ledgers; for each it takes the
  ledger's LeaseLock (so two workers never repair one ledger at once), reads
  the mark again under it (the walk's listing can be old: a ledger another
  worker repaired since is left alone, one marked again is repaired for its
  current record), and for each missing bookie copies that bookie's entries of each fragment from a
  surviving replica to a writable bookie outside the fragment's ensemble and
  CASes the fragment's ensemble
  (:meth:`~bk.autorecovery.replicator.Replicator.replicate_ledger`);
  every metadata CAS also compares the lock's token, so a worker paused past
  its lease changes nothing (a recovery-open's first CAS, to IN_RECOVERY, comes
  before any fence). A marked bookie that is registered and writable lost
  entries, not its place: what it lacks is copied back to it
  (:meth:`~bk.autorecovery.replicator.Replicator.repair_in_place`), the
  ensembles unchanged. Copies are paced to ``replicationRateByBytes``. Then the worker removes the record (only
  if nobody marked the ledger again meanwhile). However a step under the lock
  ends (repaired, found repaired meanwhile by another, deleted, stopped, failed),
  the worker's log names the ledger. A ledger still open whose
  *last* ensemble holds a lost bookie is left to its writer for
  ``openLedgerRereplicationGracePeriod`` ms from the mark (an active writer
  replaces the bookie itself by ensemble change, after which only complete
  fragments need copying; the worker does not even take the lock meanwhile),
  then is recovery-opened (fenced and closed) and repaired. A deleted ledger is
  unmarked. A ledger that cannot be repaired now (no surviving replica, too few
  bookies) gets its reason and a retry time
  (``lockReleaseOfFailedLedgerGracePeriod`` ms) in its record and is skipped
  until then: no tight loop.

``bkshell autorecovery --disable`` pauses both (the ``autorecovery`` key).

Idle cost: nothing here polls etcd at a short interval. The auditor and the
worker sleep until an etcd watch wakes them (bookies registering or leaving,
cookies, marks, the ``autorecovery`` switches), until a deadline of their own
comes (a lost bookie's delay, a retry time, a periodic check), or at the
latest every ``IDLE_LOOK`` seconds, so a quiet cluster costs etcd a few reads
per process per ``IDLE_LOOK`` however many ledgers it holds.

Modules: :mod:`~bk.autorecovery.service` (:class:`AutoRecovery`, the two threads of
one process), :mod:`~bk.autorecovery.replicator` (the fragment copy engine),
:mod:`~bk.autorecovery.checker` (periodic checks), :mod:`~bk.autorecovery.status`
and :mod:`~bk.autorecovery.daemon`. This package module imports none of them: a
bookie that does not host auto-recovery loads only the light checker and status
modules, not the client stack the replicator needs.
"""
