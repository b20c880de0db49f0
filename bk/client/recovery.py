"""Ledger recovery: how a reader takes over (closes) a ledger whose writer may be dead.

Theory of operation
-------------------
This is BookKeeper's "closing a ledger as a reader":

1. Check the password against the metadata's password digest, or an
   administrator's master key against the metadata's ``masterKey``
   (BadPasswordError before anything changes). A CLOSED ledger needs nothing.
2. CAS the metadata to IN_RECOVERY. A lost CAS re-reads; IN_RECOVERY already
   is fine (another recovery runs: concurrent recoveries converge because
   every step below is idempotent and the final CAS decides), CLOSED ends it.
3. Fence: READ_LAC with FLAG_FENCE and the master key to every bookie of the
   last ensemble, until (Qw - Qa) + 1 bookies of *every* write quorum have
   answered. From then on no write quorum can gather Qa acknowledgements for
   the old writer: whatever it has acknowledged is on a bookie we will ask.
4. Read forward from the highest LAC + 1 with the fence flag, asking every
   bookie of the entry's write set. An entry found (digest verified; for a
   mac ledger recovered with the master key only its shape, as the MAC needs
   the password) is written back, its LAC and digest bytes as read, to its
   whole write set with FLAG_RECOVERY through a recovery write handle (which
   replaces dead bookies by ensemble change like a writer does, and counts a
   write-back done only once every bookie of its write set has it, so that
   recovery leaves no entry it wrote under-replicated). Those ensemble changes
   stay in memory until step 5 (as in BookKeeper since 4.9): stored at once,
   they would outlive a recovery that fails later, and the next recovery would
   read the writer's entries from a replacement that never got them, counting
   its "no such entry" towards the (Qw - Qa) + 1 below, and truncate the ledger
   before an acknowledged entry.
   Reading stops at the first entry for which (Qw - Qa) + 1 bookies of its
   write set answer "no such entry/ledger": fewer than Qa bookies can have it,
   so it was never acknowledged.
5. CAS to CLOSED with the last entry found and its length (carried by the
   entry's digest field), and the write-back's ensemble changes. A lost CAS
   re-reads: CLOSED means another recovery won, and its result stands.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time

from bk import protocol
from bk.metrics import client_metrics
from bk.client import digest as _digest
from bk.client.ledger import LedgerHandle
from bk.errors import (BadPasswordError, BKError, DigestMismatchError, LedgerRecoveryError,
                       MetadataError, MetadataVersionError, NotEnoughBookiesError,
                       error_for_status)
from bk.errors import ENOENTRY, ENOLEDGER, EOK, EUA
from bk.meta.ledger import LedgerMetadata, LedgerState

log = logging.getLogger("bk.client")


def check_password(md: LedgerMetadata, password: bytes, what: str) -> None:
    if not isinstance(password, (bytes, bytearray)):
        raise TypeError(f"{what}: password must be bytes, not {type(password).__name__}")
    if not _digest.password_matches(md.password_digest, bytes(password)):
        raise BadPasswordError(f"{what}: wrong password")


def _cas_state(store, md, version, to_state, what, accept=(), guards=()):
    """CAS the state of ``md``; returns (md, version) as stored afterwards."""
    for _ in range(50):
        if md.state == to_state or md.state in accept:
            return md, version
        try:
            new = md.replace(state=to_state)
            return new, store.write_ledger(new, version, guards)
        except MetadataVersionError:
            md, version = store.read_ledger(md.ledger_id)
    raise MetadataError(f"{what}: too many CAS conflicts")


def check_master_key(md: LedgerMetadata, master_key: bytes, what: str) -> None:
    if not isinstance(master_key, (bytes, bytearray)):
        raise TypeError(f"{what}: master key must be bytes, not {type(master_key).__name__}")
    if not md.master_key:
        raise BadPasswordError(f"{what}: the ledger metadata has no master key (created by an "
                               f"older bk); give the ledger's password")
    if not hmac.compare_digest(bytes(master_key), md.master_key):
        raise BadPasswordError(f"{what}: wrong master key")


def recover_ledger(client, ledger_id: int, password: bytes | None = None,
                   master_key: bytes | None = None, guards=()) -> tuple[LedgerMetadata, int]:
    """Fence, recover and close ``ledger_id``; returns the CLOSED metadata and version.

    The one implementation of recovery: ``BookKeeper.open_ledger`` calls it
    with the ledger's ``password``; an administrator (``bk.admin``, ``bkshell
    recoverledger``) without the password passes ``master_key`` instead, the
    key the bookies hold (``LedgerMetadata.master_key``). Exactly one of the two
    is given; either is checked against the metadata (BadPasswordError before
    anything changes). Entries are written back with their digest bytes as
    read, so the master key suffices for every digest type; without the
    password a ``mac`` ledger's copies are taken from their write set unchecked.
    ``guards`` (a replication worker's lock) are compared by both metadata CASes
    (to IN_RECOVERY, before anything is fenced, and to CLOSED): a worker that
    lost its lock fences nothing and closes nothing.
    """
    started: list = []
    try:
        out = _recover_ledger(client, ledger_id, password, master_key, started, guards)
    except BaseException:
        if started:
            client_metrics().recoveries.labels("false").inc()
        raise
    if started:          # a ledger found closed was not recovered: not counted
        client_metrics().recoveries.labels("true").inc()
    return out


def _recover_ledger(client, ledger_id, password, master_key, started, guards=()):
    what = f"recover ledger {ledger_id}"
    if (password is None) == (master_key is None):
        raise ValueError(f"{what}: give the password or the master key (exactly one)")
    store = client._store
    md, version = store.read_ledger(ledger_id)
    if password is not None:
        check_password(md, password, f"open ledger {ledger_id}")
        password = bytes(password)
    else:
        check_master_key(md, master_key, what)
        master_key = bytes(master_key)
    if md.state == LedgerState.CLOSED:
        return md, version
    md, version = _cas_state(store, md, version, LedgerState.IN_RECOVERY, what,
                             accept=(LedgerState.CLOSED,), guards=guards)
    if md.state == LedgerState.CLOSED:
        return md, version
    t0 = time.monotonic()
    started.append(t0)
    found_md = md
    rh = LedgerHandle(client, md, version, password, writable=False, master_key=master_key)
    lac = _fence(client, rh, what)
    frag_first = md.ensembles[-1][0]
    lac0 = max(lac, frag_first - 1)
    length0 = 0
    if lac0 >= 0:
        try:
            length0 = rh._read_range(lac0, lac0, retry=False)[0].length
        except BKError as e:
            raise LedgerRecoveryError(f"{what}: cannot read the last confirmed entry {lac0}: {e}")
    # The recovery writer: writes found entries back with FLAG_RECOVERY.
    wh = LedgerHandle(client, md, version, password, writable=True, recovery=True,
                      lac=lac0, length=length0, master_key=master_key)
    last, length = lac0, length0
    e = lac0 + 1
    reader = _RecoveryReader(client, rh, what)
    try:
        while True:
            found = reader.get(e)
            if found is None:
                break
            data, elength, elac, edigest = found
            wh._submit_recovery(e, data, elength, elac, edigest)
            last, length = e, elength
            e += 1
        if not wh._drain(float(client.conf.addEntryTimeoutSec) * 3 + 30):
            raise LedgerRecoveryError(f"{what}: writing back recovered entries timed out")
        if wh._error is not None:
            cls, reason = wh._error
            raise LedgerRecoveryError(f"{what}: writing back entry failed: {reason}")
    finally:
        wh._closed = True
        client._io.call_soon(wh._stop_ticker)
    md, version = wh._md, wh._version
    # The write-back's ensemble changes, so far in wh's metadata only.
    mine = [fb for fb in md.ensembles if fb not in found_md.ensembles]
    for _ in range(50):
        if md.state == LedgerState.CLOSED:
            if md.last_entry_id != last:
                log.info("%s: another recovery closed it at %d (we found %d)", what,
                         md.last_entry_id, last)
            return md, version
        new = md.replace(state=LedgerState.CLOSED, last_entry_id=last, length=length)
        try:
            version = store.write_ledger(new, version, guards)
            log.info("%s: closed at entry %d, length %d (%.0f ms)", what, last, length,
                     (time.monotonic() - t0) * 1000)
            return new, version
        except MetadataVersionError:
            md, version = store.read_ledger(ledger_id)
            if mine and md.state != LedgerState.CLOSED:
                md = md.replace(ensembles=[(f, b) for f, b in md.ensembles if f < mine[0][0]]
                                + mine)
    raise MetadataError(f"{what}: too many CAS conflicts")


def _covered(answered: set, E: int, qw: int, need: int) -> bool:
    """True if every write quorum has ``need`` slots in ``answered``."""
    for i in range(E):
        if sum(1 for j in range(qw) if (i + j) % E in answered) < need:
            return False
    return True


def _fence(client, rh: LedgerHandle, what: str) -> int:
    """Fence the last ensemble; return the highest LAC the bookies report."""
    md = rh._md
    E, qw, qa = md.ensemble_size, md.write_quorum_size, md.ack_quorum_size
    need = qw - qa + 1
    ens = md.last_ensemble
    rh._prepare_conns(ens)
    cond = threading.Condition()
    answered: set = set()
    finished: list = []
    lacs = [-1]
    errors = []

    def on_done(call):
        slot = call.tag
        with cond:
            r = call.reply
            if r is not None and r[2] == EOK:
                answered.add(slot)
                if r[4] is not None:
                    lacs.append(r[4])
            elif r is not None and r[2] in (ENOLEDGER, ENOENTRY):
                answered.add(slot)
            elif r is not None and r[2] == EUA:
                errors.append(BadPasswordError(f"{what}: bookie {ens[slot]} refused the "
                                               f"master key"))
            else:
                errors.append(call.error or error_for_status(r[2], f"bookie {ens[slot]}"))
            finished.append(slot)
            cond.notify_all()

    timeout = rh._read_timeout
    for slot, conn in enumerate(rh._conns_of(ens)):
        client._io.request(conn, protocol.read_lac, md.ledger_id, True, rh._master_key,
                           timeout=timeout, callback=on_done, tag=slot)
    deadline = time.monotonic() + timeout + 5
    with cond:
        while not _covered(answered, E, qw, need) and len(finished) < E:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            cond.wait(left)
        if any(isinstance(e, BadPasswordError) for e in errors):
            raise next(e for e in errors if isinstance(e, BadPasswordError))
        if not _covered(answered, E, qw, need):
            raise NotEnoughBookiesError(
                f"{what}: could not fence enough bookies: {len(answered)} of {E} answered, "
                f"need {need} of every write quorum of {qw} "
                f"({'; '.join(str(e) for e in errors) or 'no answer'})")
        return max(lacs)


class _RecoveryReader:
    """Fencing reads of entries from their whole write sets, a window ahead.

    ``rh`` must hold the metadata as recovery found it: a replacement bookie
    added by a write-back ensemble change has none of the old writer's
    entries, and its "no such entry" must not count. :meth:`get` returns
    ``(payload, length, entry_lac, digest)`` if a good copy exists, None if (Qw - Qa) + 1 bookies
    of the write set say it does not exist, and raises LedgerRecoveryError
    when it cannot tell.
    """

    def __init__(self, client, rh: LedgerHandle, what: str, window: int = 64):
        self.client, self.rh, self.what, self.window = client, rh, what, window
        md = rh._md
        self.need = md.write_quorum_size - md.ack_quorum_size + 1
        self.cond = threading.Condition()
        self.state: dict = {}
        self.next = None

    def _start(self, entry_id):
        rh = self.rh
        ws = rh._md.write_set(entry_id)
        rh._prepare_conns(ws)
        st = self.state[entry_id] = {"found": None, "neg": 0, "n": 0, "of": len(ws),
                                     "errors": []}

        def on_done(call):
            r = call.reply
            with self.cond:
                st["n"] += 1
                if r is not None and r[2] == EOK and r[7] is not None:
                    try:
                        length = rh._digest.verify(entry_id, r[5], r[6], r[7])
                        if st["found"] is None:
                            st["found"] = (r[7], length, r[5], r[6])
                    except DigestMismatchError as e:
                        st["errors"].append(e)
                elif r is not None and (r[2] in (ENOENTRY, ENOLEDGER) or r[2] == EOK):
                    st["neg"] += 1
                else:
                    st["errors"].append(call.error or error_for_status(
                        r[2], f"bookie {call.conn.bookie_id}"))
                self.cond.notify_all()

        for conn in rh._conns_of(ws):
            self.client._io.request(conn, protocol.read, rh._lid, entry_id, True,
                                    rh._master_key, timeout=rh._read_timeout, callback=on_done)

    def get(self, entry_id):
        if self.next is None:
            self.next = entry_id
        while self.next < entry_id + self.window:
            self._start(self.next)
            self.next += 1
        st = self.state.pop(entry_id)
        deadline = time.monotonic() + self.rh._read_timeout + 5
        with self.cond:
            while st["found"] is None and st["neg"] < self.need and st["n"] < st["of"]:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            if st["found"] is not None:
                return st["found"]
            if st["neg"] >= self.need:
                return None
            raise LedgerRecoveryError(
                f"{self.what}: cannot tell whether entry {entry_id} exists: {st['neg']} of "
                f"{st['of']} bookies say no, need {self.need} "
                f"({'; '.join(str(e) for e in st['errors']) or 'no answer'})")
