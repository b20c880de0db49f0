"""Storage of one shard: ledger state and entry index over the journal.

Theory of operation
-------------------
Entries live in the journal (``bk.bookie.journal``) and nowhere else: one
write per entry. This module keeps, in memory, per ledger:

* ``fenced``, ``key`` (the master key, i.e. the password digest), ``lac`` (max
  of the LAC fields of its entries and of explicit WRITE_LACs), ``last`` (the
  highest entry id held);
* ``idx``: a dense ``array('q')`` entry id - ``base`` -> journal position, -1
  where the bookie does not hold the entry (with E > Qw a bookie holds a
  stripe). ``base`` is the lowest entry id the index covers: a bookie that
  joins a long ledger through an ensemble change at entry 20,000,000 indexes
  from there, not from 0;
* ``segb``: live bytes of this ledger per journal segment (the records its
  index points to), from which compaction derives each segment's live
  fraction without reading the segments;
* ``meta_seg``: the lowest segment holding one of its FENCE / MASTER_KEY /
  WRITE_LAC records not superseded by a STATE record (compaction rewrites the
  state before removing such a segment).

Writes only *append* (the worker calls :meth:`ShardStorage.sync` once per
batch, then answers); the in-memory state changes right away, which is fine
since the worker replies only after the sync. A FENCE or MASTER_KEY is a
journal record, so it is durable when the batch's sync returns.

Checkpoint. :meth:`ShardStorage.checkpoint` syncs the journal and writes
every ledger state and index, plus the journal *mark* (the append position),
to ``index_dir/checkpoint`` atomically (tmp + fsync + rename + fsync dir).
Its file is a msgpack array ``[magic, version, crc32c(content), content]``
where ``content`` is a msgpack map. Opening loads it and replays the journal
only after its mark; a missing or corrupt checkpoint (logged) means a replay
of the whole journal from its first segment. After a replay that found
records, a new checkpoint is written at once.

Over-replicated ledgers. :meth:`ShardStorage.drop_ledgers` forgets a ledger's
entries (a DROP record, then a checkpoint) but keeps its state fenced, with its
key and without a tombstone: the ledger lives on elsewhere, an old writer is
still refused, and this bookie may be picked to hold it again.

Deletion and compaction. :meth:`ShardStorage.delete_ledgers` first appends
each ledger's id to the shard's tombstone file (``index_dir/tombstones``,
fsync'd), then a DELETE record per ledger (so even a full replay forgets
them) and checkpoints. A tombstone is forever (ids are never reused): an ADD
to a deleted ledger gets EFENCED, also with the recovery flag, and a fence
ENOLEDGER, and neither creates state, so a writer that outlived its ledger's
recovery and deletion is never acknowledged again. The tombstone file lives
apart from the journal, so compaction and a lost checkpoint cannot lose it;
a ledger found with state and a tombstone at open (a crash between the two)
is dropped.
:meth:`ShardStorage.compact` copies the live ADDs of sparse, non-active
segments forward (repointing the index), rewrites a STATE record for every
ledger whose state records may sit in those segments, syncs, checkpoints and
only then removes the files. A crash anywhere in between leaves either the
old checkpoint (whose replay re-applies the copies, both copies being valid)
or the new one (which no longer points into the old segments): nothing of a
live ledger is lost.

"""

from __future__ import annotations

import bisect
import heapq
import logging
import os
import sys
import time
from array import array

import msgpack
from crc32c import crc32c

from bk.bookie import journal as J
from bk.bookie.journal import ADD_OVERHEAD, CorruptRecordError, Journal, JournalError, \
    RecordTooLargeError
from bk.errors import EBADREQ, EFENCED, EIO, ENOENTRY, ENOLEDGER, EOK, EUA
from bk.protocol import ids_to_ranges

log = logging.getLogger("bk.storage")

CHECKPOINT_FILE = "checkpoint"
CHECKPOINT_MAGIC = "bk-shard-checkpoint"
CHECKPOINT_VERSION = 1
LEDGER_FIELDS = ["ledger", "fenced", "key", "lac", "last", "index", "segment_bytes", "meta_seg",
                 "base"]
# An ADD may open a gap of at most this many entry ids before or past a ledger's
# index: the index is dense, so a wild entry id must not allocate gigabytes.
MAX_ENTRY_GAP = 1 << 24
_NO_SEG = 1 << 62
_FILL = array("q", [-1]) * 4096


# --- tombstones of deleted ledgers ----------------------------------------------

TOMBSTONE_FILE = "tombstones"
TOMBSTONE_MAGIC = b"BKTOMB01"            # then the ids, 8 bytes each, little-endian


class Tombstones:
    """Ids of the ledgers this shard deleted: a sorted ``array('q')`` in memory (8
    bytes a ledger; lookups by bisection) and an append-only file of 8-byte ids,
    appended and fsync'd before a deletion is reported. Ledger ids are never
    reused, so a tombstone is forever; the file outlives journal segments, their
    compaction and a lost checkpoint."""

    def __init__(self, path: str):
        self.path = path
        raw = b""
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            pass
        if raw[:len(TOMBSTONE_MAGIC)] != TOMBSTONE_MAGIC:
            if raw:
                raise JournalError(f"{path} is not a bk tombstone file; refusing to "
                                   f"overwrite it")
            self._rewrite(array("q"))
            raw = TOMBSTONE_MAGIC
        body = raw[len(TOMBSTONE_MAGIC):]
        whole = len(body) // 8 * 8
        ids = array("q")
        ids.frombytes(body[:whole])
        if sys.byteorder != "little":
            ids.byteswap()
        if whole != len(body):           # a torn append: the ids before it are intact
            log.warning("%s: dropping a torn tail of %d bytes", path, len(body) - whole)
            with open(path, "r+b") as f:
                f.truncate(len(TOMBSTONE_MAGIC) + whole)
                os.fsync(f.fileno())
        self._ids = array("q", sorted(set(ids)))

    def _rewrite(self, ids: array) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(TOMBSTONE_MAGIC)
            f.write(_le_bytes(ids))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        J._fsync_dir(os.path.dirname(self.path))

    def __contains__(self, ledger: int) -> bool:
        ids = self._ids
        i = bisect.bisect_left(ids, ledger)
        return i < len(ids) and ids[i] == ledger

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, ledgers) -> None:
        """Make these ids tombstones, durably, before returning."""
        new = sorted({lid for lid in ledgers if lid not in self})
        if not new:
            return
        with open(self.path, "ab") as f:
            f.write(_le_bytes(array("q", new)))
            f.flush()
            os.fsync(f.fileno())
        self._ids = array("q", heapq.merge(self._ids, new))


def _le_bytes(ids: array) -> bytes:
    if sys.byteorder != "little":
        ids = array("q", ids)
        ids.byteswap()
    return ids.tobytes()


class _Ledger:
    __slots__ = ("fenced", "key", "lac", "last", "idx", "segb", "meta_seg", "base")

    def __init__(self, key):
        self.fenced = False
        self.key = key
        self.lac = -1
        self.last = -1
        self.idx = array("q")
        self.segb: dict[int, int] = {}
        self.meta_seg = _NO_SEG
        self.base = 0


class ShardStorage:
    """Ledger state, entry index and journal of one shard (single-threaded)."""

    def __init__(self, journal_dir: str, index_dir: str, *, segment_size: int,
                 sync_data: bool = True, owns=None, progress=None):
        # ``owns(ledger_id)``: whether this shard owns a ledger; an ADD or fence of a
        # ledger it does not own is a misrouted request (EBADREQ), never new state.
        self._owns = owns
        os.makedirs(journal_dir, exist_ok=True)
        os.makedirs(index_dir, exist_ok=True)
        self.journal_dir = journal_dir
        self.index_dir = index_dir
        self._ckpt_path = os.path.join(index_dir, CHECKPOINT_FILE)
        self._ledgers: dict[int, _Ledger] = {}
        self._entries = 0
        self._ckpt_mark = None
        self.checkpoints = 0
        self.replayed_records = 0
        self._replayed_deletes: list[int] = []
        self._ckpt_at = 0          # journal bytes appended when the last checkpoint was taken
        self._progress = progress  # progress(done_bytes, total_bytes) during a long replay
        self._closed = False
        self._tomb = Tombstones(os.path.join(index_dir, TOMBSTONE_FILE))
        self._journal = Journal(journal_dir, segment_size, sync_data)
        try:
            t0 = time.monotonic()
            mark = self._load_checkpoint()
            self._replay(mark)
            self._bury()
            self.replay_seconds = time.monotonic() - t0
            if self.replayed_records or mark is None:
                self.checkpoint()
        except BaseException:
            self._journal.close()
            raise
        self._append_add = self._journal.append_add
        log.info("shard storage %s: %d ledgers, %d entries, replayed %d records in %.3fs",
                 journal_dir, len(self._ledgers), self._entries, self.replayed_records,
                 self.replay_seconds)

    # --- writes ---------------------------------------------------------------
    def _admit(self, ledger: int, entry: int, master_key: bytes, recovery):
        """The ledger's state if an ADD of ``entry`` may go in, else the status that
        refuses it: the one place of the rules (tombstone, ownership, master key,
        fence) for single and batched adds."""
        st = self._ledgers.get(ledger)
        if st is None:
            if ledger in self._tomb:     # deleted: its old writer must never get in again
                return EFENCED
            if entry < 0 or not self._owned(ledger):
                return EBADREQ
            st = self._new_ledger(ledger, master_key)
            if st is None:
                return EIO
        elif st.key != master_key:
            status = self._key_mismatch(ledger, st, master_key)
            if status != EOK:
                return status
        if st.fenced and not recovery:
            return EFENCED
        return st

    def add_entry(self, ledger: int, entry: int, lac: int, master_key: bytes, digest: bytes,
                  payload: bytes, recovery: bool) -> int:
        """Append one entry. EOK; EUA (wrong key); EFENCED (fenced, not a recovery add);
        EBADREQ (negative or absurdly far entry id, larger than a segment); EIO."""
        st = self._admit(ledger, entry, master_key, recovery)
        if type(st) is int:
            return st
        idx = st.idx
        n = len(idx)
        if not n:
            st.base = entry
        i = entry - st.base
        if entry < 0 or i - n > MAX_ENTRY_GAP or -i > MAX_ENTRY_GAP:
            return EBADREQ
        try:
            pos = self._append_add(ledger, entry, lac, digest, payload)
        except RecordTooLargeError as e:
            log.warning("add entry %d of ledger %d refused: %s", entry, ledger, e)
            return EBADREQ
        except (JournalError, OSError) as e:
            log.error("add entry %d of ledger %d failed: %s", entry, ledger, e)
            return EIO
        if i == n:                      # the common case: the next entry
            idx.append(pos)
            self._entries += 1
            seq = pos >> 32
            sb = st.segb
            sb[seq] = sb.get(seq, 0) + ADD_OVERHEAD + len(digest) + len(payload)
            if lac > st.lac:
                st.lac = lac
            if entry > st.last:
                st.last = entry
        else:
            self._index_put(st, entry, lac, pos, ADD_OVERHEAD + len(digest) + len(payload))
        return EOK

    def add_batch(self, recs: list, records, master_key: bytes, recovery: bool,
                  acked: list, errors: list) -> int:
        """Append the entries of one ADD_BATCH (``recs`` from
        ``protocol.split_add_batch``; each body is appended from ``records`` as
        received). Each entry goes into the runs ``acked`` or, with its status,
        into ``errors`` (see ``protocol.add_ack``), with the same checks and
        statuses as :meth:`add_entry` entry by entry: a fenced ledger refuses
        every entry that is not a recovery add. Returns how many failed."""
        src = memoryview(records)
        try:
            return self._add_batch(recs, src, master_key, recovery, acked, errors)
        finally:
            src.release()

    def _add_batch(self, recs, src, master_key, recovery, acked, errors) -> int:
        ledgers = self._ledgers
        failed = 0
        i = 0
        n = len(recs)
        while i < n:
            lid, eid, lac, start, end = recs[i]
            st = ledgers.get(lid)
            if st is not None and st.key == master_key and (recovery or not st.fenced) \
                    and st.idx and eid - st.base == len(st.idx):
                # The fast path: a run of this ledger's next entries, appended in one go.
                j = i + 1
                nxt = eid + 1
                while j < n and recs[j][0] == lid and recs[j][1] == nxt:
                    j += 1
                    nxt += 1
                run = recs[i:j]
                positions = []
                try:
                    self._journal.append_add_bodies(src, [(r[3], r[4]) for r in run],
                                                    positions)
                except (JournalError, OSError) as e:
                    log.error("add entry %d of ledger %d failed: %s", eid + len(positions),
                              lid, e)
                    status = EBADREQ if isinstance(e, RecordTooLargeError) else EIO
                    for r in run[len(positions):]:
                        errors += (lid, r[1], status)
                        failed += 1
                    run = run[:len(positions)]
                if positions:
                    st.idx.extend(positions)
                    self._entries += len(positions)
                    segb = st.segb
                    seq = positions[0] >> 32
                    if positions[-1] >> 32 == seq:
                        # records back to back: 4-byte heads on the wire, 9 in the journal
                        k = len(positions)
                        segb[seq] = segb.get(seq, 0) + run[k - 1][4] - run[0][3] + 5 * k + 4
                    else:               # the run rolled to a new segment
                        for r, pos in zip(run, positions):
                            seq = pos >> 32
                            segb[seq] = segb.get(seq, 0) + 9 + r[4] - r[3]
                    maxlac = max([r[2] for r in run])
                    if maxlac > st.lac:
                        st.lac = maxlac
                    last = eid + len(positions) - 1
                    if last > st.last:
                        st.last = last
                    if acked and acked[-1] == eid - 1 and acked[-3] == lid:
                        acked[-1] = last
                    else:
                        acked += (lid, eid, last)
                i = j
                continue
            status = self._add_slow(lid, eid, lac, master_key, recovery, src, start, end)
            if status == EOK:
                if acked and acked[-1] == eid - 1 and acked[-3] == lid:
                    acked[-1] = eid
                else:
                    acked += (lid, eid, eid)
            else:
                errors += (lid, eid, status)
                failed += 1
            i += 1
        return failed

    def _add_slow(self, ledger, entry, lac, master_key, recovery, src, start, end) -> int:
        """:meth:`add_entry` for a record body of an ADD_BATCH (every case but the
        next entry of a known ledger)."""
        st = self._admit(ledger, entry, master_key, recovery)
        if type(st) is int:
            return st
        n = len(st.idx)
        i = entry - (st.base if n else entry)
        if entry < 0 or i - n > MAX_ENTRY_GAP or -i > MAX_ENTRY_GAP:
            return EBADREQ
        try:
            pos = self._journal.append_add_body(src, start, end)
        except RecordTooLargeError as e:
            log.warning("add entry %d of ledger %d refused: %s", entry, ledger, e)
            return EBADREQ
        except (JournalError, OSError) as e:
            log.error("add entry %d of ledger %d failed: %s", entry, ledger, e)
            return EIO
        self._index_put(st, entry, lac, pos, 9 + end - start)
        return EOK

    def _index_put(self, st: _Ledger, entry: int, lac: int, pos: int, rlen: int) -> None:
        """Point ``entry`` at ``pos`` in the ledger's index, growing it either way."""
        idx = st.idx
        if not idx:
            st.base = entry
        i = entry - st.base
        if i < 0:                       # an older entry (re-replication): extend downwards
            st.idx = idx = array("q", [-1]) * (-i) + idx
            st.base = entry
            i = 0
        if i < len(idx):
            old = idx[i]
            idx[i] = pos
            if old < 0:
                self._entries += 1
            else:
                self._unaccount(st, old)
        else:
            self._grow(idx, i)
            idx.append(pos)
            self._entries += 1
        seq = pos >> 32
        st.segb[seq] = st.segb.get(seq, 0) + rlen
        if lac > st.lac:
            st.lac = lac
        if entry > st.last:
            st.last = entry

    def fence(self, ledger: int, master_key: bytes) -> int:
        """Fence a ledger (creating its state if unknown). EOK, EUA, EBADREQ (not this
        shard's ledger) or EIO."""
        st = self._ledgers.get(ledger)
        if st is None:
            if ledger in self._tomb:     # deleted: nothing to fence, nothing to create
                return ENOLEDGER
            if not self._owned(ledger):
                return EBADREQ
            st = self._new_ledger(ledger, master_key)
            if st is None:
                return EIO
        elif st.key != master_key:
            status = self._key_mismatch(ledger, st, master_key)
            if status != EOK:
                return status
        if not st.fenced:
            try:
                pos = self._journal.append(J.FENCE, ledger)
            except (JournalError, OSError) as e:
                log.error("fence of ledger %d failed: %s", ledger, e)
                return EIO
            st.fenced = True
            self._meta(st, pos)
        return EOK

    def write_lac(self, ledger: int, master_key: bytes, lac: int) -> int:
        """Record an explicit LAC. EOK, EUA, ENOLEDGER or EIO."""
        st = self._ledgers.get(ledger)
        if st is None:
            return ENOLEDGER
        if st.key != master_key:
            status = self._key_mismatch(ledger, st, master_key)
            if status != EOK:
                return status
        if lac > st.lac:
            try:
                pos = self._journal.append(J.WRITE_LAC, ledger, lac)
            except (JournalError, OSError) as e:
                log.error("write LAC of ledger %d failed: %s", ledger, e)
                return EIO
            st.lac = lac
            self._meta(st, pos)
        return EOK

    def sync(self) -> None:
        """Make everything appended since the last sync durable (one pwrite + fdatasync).

        Raises JournalError if the write or the sync fails; the journal then refuses all
        writes (nothing of the batch may be acknowledged)."""
        self._journal.sync()

    def begin_sync(self):
        """Pipelined group commit: see :meth:`bk.bookie.journal.Journal.begin_sync`."""
        return self._journal.begin_sync()

    def end_sync(self, job) -> None:
        self._journal.end_sync(job)

    @property
    def unsynced_bytes(self) -> int:
        return self._journal._unsynced

    def _new_ledger(self, ledger: int, master_key: bytes):
        try:
            pos = self._journal.append(J.MASTER_KEY, ledger, master_key)
        except (JournalError, OSError) as e:
            log.error("recording the master key of ledger %d failed: %s", ledger, e)
            return None
        st = _Ledger(bytes(master_key))
        st.meta_seg = pos >> 32
        self._ledgers[ledger] = st
        return st

    def _owned(self, ledger: int) -> bool:
        if self._owns is None or self._owns(ledger):
            return True
        log.warning("refused a request for ledger %d: another shard owns it (misrouted)",
                    ledger)
        return False

    def _key_mismatch(self, ledger: int, st: _Ledger, master_key: bytes) -> int:
        """The key presented differs from the ledger's: EUA, unless the ledger has no
        key (its MASTER_KEY record was lost), when the key is adopted (EOK, or EIO)."""
        if st.key is not None:
            return EUA
        return EOK if self._adopt_key(ledger, st, master_key) else EIO

    def _adopt_key(self, ledger: int, st: _Ledger, master_key: bytes) -> bool:
        # Only a ledger whose MASTER_KEY record was lost (see _replay) has no key.
        try:
            pos = self._journal.append(J.MASTER_KEY, ledger, master_key)
        except (JournalError, OSError) as e:
            log.error("recording the master key of ledger %d failed: %s", ledger, e)
            return False
        st.key = bytes(master_key)
        self._meta(st, pos)
        return True

    @staticmethod
    def _meta(st: _Ledger, pos: int) -> None:
        seq = pos >> 32
        if seq < st.meta_seg:
            st.meta_seg = seq

    @staticmethod
    def _grow(idx: array, i: int) -> None:
        gap = i - len(idx)
        while gap >= len(_FILL):
            idx.extend(_FILL)
            gap -= len(_FILL)
        if gap:
            idx.extend(_FILL[:gap])

    def _unaccount(self, st: _Ledger, old_pos: int) -> None:
        seq = old_pos >> 32
        left = st.segb.get(seq, 0) - self._journal.record_length(old_pos)
        if left > 0:
            st.segb[seq] = left
        else:
            st.segb.pop(seq, None)

    # --- reads ----------------------------------------------------------------
    def read_entry(self, ledger: int, entry: int) -> tuple[int, int, bytes, bytes]:
        """``(status, entry_lac, digest, payload)``; ENOLEDGER / ENOENTRY / EIO with
        ``(status, -1, b"", b"")``."""
        st = self._ledgers.get(ledger)
        if st is None:
            return ENOLEDGER, -1, b"", b""
        idx = st.idx
        i = entry - st.base
        if i < 0 or i >= len(idx) or idx[i] < 0:
            return ENOENTRY, -1, b"", b""
        pos = idx[i]
        try:
            rl, re_, lac, digest, payload = self._journal.read_add(pos)
        except CorruptRecordError as e:
            log.error("read of entry %d of ledger %d: %s", entry, ledger, e)
            return EIO, -1, b"", b""
        if rl != ledger or re_ != entry:
            log.error("read of entry %d of ledger %d: index points to entry %d of ledger %d",
                      entry, ledger, re_, rl)
            return EIO, -1, b"", b""
        return EOK, lac, digest, payload

    def read_range(self, ledger: int, first: int, last: int, max_bytes: int, stride: int = 1,
                   offset: int = 0, max_count: int = 10000) -> tuple[int, int, list]:
        """``(status, next, entries)`` for READ_RANGE: the entries ``first..last``
        whose id is ``offset`` mod ``stride`` that this shard holds, as a flat list
        ``[entry, entry_lac, digest, payload, ...]``, up to ``max_bytes`` of payload
        (at least one entry) or ``max_count`` entries; ``next`` is the first entry
        id not looked at. ENOLEDGER for an unknown ledger; a corrupt copy ends the
        range before it (EIO if it is the first)."""
        st = self._ledgers.get(ledger)
        if st is None:
            return ENOLEDGER, first, []
        idx = st.idx
        base = st.base
        hi = min(last, base + len(idx) - 1)
        e = first + (offset - first) % stride
        if e < base:
            e += (base - e + stride - 1) // stride * stride
        out = []
        total = 0
        read_add = self._journal.read_add
        while e <= hi:
            pos = idx[e - base]
            if pos >= 0:
                try:
                    rl, re_, lac, digest, payload = read_add(pos)
                except CorruptRecordError as err:
                    log.error("read of entry %d of ledger %d: %s", e, ledger, err)
                    rl = re_ = -1
                if rl != ledger or re_ != e:
                    if rl != -1:
                        log.error("read of entry %d of ledger %d: index points elsewhere",
                                  e, ledger)
                    return (EIO if not out else EOK), e, out
                n = len(payload)
                if out and total + n > max_bytes:
                    return EOK, e, out
                out += (e, lac, digest, payload)
                total += n
                if total >= max_bytes or len(out) >= 4 * max_count:
                    return EOK, e + 1, out
            e += stride
        return EOK, max(first, last + 1), out

    def read_lac(self, ledger: int) -> tuple[int, int, int]:
        """``(status, lac, last_entry_id)``; ENOLEDGER with ``-1, -1``."""
        st = self._ledgers.get(ledger)
        if st is None:
            return ENOLEDGER, -1, -1
        return EOK, st.lac, st.last

    def lac(self, ledger: int) -> int:
        st = self._ledgers.get(ledger)
        return -1 if st is None else st.lac

    def check_master_key(self, ledger: int, master_key: bytes) -> int:
        st = self._ledgers.get(ledger)
        if st is None:
            return ENOLEDGER
        return EOK if st.key is None or st.key == master_key else EUA

    def is_fenced(self, ledger: int) -> bool:
        st = self._ledgers.get(ledger)
        return st is not None and st.fenced

    def list_entries(self, ledger: int) -> tuple[int, list[int]]:
        """``(status, [first, last, ...])`` inclusive runs of the entry ids held."""
        st = self._ledgers.get(ledger)
        if st is None:
            return ENOLEDGER, []
        base = st.base
        return EOK, ids_to_ranges(base + i for i, p in enumerate(st.idx) if p >= 0)

    def ledgers(self) -> list[int]:
        return sorted(self._ledgers)

    # --- checkpoint -----------------------------------------------------------
    def checkpoint(self) -> None:
        """Sync, then atomically persist every ledger state, index and the journal mark."""
        self._journal.sync()
        mark = self._journal.mark
        rows = []
        for lid, st in self._ledgers.items():
            segb = []
            for seq, b in st.segb.items():
                segb += (seq, b)
            rows.append([lid, st.fenced, st.key, st.lac, st.last, st.idx.tobytes(), segb,
                         st.meta_seg, st.base])
        content = msgpack.packb({
            "mark": list(mark), "byteorder": sys.byteorder, "created": time.time(),
            "ledger_fields": LEDGER_FIELDS, "ledgers": rows,
        }, use_bin_type=True)
        data = msgpack.packb([CHECKPOINT_MAGIC, CHECKPOINT_VERSION, crc32c(content), content],
                             use_bin_type=True)
        tmp = self._ckpt_path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self._ckpt_path)
        J._fsync_dir(self.index_dir)
        self._ckpt_mark = mark
        self._ckpt_at = self._journal.synced_bytes
        self.checkpoints += 1

    @property
    def bytes_since_checkpoint(self) -> int:
        """Journal bytes appended since the last checkpoint (what a restart replays)."""
        j = self._journal
        return j.synced_bytes + j._unsynced - self._ckpt_at

    def _load_checkpoint(self):
        """Load the checkpoint into memory; return its mark, or None for a full replay."""
        path = self._ckpt_path
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            if self._journal.segments():
                log.warning("no checkpoint in %s: replaying the whole journal %s",
                            self.index_dir, self.journal_dir)
            return None
        try:
            outer = msgpack.unpackb(data, raw=False)
            if not (isinstance(outer, list) and len(outer) == 4 and outer[0] == CHECKPOINT_MAGIC):
                raise ValueError("not a bk shard checkpoint")
            _, version, crc, content = outer
            if version != CHECKPOINT_VERSION:
                raise ValueError(f"checkpoint format version {version} is not supported")
            if crc32c(content) != crc:
                raise ValueError("CRC mismatch")
            body = msgpack.unpackb(content, raw=False, strict_map_key=False)
            if body["ledger_fields"] != LEDGER_FIELDS:
                raise ValueError(f"unknown ledger fields {body['ledger_fields']}")
            swap = body["byteorder"] != sys.byteorder
            ledgers: dict[int, _Ledger] = {}
            entries = 0
            for lid, fenced, key, lac, last, idx_bytes, segb, meta_seg, base in body["ledgers"]:
                st = _Ledger(key)
                st.base = base
                st.fenced, st.lac, st.last, st.meta_seg = bool(fenced), lac, last, meta_seg
                st.idx.frombytes(idx_bytes)
                if swap:
                    st.idx.byteswap()
                st.segb = {segb[i]: segb[i + 1] for i in range(0, len(segb), 2)}
                entries += len(st.idx) - st.idx.count(-1)
                ledgers[lid] = st
            mark = tuple(body["mark"])
            J.parse_mark(mark)
        except Exception as e:   # any decoding failure means the same thing: unusable
            log.warning("checkpoint %s is unusable (%s): replaying the whole journal %s",
                        path, e, self.journal_dir)
            return None
        self._ledgers = ledgers
        self._entries = entries
        self._ckpt_mark = mark
        return mark

    def _replay(self, mark) -> None:
        ledgers = self._ledgers
        journal = self._journal
        n = 0
        keyless = set()
        report = self._replay_reporter(mark)
        for pos, rlen, rtype, f in journal.replay(mark):
            n += 1
            if not n & 0x3FFF and report is not None:
                report(pos)
            lid = f[0]
            st = ledgers.get(lid)
            if rtype == J.DELETE:
                if st is not None:
                    self._entries -= len(st.idx) - st.idx.count(-1)
                    del ledgers[lid]
                self._replayed_deletes.append(lid)
                continue
            if rtype == J.DROP:
                if st is not None:
                    self._forget_entries(st)
                    self._meta(st, pos)
                continue
            if st is None:
                st = ledgers[lid] = _Ledger(None)
                keyless.add(lid)
            if rtype == J.ADD:
                _, entry, lac = f
                if entry >= 0:
                    self._index_put(st, entry, lac, pos, rlen)
            elif rtype == J.MASTER_KEY:
                if st.key is None:
                    st.key = f[1]
                    keyless.discard(lid)
                self._meta(st, pos)
            elif rtype == J.FENCE:
                st.fenced = True
                self._meta(st, pos)
            elif rtype == J.WRITE_LAC:
                if f[1] > st.lac:
                    st.lac = f[1]
                self._meta(st, pos)
            elif rtype == J.STATE:
                _, fenced, lac, key = f
                st.fenced = st.fenced or fenced
                if lac > st.lac:
                    st.lac = lac
                if key is not None:
                    st.key = key
                    keyless.discard(lid)
                st.meta_seg = pos >> 32     # a STATE supersedes all earlier state records
        self.replayed_records = n
        keyless &= ledgers.keys()
        if keyless:
            log.warning("replay found entries but no master key for %d ledgers (e.g. %d); "
                        "the first key presented will be adopted", len(keyless), min(keyless))

    def _replay_reporter(self, mark):
        """A function of a replay position that calls ``progress(done, total)`` (bytes
        of journal) at most every half second, or None."""
        if self._progress is None:
            return None
        journal = self._journal
        seqs = journal.segments()
        if not seqs:
            return None
        start_seq, start_off = J.parse_mark(mark) if mark is not None else (seqs[0], 0)
        before, total = {}, 0
        for seq in seqs:
            if seq >= start_seq:
                before[seq] = total
                total += journal.segment_size_of(seq)
        total -= start_off
        last = [time.monotonic()]

        def report(pos):
            now = time.monotonic()
            if now - last[0] >= 0.5:
                last[0] = now
                seq, off = pos >> 32, pos & 0xFFFFFFFF
                self._progress(before.get(seq, 0) + off - start_off, total)
        return report

    # --- maintenance ----------------------------------------------------------
    def delete_ledgers(self, ledger_ids) -> int:
        """Drop the state and index of these ledgers, leaving a durable tombstone for
        each, and checkpoint; return how many."""
        # Tombstones first: once a ledger's state is gone, only its tombstone keeps
        # an old writer's ADD from creating it anew.
        self._tomb.add(lid for lid in ledger_ids if lid in self._ledgers)
        dropped = 0
        for lid in ledger_ids:
            st = self._ledgers.get(lid)
            if st is None:
                continue
            self._journal.append(J.DELETE, lid)
            del self._ledgers[lid]
            self._entries -= len(st.idx) - st.idx.count(-1)
            dropped += 1
        if dropped:
            self.checkpoint()
        return dropped

    def drop_ledgers(self, ledger_ids) -> int:
        """Forget the entries of these ledgers but keep each fenced, with its key and
        no tombstone (over-replicated GC: the ledger lives on, re-replicated to
        other bookies). Fenced, so an old writer's ADD is refused (EFENCED) where
        an absent ledger would have been created anew; no tombstone, so recovery
        adds (this bookie picked again to hold it) are accepted. Checkpoints;
        returns how many had entries."""
        dropped = 0
        for lid in ledger_ids:
            st = self._ledgers.get(lid)
            if st is None:
                continue
            pos = self._journal.append(J.DROP, lid)
            if self._forget_entries(st):
                dropped += 1
            self._meta(st, pos)
        if ledger_ids:
            self.checkpoint()
        return dropped

    def _forget_entries(self, st: _Ledger) -> bool:
        n = len(st.idx) - st.idx.count(-1)
        self._entries -= n
        st.idx = array("q")
        st.segb = {}
        st.base = 0
        st.last = -1
        st.fenced = True
        return n > 0

    def _bury(self) -> None:
        """After loading: a ledger with a tombstone but state (a crash between the
        tombstone and its DELETE record) is deleted; so are DELETE records whose
        tombstone is missing re-tombstoned (see _replay)."""
        dead = [lid for lid in self._ledgers if lid in self._tomb]
        for lid in dead:
            st = self._ledgers.pop(lid)
            self._entries -= len(st.idx) - st.idx.count(-1)
        if dead:
            log.warning("dropped %d ledgers that have tombstones (e.g. %d)", len(dead),
                        dead[0])
        if self._replayed_deletes:
            self._tomb.add(self._replayed_deletes)
            self._replayed_deletes = []

    @property
    def tombstones(self) -> int:
        return len(self._tomb)

    def is_deleted(self, ledger: int) -> bool:
        return ledger in self._tomb

    def live_bytes(self) -> dict[int, int]:
        """Live bytes (referenced by some index) per segment."""
        live: dict[int, int] = {}
        for st in self._ledgers.values():
            for seq, b in st.segb.items():
                live[seq] = live.get(seq, 0) + b
        return live

    def compact(self, threshold: float, max_bytes: int | None = None) -> dict:
        """Remove full segments whose live fraction is under ``threshold``, copying
        their live entries forward first. ``max_bytes`` bounds the bytes copied by
        one call (the emptiest segments go first; the first segment is always
        processed so that every call makes progress).
        Returns ``{segments_removed, bytes_freed, entries_moved, bytes_moved}``."""
        stats = {"segments_removed": 0, "bytes_freed": 0, "entries_moved": 0, "bytes_moved": 0}
        journal = self._journal
        if threshold <= 0:
            return stats
        active = journal.active_seq
        live = self.live_bytes()
        cands = []
        for seq in journal.segments():
            if seq == active:
                continue
            frac = live.get(seq, 0) / journal.segment_size_of(seq)
            if frac < threshold:
                cands.append((frac, seq))
        if not cands:
            return stats
        cands.sort()
        chosen = []
        moved = 0
        ledgers = self._ledgers
        for _, seq in cands:
            need = live.get(seq, 0)
            if need and max_bytes is not None and chosen and moved + need > max_bytes:
                break
            chosen.append(seq)
            if not need:
                continue
            for pos, rlen, rtype, f in journal.scan_segment(seq, full=False):
                if rtype != J.ADD:
                    continue
                lid, entry, lac = f
                st = ledgers.get(lid)
                i = entry - st.base if st is not None else -1
                if i < 0 or i >= len(st.idx) or st.idx[i] != pos:
                    continue
                _, _, _, digest, payload = journal.read_add(pos)
                new = journal.append_add(lid, entry, lac, digest, payload)
                st.idx[i] = new
                left = st.segb.get(seq, 0) - rlen
                if left > 0:
                    st.segb[seq] = left
                else:
                    st.segb.pop(seq, None)
                nseq = new >> 32
                st.segb[nseq] = st.segb.get(nseq, 0) + rlen
                moved += rlen
                stats["entries_moved"] += 1
        stats["bytes_moved"] = moved
        top = max(chosen)
        for lid, st in ledgers.items():
            if st.meta_seg <= top:
                pos = journal.append(J.STATE, lid, st.fenced, st.lac, st.key)
                st.meta_seg = pos >> 32
        self.checkpoint()               # syncs the copies first
        live = self.live_bytes()
        for seq in chosen:
            if live.get(seq):
                log.error("compaction left %d live bytes in segment %s (unreadable records?); "
                          "keeping it", live[seq], journal.segment_path(seq))
                continue
            stats["bytes_freed"] += journal.remove_segment(seq)
            stats["segments_removed"] += 1
        return stats

    def stats(self) -> dict:
        j = self._journal
        return {
            "ledgers": len(self._ledgers),
            "entries": self._entries,
            "segments": len(j.segments()),
            "journal_bytes": j.disk_usage(),
            "syncs": j.syncs,
            "synced_records": j.synced_records,
            "synced_bytes": j.synced_bytes,
            "unsynced_bytes": j.unsynced_bytes,
            "journal_mark": J.format_mark(j.mark),
            "last_mark": J.format_mark(self._ckpt_mark) if self._ckpt_mark else None,
            "checkpoints": self.checkpoints,
            "tombstones": len(self._tomb),
            "replayed_records": self.replayed_records,
        }

    def close(self) -> None:
        """Sync, checkpoint and unmap (idempotent). After a journal failure the
        checkpoint is skipped: its state may include records that are not durable."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._journal._failed is None:
                self.checkpoint()
        finally:
            self._journal.close()
