"""Administration of a bk cluster, usable without the CLI (``bkshell`` wraps it).

    from bk.admin import Admin
    with Admin("etcd://127.0.0.1:2379/ledgers") as admin:
        admin.list_bookies(all=True)
        report = admin.recover_bookie("127.0.0.1:3181")     # re-replicate a dead bookie
        print(report.summary())

Theory of operation of bookie recovery (BookKeeper's ``recoverBookieData`` and
``LedgerFragmentReplicator``)
-----------------------------------------------------------------------------
For every ledger with a fragment (``(first entry, ensemble)`` of its metadata)
whose ensemble holds the lost bookie B:

1. A ledger that is not CLOSED and whose *last* ensemble holds B is first
   closed by a recovery (:meth:`Admin.recover_ledger`), which is the client's
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
import os
import random
import time
import zlib
from dataclasses import dataclass, field

from bk import protocol as P
from bk.errors import (BKError, BookieUnavailableError, EOK, MetadataError,
                       MetadataVersionError, NoSuchEntryError, NoSuchLedgerError,
                       NotEnoughBookiesError, BadPasswordError, error_for_status)
from bk.client.placement import PlacementPolicy, write_quorum_racks
from bk.meta.ledger import LedgerMetadata, LedgerState
from bk.meta.racks import DEFAULT_RACK, all_racks, get_rack, set_rack
from bk.meta.store import MetadataStore, _check_bookie_id

log = logging.getLogger("bk.admin")

BATCH = 256            # requests pipelined per round trip
# Re-replication (Admin._copy_fragment): entries per batch, batches whose reads are
# in flight ahead of their adds, batches of adds awaiting the target's journal.
COPY_BATCH = 256
READ_AHEAD = 2
ADD_WINDOW = 2
RANGE_BYTES = 4 << 20     # a READ_RANGE answer's budget (the bookie caps it at half a frame)
ADD_BATCH_BYTES = 1 << 20  # payload per ADD_BATCH frame of a copy (at most a quarter frame)


def _digest_mod():
    from bk.client import digest
    return digest


def _take_reads(entries, resps, got: dict, pending: list) -> None:
    """Sort READ answers: an entry read goes into ``got`` as (lac, digest, payload),
    one the source lacks (or failed) into ``pending`` for its next source."""
    for e, resp in zip(entries, resps):
        if resp[2] == EOK:
            got[e] = (resp[5], resp[6], resp[7])
        else:
            pending.append(e)


# --- bookie connections ------------------------------------------------------------

class BookiePool:
    """Blocking raw connections to bookies, one per (bookie, shard), made on demand."""

    def __init__(self, store: MetadataStore, timeout: float = 10.0):
        self.store = store
        self.timeout = timeout
        self._conns: dict = {}
        self._shards: dict[str, int] = {}
        self._addr: dict[str, str] = {}
        self._stash: dict = {}     # connection -> {rid: response} received ahead of its recv

    def address(self, bookie_id: str) -> str:
        addr = self._addr.get(bookie_id)
        if addr is None:
            info = self.store.bookie_info(bookie_id)
            addr = bookie_id
            if info and info.get("address") and info.get("port"):
                addr = f"{info['address']}:{info['port']}"
            if info and info.get("numShards"):
                self._shards[bookie_id] = int(info["numShards"])
            self._addr[bookie_id] = addr
        return addr

    def num_shards(self, bookie_id: str) -> int:
        addr = self.address(bookie_id)
        n = self._shards.get(bookie_id)
        if n is None:
            from bk.rawclient import BookieConnection
            with BookieConnection(addr, -1, timeout=self.timeout) as c:
                n = self._shards[bookie_id] = int(c.num_shards)
        return n

    def conn(self, bookie_id: str, ledger_id: int | None = None, shard: int | None = None):
        from bk.rawclient import BookieConnection
        if shard is None:
            shard = P.shard_of(ledger_id, self.num_shards(bookie_id))
        key = (bookie_id, shard)
        c = self._conns.get(key)
        if c is None:
            try:
                c = BookieConnection(self.address(bookie_id), shard, timeout=self.timeout)
            except OSError as e:
                raise BookieUnavailableError(f"connect to bookie {bookie_id}: {e}") from None
            self._conns[key] = c
        return c

    def drop(self, bookie_id: str) -> None:
        for key in [k for k in self._conns if k[0] == bookie_id]:
            c = self._conns.pop(key)
            self._stash.pop(c, None)
            try:
                c.close()
            except OSError:
                pass

    def send(self, bookie_id: str, ledger_id: int, msgs: list):
        """Send ``msgs`` pipelined on one connection without waiting; returns the
        ticket :meth:`recv` takes. Several tickets may be outstanding on one
        connection (and on several bookies) at once: that is how a copy keeps
        reads and adds in flight together. BookieUnavailableError (and the
        bookie's connections dropped) if the bookie fails."""
        try:
            c = self.conn(bookie_id, ledger_id)
            c.send_raw(b"".join(P.encode_frame(m) for m in msgs))
        except (OSError, BookieUnavailableError) as e:
            self.drop(bookie_id)
            raise BookieUnavailableError(f"bookie {bookie_id}: {e}") from None
        return bookie_id, c, [m[1] for m in msgs]

    def recv(self, ticket) -> list:
        """The responses to a :meth:`send`, in its order. Responses to other
        requests on the connection met on the way are kept for their own recv."""
        bookie_id, c, rids = ticket
        if not rids:
            return []
        stash = self._stash.setdefault(c, {})
        out = []
        try:
            for rid in rids:
                r = stash.pop(rid, None)
                while r is None:
                    resp = c.recv()
                    if resp[1] == rid:
                        r = resp
                    else:
                        stash[resp[1]] = resp
                out.append(r)
        except (OSError, BookieUnavailableError, IndexError, TypeError) as e:
            self._stash.pop(c, None)
            self.drop(bookie_id)
            raise BookieUnavailableError(f"bookie {bookie_id}: {e}") from None
        if not stash:
            del self._stash[c]
        return out

    def features(self, bookie_id: str, ledger_id: int) -> int:
        """What the bookie announced at HELLO (``P.FEATURE_*`` bits)."""
        return self.conn(bookie_id, ledger_id).features

    def send_frame(self, bookie_id: str, ledger_id: int, frame: bytes, rid: int):
        """Send one pre-encoded frame (e.g. an ADD_BATCH); a ticket for :meth:`recv`."""
        try:
            c = self.conn(bookie_id, ledger_id)
            c.send_raw(frame)
        except (OSError, BookieUnavailableError) as e:
            self.drop(bookie_id)
            raise BookieUnavailableError(f"bookie {bookie_id}: {e}") from None
        return bookie_id, c, [rid]

    def calls(self, bookie_id: str, ledger_id: int, msgs: list) -> list:
        """Send ``msgs`` pipelined on one connection; their responses in order.
        BookieUnavailableError (and the connection dropped) if the bookie fails."""
        if not msgs:
            return []
        return self.recv(self.send(bookie_id, ledger_id, msgs))

    def call(self, bookie_id: str, ledger_id: int, build, *args) -> list:
        c = self.conn(bookie_id, ledger_id)
        return self.calls(bookie_id, ledger_id, [build(c.next_rid(), *args)])[0]

    def rids(self, bookie_id: str, ledger_id: int, n: int) -> list[int]:
        c = self.conn(bookie_id, ledger_id)
        return [c.next_rid() for _ in range(n)]

    def close(self) -> None:
        for c in self._conns.values():
            try:
                c.close()
            except OSError:
                pass
        self._conns.clear()
        self._stash.clear()


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


# --- helpers -----------------------------------------------------------------------

def fragment_bounds(md: LedgerMetadata, index: int, last_entry: int | None = None):
    """(first, last) entry ids of fragment ``index``; last may be < first (empty).
    ``last_entry``: the ledger's last entry when known (else the metadata's)."""
    first = md.ensembles[index][0]
    if index + 1 < len(md.ensembles):
        return first, md.ensembles[index + 1][0] - 1
    last = md.last_entry_id if last_entry is None else last_entry
    return first, last


class Admin:
    """The cluster administration behind ``bkshell``."""

    def __init__(self, uri: str, timeout: float = 5.0, bookie_timeout: float = 10.0,
                 password: bytes | None = None, rate_bytes: int = -1,
                 max_frame: int = P.DEFAULT_MAX_FRAME_SIZE, placement: PlacementPolicy | None = None):
        self.uri = uri
        # where re-replicated fragments go (ensemblePlacementPolicy of the caller's conf)
        self.placement = placement or PlacementPolicy()
        self._racks_at: tuple = (0.0, None)
        self.store = MetadataStore(uri, timeout=timeout)
        self.bookies = BookiePool(self.store, bookie_timeout)
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
    def client(self):
        """A :class:`bk.BookKeeper` on the same cluster (made on first use): ledger
        recovery goes through the client's implementation."""
        if self._client is None:
            from bk.client.bookkeeper import BookKeeper
            pl = self.placement
            self._client = BookKeeper(self.uri,
                                      ensemblePlacementPolicy=pl.name,
                                      minNumRacksPerWriteQuorum=pl.min_racks,
                                      enforceMinNumRacksPerWriteQuorum=pl.enforce,
                                      metadataTimeoutMillis=max(1, int(self._timeout * 1000)),
                                      readEntryTimeoutSec=self._bookie_timeout,
                                      addEntryTimeoutSec=self._bookie_timeout)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        self.bookies.close()
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- cluster ------------------------------------------------------------------
    def metaformat(self, force: bool = False) -> str:
        """Create the cluster (with ``force``: anew, deleting its metadata); return
        its new instanceId."""
        self.store.format(force)
        return self.store.instance_id

    def list_bookies(self, readonly: bool = False, all: bool = False) -> list[dict]:  # noqa: A002
        """[{id, address, state, rack, shards, pid, httpPort}] of registered bookies
        (writable by default); httpPort is None unless the bookie serves HTTP."""
        out = []
        racks = all_racks(self.store)
        for bid, info in self.store.all_bookies().items():
            ro = bool(info.get("readonly"))
            if not all and ro != readonly:
                continue
            addr = f"{info['address']}:{info['port']}" if info.get("address") and \
                info.get("port") else bid
            out.append({"id": bid, "address": addr, "state": "readonly" if ro else "writable",
                        "rack": racks.get(bid, DEFAULT_RACK), "shards": info.get("numShards"), "pid": info.get("pid"),
                        "httpPort": info.get("httpPort")})
        return out

    def set_rack(self, bookie_id: str, rack: str) -> str:
        """Put a bookie in ``/region/rack`` (it need not be running); returns the path."""
        _check_bookie_id(bookie_id)
        return set_rack(self.store, bookie_id, rack)

    def get_rack(self, bookie_id: str) -> dict:
        """{id, rack, stored}: the bookie's rack (the default one if none is stored)."""
        _check_bookie_id(bookie_id)
        rack = get_rack(self.store, bookie_id)
        return {"id": bookie_id, "rack": rack or DEFAULT_RACK, "stored": rack is not None}

    def require_bookie(self, bookie_id: str) -> dict:
        """The registration info of a live bookie; BKError naming it otherwise."""
        info = self.store.bookie_info(bookie_id)
        if info is None:
            known = ", ".join(self.store.all_bookies()) or "none"
            raise BKError(f"bookie {bookie_id} is not registered (registered: {known})")
        return info

    def bookie_info(self, bookie_id: str | None = None) -> list[dict]:
        """Free/total space and storage counters of each registered bookie (or one),
        by GET_BOOKIE_INFO to each of its shards."""
        ids = [bookie_id] if bookie_id else list(self.store.all_bookies())
        if bookie_id:
            self.require_bookie(bookie_id)
        out = []
        for bid in ids:
            row = {"id": bid}
            try:
                n = self.bookies.num_shards(bid)
                infos = []
                for shard in range(n):
                    c = self.bookies.conn(bid, shard=shard)
                    r = c.call(P.get_bookie_info(c.next_rid()))
                    if r[2] != EOK:
                        raise error_for_status(r[2], f"bookie info of {bid}")
                    infos.append(r[3])
                first = infos[0]
                row.update(free_bytes=first.get("free_bytes"), total_bytes=first.get("total_bytes"),
                           usage=first.get("usage"), readonly=any(i.get("readonly") for i in infos),
                           shards=n, ledgers=sum(i.get("ledgers", 0) for i in infos),
                           entries=sum(i.get("entries", 0) for i in infos),
                           journal_bytes=sum(i.get("journal_bytes", 0) for i in infos))
            except (BKError, OSError) as e:
                self.bookies.drop(bid)
                row["error"] = str(e)
            out.append(row)
        return out

    def bookie_sanity(self, bookie_id: str, entries: int = 10, entry_size: int = 100) -> dict:
        """Create a ledger (E=Qw=Qa=1) on exactly ``bookie_id``, write ``entries``,
        read them back, delete the ledger. Raises BKError describing a failure."""
        digest = _digest_mod()
        info = self.require_bookie(bookie_id)
        if info.get("readonly"):
            raise BKError(f"bookie sanity of {bookie_id}: the bookie is read-only")
        pw = b"bookiesanity"
        t0 = time.monotonic()
        lid = self.store.new_ledger_id()
        md = LedgerMetadata(ledger_id=lid, ensemble_size=1, write_quorum_size=1,
                            ack_quorum_size=1, ensembles=[(0, [bookie_id])],
                            digest_type="crc32c", password_digest=digest.password_digest(pw),
                            master_key=digest.master_key(pw),
                            custom_metadata={"application": b"bkshell-bookiesanity"})
        version = self.store.create_ledger(md)
        try:
            signer = digest.EntryDigest(lid, "crc32c", pw)
            payloads = [os.urandom(entry_size) for _ in range(entries)]
            mk = digest.master_key(pw)
            adds, length = [], 0
            rids = self.bookies.rids(bookie_id, lid, entries)
            for eid, data in enumerate(payloads):
                length += len(data)
                adds.append(P.add(rids[eid], lid, eid, eid - 1, mk,
                                  signer.sign(eid, eid - 1, length, data), data))
            for r in self.bookies.calls(bookie_id, lid, adds):
                if r[2] != EOK:
                    raise error_for_status(r[2], f"bookie sanity: add entry {r[4]} of ledger "
                                                 f"{lid} to {bookie_id}")
            rids = self.bookies.rids(bookie_id, lid, entries)
            reads = [P.read(rids[e], lid, e) for e in range(entries)]
            for e, r in enumerate(self.bookies.calls(bookie_id, lid, reads)):
                if r[2] != EOK:
                    raise error_for_status(r[2], f"bookie sanity: read entry {e} of ledger "
                                                 f"{lid} from {bookie_id}")
                signer.verify(e, r[5], r[6], r[7])
                if r[7] != payloads[e]:
                    raise BKError(f"bookie sanity: entry {e} of ledger {lid} read back from "
                                  f"{bookie_id} differs from what was written")
            self.store.write_ledger(md.replace(state=LedgerState.CLOSED,
                                               last_entry_id=entries - 1, length=length), version)
        finally:
            try:
                self.store.delete_ledger(lid)
            except BKError as e:
                log.warning("bookie sanity: could not delete ledger %d: %s", lid, e)
        return {"bookie": bookie_id, "ledger": lid, "entries": entries,
                "seconds": round(time.monotonic() - t0, 3), "ok": True}

    # --- ledgers ------------------------------------------------------------------
    def ledger_metadata(self, ledger_id: int) -> LedgerMetadata:
        return self.store.read_ledger(ledger_id)[0]

    def delete_ledger(self, ledger_id: int) -> None:
        self.store.delete_ledger(ledger_id)

    def list_ledgers(self):
        return self.store.list_ledgers()

    def list_ledger_metadata(self):
        for md, _ in self.store.list_ledger_metadata():
            yield md

    def placement_check(self, policy: PlacementPolicy) -> list[dict]:
        """Fragments whose write quorums span fewer racks (regions) than ``policy``
        asks, where the racks that have writable bookies now could meet it:
        ``[{ledger, first_entry, ensemble, racks, min_racks}]``, racks being the
        fewest any write quorum of the fragment spans."""
        racks = all_racks(self.store)
        domain = policy._domain(racks)
        available = len({domain(b) for b in self.store.list_bookies()})
        out = []
        for md in self.list_ledger_metadata():
            for first, ens in md.ensembles:
                if not policy.adheres(ens, md.write_quorum_size, racks, available):
                    out.append({"ledger": md.ledger_id, "first_entry": first,
                                "ensemble": list(ens),
                                "racks": min(write_quorum_racks(ens, md.write_quorum_size,
                                                                domain)),
                                "min_racks": policy.min_racks})
        return out

    def master_key(self, md: LedgerMetadata) -> bytes:
        """The key the bookies hold for the ledger: from the metadata, else from the
        admin's password (checked against the password digest)."""
        if md.master_key:
            return md.master_key
        digest = _digest_mod()
        if self.password is not None:
            if not digest.password_matches(md.password_digest, self.password):
                raise BadPasswordError(f"ledger {md.ledger_id}: the given password does not "
                                       f"match the ledger's")
            return digest.master_key(self.password)
        raise BadPasswordError(f"ledger {md.ledger_id}: its metadata has no master key "
                               f"(created by an older bk); give the ledger's password")

    def read_entry_raw(self, md: LedgerMetadata, entry_id: int, exclude=()) -> tuple:
        """(entry_lac, digest, payload) from the first replica that has it."""
        errors = []
        for b in md.write_set(entry_id):
            if b in exclude:
                continue
            try:
                r = self.bookies.call(b, md.ledger_id, P.read, md.ledger_id, entry_id)
            except BKError as e:
                errors.append(str(e))
                continue
            if r[2] == EOK:
                return r[5], r[6], r[7]
            errors.append(f"{b}: {error_for_status(r[2], 'read')}")
        if errors and all("no such" in e.lower() for e in errors):
            raise NoSuchEntryError(f"read entry {entry_id} of ledger {md.ledger_id}: no "
                                   f"replica has it")
        raise BKError(f"read entry {entry_id} of ledger {md.ledger_id}: "
                      f"{'; '.join(errors) or 'no replica'}")

    def read_entries(self, ledger_id: int, first: int = 0, last: int | None = None,
                     verify: bool = True):
        """Yield (entry_id, payload) of a ledger, straight from the bookies.

        ``last`` defaults to the last entry of a CLOSED ledger; for a ledger not
        closed, reading goes on until no replica has the next entry. Digests of
        crc32/crc32c ledgers are verified (and of mac ledgers when a password is set)."""
        md = self.ledger_metadata(ledger_id)
        if first < 0:
            raise ValueError(f"read ledger {ledger_id}: --from must be >= 0, not {first}")
        if last is None and md.is_closed:
            last = md.last_entry_id
        if md.is_closed and last is not None and last > md.last_entry_id:
            raise NoSuchEntryError(f"read ledger {ledger_id}: entry {last} is past the last "
                                   f"entry {md.last_entry_id} of the closed ledger")
        signer = None
        if verify and (md.digest_type != "mac" or self.password is not None):
            signer = _digest_mod().EntryDigest(ledger_id, md.digest_type, self.password or b"")
        e = first
        while last is None or e <= last:
            try:
                lac, dig, payload = self.read_entry_raw(md, e)
            except NoSuchEntryError:
                if last is None:
                    return
                raise
            if signer is not None:
                signer.verify(e, lac, dig, payload)
            yield e, payload
            e += 1

    # --- recovery of one ledger -----------------------------------------------------
    def recover_ledger(self, ledger_id: int, guards=()) -> LedgerMetadata:
        """Fence and close a ledger as a reader (recovery open); returns the CLOSED
        metadata. The old writer's next add fails with LedgerFencedError.

        This is the client's recovery (:func:`bk.client.recovery.recover_ledger`)
        with the master key from the metadata, or, for older metadata without
        one, with the admin's password. ``guards`` are compared by its metadata
        CASes (a replication worker's lock)."""
        from bk.client import recovery
        md = self.ledger_metadata(ledger_id)
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
        return [md for md in self.list_ledger_metadata()
                if any(bookie_id in ens for _, ens in md.ensembles)]

    def bookie_known(self, bookie_id: str) -> bool:
        if self.store.bookie_info(bookie_id) is not None:
            return True
        return self.store.read_cookie(bookie_id)[0] is not None

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
        from bk.autorecovery.checker import owned_entries
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
            lo, hi = fragment_bounds(md, index)
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
            self._copy_fragment(md, ens, bookie_id, target, mine, mk, fr, alive)
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
        from bk.autorecovery.checker import expected_entries, owned_entries
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
        for _ in range(50):
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
            try:
                self.store.write_ledger(md.replace(ensembles=ensembles), version, guards)
                return
            except MetadataVersionError:
                continue
        raise MetadataError(f"ledger {ledger_id}: too many CAS conflicts replacing {bookie_id}")

    def autorecovery_running(self) -> bool:
        """True if auto-recovery is enabled and an auditor is elected (so replication
        workers run: every auto-recovery process runs one)."""
        from bk.meta import underreplication as UR
        if UR.settings(self.store).get("enabled", True) is False:
            return False
        value, _ = self.store.get_json(UR.AUDITOR)
        return isinstance(value, dict) and bool(value.get("id"))

    def decommission_bookie(self, bookie_id: str, progress=None,
                            use_autorecovery: bool | None = None,
                            poll: float = 0.5) -> RecoveryReport:
        """Recover everything of a bookie that is no longer running, then delete its
        cookie. Refuses while it is registered (alive).

        When auto-recovery runs (``use_autorecovery`` None: if an auditor is
        elected), its ledgers are marked under-replicated and the cluster's
        replication workers copy them (paced, spread over workers, open ledgers
        given their grace period); this waits until none is left, calling
        ``progress(done, total, report)``. Ledgers a worker reports it cannot
        repair end the wait as failures. Otherwise this process copies."""
        if self.store.bookie_info(bookie_id) is not None:
            raise BKError(f"bookie {bookie_id} is still registered (running); stop it first, "
                          f"then decommission it")
        if use_autorecovery is None:
            use_autorecovery = self.autorecovery_running()
        if use_autorecovery:
            report = self._decommission_by_autorecovery(bookie_id, progress, poll)
        else:
            report = self.recover_bookie(bookie_id, progress=progress)
        if report.ok and not report.skipped_open:
            cookie, version = self.store.read_cookie(bookie_id)
            if cookie is not None:
                self.store.delete_cookie(bookie_id)
        return report

    def _decommission_by_autorecovery(self, bookie_id, progress, poll) -> RecoveryReport:
        from bk.meta import underreplication as UR
        t0 = time.monotonic()
        report = RecoveryReport(bookie_id, by_autorecovery=True)
        if not self.bookie_known(bookie_id) and not self.ledgers_of(bookie_id):
            raise BKError(f"bookie {bookie_id} not found: not registered, no cookie, and "
                          f"in no ledger's ensemble ({self.uri})")
        total: set[int] = set()
        while True:
            todo = {md.ledger_id for md in self.ledgers_of(bookie_id)}
            if not todo:
                break
            for lid in sorted(todo):         # again for any a worker let go unrepaired
                UR.mark(self.store, lid, [bookie_id])
            total |= todo
            report.ledgers = sorted(total)
            # Wait for the workers: a record disappears once its ledger is repaired
            # (or deleted); one with an error is a ledger they cannot repair now.
            while True:
                left = {lid: rec for lid, rec, _ in UR.list_marked(self.store)
                        if lid in total}
                if progress:
                    progress(len(total) - len(left), len(total), report)
                if not left:
                    break
                failed = {lid: rec["error"] for lid, rec in left.items() if rec.get("error")}
                if failed and len(failed) == len(left):
                    report.failed = failed
                    report.seconds = time.monotonic() - t0
                    return report
                time.sleep(poll)
        report.seconds = time.monotonic() - t0
        return report


# --- local inspection (a bookie's own directories) ----------------------------------------

def local_num_shards(conf) -> int:
    from bk.bookie import layout
    for d in layout.all_dirs(conf):
        cookie = layout.read_local_cookie(d)
        if cookie and cookie.get("numShards"):
            return int(cookie["numShards"])
    return conf.num_shards


def read_checkpoint_mark(index_dir: str):
    """The journal mark ("seq:offset") of a shard's last checkpoint, or None."""
    import msgpack
    from crc32c import crc32c
    from bk.bookie import storage as S
    path = os.path.join(index_dir, S.CHECKPOINT_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None, None
    outer = msgpack.unpackb(data, raw=False)
    if not (isinstance(outer, list) and len(outer) == 4 and outer[0] == S.CHECKPOINT_MAGIC):
        raise BKError(f"{path} is not a bk shard checkpoint")
    if crc32c(outer[3]) != outer[2]:
        raise BKError(f"{path}: CRC mismatch")
    body = msgpack.unpackb(outer[3], raw=False, strict_map_key=False)
    return tuple(body["mark"]), os.path.getmtime(path)


def last_marks(conf) -> list[dict]:
    """Checkpoint mark of each shard of the bookie described by ``conf``."""
    from bk.bookie import journal as J, layout
    out = []
    for shard in range(local_num_shards(conf)):
        jd, idx = layout.shard_dirs(conf, shard)
        mark, mtime = read_checkpoint_mark(idx)
        out.append({"shard": shard, "mark": J.format_mark(mark) if mark else None,
                    "checkpoint_time": mtime, "journal_dir": jd, "index_dir": idx})
    return out


def read_journal(conf, shard: int = 0, start=None, limit: int | None = None):
    """Decoded records of one shard's journal, read-only (never truncating)."""
    from bk.bookie import journal as J, layout
    n = local_num_shards(conf)
    if not 0 <= shard < n:
        raise ValueError(f"shard {shard} does not exist: the bookie has {n} shards (0..{n - 1})")
    jd, _ = layout.shard_dirs(conf, shard)
    if not os.path.isdir(jd):
        raise BKError(f"journal directory {jd} of shard {shard} does not exist")
    for i, rec in enumerate(J.iter_records(jd, start)):
        if limit is not None and i >= limit:
            return
        yield rec


def describe_record(rec) -> dict:
    from bk.bookie import journal as J
    d = {"mark": J.format_mark((rec.seq, rec.offset)), "type": rec.type_name,
         "length": rec.length}
    f = rec.fields
    t = rec.type
    if t == J.ADD:
        ledger, entry, lac, digest, payload = f[:5]
        d.update(ledger=ledger, entry=entry, lac=lac, digest_bytes=len(digest),
                 payload_bytes=len(payload))
    elif t in (J.FENCE, J.DELETE, J.DROP):
        d.update(ledger=f[0])
    elif t == J.MASTER_KEY:
        d.update(ledger=f[0], key_bytes=len(f[1]))
    elif t == J.WRITE_LAC:
        d.update(ledger=f[0], lac=f[1])
    elif t == J.STATE:
        d.update(ledger=f[0], fenced=bool(f[1]), lac=f[2])
    else:
        d.update(fields=[x if not isinstance(x, (bytes, memoryview)) else f"<{len(x)} bytes>"
                         for x in f])
    return d
