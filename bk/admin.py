"""Administration of a bk cluster, usable without the CLI (``bkshell`` wraps it).

    from bk.admin import Admin
    with Admin("etcd://127.0.0.1:2379/ledgers") as admin:
        admin.list_bookies(all=True)
        report = admin.recover_bookie("127.0.0.1:3181")     # re-replicate a dead bookie
        print(report.summary())

A thin facade over the machinery where it lives: the metadata store
(:mod:`bk.meta.store`), raw bookie connections (:class:`bk.rawclient.BookiePool`)
and the fragment copy engine of auto-recovery
(:class:`bk.autorecovery.replicator.Replicator`, whose docstring explains
bookie recovery). A bookie's local directories are inspected by
:mod:`bk.bookie.inspect`.
"""

from __future__ import annotations

import logging
import os
import time

from bk import protocol as P
from bk.autorecovery.replicator import (FragmentReport, RecoveryReport,  # noqa: F401
                                        Replicator)
from bk.autorecovery.status import auditor_id
from bk.client import digest
from bk.client.placement import PlacementPolicy
from bk.errors import BKError, EOK, NoSuchEntryError, error_for_status
from bk.meta import underreplication as UR
from bk.meta.ledger import LedgerMetadata, LedgerState
from bk.meta.racks import DEFAULT_RACK, all_racks, get_rack, set_rack
from bk.meta.store import MetadataStore, _check_bookie_id
from bk.rawclient import BookiePool
from bk.security import ClientSecurity, client_settings
from bk.security.etcd import EtcdCredentials

log = logging.getLogger("bk.admin")


class Admin:
    """The cluster administration behind ``bkshell``."""

    def __init__(self, uri: str, timeout: float = 5.0, bookie_timeout: float = 10.0,
                 password: bytes | None = None, rate_bytes: int = -1,
                 max_frame: int = P.DEFAULT_MAX_FRAME_SIZE, placement: PlacementPolicy | None = None,
                 conf=None):
        self.uri = uri
        # where re-replicated fragments go (ensemblePlacementPolicy of the caller's conf)
        self.placement = placement or PlacementPolicy()
        # TLS and token towards bookies (bk.security), from the caller's conf if any
        security = ClientSecurity.from_conf(conf) if conf is not None else None
        etcd = EtcdCredentials.from_conf(conf) if conf is not None else None
        self.store = MetadataStore(uri, timeout=timeout, credentials=etcd)
        self.bookies = BookiePool(self.store, bookie_timeout, security=security)
        self.password = password
        self.replicator = Replicator(self.store, self.bookies, uri, timeout=timeout,
                                     bookie_timeout=bookie_timeout, password=password,
                                     rate_bytes=rate_bytes, max_frame=max_frame,
                                     placement=self.placement,
                                     client_settings=client_settings(conf) if conf else None)

    @property
    def client(self):
        """A :class:`bk.BookKeeper` on the same cluster (made on first use, with
        this admin's placement policy)."""
        return self.replicator.client

    def close(self) -> None:
        self.replicator.close()
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

    def placement_check(self, policy: PlacementPolicy | None = None,
                        progress=None) -> list[dict]:
        """Fragments that do not adhere to ``policy`` (default: this admin's):
        ``[{ledger, first_entry, ensemble, racks, min_racks}]``, with
        ``progress(ledgers_checked, rows_so_far)`` after each ledger. The walk is
        :meth:`Replicator.placement_check`'s, whose count the auditor exports."""
        return self.replicator.placement_check(policy or self.placement, progress)

    def master_key(self, md: LedgerMetadata) -> bytes:
        """The key the bookies hold for the ledger (see :meth:`Replicator.master_key`)."""
        return self.replicator.master_key(md)

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
            signer = digest.EntryDigest(ledger_id, md.digest_type, self.password or b"")
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

    # --- recovery (the replicator's) -------------------------------------------------
    def recover_ledger(self, ledger_id: int, guards=()) -> LedgerMetadata:
        """Fence and close a ledger as a reader (recovery open); returns the CLOSED
        metadata. The old writer's next add fails with LedgerFencedError."""
        return self.replicator.recover_ledger(ledger_id, guards)

    def recover_bookie(self, bookie_id: str, dry_run: bool = False, skip_open: bool = False,
                       ledger_ids=None, progress=None) -> RecoveryReport:
        """Re-replicate every ledger fragment that had ``bookie_id``
        (:meth:`Replicator.recover_bookie`)."""
        return self.replicator.recover_bookie(bookie_id, dry_run, skip_open, ledger_ids,
                                              progress)

    def ledgers_of(self, bookie_id: str) -> list[LedgerMetadata]:
        """Metadata of every ledger with a fragment whose ensemble holds ``bookie_id``."""
        return self.replicator.ledgers_of(bookie_id)

    def autorecovery_running(self) -> bool:
        """True if auto-recovery is enabled and an auditor is elected (so replication
        workers run: every auto-recovery process runs one)."""
        if UR.settings(self.store).get("enabled", True) is False:
            return False
        return auditor_id(self.store) is not None

    def decommission_bookie(self, bookie_id: str, progress=None,
                            use_autorecovery: bool | None = None,
                            poll: float = 0.5, auditor_wait: float = 0.0,
                            on_path=None, on_wait=None) -> RecoveryReport:
        """Recover everything of a bookie that is no longer running, then delete its
        cookie. Refuses while it is registered (alive).

        By auto-recovery (:meth:`decommission_path` decides, and says why through
        ``on_path(message)``): its ledgers are marked under-replicated and the
        cluster's replication workers copy them (paced, spread over workers, open
        ledgers given their grace period); this waits until none is left, calling
        ``progress(done, total, report)``. Ledgers a worker reports it cannot
        repair end the wait as failures. Otherwise this process copies, paced to
        the admin's ``rate_bytes``."""
        if self.store.bookie_info(bookie_id) is not None:
            raise BKError(f"bookie {bookie_id} is still registered (running); stop it first, "
                          f"then decommission it")
        by_ar, how = self.decommission_path(use_autorecovery, auditor_wait, poll, on_wait)
        if on_path is not None:
            on_path(how)
        if by_ar:
            report = self._decommission_by_autorecovery(bookie_id, progress, poll)
        else:
            report = self.replicator.recover_bookie(bookie_id, progress=progress)
        report.how = how
        if report.ok and not report.skipped_open:
            cookie, version = self.store.read_cookie(bookie_id)
            if cookie is not None:
                self.store.delete_cookie(bookie_id)
        return report

    def decommission_path(self, use_autorecovery: bool | None = None,
                          auditor_wait: float = 0.0, poll: float = 0.5,
                          on_wait=None) -> tuple[bool, str]:
        """(by auto-recovery?, why) for a decommission. An auditor elected now:
        auto-recovery. None, but processes run auto-recovery
        (``underreplication/candidates/``: a hand-over, ~0.5 s after a clean stop
        of the auditor, a lease's TTL after it died) or ``use_autorecovery`` asks
        for it: wait up to ``auditor_wait`` seconds for one, calling
        ``on_wait(waited, auditor_wait, why)`` every ``poll`` seconds; none by
        then: this process copies (BKError if auto-recovery was asked for). No
        auto-recovery in the cluster, ``use_autorecovery`` False, or
        auto-recovery disabled cluster-wide: this process copies."""
        if use_autorecovery is False:
            return False, self._copy_here("--no-autorecovery")
        if UR.settings(self.store).get("enabled", True) is False:
            if use_autorecovery:
                raise BKError("auto-recovery is disabled cluster-wide ('bkshell autorecovery "
                              "--enable' resumes it); --no-autorecovery copies from here")
            return False, self._copy_here("auto-recovery is disabled cluster-wide")
        auditor = auditor_id(self.store)
        if auditor is not None:
            return True, (f"auto-recovery: auditor {auditor} is elected; the cluster's "
                          f"replication workers re-replicate the ledgers")
        running = UR.candidates(self.store)
        if running:
            why = (f"{len(running)} auto-recovery process(es) run ({', '.join(running[:3])}"
                   f"{', ...' if len(running) > 3 else ''}) but no auditor is elected")
        elif use_autorecovery:
            why = "auto-recovery asked for (--autorecovery) but no auditor is elected"
        else:
            return False, self._copy_here("no process runs auto-recovery (no auditor, no "
                                          "candidate)")
        t0 = time.monotonic()
        while True:
            waited = time.monotonic() - t0
            if on_wait is not None:
                on_wait(waited, auditor_wait, why)
            if waited >= auditor_wait:
                break
            time.sleep(min(poll, max(0.0, auditor_wait - waited)))
            auditor = auditor_id(self.store)
            if auditor is not None:
                return True, (f"auto-recovery: auditor {auditor} elected after "
                              f"{time.monotonic() - t0:.1f}s of waiting; the cluster's "
                              f"replication workers re-replicate the ledgers")
        if use_autorecovery:
            raise BKError(f"{why}, and none was within {auditor_wait:g}s: is auto-recovery "
                          f"running ('bkshell whoisauditor')? --no-autorecovery copies "
                          f"from here")
        return False, self._copy_here(f"{why}, and none was within {auditor_wait:g}s")

    def _copy_here(self, why: str) -> str:
        rate = self.replicator.rate_bytes
        pace = (f"paced to {rate} bytes/s" if rate and rate > 0 else
                "not paced (--rate-bytes paces it)")
        return f"{why}: this process copies the ledgers, {pace}"

    def _decommission_by_autorecovery(self, bookie_id, progress, poll) -> RecoveryReport:
        t0 = time.monotonic()
        report = RecoveryReport(bookie_id, by_autorecovery=True)
        rep = self.replicator
        if not rep.bookie_known(bookie_id) and not rep.ledgers_of(bookie_id):
            raise BKError(f"bookie {bookie_id} not found: not registered, no cookie, and "
                          f"in no ledger's ensemble ({self.uri})")
        total: set[int] = set()
        while True:
            todo = {md.ledger_id for md in rep.ledgers_of(bookie_id)}
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
