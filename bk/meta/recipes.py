"""Coordination recipes on etcd: a lease-bound lock and a leader election, each
with a fencing token.

Theory of operation
-------------------
A :class:`LeaseLock` is one key under the store's prefix, created only if absent
("create_revision == 0") and bound to a lease that a daemon thread keeps alive
(every ttl/3). Whoever created the key holds the lock; its ``create_revision``
is the holder's *fencing token*: it is unique for the life of the cluster and
grows with every new holder. Releasing deletes the key only if it is still
ours (same create_revision). A holder that stops refreshing (crashed, paused
by SIGSTOP, partitioned) loses the key when its lease expires, and someone
else may take it. Its keep-alive finds that out at its next refresh and calls
the holder's ``on_lost`` (if given): what the holder shows for the lock (the
compactor's metrics) goes then, not at its next write.

Being told "you hold the lock" is not enough to act safely: a paused holder
wakes up believing it still holds it. So every write a holder makes on behalf
of the lock is a transaction that also compares the token
(:meth:`LeaseLock.guard` gives the comparison), as the auditor's writes compare
its epoch and a replication worker's ledger CAS compares its lock. A deposed
holder's writes then change nothing.

An :class:`Election` is a LeaseLock on a well-known key whose value names the
leader; ``campaign()`` waits (looking twice a second) until it wins, and the
leader's token is its *epoch*.

Used by auto-recovery (the auditor's election, the replication workers' ledger
locks); the log writer's ownership is fencing on the bookies instead.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from bk.errors import LockLostError, MetadataError
from bk.retry import Backoff

log = logging.getLogger(__name__)

__all__ = ["LeaseLock", "Election", "LockLostError"]


class LeaseLock:
    """``<prefix>/<rel>`` held while its lease lives; a context manager.

        with LeaseLock(store, "underreplication/locks/42", {"owner": me}, ttl=10) as lock:
            store.txn_guarded(lock.guard(), ...)    # writes compare lock.token
    """

    def __init__(self, store, rel: str, value=None, ttl: int = 10, on_lost=None):
        """``on_lost()`` is called (from the keep-alive thread) when the lease is
        found expired: a holder that shows what it holds (a metric) takes it back
        then, not only when its own next write fails."""
        store._check_rel(rel)
        if ttl < 1:
            raise ValueError(f"lock {rel}: ttl must be >= 1 second, not {ttl}")
        self.store = store
        self.rel = rel
        self.key = store._key(rel)
        self.value = value if value is not None else {}
        self.ttl = int(ttl)
        self.on_lost = on_lost
        self.token: int | None = None        # create_revision of our key while held
        self._lease_id: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost = threading.Event()

    def __repr__(self):
        return f"LeaseLock({self.rel!r}, token={self.token})"

    # --- acquire / release ------------------------------------------------------------
    def try_acquire(self) -> bool:
        """Take the lock if nobody holds it; True if we now hold it."""
        if self.token is not None:
            return True
        s = self.store
        # Held by someone: say so after one read. Granting and revoking a lease for a
        # doomed try costs etcd two raft writes (each an fsync), and candidates that
        # campaign all the time would make an idle cluster's etcd busy.
        held = s._call(f"check lock {self.rel}", "get",
                       lambda c: c.get_response(self.key, count_only=True), idempotent=True)
        if held.count:
            return False
        lease = s._call(f"grant a {self.ttl}s lease for {self.rel}", "lease",
                        lambda c: c.lease(self.ttl))
        c = s._client()
        try:
            ok, rev, _ = s._txn_full(
                f"take lock {self.rel}", [c.transactions.create(self.key) == 0],
                [c.transactions.put(self.key, json.dumps(self.value).encode(),
                                    lease=lease.id)])
        except BaseException:
            self._revoke(lease.id)
            raise
        if not ok:
            self._revoke(lease.id)
            return False
        self.token, self._lease_id = rev, lease.id
        self._lost.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._keepalive, daemon=True,
                                        name=f"bk-lock-{self.rel}")
        self._thread.start()
        return True

    def acquire(self, timeout: float | None = None, poll: float = 0.2) -> bool:
        """Wait until we hold the lock (False if ``timeout`` seconds passed first)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        schedule = Backoff(first=0.02, cap=poll).start(deadline)
        while not self.try_acquire():
            delay = schedule.next_delay()
            if delay is None:
                return False
            time.sleep(delay)
        return True

    def release(self) -> None:
        """Delete the key if it is still ours, and revoke the lease (idempotent)."""
        token, lease_id = self.token, self._lease_id
        self.token = self._lease_id = None
        self._stop.set()
        if token is None:
            return
        s = self.store
        c = s._client()
        try:
            s._txn_full(f"release lock {self.rel}",
                        [c.transactions.create(self.key) == token],
                        [c.transactions.delete(self.key)])
        except MetadataError as e:
            log.warning("could not release lock %s (it expires with its lease): %s",
                        self.rel, e)
        self._revoke(lease_id)

    def __enter__(self) -> "LeaseLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # --- while held ----------------------------------------------------------------------
    @property
    def held(self) -> bool:
        """True while we believe we hold it (the lease was refreshed in time)."""
        return self.token is not None and not self._lost.is_set()

    def confirm(self) -> bool:
        """Ask etcd, not our belief (:attr:`held`): True if our key is still there
        (the same create revision) and our lease was just refreshed. For the moment
        before acting on what the lock protects: a lease can expire between two
        keep-alives (a starved process, an etcd late by seconds), and another holder
        may have taken and even released the lock since."""
        if not self.held:
            return False
        s = self.store
        lease_id = self._lease_id
        resp = s._call(f"confirm lock {self.rel}", "get",
                       lambda c: c.get_response(self.key), idempotent=True)
        if not resp.kvs or resp.kvs[0].create_revision != self.token:
            return False
        answers = s._call(f"refresh the lease of lock {self.rel}", "lease",
                          lambda c: list(c.refresh_lease(lease_id)))
        return bool(answers) and answers[0].TTL > 0

    def guard(self):
        """The etcd comparison "this lock is still ours": add it to every
        transaction made on the lock's behalf. LockLostError if already lost."""
        if self.token is None or self._lost.is_set():
            raise LockLostError(f"lock {self.rel} is not held")
        return self.store._client().transactions.create(self.key) == self.token

    def _keepalive(self) -> None:
        s = self.store
        interval = max(0.2, self.ttl / 3.0)
        while not self._stop.wait(interval):
            lease_id = self._lease_id
            if lease_id is None:
                return
            try:
                answers = s._call(f"refresh the lease of lock {self.rel}", "lease",
                                  lambda c: list(c.refresh_lease(lease_id)))
                resp = answers[0] if answers else None
                if resp is None or resp.TTL <= 0:
                    raise LockLostError(f"lease of lock {self.rel} expired")
            except LockLostError as e:
                log.warning("%s", e)
                self._lost.set()
                if self.on_lost is not None:
                    try:
                        self.on_lost()
                    except Exception:
                        log.exception("lock %s: on_lost failed", self.rel)
                return
            except MetadataError as e:
                log.warning("lock %s: %s", self.rel, e)

    def _revoke(self, lease_id) -> None:
        if lease_id is None:
            return
        try:
            self.store._call(f"revoke the lease of lock {self.rel}", "lease",
                             lambda c: c.revoke_lease(lease_id))
        except MetadataError:
            pass


class Election:
    """Leader election on ``<prefix>/<rel>``: the holder of a LeaseLock whose value
    names it. ``epoch`` (the token) fences the leader's writes."""

    # How often a candidate looks whether the leader is gone: a dead leader's lease
    # (seconds) outlives that. Kept across campaign() calls, which callers repeat with
    # a short timeout to check for a stop: a back-off restarting at each call looked
    # ~7 times a second, and the bench cluster's idle candidates (auditor and
    # compactor, per bookie) made 35 etcd reads/s (docs/performance-log.md, etcd's CPU).
    LOOK_EVERY = 0.5

    def __init__(self, store, rel: str, identifier: str, ttl: int = 10,
                 look_every: float | None = None, on_lost=None):
        """``look_every``: seconds between looks (``LOOK_EVERY`` unless given): a
        leader whose work can wait (the compactor's) is replaced less eagerly.
        ``on_lost``: see :class:`LeaseLock` (called when a leader's lease expired)."""
        self.identifier = identifier
        self.lock = LeaseLock(store, rel, {"id": identifier, "since": time.time()}, ttl,
                              on_lost=on_lost)
        self.look_every = self.LOOK_EVERY if look_every is None else float(look_every)
        self._next_look = 0.0            # time.monotonic() of the next try

    def campaign(self, timeout: float | None = None) -> bool:
        """Block until this candidate leads (False if ``timeout`` passed first). A
        candidate looks every ``look_every`` seconds, also over repeated calls."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            now = time.monotonic()
            wait = self._next_look - now
            if wait > 0:
                if deadline is not None and now + wait > deadline:
                    time.sleep(max(0.0, deadline - now))
                    return False
                time.sleep(wait)
            self._next_look = time.monotonic() + self.look_every
            if self.lock.try_acquire():
                return True

    def leader(self) -> str | None:
        """Who leads now, as the store says (None: nobody)."""
        value, _ = self.lock.store.get_json(self.lock.rel)
        return value.get("id") if isinstance(value, dict) else None

    @property
    def is_leader(self) -> bool:
        return self.lock.held

    @property
    def epoch(self) -> int | None:
        return self.lock.token

    def resign(self) -> None:
        self.lock.release()
