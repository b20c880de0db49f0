"""Garbage collection of deleted ledgers: which ledgers a bookie's shards may drop.

Theory of operation
-------------------
A ledger's metadata is created before any bookie holds an entry of it, and ids
are never reused, so a ledger a shard holds whose metadata is absent was
deleted. The decision rule is today's and BookKeeper's; what changes is what it
costs. The cluster may hold millions of ledgers, so nothing here reads them all:

* **Watch** (between reconciles). A daemon thread watches ``ledgers/`` for
  deletions only (etcd filters out puts) from the revision this bookie
  remembers, in ``gc-state.json`` next to its cookie. The deleted ids are
  *candidates*; etcd sends each deletion once, so the metadata cost follows
  deletions, not ledgers.
* **Rounds** (every ``gcWaitTime``). An incremental round takes the
  candidates learned so far, checks that the cluster is still the bookie's
  (:meth:`~bk.meta.store.MetadataStore.member_revision`: same instanceId,
  cookie present) and that each candidate is absent *at that revision*, and
  tells each shard to delete its own (``gc_delete``; a shard ignores ids it
  does not hold). No candidates: no etcd request at all.
* **Full reconcile** (at start when the remembered revision is unusable,
  every ``gcFullReconcileIntervalSeconds``, on SIGUSR1, after the watch fell
  behind a compaction, and when the over-replicated scan is due: every
  ``gcOverreplicatedLedgerWaitTime``, it reads the metadata of the ledgers the
  bookie holds entries of, not of those it dropped already, see
  :func:`bk.autorecovery.checker.claim_overreplicated` and
  :meth:`bk.bookie.storage.ShardStorage.settled`).
  Each shard reports its ledgers (``gc_begin``); once every shard has (or
  died), the arbiter hands the lists to one check for the whole bookie
  (:meth:`GarbageCollector.check`), at one member revision taken after the
  last list arrived: those absent there are dropped. It asks only about the
  bookie's own ids (``existing_ledgers``), the shards' together: a shard holds
  every numShards-th id at most, so together they are denser, and a range
  read once serves every shard. Ids come in blocks (one idgen write, which a
  client hands out in order), so a block in which the held ids are one in 64
  of the span they cover, however scattered (a bookie among a few dozen),
  is one keys-only range request (the other keys in it, of other bookies'
  ledgers, are skipped); sparser ids are read alone, or by ranges over their
  dense runs: ~60 requests for 60,000 ledgers held, ~300 for 10,000
  scattered one in 30 among 300,000. A long reconcile says how far it got in
  the log every ``PROGRESS_EVERY`` seconds and in the GC state
  (``reconciling``: its shards, ledgers checked and held). It also catches
  what a watch cannot: entries written with no metadata at all, or that reached
  a bookie long after their ledger was deleted.

Late entries. Each round hands every shard all the deletions it verified, not
only those of ledgers it holds: a shard tombstones what it holds and refuses,
for one reconcile interval (in memory), new entries of the others, which may
still arrive from a zombie writer or a re-replication in flight. Without that
they would create the ledger anew and stay until the next full reconcile.
The shards forget those on a restart, and the remembered revision has by then
moved past the deletions, so the watch does not send them again: the
:class:`DeletionLog` (``gc-recent.bin``, written before the revision advances)
keeps the verified deletions of the last reconcile interval, bounded. The
arbiter keeps them, and every deletion a round tells a shard since, per shard
(:class:`ShardDeletions`), and hands a shard its own with the fork that starts
it, at start or when it is respawned after it died: the shard applies them
before it serves its first request. They are also candidates of the first
round again (checked absent once more), so a deletion seen just before a
restart is still honoured after it.

Safety does not rest on the watch: an event only nominates a ledger; the
decision is always "absent at a revision at which the cluster was verified to
be this bookie's", so a wiped, re-formatted or foreign etcd (whose watch sends a
deletion for every key) makes the bookie drop nothing, and a crash anywhere only
repeats work. A reconcile decides nothing until every id of the bookie was
read at the member revision (taken after every shard listed what it holds, so
a ledger a list names existed before it unless it was deleted): a range read
says "absent" only for an id inside a span etcd returned whole at that
revision (a page cut short is followed to the span's end), and an etcd that
stops answering, or a revision compacted while it reads, fails the round (one
retry at a new revision for the latter), which deletes nothing and leaves the
revision where it was. The remembered revision advances only once every shard
has finished a round that covered every deletion up to it; killed before that, the
bookie watches again from the older revision and learns the same deletions
again. If etcd compacted that revision away meanwhile, the watch fails with
MetadataCompactedError, the bookie watches from now on, and a full reconcile
covers the gap before the revision advances again.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import struct
import sys
import threading
import time
import zlib
from array import array

from bk import protocol as P
from bk.bookie.layout import GC_RECENT_FILE, GC_STATE_FILE
from bk.errors import ClusterIdentityError, MetadataCompactedError, MetadataError

log = logging.getLogger("bk.bookie.gc")

STATE_FILE = GC_STATE_FILE
# a full reconcile that takes longer says how far it got this often (bookie log)
PROGRESS_EVERY = 10.0


def read_state(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
        return rec if isinstance(rec, dict) else {}
    except (OSError, ValueError):
        return {}


def write_state(path: str, rec: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(rec, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class DeletionLog:
    """The deletions GC verified within the last ``keep`` seconds (wall clock: they
    outlive the process), at most ``limit`` ids (the oldest rounds go first), saved
    atomically as one small binary file: a header, then per round its expiry and
    its sorted ids (8 bytes each), then a CRC32 of all that. An unreadable or
    foreign file is ignored: the next full reconcile covers what it held."""

    MAGIC = b"BKGCDL1\n"

    def __init__(self, path: str, instance_id: str, keep: float, limit: int = 1_000_000):
        self.path = path
        self.instance_id = instance_id
        self.keep = keep
        self.limit = limit
        self.rounds: list[tuple[float, array]] = []    # (wall-clock expiry, sorted ids)
        # the rounds read at start: their ids come back as candidates, and a round
        # that verifies them again must not give them a new expiry (a watch sends a
        # deletion once, so only these can come twice)
        self._loaded: list[array] = []

    def __len__(self) -> int:
        return sum(len(ids) for _, ids in self.rounds)

    def _was_loaded(self, lid: int) -> bool:
        for ids in self._loaded:
            i = bisect.bisect_left(ids, lid)
            if i < len(ids) and ids[i] == lid:
                return True
        return False

    def ids(self) -> list[int]:
        return [lid for _, ids in self.rounds for lid in ids]

    def _expire(self) -> bool:
        now, n = time.time(), len(self.rounds)
        self.rounds = [r for r in self.rounds if r[0] > now]
        total = len(self)
        while total > self.limit and len(self.rounds) > 1:
            total -= len(self.rounds.pop(0)[1])
        if self._loaded:
            kept = {id(ids) for _, ids in self.rounds}
            self._loaded = [ids for ids in self._loaded if id(ids) in kept]
        return len(self.rounds) != n

    def add(self, lids) -> bool:
        """Remember ``lids`` (those read at start keep their expiry); True if it changed."""
        lids = set(lids)
        if self._loaded:
            lids = {lid for lid in lids if not self._was_loaded(lid)}
        new = array("q", sorted(lids))
        changed = self._expire()
        if new:
            self.rounds.append((time.time() + self.keep, new))
            self._expire()
            changed = True
        return changed

    def load(self) -> "DeletionLog":
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except OSError:
            return self
        try:
            body, (crc,) = data[:-4], struct.unpack("<I", data[-4:])
            if not body.startswith(self.MAGIC) or zlib.crc32(body) != crc:
                raise ValueError("bad magic or checksum")
            pos = len(self.MAGIC)
            (n,) = struct.unpack_from("<H", body, pos)
            pos += 2
            owner = body[pos:pos + n].decode("utf-8")
            pos += n
            (count,) = struct.unpack_from("<I", body, pos)
            pos += 4
            rounds = []
            for _ in range(count):
                expiry, k = struct.unpack_from("<dI", body, pos)
                pos += 12
                ids = array("q")
                ids.frombytes(body[pos:pos + 8 * k])
                if sys.byteorder != "little":
                    ids.byteswap()
                pos += 8 * k
                rounds.append((expiry, ids))
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            log.warning("gc: ignoring %s (%s); the next full reconcile covers it", self.path, e)
            return self
        if owner == self.instance_id:
            self.rounds = rounds
            self._loaded = [ids for _, ids in rounds]
            self._expire()
        return self

    def save(self) -> None:
        owner = self.instance_id.encode("utf-8")
        parts = [self.MAGIC, struct.pack("<H", len(owner)), owner,
                 struct.pack("<I", len(self.rounds))]
        for expiry, ids in self.rounds:
            if sys.byteorder != "little":
                ids = array("q", ids)
                ids.byteswap()
            parts += [struct.pack("<dI", expiry, len(ids)), ids.tobytes()]
        body = b"".join(parts)
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(body + struct.pack("<I", zlib.crc32(body)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


class ShardDeletions:
    """The verified deletions each shard was told (or is being told) within the
    last ``keep`` seconds, by shard, at most ``limit`` ids a shard (the oldest
    rounds go first). A shard forked anew (at start, or respawned after it died)
    forgot them: it gets its own with the fork and applies them before it serves
    anything, so there is no moment at which a zombie writer's add to one of them
    is accepted. Expiries are wall clock, like :class:`DeletionLog`'s, whose rounds
    are the first ones. Thread-safe: rounds add on the arbiter's metadata thread,
    spawns read on its loop."""

    def __init__(self, keep: float, num_shards: int, limit: int = 1_000_000):
        self.keep = keep
        self.limit = limit
        self._lock = threading.Lock()
        self._rounds: list[list[tuple[float, array]]] = [[] for _ in range(num_shards)]

    @classmethod
    def remembered(cls, conf, instance_id: str, state_dir: str,
                   num_shards: int) -> "ShardDeletions":
        """Those of the last reconcile interval before this start (``gc-recent.bin``):
        verified absent at a revision of this cluster, whose ids are never reused."""
        dlog = DeletionLog(os.path.join(state_dir, GC_RECENT_FILE), instance_id,
                           float(conf.gcFullReconcileIntervalSeconds)).load()
        out = cls(dlog.keep, num_shards)
        for expiry, ids in dlog.rounds:
            per: dict[int, array] = {}
            for lid in ids:                       # sorted: each shard's part stays sorted
                per.setdefault(P.shard_of(lid, num_shards), array("q")).append(lid)
            for shard, part in per.items():
                out._rounds[shard].append((expiry, part))
        return out

    def add(self, shard: int, ids) -> None:
        ids = array("q", sorted(set(ids)))
        if not ids:
            return
        with self._lock:
            rounds = self._expired(shard)
            rounds.append((time.time() + self.keep, ids))
            total = sum(len(r[1]) for r in rounds)
            while total > self.limit and len(rounds) > 1:
                total -= len(rounds.pop(0)[1])

    def of(self, shard: int) -> array:
        """The ids ``shard`` must refuse late entries of, now (8 bytes each: the fork
        copies them, the arbiter keeps no list of ints)."""
        out = array("q")
        with self._lock:
            for _, ids in self._expired(shard):
                out.extend(ids)
        return out

    def _expired(self, shard: int) -> list:
        now = time.time()
        rounds = self._rounds[shard] = [r for r in self._rounds[shard] if r[0] > now]
        return rounds


class GcRound:
    """One round: full (shards list their ledgers) or incremental (candidates)."""

    __slots__ = ("full", "reason", "candidates", "safe", "shards", "revisions", "started",
                 "failed", "overreplicated", "dead", "checked", "requests")

    def __init__(self, full: bool, reason: str, candidates: set, safe: int, shards):
        self.full = full
        self.reason = reason
        self.candidates = candidates    # ids the watch reported deleted (incremental)
        self.safe = safe                # every deletion up to here is among them
        self.shards = set(shards)       # shards taking part
        self.revisions: dict[int, int] = {}   # shard -> member revision it was checked at
        self.started = time.time()
        self.failed = False
        self.overreplicated = False     # also look for over-replicated ledgers
        self.dead: set = set()          # ids verified deleted, handed to the shards
        self.checked = 0                # ids a full round asked etcd about
        self.requests = 0               # and the Range requests that took (its own)


class GarbageCollector:
    """Decides what the shards of one bookie delete; the arbiter relays."""

    def __init__(self, conf, store, instance_id: str, state_dir: str, num_shards: int):
        self.conf = conf
        self.store = store
        self.instance_id = instance_id
        self.bookie_id = conf.bookie_id
        self.num_shards = num_shards
        self.path = os.path.join(state_dir, STATE_FILE)
        # the shards refuse late entries of deleted ledgers for one reconcile interval
        # (bk.bookie.storage.RecentDeletions): remembered across restarts here
        self.recent = DeletionLog(os.path.join(state_dir, GC_RECENT_FILE), instance_id,
                                  float(conf.gcFullReconcileIntervalSeconds))
        self.reconcile_interval = float(conf.gcFullReconcileIntervalSeconds)
        self.overrep_interval = conf.gcOverreplicatedLedgerWaitTime / 1000.0
        # like BookKeeper: the first scan one interval after start, not at every start
        self._next_overrep = time.monotonic() + self.overrep_interval
        self._lock = threading.Lock()          # guards the fields below (no I/O under it)
        self._deleted: dict[int, int] = {}     # candidate id -> revision it was deleted at
        self._watch_rev = 0                    # every deletion up to here was delivered
        self._watch_from = 0                   # the current watch's start revision
        self._remembered = 0                   # persisted revision
        self._gap = True                       # deletions may be missing: reconcile first
        self._gap_reason = "start"
        self._next_reconcile = 0.0
        self._stop = threading.Event()
        self._broken = threading.Event()
        self._break: BaseException | None = None   # why the watch broke
        self._cancel = None
        self._thread: threading.Thread | None = None
        self._checking: dict | None = None       # the full reconcile's check in progress
        self.stats = {"rounds": 0, "reconciles": 0, "deleted": 0, "watchRestarts": 0,
                      "lastReconcile": None, "lastRound": None}

    # --- lifecycle ------------------------------------------------------------------
    def start(self) -> "GarbageCollector":
        rec = read_state(self.path)
        rev = rec.get("revision") if rec.get("instanceId") == self.instance_id else None
        if isinstance(rev, int) and rev > 0:
            self._remembered = self._watch_rev = rev
            self._watch_from = rev + 1
            self._gap = False                   # unless the watch finds it compacted
            self._next_reconcile = time.monotonic() + self.reconcile_interval
        # Deletions verified before a restart: candidates once more (revision 0: the
        # first complete round forgets them), checked absent again, and sent to
        # the shards, which forgot them.
        for lid in self.recent.load().ids():
            self._deleted.setdefault(lid, 0)
        self._thread = threading.Thread(target=self._watch_loop, daemon=True,
                                        name="bk-gc-watch")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._broken.set()
        cancel, self._cancel = self._cancel, None
        if cancel is not None:
            cancel()

    # --- the watch ------------------------------------------------------------------
    def _on_deletions(self, ids, rev_or_error) -> None:
        if ids is None:
            self._break = rev_or_error
            self._broken.set()
            return
        with self._lock:
            for lid in ids:
                self._deleted.setdefault(lid, rev_or_error)
            self._watch_rev = max(self._watch_rev, rev_or_error)

    def _watch_loop(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            with self._lock:
                start = self._watch_from or 0
            try:
                if not start:
                    # No usable revision: watch from now on; the reconcile that the
                    # gap asks for covers everything before.
                    start = self.store.revision() + 1
                    with self._lock:
                        self._watch_from = start
                        self._watch_rev = max(self._watch_rev, start - 1)
                self._broken.clear()
                self._break = None
                self._cancel = self.store.watch_ledger_deletions(start, self._on_deletions)
                since = time.monotonic()
                self._broken.wait()
                if time.monotonic() - since > 10.0:
                    backoff = 0.2                # it ran well: this is a new trouble
                cancel, self._cancel = self._cancel, None
                if cancel is not None:
                    cancel()
                if self._stop.is_set():
                    return
                if isinstance(self._break, MetadataCompactedError):
                    raise self._break
                log.info("gc: ledger deletion watch broke (%s); watching again", self._break)
                with self._lock:
                    self._watch_from = self._watch_rev + 1
                self.stats["watchRestarts"] += 1
                self._stop.wait(backoff)
                backoff = min(2 * backoff, 5.0)
            except MetadataCompactedError as e:
                log.info("gc: deletions since revision %d were compacted away (%s); a full "
                         "reconcile covers them", start, e)
                with self._lock:
                    self._gap, self._gap_reason = True, "compacted"
                    self._watch_from = 0
                self.stats["watchRestarts"] += 1
            except MetadataError as e:
                log.debug("gc: cannot watch ledger deletions: %s", e)
                self._stop.wait(backoff)
                backoff = min(2 * backoff, 5.0)
            except Exception:  # pragma: no cover - the thread must not die silently
                log.exception("gc: deletion watch failed")
                self._stop.wait(1.0)

    # --- rounds (begin on the arbiter's loop, the rest on its metadata thread) --------
    def begin(self, shards, force_full: bool = False) -> GcRound:
        """The plan of a round over ``shards``; no I/O."""
        now = time.monotonic()
        with self._lock:
            overrep = self.overrep_interval > 0 and now >= self._next_overrep
            if overrep:
                self._next_overrep = now + self.overrep_interval
            if force_full:
                reason = "requested"
            elif self._gap:
                reason = self._gap_reason
            elif now >= self._next_reconcile:
                reason = "interval"
            elif overrep:
                reason = "overreplicated"    # the scan needs each shard's ledgers
            else:
                reason = None
            rnd = GcRound(reason is not None, reason or "deletions", set(self._deleted),
                          self._watch_rev, shards)
            rnd.overreplicated = overrep
            return rnd

    def _member_revision(self, rnd: GcRound) -> int | None:
        try:
            return self.store.member_revision(self.bookie_id, self.instance_id)
        except ClusterIdentityError as e:
            log.error("garbage collection skipped, nothing deleted: %s", e)
            rnd.failed = True
            return None

    def check(self, rnd: GcRound, held: dict) -> dict[int, list[int]]:
        """Full round: per shard, the ids of ``held`` (shard -> the ids it reported
        holding) and of the round's candidates that have no metadata at a revision
        of this bookie's cluster (a shard refuses late entries of deleted ledgers
        it holds nothing of: see ``bk.bookie.storage.RecentDeletions``). One check
        for the whole bookie, at one revision taken after every list arrived: the
        shards' ids together are denser in the id space than each shard's (a
        shard holds every numShards-th id at most), and each key is read once."""
        shards = set(held)
        ids = sorted(set().union(*held.values()).union(
            lid for lid in rnd.candidates if P.shard_of(lid, self.num_shards) in shards))
        progress = _Progress(self, rnd, sorted(shards), len(ids))
        try:
            for attempt in range(2):
                rev = self._member_revision(rnd)
                if rev is None:
                    return {}
                # the arbiter's metadata thread (this one) is the only reader of
                # ledgers through this store (see its rpc_counts): the count is this
                # check's own, whatever else etcd answers meanwhile
                sent = self.store.rpc_counts["ledger ranges"]
                try:
                    live = self.store.existing_ledgers(ids, revision=rev,
                                                       progress=progress) if ids else set()
                except MetadataCompactedError:
                    if attempt:
                        raise
                    continue        # compacted while we read: once more at a new revision
                finally:
                    rnd.requests += self.store.rpc_counts["ledger ranges"] - sent
                out: dict[int, list[int]] = {s: [] for s in shards}
                for lid in ids:
                    if lid not in live:
                        out[P.shard_of(lid, self.num_shards)].append(lid)
                dead = sum(len(d) for d in out.values())
                with self._lock:
                    for s in shards:
                        rnd.revisions[s] = rev
                        rnd.dead.update(out[s])
                    rnd.checked += len(ids)
                progress.finished(dead)
                return out
            return {}
        finally:
            with self._lock:
                self._checking = None

    def incremental(self, rnd: GcRound) -> dict[int, list[int]]:
        """Incremental round: per shard, the candidates absent at a revision of this
        bookie's cluster (a shard ignores ids it does not hold)."""
        if not rnd.candidates:
            return {}
        rev = self._member_revision(rnd)
        if rev is None:
            return {}
        live = self.store.existing_ledgers(rnd.candidates, revision=rev)
        if live:
            # deleted and then present again: an etcd restored from a backup, or a
            # deletion event of another cluster under this prefix. Never drop those.
            log.warning("gc: %d ledgers reported deleted exist at revision %d (e.g. %d); "
                        "keeping them", len(live), rev, min(live))
        out: dict[int, list[int]] = {}
        rnd.dead = rnd.candidates - live
        for lid in sorted(rnd.dead):
            out.setdefault(P.shard_of(lid, self.num_shards), []).append(lid)
        for s in rnd.shards:
            rnd.revisions[s] = rev
        return out

    def finish(self, rnd: GcRound, done_shards, deleted: int = 0) -> None:
        """Every shard of ``done_shards`` has applied the round: forget the candidates
        it covered and remember (durably) the revision up to which nothing is left."""
        self.stats["rounds"] += 1
        self.stats["deleted"] += deleted
        complete = (not rnd.failed and set(done_shards) >= set(range(self.num_shards))
                    and (not rnd.full or set(rnd.revisions) >= set(done_shards)))
        summary = {"at": rnd.started, "full": rnd.full, "reason": rnd.reason,
                   "candidates": len(rnd.candidates), "checked": rnd.checked,
                   "requests": rnd.requests, "dead": len(rnd.dead), "complete": complete,
                   "seconds": round(time.time() - rnd.started, 3)}
        self.stats["lastRound"] = summary
        if rnd.full:
            self.stats["lastReconcile"] = summary
        if not complete:
            return
        # before the revision moves past these deletions (the watch will not send
        # them again): a crash between the two only repeats work
        with self._lock:
            dead = rnd.dead
        if self.recent.add(dead):
            try:
                self.recent.save()
            except OSError as e:
                log.warning("gc: cannot save %s (%s): revision not advanced", self.recent.path, e)
                return
        with self._lock:
            if rnd.full:
                self.stats["reconciles"] += 1
                self._next_reconcile = time.monotonic() + self.reconcile_interval
                # Every deletion up to the oldest revision a shard was checked at is
                # applied; the gap closes if the watch has run since then.
                safe = min(rnd.revisions.values())
                if self._watch_from and self._watch_from <= safe + 1:
                    self._gap = False
            else:
                safe = rnd.safe
            if self._gap:
                return
            for lid in rnd.candidates:
                if self._deleted.get(lid, 0) <= safe:
                    self._deleted.pop(lid, None)
            if safe <= self._remembered:
                return
            self._remembered = safe
        write_state(self.path, {"instanceId": self.instance_id, "revision": safe,
                                "at": time.time()})

    def state(self) -> dict:
        """For the bookie's HTTP info: what GC knows and did."""
        recent = len(self.recent)
        with self._lock:
            checking = dict(self._checking) if self._checking else None
            return {"rememberedRevision": self._remembered, "watchRevision": self._watch_rev,
                    "candidates": len(self._deleted), "reconcileNeeded": self._gap,
                    "recentDeletions": recent, "reconciling": checking, **self.stats}


class _Progress:
    """A full reconcile's progress (the bookie's shards together): in the GC state
    (``reconciling``) as groups of ids are checked, and in the log every :data:`PROGRESS_EVERY` seconds
    of a long one (hundreds of thousands of ledgers held), then when it ends."""

    def __init__(self, gc: GarbageCollector, rnd: GcRound, shards: list[int], total: int):
        self.gc, self.rnd, self.total = gc, rnd, total
        self.shards = ",".join(str(s) for s in shards)
        self.started = self.logged = time.monotonic()
        with gc._lock:
            gc._checking = {"shards": list(shards), "reason": rnd.reason, "checked": 0,
                            "ledgers": total}

    def __call__(self, done: int, total: int) -> None:
        with self.gc._lock:
            if self.gc._checking is not None:
                self.gc._checking["checked"] = done
        now = time.monotonic()
        if now - self.logged >= PROGRESS_EVERY:
            self.logged = now
            log.info("gc: full reconcile (%s), shards %s: %d of %d ledgers checked, %.0f s",
                     self.rnd.reason, self.shards, done, total, now - self.started)

    def finished(self, dead: int) -> None:
        took = time.monotonic() - self.started
        if took >= PROGRESS_EVERY:
            log.info("gc: full reconcile (%s), shards %s: %d ledgers checked in %.0f s, "
                     "%d without metadata", self.rnd.reason, self.shards, self.total, took,
                     dead)
