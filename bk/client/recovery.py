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
   bookie of the entry's write set (by windows: one fencing READ_RANGE per
   bookie per window, or a fencing READ per entry to a bookie without it). An entry found (digest verified; for a
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

A client closed under a recovery ends it at once with ClientClosedError
(fencing, reading or writing back, whichever step it was in), never with
"could not fence" or "cannot tell" after waiting out a read timeout; it
leaves the ledger IN_RECOVERY, which the next recovery finishes (every step
is idempotent).
"""

from __future__ import annotations

import hmac
import logging
import threading
import time

from bk import protocol
from bk.exposition import client_metrics
from bk.client import digest as _digest
from bk.client.connection import closed_error_among
from bk.client.ledger import LedgerHandle
from bk.errors import (BadPasswordError, BKError, ClientClosedError, DigestMismatchError,
                       LedgerRecoveryError,
                       MetadataError, SecurityError, MetadataVersionError, NoSuchLedgerError,
                       NotEnoughBookiesError, error_for_status)
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
        try:
            out = _recover_ledger(client, ledger_id, password, master_key, started, guards)
        except MetadataError:
            _check_open(client, f"recover ledger {ledger_id}")   # the store closed with it
            raise
        except NoSuchLedgerError as e:
            if not started:
                raise           # absent (or deleted) before the recovery began
            # deleted under it: its CAS, a read or a write-back found it gone
            raise NoSuchLedgerError(f"recover ledger {ledger_id}: the ledger was deleted "
                                    f"during the recovery ({e})") from None
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
    _check_open(client, what)
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
            length0 = rh.read_entry_once(lac0).length
        except (ClientClosedError, NoSuchLedgerError):
            raise
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
            wh.write_back(e, data, elength, elac, edigest)
            last, length = e, elength
            e += 1
        if not wh.wait_written(float(client.conf.addEntryTimeoutSec) * 3 + 30):
            _check_open(client, what)
            raise LedgerRecoveryError(f"{what}: writing back recovered entries timed out")
        failure = wh.failure()
        if failure is not None:
            _cls, reason = failure
            if _cls is ClientClosedError:
                raise client._closed_error(what)
            if _cls is NoSuchLedgerError:        # bookies refused: the ledger was deleted
                raise NoSuchLedgerError(f"{what}: writing back entry failed: {reason}")
            raise LedgerRecoveryError(f"{what}: writing back entry failed: {reason}")
    finally:
        wh.retire()
    md, version = wh.metadata, wh.metadata_version
    # The write-back's ensemble changes, so far in wh's metadata only.
    mine = [fb for fb in md.ensembles if fb not in found_md.ensembles]
    _check_open(client, what)
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


def _check_open(client, what):
    if client._closed:
        raise client._closed_error(what)


def _covered(answered: set, E: int, qw: int, need: int) -> bool:
    """True if every write quorum has ``need`` slots in ``answered``."""
    for i in range(E):
        if sum(1 for j in range(qw) if (i + j) % E in answered) < need:
            return False
    return True


def _fence(client, rh: LedgerHandle, what: str) -> int:
    """Fence the last ensemble; return the highest LAC the bookies report."""
    md = rh.metadata
    E, qw, qa = md.ensemble_size, md.write_quorum_size, md.ack_quorum_size
    need = qw - qa + 1
    ens = md.last_ensemble
    conns = rh.connections(ens)
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

    timeout = rh.read_timeout
    for slot, conn in enumerate(conns):
        rh.fencing_read_lac(conn, on_done, slot)
    deadline = time.monotonic() + timeout + 5
    with cond:
        while not _covered(answered, E, qw, need) and len(finished) < E:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            cond.wait(left)
        if closed_error_among(errors) is not None:
            raise client._closed_error(what)
        for refused in (BadPasswordError, SecurityError):   # AuthError: may not fence
            if any(isinstance(e, refused) for e in errors):
                raise next(e for e in errors if isinstance(e, refused))
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

    Reads go by windows of ``window`` entries: each bookie of the ensemble gets
    ONE fencing READ_RANGE for the window (the entries it is in the write set
    of are answered in one frame, the ones it lacks being its "no"), followed
    up from ``next`` if the answer was cut by its byte budget; a bookie without
    FEATURE_READ_RANGE gets a fencing READ per entry, as before.
    """

    def __init__(self, client, rh: LedgerHandle, what: str, window: int = 256):
        self.client, self.rh, self.what, self.window = client, rh, what, window
        md = rh.metadata
        self.need = md.write_quorum_size - md.ack_quorum_size + 1
        self.cond = threading.Condition()
        self.state: dict = {}
        self.next = None

    def _note(self, entry_id, bookie, reply=None, error=None):
        """One bookie's answer about one entry (I/O thread): a READ-shaped
        ``reply`` ``(status, entry_lac, digest, payload)`` or an ``error``."""
        st = self.state.get(entry_id)
        if st is None or bookie in st["from"]:
            return
        st["from"].add(bookie)
        with self.cond:
            st["n"] += 1
            if reply is not None and reply[0] == EOK and reply[3] is not None:
                try:
                    length = self.rh.verify_entry(entry_id, reply[1], reply[2], reply[3])
                    if st["found"] is None:
                        st["found"] = (reply[3], length, reply[1], reply[2])
                except DigestMismatchError as e:
                    st["errors"].append(e)
            elif reply is not None and reply[0] in (ENOENTRY, ENOLEDGER, EOK):
                st["neg"] += 1
            else:
                st["errors"].append(error or error_for_status(reply[0], f"bookie {bookie}"))
            self.cond.notify_all()

    def _start_single(self, entry_id, conn):
        def on_done(call):
            r = call.reply
            if r is not None:
                self._note(entry_id, conn.bookie_id, (r[2], r[5], r[6], r[7]))
            else:
                self._note(entry_id, conn.bookie_id, error=call.error)

        self.rh.fencing_read(conn, entry_id, on_done)

    def _start_window(self, first, last):
        rh = self.rh
        md = rh.metadata
        for e in range(first, last + 1):
            ws = md.write_set(e)
            self.state[e] = {"found": None, "neg": 0, "n": 0, "of": len(ws), "errors": [],
                             "from": set()}
        by_bookie: dict = {}
        for e in range(first, last + 1):
            for b in md.write_set(e):
                by_bookie.setdefault(b, []).append(e)
        conns = dict(zip(by_bookie, rh.connections(by_bookie)))
        ranges = []
        for b, entries in by_bookie.items():
            conn = conns[b]
            if len(entries) == 1 or not self.client._io.batching:
                for e in entries:
                    self._start_single(e, conn)
            else:
                ranges.append(_RecoveryRange(self, conn, entries))
        if ranges:
            # This is the caller's thread: a connection is the I/O thread's alone.
            # Sent from here, a READ_RANGE to a bookie whose connection had broken
            # connected it from this thread, racing the I/O thread's poll (a soak
            # saw the loop die of an epoll event of an fd it had no connection for).
            self.client._io.call_soon(_RecoveryRange.start_all, ranges)

    def get(self, entry_id):
        if self.next is None:
            self.next = entry_id
        while self.next < entry_id + self.window:
            self._start_window(self.next, self.next + self.window - 1)
            self.next += self.window
        st = self.state[entry_id]         # answers keep coming in: popped once decided
        deadline = time.monotonic() + self.rh.read_timeout + 5
        try:
            return self._decide(entry_id, st, deadline)
        finally:
            self.state.pop(entry_id, None)

    def _decide(self, entry_id, st, deadline):
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
            if closed_error_among(st["errors"]) is not None:
                raise self.client._closed_error(self.what)
            raise LedgerRecoveryError(
                f"{self.what}: cannot tell whether entry {entry_id} exists: {st['neg']} of "
                f"{st['of']} bookies say no, need {self.need} "
                f"({'; '.join(str(e) for e in st['errors']) or 'no answer'})")


class _RecoveryRange:
    """One bookie's fencing READ_RANGE over a window of recovery reads (I/O thread)."""

    def __init__(self, reader: _RecoveryReader, conn, entries):
        self.reader = reader
        self.conn = conn
        self.left = entries            # ascending entry ids still unanswered
        self.last = entries[-1]

    @staticmethod
    def start_all(ranges):
        for r in ranges:
            r.start()

    def start(self):
        """Send the READ_RANGE of the entries left (I/O thread)."""
        rh = self.reader.rh
        io = self.reader.client._io
        rid = next(io.rids)
        budget = max(1, min(rh.read_window_bytes, io.max_frame_size // 2))
        self.conn.send_featured(
            protocol.FEATURE_READ_RANGE, rid, self,
            rh.fencing_read_range_frame(rid, self.left[0], self.last, budget),
            rh.read_timeout)

    def unsupported(self, conn):
        left, self.left = self.left, []
        for e in left:
            self.reader._start_single(e, conn)

    def on_reply(self, conn, msg):
        status = msg[2]
        bid = conn.bookie_id
        note = self.reader._note
        if status == EOK and type(msg[4]) is int:
            nxt, ents = msg[4], msg[5]
            got = {}
            for i in range(0, len(ents), 4):
                got[ents[i]] = (EOK, ents[i + 1], ents[i + 2], ents[i + 3])
            rest = []
            for e in self.left:
                if e < nxt:
                    note(e, bid, got.get(e, (ENOENTRY, -1, None, None)))
                else:
                    rest.append(e)
            self.left = rest
            if rest:
                self.start()
            return
        left, self.left = self.left, []
        for e in left:
            note(e, bid, (status, -1, None, None))

    def on_error(self, conn, exc):
        left, self.left = self.left, []
        for e in left:
            self.reader._note(e, conn.bookie_id, error=exc)
