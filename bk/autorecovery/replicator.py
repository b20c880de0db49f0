"""Re-replication of ledger fragments: BookKeeper's ``LedgerFragmentReplicator``
and ``recoverBookieData``, used by the replication worker of auto-recovery, by
``bkshell recover`` and by ``decommissionbookie`` (through :mod:`bk.admin`).

Theory of operation of bookie recovery (BookKeeper's ``recoverBookieData`` and
``LedgerFragmentReplicator``)
-----------------------------------------------------------------------------
For every ledger with a fragment (``(first entry, ensemble)`` of its metadata)
whose ensemble holds the lost bookie B:

1. A ledger that is not CLOSED and whose *last* ensemble holds B is first
   closed by a recovery (:meth:`Replicator.recover_ledger`), which is the client's
   one recovery protocol (:func:`bk.client.recovery.recover_ledger`: fence,
   read forward, write back to full write sets, replacing dead bookies by
   ensemble change, CAS to CLOSED) run with the ledger's master key instead
   of its password. With ``skip_open`` such ledgers are left alone.
   (Open ledgers that hold B only in earlier fragments need no closing: those
   fragments are complete, the writer has moved on.)
2. For each fragment holding B, a replacement R is picked among the writable
   bookies not in that fragment's ensemble (deterministically per ledger and
   fragment, so that an interrupted run picks the same R again when it is
   re-run). Each entry of the fragment whose write set holds B is read raw
   from a surviving replica and added to R with the recovery flag and the
   ledger's master key, digest and LAC unchanged (so it still verifies under
   the writer's digest, whatever its type). Entries R already holds
   (GET_LIST_OF_ENTRIES) are skipped: a re-run after an interruption copies
   only what is missing.
3. Then the fragment's ensemble is changed by CAS: B replaced by R in that
   fragment only. A lost CAS re-reads and re-applies the change to the fresh
   metadata (the fragment is found by its first entry id).

The master key comes from the ledger metadata (``masterKey``, stored by the
client at creation); for older metadata without it, the password can be
given (it is checked against the password digest). After a complete run B is
in no ensemble, so a second run does nothing.

Apart from ledger recovery (the client's), everything talks to bookies through
blocking raw-protocol connections, one per (bookie, shard), pipelining a batch
of requests at a time.
"""

from __future__ import annotations

import collections
import logging
import random
import time
import zlib
from dataclasses import dataclass, field

from bk import protocol as P
from bk.autorecovery.checker import expected_entries, owned_entries
from bk.client import digest, recovery
from bk.client.bookkeeper import BookKeeper
from bk.client.health import BookieHealth
from bk.client.placement import PlacementPolicy, write_quorum_racks
from bk.errors import (BKError, EOK, BadPasswordError, NoSuchLedgerError,
                       NotEnoughBookiesError, TransientError, error_for_status)
from bk.meta.ledger import LedgerMetadata
from bk.meta.racks import all_racks
from bk.rawclient import BookiePool
from bk.retry import retry_cas

log = logging.getLogger("bk.replicator")

# Re-replication (Replicator._copy_fragment): entries per batch, batches whose reads are
# in flight ahead of their adds, batches of adds awaiting the target's journal.
COPY_BATCH = 256
READ_AHEAD = 2
ADD_WINDOW = 2
RANGE_BYTES = 4 << 20     # a READ_RANGE answer's budget (the bookie caps it at half a frame)
ADD_BATCH_BYTES = 1 << 20  # payload per ADD_BATCH frame of a copy (at most a quarter frame)



def _take_reads(entries, resps, got: dict, pending: list) -> None:
    """Sort READ answers: an entry read goes into ``got`` as (lac, digest, payload),
    one the source lacks (or failed) into ``pending`` for its next source."""
    for e, resp in zip(entries, resps):
        if resp[2] == EOK:
            got[e] = (resp[5], resp[6], resp[7])
        else:
            pending.append(e)


# --- reports -----------------------------------------------------------------------

@dataclass
class FragmentReport:
    ledger_id: int
    first_entry: int
    last_entry: int
    ensemble: list
    replacement: str | None
    entries: int = 0            # entries the lost bookie should hold
    copied: int = 0
    bytes_copied: int = 0       # payload bytes of the entries copied
    already: int = 0            # already on the replacement
    done: bool = False
    error: str | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class RecoveryReport:
    bookie_id: str
    dry_run: bool = False
    ledgers: list = field(default_factory=list)          # ids of ledgers touched
    closed: list = field(default_factory=list)           # open ledgers fenced + closed
    skipped_open: list = field(default_factory=list)     # open ledgers left alone
    failed: dict = field(default_factory=dict)           # ledger id -> error
    fragments: list = field(default_factory=list)        # FragmentReport
    seconds: float = 0.0
    by_autorecovery: bool = False      # the cluster's replication workers did the copying
    how: str = ""                      # which of the two, and why (decommissioning)

    @property
    def entries_copied(self) -> int:
        return sum(f.copied for f in self.fragments)

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_dict(self) -> dict:
        return {
            "bookie": self.bookie_id, "dry_run": self.dry_run,
            "ledgers": len(self.ledgers), "ledger_ids": self.ledgers,
            "closed": self.closed, "skipped_open": self.skipped_open,
            "failed": {str(k): v for k, v in self.failed.items()},
            "fragments": len(self.fragments),
            "fragments_replicated": sum(1 for f in self.fragments if f.done),
            "entries_copied": self.entries_copied,
            "entries_already_there": sum(f.already for f in self.fragments),
            "seconds": round(self.seconds, 3),
            "by_autorecovery": self.by_autorecovery,
            **({"how": self.how} if self.how else {}),
            "fragment_details": [f.to_dict() for f in self.fragments],
        }

    def summary(self) -> str:
        d = self.to_dict()
        if self.dry_run:
            n = sum(f.entries for f in self.fragments)
            return (f"dry run: would recover {d['ledgers']} ledgers of bookie {self.bookie_id}: "
                    f"{d['fragments']} fragments, {n} entries to copy, "
                    f"{len(self.closed)} open ledgers to close"
                    + (f", {len(self.skipped_open)} open ledgers skipped"
                       if self.skipped_open else ""))
        if self.by_autorecovery:
            s = (f"bookie {self.bookie_id}: {d['ledgers']} ledgers re-replicated by "
                 f"auto-recovery")
            if self.failed:
                s += f", {len(self.failed)} ledgers FAILED"
            return s + f" in {self.seconds:.1f}s"
        s = (f"recovered bookie {self.bookie_id}: {d['ledgers']} ledgers, "
             f"{d['fragments_replicated']}/{d['fragments']} fragments, "
             f"{d['entries_copied']} entries copied"
             + (f" ({d['entries_already_there']} already there)"
                if d['entries_already_there'] else "")
             + f", {len(self.closed)} open ledgers closed")
        if self.skipped_open:
            s += f", {len(self.skipped_open)} open ledgers skipped"
        if self.failed:
            s += f", {len(self.failed)} ledgers FAILED"
        return s + f" in {self.seconds:.1f}s"


# --- the copy engine ----------------------------------------------------------------

class Replicator:
    """Copies the entries of ledger fragments to replacement bookies and swaps them
    into the metadata by CAS; closes open ledgers by recovery first.

    ``store``: the cluster's MetadataStore; ``pool``: a :class:`BookiePool` on it;
    ``uri`` and ``timeout`` / ``bookie_timeout`` make the client used for ledger
    recovery (on first use); ``password``: for ledgers whose metadata has no
    master key; ``rate_bytes``: replicationRateByBytes (<= 0: no limit);
    ``max_frame``: the bookies' nettyMaxFrameSizeBytes; ``client_settings``: TLS and
    token settings of the connections it makes; ``quarantine_seconds``:
    how long a replacement that failed a copy is avoided (bookieQuarantineTimeSeconds)."""

    def __init__(self, store, pool: BookiePool, uri: str, timeout: float = 5.0,
                 bookie_timeout: float = 10.0, password: bytes | None = None,
                 rate_bytes: int = -1, max_frame: int = P.DEFAULT_MAX_FRAME_SIZE,
                 placement: PlacementPolicy | None = None, quarantine_seconds: float = 60.0,
                 client_settings: dict | None = None):
        self.store = store
        self._client_settings = client_settings or {}   # TLS and token (bk.security)
        # Replacements that failed a copy (unreachable from here, say, though still
        # registered): the next pick avoids them while others exist. Without this
        # the deterministic pick below chose the same dead end on every retry.
        self.health = BookieHealth(quarantine_seconds)
        # where re-replicated fragments go (ensemblePlacementPolicy of the caller's conf)
        self.placement = placement or PlacementPolicy()
        self._racks_at: tuple = (0.0, None)
        self.bookies = pool
        self.uri = uri
        self.password = password
        # replicationRateByBytes: copies pace themselves to this many bytes/s (<= 0: no
        # limit). A token bucket of one second's worth: a burst never exceeds it.
        self.rate_bytes = rate_bytes
        # nettyMaxFrameSizeBytes of the bookies: a copy's ADD_BATCH frames stay well under.
        self.batch_bytes = max(1, min(ADD_BATCH_BYTES, max_frame // 4))
        self._rate_t = time.monotonic()
        self._rate_debt = 0.0
        self._timeout = timeout
        self._bookie_timeout = bookie_timeout
        self._client = None

    @property
    def client(self) -> BookKeeper:
        """A client on the same cluster (made on first use): ledger recovery goes
        through the client's implementation."""
        if self._client is None:
            pl = self.placement
            self._client = BookKeeper(self.uri,
                                      ensemblePlacementPolicy=pl.name,
                                      minNumRacksPerWriteQuorum=pl.min_racks,
                                      enforceMinNumRacksPerWriteQuorum=pl.enforce,
                                      metadataTimeoutMillis=max(1, int(self._timeout * 1000)),
                                      readEntryTimeoutSec=self._bookie_timeout,
                                      addEntryTimeoutSec=self._bookie_timeout,
                                      **self._client_settings)
        return self._client

    def close(self) -> None:
        """Close the recovery client (the store and the pool belong to the caller)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def master_key(self, md: LedgerMetadata) -> bytes:
        """The key the bookies hold for the ledger: from the metadata, else from the
        admin's password (checked against the password digest)."""
        if md.master_key:
            return md.master_key
        if self.password is not None:
            if not digest.password_matches(md.password_digest, self.password):
                raise BadPasswordError(f"ledger {md.ledger_id}: the given password does not "
                                       f"match the ledger's")
            return digest.master_key(self.password)
        raise BadPasswordError(f"ledger {md.ledger_id}: its metadata has no master key "
                               f"(created by an older bk); give the ledger's password")

    # --- recovery of one ledger -----------------------------------------------------
    def recover_ledger(self, ledger_id: int, guards=()) -> LedgerMetadata:
        """Fence and close a ledger as a reader (recovery open); returns the CLOSED
        metadata. The old writer's next add fails with LedgerFencedError.

        This is the client's recovery (:func:`bk.client.recovery.recover_ledger`)
        with the master key from the metadata, or, for older metadata without
        one, with the admin's password. ``guards`` are compared by its metadata
        CASes (a replication worker's lock)."""
        md, _ = self.store.read_ledger(ledger_id)
        if md.is_closed:
            return md
        if md.master_key:
            cred = {"master_key": md.master_key}
        elif self.password is not None:
            cred = {"password": self.password}
        else:
            raise BadPasswordError(f"ledger {ledger_id}: its metadata has no master key "
                                   f"(created by an older bk); give the ledger's password")
        return recovery.recover_ledger(self.client, ledger_id, guards=guards, **cred)[0]

    # --- bookie recovery ------------------------------------------------------------
    def ledgers_of(self, bookie_id: str) -> list[LedgerMetadata]:
        """Metadata of every ledger with a fragment whose ensemble holds ``bookie_id``."""
        return [md for md, _ in self.store.list_ledger_metadata()
                if any(bookie_id in ens for _, ens in md.ensembles)]

    def bookie_known(self, bookie_id: str) -> bool:
        if self.store.bookie_info(bookie_id) is not None:
            return True
        return self.store.read_cookie(bookie_id)[0] is not None

    def placement_check(self, policy: PlacementPolicy | None = None,
                        progress=None) -> list[dict]:
        """Fragments whose write quorums span fewer racks (regions) than ``policy``
        (default: this replicator's) asks, where the racks that have writable
        bookies now could meet it: ``[{ledger, first_entry, ensemble, racks,
        min_racks}]``, racks being the fewest any write quorum of the fragment spans.
        The auditor exports their count; ``bkshell placementcheck`` lists them.

        ``progress(ledgers_checked, rows_so_far)``, if given, is called after each
        ledger: the walk reads every ledger's metadata, minutes on a large cluster,
        and a shell shows where it is."""
        policy = policy or self.placement
        racks = all_racks(self.store)
        domain = policy._domain(racks)
        available = len({domain(b) for b in self.store.list_bookies()})
        out, n = [], 0
        for md, _ in self.store.list_ledger_metadata():
            for first, ens in md.ensembles:
                if not policy.adheres(ens, md.write_quorum_size, racks, available):
                    out.append({"ledger": md.ledger_id, "first_entry": first,
                                "ensemble": list(ens),
                                "racks": min(write_quorum_racks(ens, md.write_quorum_size,
                                                                domain)),
                                "min_racks": policy.min_racks})
            n += 1
            if progress is not None:
                progress(n, len(out))
        return out

    def _racks(self) -> dict:
        """bookie -> rack, read at most every few seconds (a recovery picks a target
        per fragment; one etcd range read each would be too many)."""
        t, racks = self._racks_at
        if racks is None or time.monotonic() - t > 5.0:
            racks = all_racks(self.store)
            self._racks_at = (time.monotonic(), racks)
        return racks

    def _pick_replacement(self, md, index, ensemble, bookie_id, writable) -> str:
        candidates = [b for b in writable if b not in ensemble and b != bookie_id]
        if not candidates:
            raise NotEnoughBookiesError(
                f"ledger {md.ledger_id} fragment at entry {md.ensembles[index][0]}: no writable "
                f"bookie outside its ensemble {ensemble} to replace {bookie_id}")
        bad = self.health.quarantined_set()
        healthy = [b for b in candidates if b not in bad]
        if healthy and len(healthy) < len(candidates):
            log.info("ledger %d: not copying to %s (a copy to it failed lately)", md.ledger_id,
                     sorted(set(candidates) - set(healthy)))
        candidates = healthy or candidates       # a preference, never an exclusion
        key = f"{md.ledger_id}/{md.ensembles[index][0]}/".encode()
        if self.placement.rack_aware:
            # the same pick on a re-run (seeded by the fragment), within the policy
            _, mapping = self.placement.replace_bookies(
                candidates, list(ensemble), [bookie_id], md.write_quorum_size,
                self._racks(), rng=random.Random(zlib.crc32(key)))
            return mapping[bookie_id]
        return min(candidates, key=lambda b: (zlib.crc32(key + b.encode()), b))

    def recover_bookie(self, bookie_id: str, dry_run: bool = False, skip_open: bool = False,
                       ledger_ids=None, progress=None) -> RecoveryReport:
        """Re-replicate every ledger fragment that had ``bookie_id`` (see the module doc).

        ``progress(done_ledgers, total_ledgers, report)`` is called after each
        ledger. Per-ledger failures are recorded in ``report.failed`` (the others
        are still recovered); re-running finishes the job."""
        t0 = time.monotonic()
        report = RecoveryReport(bookie_id, dry_run=dry_run)
        if not self.bookie_known(bookie_id):
            todo = self.ledgers_of(bookie_id)
            if not todo:
                raise BKError(f"bookie {bookie_id} not found: not registered, no cookie, and "
                              f"in no ledger's ensemble ({self.uri})")
        else:
            todo = self.ledgers_of(bookie_id)
        if ledger_ids is not None:
            wanted = set(ledger_ids)
            todo = [md for md in todo if md.ledger_id in wanted]
        alive = self.store.bookie_info(bookie_id) is not None
        if alive:
            log.warning("bookie %s is registered (alive): its entries are copied anyway",
                        bookie_id)
        writable = self.store.list_bookies()
        for n, md in enumerate(todo, 1):
            lid = md.ledger_id
            try:
                self._recover_ledger_fragments(md, bookie_id, report, writable, dry_run,
                                               skip_open, alive)
            except NoSuchLedgerError:
                log.info("ledger %d was deleted meanwhile", lid)
            except BKError as e:
                report.failed[lid] = str(e)
                log.warning("recover bookie %s: ledger %d: %s", bookie_id, lid, e)
            if progress:
                progress(n, len(todo), report)
        report.seconds = time.monotonic() - t0
        return report

    def replicate_ledger(self, ledger_id: int, bookie_id: str, guards=()) -> RecoveryReport:
        """Re-replicate the fragments of one ledger that had ``bookie_id`` (closing it
        first by recovery if its last ensemble holds it); every metadata CAS also
        compares ``guards`` (a replication worker's lock). BKError on failure."""
        md, _ = self.store.read_ledger(ledger_id)
        report = RecoveryReport(bookie_id)
        self._recover_ledger_fragments(md, bookie_id, report, self.store.list_bookies(),
                                       False, False, False, guards)
        return report

    def _recover_ledger_fragments(self, md, bookie_id, report, writable, dry_run, skip_open,
                                  alive, guards=()):
        lid = md.ledger_id
        if not md.is_closed and bookie_id in md.last_ensemble:
            if skip_open:
                report.skipped_open.append(lid)
                return
            report.closed.append(lid)
            if not dry_run:
                md = self.recover_ledger(lid, guards)
        report.ledgers.append(lid)
        mk = None if dry_run else self.master_key(md)
        for index, (first, ens) in enumerate(md.ensembles):
            if bookie_id not in ens:
                continue
            if not md.is_closed and index == len(md.ensembles) - 1:
                continue   # dry run of an open ledger: its last fragment's end is unknown
            lo, hi = md.fragment_bounds(index)
            mine = owned_entries(md, bookie_id, lo, hi)
            try:
                target = self._pick_replacement(md, index, ens, bookie_id, writable)
            except NotEnoughBookiesError as e:
                report.fragments.append(FragmentReport(lid, lo, hi, list(ens), None, len(mine),
                                                       error=str(e)))
                raise
            fr = FragmentReport(lid, lo, hi, list(ens), target, len(mine))
            report.fragments.append(fr)
            if dry_run:
                continue
            try:
                self._copy_fragment(md, ens, bookie_id, target, mine, mk, fr, alive)
            except TransientError:
                # most likely the target (sources have fallbacks): avoid it next time
                self.health.failed(target)
                raise
            self.health.ok(target)
            self._swap_bookie(lid, first, bookie_id, target, guards)
            fr.done = True

    def _copy_fragment(self, md, ens, bookie_id, target, entries, mk, fr, alive):
        """Copy ``entries`` of a fragment (those whose write set holds ``bookie_id``)
        to ``target`` with recovery adds, skipping those it already holds.

        Each entry is read from its sources in order: its surviving replicas
        (write-set order), then ``bookie_id`` itself if it is alive; an entry on
        no reachable source raises BKError naming it. The copy is a pipeline of
        batches of COPY_BATCH entries: the reads of the next READ_AHEAD batches
        are in flight (on every source at once) while the adds of up to
        ADD_WINDOW batches wait for the target's journal, so neither the sources'
        reads nor the target's group commits wait for the other. With bookies
        that take them (HELLO features), a source answers a batch's entries of
        one residue class (entry % E) with one READ_RANGE frame, and the target
        takes a batch as one ADD_BATCH frame (one group commit, one
        acknowledgement; then one batch of adds is in flight at a time)."""
        lid = md.ledger_id
        if not entries:
            return
        pool = self.bookies
        r = pool.call(target, lid, P.get_list_of_entries, lid)
        have = set(P.ranges_to_ids(r[4])) if r[2] == EOK and r[4] else set()
        todo = [e for e in entries if e not in have]
        fr.already = len(entries) - len(todo)
        if not todo:
            return
        # An entry's sources depend only on entry % E within a fragment.
        by_slot: dict[int, list] = {}
        width = len(ens)

        def sources(e):
            srcs = by_slot.get(e % width)
            if srcs is None:
                srcs = [b for b in md.write_set(e) if b != bookie_id]
                if alive:
                    srcs.append(bookie_id)
                by_slot[e % width] = srcs
            return srcs

        batches = [todo[i:i + COPY_BATCH] for i in range(0, len(todo), COPY_BATCH)]
        batched = bool(pool.features(target, lid) & P.FEATURE_ADD_BATCH)
        window = 1 if batched else ADD_WINDOW
        tried: set = set()
        reads: collections.deque = collections.deque()     # (batch, [(src, es, ticket)])
        adds: collections.deque = collections.deque()      # (batch, ticket, payload bytes)
        nxt = 0
        try:
            while nxt < len(batches) or reads:
                while nxt < len(batches) and len(reads) < READ_AHEAD:
                    reads.append(self._send_reads(lid, batches[nxt], sources, tried, width))
                    nxt += 1
                batch, sent = reads.popleft()
                got = self._collect_reads(lid, target, sent, sources, tried)
                while len(adds) >= window:
                    self._collect_adds(lid, target, adds.popleft(), fr)
                nbytes = sum(len(got[e][2]) for e in batch)
                self._throttle(nbytes)
                if batched:
                    # ADD_BATCH frames of up to ADD_BATCH_BYTES, one in flight at a
                    # time: a frame is appended in one go, so its group
                    # acknowledgement is its own (two frames in flight could share
                    # one, named by the later rid).
                    chunks, cur, cur_bytes = [], [], 0
                    for e in batch:
                        size = len(got[e][2])
                        if cur and cur_bytes + size > self.batch_bytes:
                            chunks.append(cur)
                            cur, cur_bytes = [], 0
                        cur.append(e)
                        cur_bytes += size
                    chunks.append(cur)
                    for i, chunk in enumerate(chunks):
                        rid = pool.rids(target, lid, 1)[0]
                        frame = P.encode_add_batch(rid, mk, P.FLAG_RECOVERY,
                                                   [(lid, e, *got[e]) for e in chunk])
                        item = (chunk, pool.send_frame(target, lid, frame, rid),
                                sum(len(got[e][2]) for e in chunk))
                        if i + 1 < len(chunks):
                            self._collect_adds(lid, target, item, fr)
                        else:
                            adds.append(item)
                else:
                    rids = pool.rids(target, lid, len(batch))
                    msgs = [P.add(rid, lid, e, got[e][0], mk, got[e][1], got[e][2], True)
                            for rid, e in zip(rids, batch)]
                    adds.append((batch, pool.send(target, lid, msgs), nbytes))
            while adds:
                self._collect_adds(lid, target, adds.popleft(), fr)
        except BaseException:
            # Responses still due would be stale on these connections: drop them.
            for _, sent in reads:
                for src, _, ticket, _ in sent:
                    if ticket is not None:
                        pool.drop(src)
            if adds:
                pool.drop(target)
            raise

    def _send_reads(self, lid, batch, sources, tried, width):
        """Send the reads of a batch, each entry to its first source (one pipelined
        send per source); (batch, [(source, entries, ticket or None if the send failed)])."""
        by_src: dict[str | None, list] = {}
        for e in batch:
            srcs = sources(e)
            by_src.setdefault(srcs[0] if srcs else None, []).append(e)
        sent = []
        pool = self.bookies
        for src, es in by_src.items():
            if src is None:            # no source at all: _collect_reads reports them
                sent.append((None, es, None, False))
                continue
            for e in es:
                tried.add((src, e))
            try:
                if pool.features(src, lid) & P.FEATURE_READ_RANGE:
                    # One READ_RANGE per residue class (entry % E) the source serves:
                    # its answer holds them all in one frame.
                    by_res: dict[int, list] = {}
                    for e in es:
                        by_res.setdefault(e % width, []).append(e)
                    for res, group in by_res.items():
                        rid = pool.rids(src, lid, 1)[0]
                        msg = P.read_range(rid, lid, group[0], group[-1], RANGE_BYTES,
                                           stride=width, offset=res)
                        sent.append((src, group, pool.send(src, lid, [msg]), True))
                    continue
                rids = pool.rids(src, lid, len(es))
                ticket = pool.send(src, lid, [P.read(rid, lid, e) for rid, e in zip(rids, es)])
            except BKError:
                ticket = None
                # The READ_RANGEs sent before the failure are collected as sent (their
                # answers fail with the dropped connection, or come): the failed row
                # holds the rest only. With every entry in it, those entries were
                # pending twice: read twice from their next source, and named twice
                # when on none ("entries [0, 0, 1, 2, 2]", soak seed 1701).
                ranged = {e for s, g, _, r in sent if r and s == src for e in g}
                es = [e for e in es if e not in ranged]
            sent.append((src, es, ticket, False))
        return batch, sent

    def _collect_reads(self, lid, target, sent, sources, tried) -> dict:
        """{entry: (lac, digest, payload)} of a batch sent by _send_reads; entries
        a source failed are read from their next sources, synchronously."""
        got: dict[int, tuple] = {}
        pending = []
        for src, es, ticket, ranged in sent:
            if ticket is None:
                pending.extend(es)
                continue
            try:
                resps = self.bookies.recv(ticket)
            except BKError:
                pending.extend(es)
                continue
            if ranged:
                resp = resps[0]
                if resp[2] != EOK:
                    pending.extend(es)
                    continue
                nxt, flat = resp[4], resp[5]
                for i in range(0, len(flat), 4):
                    got[flat[i]] = (flat[i + 1], flat[i + 2], flat[i + 3])
                for e in es:
                    if e not in got:
                        if e >= nxt:            # past the answer's byte budget: not a "no"
                            tried.discard((src, e))
                        pending.append(e)
                continue
            _take_reads(es, resps, got, pending)
        while pending:
            by_src: dict[str, list] = {}
            left = []
            for e in pending:
                src = next((b for b in sources(e) if (b, e) not in tried), None)
                if src is None:
                    left.append(e)
                else:
                    by_src.setdefault(src, []).append(e)
            if left:
                raise BKError(f"ledger {lid}: entries {sorted(left)[:5]} are on no reachable "
                              f"replica; cannot copy them to {target}")
            pending = []
            for src, es in by_src.items():
                for e in es:
                    tried.add((src, e))
                try:
                    rids = self.bookies.rids(src, lid, len(es))
                    resps = self.bookies.calls(src, lid,
                                               [P.read(rid, lid, e) for rid, e in zip(rids, es)])
                except BKError:
                    pending.extend(es)
                    continue
                _take_reads(es, resps, got, pending)
        return got

    def _collect_adds(self, lid, target, item, fr):
        batch, ticket, nbytes = item
        resps = self.bookies.recv(ticket)
        if resps and resps[0][0] == P.ADD_BATCH:      # a group acknowledgement
            ack = resps[0]
            P.check_add_ack(ack)
            errors = ack[4]
            if errors:
                raise error_for_status(errors[2], f"copy entry {errors[1]} of ledger {lid} "
                                                  f"to {target}")
            runs = ack[3]
            n = sum(runs[i + 2] - runs[i + 1] + 1 for i in range(0, len(runs), 3)
                    if runs[i] == lid)
            if n != len(batch):
                raise BKError(f"copy to {target}: the bookie acknowledged {n} of "
                              f"{len(batch)} entries of ledger {lid}")
        else:
            for e, resp in zip(batch, resps):
                if resp[2] != EOK:
                    raise error_for_status(resp[2], f"copy entry {e} of ledger {lid} to "
                                                    f"{target}")
        fr.copied += len(batch)
        fr.bytes_copied += nbytes

    def _throttle(self, nbytes: int) -> None:
        """Pace copies to ``rate_bytes`` per second (replicationRateByBytes)."""
        rate = self.rate_bytes
        if rate is None or rate <= 0:
            return
        now = time.monotonic()
        self._rate_debt = max(0.0, self._rate_debt - (now - self._rate_t) * rate) + nbytes
        self._rate_t = now
        if self._rate_debt > rate:          # more than a second's worth ahead: wait
            time.sleep((self._rate_debt - rate) / rate)

    def repair_in_place(self, ledger_id: int, bookie_id: str,
                        last: int | None = None) -> RecoveryReport:
        """Copy back to ``bookie_id`` (registered, writable) the entries of its write
        sets it lacks, from the other replicas (recovery adds; the ensembles do not
        change): a bookie that lost entries but not its place, as the auditor's
        periodic checks find. Open ledgers: up to ``last`` (else the complete
        fragments only). Nothing here needs a lock's guard: the metadata does not
        change, and a late copy of an entry's own bytes to its own bookie is
        harmless."""
        md, _ = self.store.read_ledger(ledger_id)
        report = RecoveryReport(bookie_id)
        report.ledgers.append(ledger_id)
        frags = expected_entries(md, last).get(bookie_id, [])
        if not frags:
            return report
        mk = self.master_key(md)
        for index, lo, hi in frags:
            mine = owned_entries(md, bookie_id, lo, hi)
            fr = FragmentReport(ledger_id, lo, hi, list(md.ensembles[index][1]), bookie_id,
                                len(mine))
            report.fragments.append(fr)
            self._copy_fragment(md, md.ensembles[index][1], bookie_id, bookie_id, mine, mk,
                                fr, False)
            fr.done = True
        return report

    def _swap_bookie(self, ledger_id, first, bookie_id, target, guards=()):
        """CAS the fragment at entry ``first``: ``bookie_id`` replaced by ``target``
        (re-applied to fresh metadata after a lost CAS; nothing if done already)."""
        def attempt():
            md, version = self.store.read_ledger(ledger_id)
            ensembles = [(f, list(ens)) for f, ens in md.ensembles]
            for i, (f, ens) in enumerate(ensembles):
                if f == first:
                    break
            else:
                raise BKError(f"ledger {ledger_id}: the fragment at entry {first} vanished")
            if bookie_id not in ens:
                return       # someone else replaced it already
            if target in ens:
                raise BKError(f"ledger {ledger_id}: {target} joined the fragment at entry "
                              f"{first} meanwhile; re-run recover")
            ens[ens.index(bookie_id)] = target
            ensembles[i] = (f, ens)
            self.store.write_ledger(md.replace(ensembles=ensembles), version, guards)
        retry_cas(f"ledger {ledger_id}: replace {bookie_id} by {target}", attempt)
