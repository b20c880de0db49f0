"""Storage of one shard: the journal, a write cache over its tail, entry logs and an on-disk index.

Theory of operation
-------------------
BookKeeper's DbLedgerStorage, with the journal as the write cache:

* **Journal** (``bk.bookie.journal``): every ADD, FENCE, MASTER_KEY and
  WRITE_LAC is appended there first; the worker acknowledges after the
  group's sync, so an acknowledged entry is on disk.
* **Write cache**: the entries written since the last flush are *in the
  journal already*; memory holds only where (``_Tail``: per ledger a dense
  ``array('q')`` of journal positions, 8 bytes an entry, and the spans of its
  records back to back in the journal, a few numbers a batch). Reads of them go to
  the journal. The tail is bounded: at half of ``dbStorage_writeCacheMaxSizeMb``
  of journal (or ``flushIntervalBytes``, or ``flushInterval`` ms) it is
  swapped and flushed by the flusher thread (``bk.bookie.flusher``) while a
  new tail takes the writes; each swap comes at a random point of the last
  quarter below that size (the first after opening: anywhere below it; see
  :func:`flush_threshold`), so that the bookies of
  an ensemble, which receive the same bytes, do not flush at the same
  moment. The flush writes at twice the rate its tail filled at
  (:func:`flush_rate`), so its writeback does not crowd the journal's syncs
  on the same disk; once the new tail is half full it goes at full speed,
  and if the new one fills too before the flush ends,
  :meth:`ShardStorage.maintain` waits for it (back-pressure).
* **Entry logs** (``bk.bookie.entrylog``): a flush writes each ledger's
  entries sorted and together, so a catch-up reader reads sequentially; a
  long stretch of one ledger that is together in the journal already stays
  in its segment, which the index then uses as an entry log.
* **Index** (``bk.bookie.index``, LMDB): runs of entries -> entry log
  location, each ledger's state (fenced, master key, LAC, last entry), the
  logs' live bytes and the journal *mark* a restart replays from. A flush
  commits all of it in one transaction, then the journal segments wholly
  before the mark are deleted.
* **Read-ahead cache**: a miss that goes to an entry log reads the next
  ``dbStorage_readAheadCacheBatchSize`` entries of the same run with the same
  ``pread`` and keeps them (bounded by ``dbStorage_readAheadCacheMaxSizeMb``).
* **Range reads** (READ_RANGE, what catch-up readers send): each run of the
  range is read with one ``pread`` and decoded straight into the answer
  (:func:`bk.bookie.entrylog.decode_flat`: CRC checked per record, no object
  per entry but its digest and payload). Entry logs are read without the
  kernel's read-ahead (a log interleaves ledgers); instead a READ_RANGE has
  the disk start on the ledger's next runs (``posix_fadvise(WILLNEED)``, up to
  the smaller of the read-ahead cache size and :data:`PREFETCH_MAX_BYTES` past
  its answer), so several runs are read at once while the loop works. Those
  pages are the kernel's page cache, not the worker's memory.

Page cache. The journal is written with ``pwrite``, so every byte of it
lands in the page cache, and a segment the index keeps (a single-ledger
shard keeps them all) would keep its pages there until the kernel reclaims
them: the page cache grew by every byte the bookie took. On a VM that hands
free memory back to its host (virtio-balloon free page reporting), each new
page costs the host a fault on first touch, which the guest sees as a slow
copy in ``pwrite`` (15-21% of the machine's CPU samples of a 30,000
entries/s run were in that copy): measured with three journal-like writers
of 32 KiB groups at 32 MB/s each for 20-25 s, 27-81 µs per pwrite into new
pages (the less recently freed memory the kernel has at hand, the more)
against 24-28 µs with the page cache bounded. So after each flush commits, the journal from
the previous drop up to the mark of the flush *before* it is advised out of
the page cache (``posix_fadvise(DONTNEED)``, :class:`~bk.bookie.flusher.UncacheJob`,
on the flusher thread): those pages are clean (synced before the index
names them), the kernel frees them and the next appends reuse them. One
flush of lag keeps what was just flushed cached for readers a little
behind; older entries are read from the disk, as from any entry log.
``journalRemovePagesFromCache=false`` leaves it to the kernel.

Memory is therefore the two tails (bounded by the write cache size), the
read-ahead cache, and per ledger its state (not per entry): it does not grow
with the entries held. A restart loads the ledger states and replays the
journal from the mark only.

Ledger state lives in memory (``_Ledger``) and changes at once (the worker
answers only after the sync); the ledgers whose state changed since the last
swap are written by the next flush, with the mark: everything before the mark
is in the index, everything after it is replayed.

Deletion (GC). :meth:`ShardStorage.delete_ledgers` first appends each id to
the tombstone file (``index_dir/tombstones``, fsync'd), then a DELETE record,
then removes the ledger's runs and state from the index (the flusher idle).
A tombstone is forever (ids are never reused): an ADD to a deleted ledger
gets EFENCED, also with the recovery flag, a fence ENOLEDGER, and neither
creates state, so a writer that outlived its ledger's recovery and deletion
is never acknowledged again. A ledger found with state and a tombstone at
open (a crash in between) is deleted then. GC also names deleted ledgers this
shard holds nothing of (every deletion the bookie's watch saw): those are
refused the same way for one full-reconcile interval (:class:`RecentDeletions`,
in memory), so an ADD that arrives after the deletion (a zombie writer's, a
re-replication in flight) is not kept until the next full reconcile.

Over-replicated ledgers. :meth:`ShardStorage.drop_ledgers` forgets a
ledger's entries (a DROP record, its runs removed) but keeps its state fenced,
with its key and no tombstone: an old writer is refused, and this bookie may
be picked to hold the ledger again (recovery adds). Such a ledger is
*settled* (:meth:`ShardStorage.settled`: fenced, no entry) until an entry
comes in again: a full GC round lists it (a deletion still removes its
state) but does not offer it to the over-replicated scan again, whose cost
then follows the ledgers holding entries, not every ledger ever dropped.

Compaction. Deleted and dropped runs leave dead bytes in entry logs; a log
whose live fraction is under a threshold has its live runs copied forward by
the flusher thread and is then deleted (see ``bk.bookie.flusher``).
"""

from __future__ import annotations

import bisect
import heapq
import logging
import os
import random
import struct
import sys
import threading
import time
from array import array
from collections import OrderedDict

from bk.bookie import journal as J
from bk.bookie.entrylog import JOURNAL_LOG, EntryLogError, EntryLogs, decode_flat, \
    decode_records, is_journal_log, journal_log_id
from bk.bookie.flusher import FLUSH_MIN_RATE, CompactJob, FlushJob, Flusher, RemoveJob, \
    UncacheJob
from bk.bookie.index import Index
from bk.bookie.journal import ADD_OVERHEAD, CorruptRecordError, Journal, JournalError, \
    RecordTooLargeError
from bk.bookie.upgrade import needs_upgrade, upgrade_shard
from bk.errors import EBADREQ, EFENCED, EIO, ENOENTRY, ENOLEDGER, EOK, EUA, ProtocolError
from bk.protocol import MAX_BATCH_ENTRIES, REC_HEAD, unpack_record_head

log = logging.getLogger("bk.storage")

# An entry farther than this from a ledger's tail array goes to a side dict, so
# that a wild entry id never allocates a huge array.
TAIL_GAP = 1 << 16
# An ADD may open a gap of at most this many entry ids past a ledger's last entry.
MAX_ENTRY_GAP = 1 << 24
_FILL = array("q", [-1]) * 4096
_ONE = array("q", [0])             # a first entry's position, and its span (see _Tail)
_ONE_SPAN = array("q", [0, 1, 0, 0])
SPAN_MIN_ENTRIES = 4               # see _Tail.spans
_NO_POS = -1
READ_AHEAD_MAX_BYTES = 1 << 20      # one read-ahead pread reads at most this much
PREFETCH_MAX_BYTES = 8 << 20        # how far past its answer a READ_RANGE starts reads
PREFETCH_LEDGERS = 1024             # ledgers whose prefetch position is remembered
FLUSH_RETRY_SECONDS = 1.0           # a failed flush (a disk error) is retried after this
FLUSH_STAGGER = 0.25                # a swap happens this fraction below flush_bytes at most
_PAGE_MASK = ~(os.sysconf("SC_PAGE_SIZE") - 1)
INDEX_TRIM_SECONDS = 1.0            # how often the index map's resident size is checked


def _skip_records(src, off: int, k: int) -> tuple[int, int]:
    """The offset after the ``k`` ADD_BATCH records from ``off`` (whole, checked
    by the caller or the journal's run) and the greatest LAC among them."""
    maxlac = -1
    for _ in range(k):
        plen, _lid, _eid, lac, dlen = unpack_record_head(src, off)
        off += REC_HEAD + dlen + plen
        if lac > maxlac:
            maxlac = lac
    return off, maxlac


def flush_threshold(flush_bytes: int, rng: random.Random, spread: float = 0.0) -> int:
    """The tail size at which the next swap happens: a random point in the last
    ``spread`` (default :data:`FLUSH_STAGGER`, a quarter) below ``flush_bytes``,
    drawn anew at every swap; the first swap after the shard opens draws from
    the whole of it (``spread`` 1), since bookies started together would
    otherwise start in phase.

    The bookies of an ensemble receive the same bytes at the same moments, so
    with one fixed threshold their flushes (the flush's syncs and index commit,
    the page-cache drop after it: a burst of CPU and disk work on each) fell on
    the same instant on all three, every ~2 s at 30,000 entries/s: a stall of
    two bookies at once is one the client's ack quorum cannot ride out. A new
    draw each time makes the shards' phases drift apart by a random walk, so
    after a few flushes they are spread over the whole cycle (a threshold
    drawn once would keep whatever phase the draw gave, colliding forever
    when two draws were close). Lower, never higher: ``flush_bytes`` still
    bounds the tail."""
    return max(1, flush_bytes - int(flush_bytes * (spread or FLUSH_STAGGER) * rng.random()))


def flush_rate(nbytes: int, fill_seconds: float) -> float:
    """Bytes/s to write a flush of ``nbytes`` at, whose tail took ``fill_seconds``
    to fill: done in half that time (so it ends well before the next tail is
    due), never slower than FLUSH_MIN_RATE."""
    if fill_seconds <= 0:
        return 0.0
    return max(float(FLUSH_MIN_RATE), 2.0 * nbytes / fill_seconds)


# --- tombstones of deleted ledgers ----------------------------------------------

TOMBSTONE_FILE = "tombstones"
TOMBSTONE_MAGIC = b"BKTOMB01"            # then the ids, 8 bytes each, little-endian


class Tombstones:
    """Ids of the ledgers this shard deleted: a sorted ``array('q')`` in memory (8
    bytes a ledger; lookups by bisection) and an append-only file of 8-byte ids,
    appended and fsync'd before a deletion is reported. Ledger ids are never
    reused, so a tombstone is forever; the file outlives journal segments, entry
    logs and the index."""

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


class RecentDeletions:
    """Ids of ledgers deleted while this shard held nothing of them, kept in memory
    for ``keep`` seconds: an ADD for one of them (a zombie writer's, or a
    re-replication or recovery write-back still in flight) is refused like one
    to a tombstone, instead of creating the ledger anew and sitting on disk until
    the next full GC reconcile. A durable tombstone for each would grow with
    every deletion in the cluster; after ``keep`` seconds (one full-reconcile
    interval) or a restart, that reconcile is again what reclaims a late write.
    One sorted ``array('q')`` per GC round (8 bytes an id), at most ``limit`` ids."""

    def __init__(self, keep: float, limit: int = 4_000_000):
        self.keep = keep
        self.limit = limit
        self._rounds: list[tuple[float, array]] = []    # (expiry, sorted ids), oldest first
        self._count = 0

    def add(self, ledgers) -> None:
        now = time.monotonic()
        self._expire(now)
        ids = array("q", sorted(set(ledgers)))
        if not ids:
            return
        self._rounds.append((now + self.keep, ids))
        self._count += len(ids)
        while self._count > self.limit and len(self._rounds) > 1:
            self._count -= len(self._rounds.pop(0)[1])

    def _expire(self, now: float) -> None:
        while self._rounds and self._rounds[0][0] <= now:
            self._count -= len(self._rounds.pop(0)[1])

    def __contains__(self, ledger: int) -> bool:
        if not self._rounds:
            return False
        self._expire(time.monotonic())
        for _, ids in self._rounds:
            i = bisect.bisect_left(ids, ledger)
            if i < len(ids) and ids[i] == ledger:
                return True
        return False

    def __len__(self) -> int:
        return self._count


def _le_bytes(ids: array) -> bytes:
    if sys.byteorder != "little":
        ids = array("q", ids)
        ids.byteswap()
    return ids.tobytes()


class _Ledger:
    __slots__ = ("fenced", "key", "lac", "last")

    def __init__(self, key, fenced=False, lac=-1, last=-1):
        self.fenced = fenced
        self.key = key
        self.lac = lac
        self.last = last

    def row(self) -> list:
        return [self.fenced, self.key, self.lac, self.last]


class _Tail:
    """One ledger's entries written since the last swap: entry -> journal position.

    ``spans`` describes the same entries for the flush, a few numbers per
    *batch* rather than per entry: a flat list of ``first entry, count, start
    position, end position`` for each stretch of consecutive entries whose
    records lie back to back in the journal, so a flush copies a span as one
    piece and finds the record sizes in bulk. It holds while the ledger's
    entries come in order (the writer's normal case); the first entry that does
    not continue them (a gap, a rewrite, a record split by a segment roll)
    turns it into None, and the flush then takes the entries one by one. So
    does a ledger whose spans hold fewer than :data:`SPAN_MIN_ENTRIES` entries
    on average (single adds interleaved with other ledgers'): then spans would
    cost more memory than the positions and save the flush nothing."""

    __slots__ = ("base", "pos", "extra", "spans")

    def __init__(self, base: int, pos: int = _NO_POS, end: int = 0):
        """Empty, or (``pos``) holding entry ``base`` at ``pos`` .. ``end``: a
        ledger's first entry in one step (with one entry a ledger, every add)."""
        self.base = base
        self.extra = None          # {entry: position} for entries far from the array
        if pos < 0:
            self.pos = array("q")
            self.spans = array("q")
        else:                      # (copying a template: half the cost of array(...))
            self.pos = pa = _ONE[:]
            pa[0] = pos
            self.spans = sp = _ONE_SPAN[:]
            sp[0] = base
            sp[2] = pos
            sp[3] = end

    def note(self, entry: int, pos: int, end: int, count: int = 1) -> None:
        """``count`` entries from ``entry`` were appended to the journal, back to
        back from ``pos`` to ``end`` (see ``spans``)."""
        sp = self.spans
        if sp is None:
            return
        if not sp:
            sp.extend((entry, count, pos, end))
            return
        if entry != sp[-4] + sp[-3] or (pos ^ end) >> 32:
            self.spans = None              # not the next entries, or across a roll
        elif sp[-1] == pos:
            sp[-3] += count
            sp[-1] = end
        elif len(sp) >= 64 and len(sp) * SPAN_MIN_ENTRIES > 4 * len(self.pos):
            self.spans = None              # fragmented: entry by entry is as good
        else:
            sp.extend((entry, count, pos, end))

    def get(self, entry: int) -> int:
        i = entry - self.base
        if 0 <= i < len(self.pos):
            return self.pos[i]
        if self.extra:
            return self.extra.get(entry, _NO_POS)
        return _NO_POS

    def put(self, entry: int, pos: int) -> bool:
        """Record ``entry`` at ``pos``; True if the tail did not hold it yet."""
        pa = self.pos
        i = entry - self.base
        n = len(pa)
        if i == n:
            pa.append(pos)
            return True
        if 0 <= i < n:
            old = pa[i]
            pa[i] = pos
            return old < 0
        if n - TAIL_GAP <= i < n + TAIL_GAP and (i >= 0 or -i <= TAIL_GAP):
            if i > n:
                gap = i - n
                while gap >= len(_FILL):
                    pa.extend(_FILL)
                    gap -= len(_FILL)
                pa.extend(_FILL[:gap])
                pa.append(pos)
            else:                    # below the base: extend downwards
                self.pos = array("q", [-1]) * (-i) + pa
                self.base = entry
                self.pos[0] = pos
            return True
        if self.extra is None:
            self.extra = {}
        new = entry not in self.extra
        self.extra[entry] = pos
        return new

    def items(self) -> list[tuple[int, int]]:
        """``(entry, position)`` in entry order."""
        base = self.base
        out = [(base + i, p) for i, p in enumerate(self.pos) if p >= 0]
        if self.extra:
            out += self.extra.items()
            out.sort()
        return out

    def entries_positions(self):
        """``(entries, positions)``: two sequences in entry order, without an
        object per entry in the common case (a dense tail: a range and the
        array itself)."""
        pa = self.pos
        if not self.extra and pa.count(-1) == 0:
            return range(self.base, self.base + len(pa)), pa
        items = self.items()
        return [e for e, _ in items], [p for _, p in items]

    def next_at_or_after(self, entry: int) -> int | None:
        best = None
        pa = self.pos
        i = max(0, entry - self.base)
        while i < len(pa):
            if pa[i] >= 0:
                best = self.base + i
                break
            i += 1
        if self.extra:
            for e in self.extra:
                if e >= entry and (best is None or e < best):
                    best = e
        return best

    def count(self) -> int:
        return len(self.pos) - self.pos.count(-1) + (len(self.extra) if self.extra else 0)


def _at_or_after(run, entry: int) -> int:
    """Position in ``run`` of its first record with an entry id >= ``entry``."""
    if entry <= run.first:
        return 0
    return min(run.count, (entry - run.first + run.step - 1) // run.step)


def _fit(run, i: int, i_max: int, k: int, room: int, left: int, dlen: int = 0) -> int:
    """End (exclusive position) of the records ``i, i + k, ...`` (up to
    ``i_max``) of ``run`` whose payloads fit ``room`` bytes and whose count
    fits ``left``: what one READ_RANGE reads of the run with one pread. The
    index knows record sizes, not digest lengths: ``dlen`` is the digest length
    of the ledger's records when known (0: not yet, and then digests count as
    payload, so the pread never takes more than ``room`` of payload)."""
    over = ADD_OVERHEAD + dlen
    if k == 1:
        most = min(i_max - i + 1, left)
        if run.rlen:
            size = run.rlen - over
            return i + max(0, min(most, room // size if size > 0 else most))
        # variable sizes: the largest n with rel(i + n) - rel(i) - n * overhead <= room
        base = run.rel(i)
        lo, hi = 0, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if run.rel(i + mid) - base - mid * over <= room:
                lo = mid
            else:
                hi = mid - 1
        return i + lo
    j = i
    picked = got = 0
    while j <= i_max and picked < left:
        size = run.rel(j + 1) - run.rel(j) - over
        if got + size > room:
            break
        got += size
        picked += 1
        j += k
    return j - k + 1 if picked else i


class _ReadCache:
    """Read-ahead cache: (ledger, entry) -> (lac, digest, payload), LRU, bounded in bytes."""

    OVERHEAD = 160                   # Python objects per entry, roughly

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._d: OrderedDict = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key):
        v = self._d.pop(key, None)
        if v is not None:
            self._d[key] = v              # pop + set: most recently used
            self.hits += 1
        return v

    def put(self, key, value) -> None:
        if key in self._d or self.max_bytes <= 0:
            return
        self._d[key] = value
        self.bytes += len(value[1]) + len(value[2]) + self.OVERHEAD
        while self.bytes > self.max_bytes and self._d:
            _, v = self._d.popitem(last=False)
            self.bytes -= len(v[1]) + len(v[2]) + self.OVERHEAD

    def clear(self) -> None:
        self._d.clear()
        self.bytes = 0


class ShardStorage:
    """Ledger state, write cache, entry logs, index and journal of one shard.

    Single-threaded (the shard's loop) but for its flusher thread, which it
    owns. ``ledger_dirs`` (default: ``[index_dir]``) are where entry logs go."""

    def __init__(self, journal_dir: str, index_dir: str, *, segment_size: int,
                 sync_data: bool = True, owns=None, progress=None, ledger_dirs=None,
                 write_cache_bytes: int = 64 << 20, flush_bytes: int | None = None,
                 flush_interval: float = 60.0, read_cache_bytes: int = 32 << 20,
                 read_ahead_entries: int = 100, log_size_limit: int = 256 << 20,
                 recent_deletions_seconds: float = 3600.0, index_cache_bytes: int = 16 << 20,
                 uncache_journal: bool = True, direct_journal: bool = False,
                 direct_journal_memory: int = 16 << 20):
        # ``owns(ledger_id)``: whether this shard owns a ledger; an ADD or fence of a
        # ledger it does not own is a misrouted request (EBADREQ), never new state.
        self._owns = owns
        os.makedirs(journal_dir, exist_ok=True)
        os.makedirs(index_dir, exist_ok=True)
        self.journal_dir = journal_dir
        self.index_dir = index_dir
        self.write_cache_bytes = write_cache_bytes
        half = max(1 << 20, write_cache_bytes // 2)
        self.flush_bytes = min(half, flush_bytes) if flush_bytes else half
        # Where the next swap happens: drawn again at every swap (see flush_threshold)
        self._rng = random.Random()
        self._flush_at = self.flush_bytes
        self.flush_interval = flush_interval
        self.read_ahead_entries = max(1, read_ahead_entries)
        self._ledgers: dict[int, _Ledger] = {}
        self._wc: dict[int, _Tail] = {}          # the tail taking writes
        self._flushing: dict[int, _Tail] | None = None   # the swapped tail being flushed
        self._dirty: set[int] = set()            # ledgers whose state changed since the swap
        self._wc_entries = 0
        self._flushing_entries = 0
        self._cache = _ReadCache(read_cache_bytes)
        self.prefetch_bytes = min(read_cache_bytes, PREFETCH_MAX_BYTES)
        self._ahead: OrderedDict[int, tuple[int, int, int]] = OrderedDict()
        self.checkpoints = 0
        self.replayed_records = 0
        self.last_flush: dict = {}
        self._replayed_deletes: list[int] = []
        self._adopted: set[int] = set()          # journal segments the index uses as entry logs
        self._final_stats: dict = {}
        self._progress = progress
        self._closed = False
        self._flush_failed = None
        self._flush_write = None        # (journal write in flight, the flush waiting for it)
        self._compaction = None                  # a CompactJob in flight
        self._compaction_done: dict | None = None
        self._last_swap = time.monotonic()
        self.uncache_journal = uncache_journal
        self.uncached_bytes = 0                  # journal bytes advised out of the page cache
        # The index's mapped pages the worker keeps resident (see bk.bookie.index)
        self.index_cache_bytes = index_cache_bytes
        self._index_resident = 0
        self.index_trims = 0                     # checks that found it over and dropped it
        self._next_trim = 0.0
        self._calm_until = 0.0                   # see maintain and _calm
        self._calm_bytes = 0
        self._tomb = Tombstones(os.path.join(index_dir, TOMBSTONE_FILE))
        self._gone = RecentDeletions(recent_deletions_seconds)
        self._journal = Journal(journal_dir, segment_size, sync_data, direct=direct_journal,
                                direct_memory=direct_journal_memory)
        self._index = None
        self._flusher = None
        try:
            from_v1 = needs_upgrade(journal_dir, index_dir)
            if from_v1:
                # Data of the previous release (entries in the journal, index in a
                # checkpoint file): convert in place before anything else.
                self._journal.close()
                self._journal = None
                upgrade_shard(journal_dir, index_dir, ledger_dirs or [index_dir],
                              segment_size=segment_size, log_size_limit=log_size_limit,
                              progress=progress, tombstones=self._tomb)
                self._journal = Journal(journal_dir, segment_size, sync_data,
                                        direct=direct_journal,
                                        direct_memory=direct_journal_memory)
            self._index = Index(index_dir)
            self._logs = EntryLogs(ledger_dirs or [index_dir], log_size_limit,
                                   journal_dir=journal_dir)
            self._remove_orphan_logs()
            self._flusher = Flusher(self._index, self._logs,
                                    name=f"bk-flush-{os.path.basename(index_dir)}")
            t0 = time.monotonic()
            for lid, (fenced, key, lac, last) in self._index.ledger_states():
                self._ledgers[lid] = _Ledger(key, bool(fenced), lac, last)
            mark = self._index.mark()
            self._replay(mark)
            self._bury()
            if mark is None:                     # replayed from the first segment
                segs = self._journal.segments()
                mark = (segs[0], J.HEADER_SIZE) if segs else self._journal.mark
                self._flushed_mark = self._uncached_mark = mark
                self._swap_at = self._journal_bytes() - self._replayed_bytes
                self.checkpoint(force=True)      # record where the next replay starts
            else:
                self._flushed_mark = self._uncached_mark = mark
                self._swap_at = self._journal_bytes() - self._replayed_bytes
            self._drop_old_segments()
            self.replay_seconds = time.monotonic() - t0
            # the first swap after opening: anywhere below flush_bytes (bookies
            # started together would otherwise start in phase)
            self._flush_at = flush_threshold(self.flush_bytes, self._rng, spread=1.0)
        except BaseException:
            self._shutdown()
            raise
        self._append_add = self._journal.append_add
        log.info("shard storage %s: %d ledgers, %d entries, replayed %d records in %.3fs",
                 index_dir, len(self._ledgers), self.entries, self.replayed_records,
                 self.replay_seconds)

    def _shutdown(self) -> None:
        pending, self._flush_write = getattr(self, "_flush_write", None), None
        if pending is not None:           # (closed after a journal failure) never read
            pending[1].abandoned = True
            pending[1].written.set()
        if self._flusher is not None:
            self._flusher.stop()
            self._flusher = None
        if self._index is not None:
            self._index.close()
            self._index = None
        if self._journal is not None:
            self._journal.close()
        if getattr(self, "_logs", None) is not None:
            self._logs.close()

    def _journal_bytes(self) -> int:
        j = self._journal
        return j.synced_bytes + j._unsynced

    def _remove_orphan_logs(self) -> None:
        known = self._index.logs()
        self._adopted = {log_id & ~JOURNAL_LOG for log_id in known if is_journal_log(log_id)}
        self._logs.reserve_ids(max((k for k in known if not is_journal_log(k)), default=0) + 1)
        for log_id in self._logs.ids():
            if log_id not in known:
                log.info("removing entry log %s: written by a flush or compaction that "
                         "did not commit", self._logs.path(log_id))
                self._logs.remove(log_id)

    # --- writes ---------------------------------------------------------------
    def _admit(self, st: _Ledger, ledger: int, entry: int, master_key: bytes, recovery):
        """``st`` if an ADD of ``entry`` to a ledger with state ``st`` may go in, else
        the status that refuses it: with :meth:`_first_add` (a ledger without
        state), the one place of the rules (tombstone, ownership, master key,
        fence) for single and batched adds."""
        if st.key != master_key:
            status = self._key_mismatch(ledger, st, master_key)
            if status != EOK:
                return status
        if st.fenced and not recovery:
            return EFENCED
        if entry < 0 or (st.last >= 0 and entry - st.last > MAX_ENTRY_GAP):
            return EBADREQ
        return st

    def _first_add(self, ledger: int, entry: int, lac: int, master_key: bytes, append,
                   *args) -> int:
        """An ADD to a ledger this shard has no state of (with one entry a ledger,
        every add): refused if the ledger was deleted (EFENCED) or is not this
        shard's (EBADREQ); else its MASTER_KEY record, its state, then the entry
        (``append(*args)``) and its tail, each made with its first values."""
        if self.is_deleted(ledger):
            return EFENCED           # deleted: its old writer must never get in again
        if entry < 0 or not self._owned(ledger):
            return EBADREQ
        st = self._new_ledger(ledger, master_key)
        if st is None:
            return EIO
        pos = self._append_entry(ledger, entry, append, args)
        if pos < 0:
            return -pos
        if lac > -1:
            st.lac = lac
        st.last = entry
        end = self._journal.position
        if ledger in self._wc:       # a tail without state: not expected (a deletion
            self._tail_put(ledger, entry, pos, end)     # drops both), taken as it is
        else:
            self._wc[ledger] = _Tail(entry, pos, end)
            self._wc_entries += 1
        return EOK

    def _tail_put(self, ledger: int, entry: int, pos: int, end: int) -> None:
        t = self._wc.get(ledger)
        if t is None:
            t = self._wc[ledger] = _Tail(entry)
        if t.put(entry, pos):
            self._wc_entries += 1
        t.note(entry, pos, end)

    def add_entry(self, ledger: int, entry: int, lac: int, master_key: bytes, digest: bytes,
                  payload: bytes, recovery: bool) -> int:
        """Append one entry. EOK; EUA (wrong key); EFENCED (fenced, not a recovery add);
        EBADREQ (negative or absurdly far entry id, larger than a segment); EIO."""
        st = self._ledgers.get(ledger)
        if st is None:
            return self._first_add(ledger, entry, lac, master_key, self._append_add,
                                   ledger, entry, lac, digest, payload)
        st = self._admit(st, ledger, entry, master_key, recovery)
        if type(st) is int:
            return st
        return self._appended(st, ledger, entry, lac, self._append_add,
                              ledger, entry, lac, digest, payload)

    def add_batch(self, records, count: int, master_key: bytes, recovery: bool,
                  acked: list, errors: list) -> int:
        """Append the ``count`` entries of one ADD_BATCH, each body straight from
        ``records`` as received (see ``bk.protocol``). Each entry goes into the
        runs ``acked`` or, with its status, into ``errors`` (see
        ``protocol.add_ack``), with the same checks and statuses as
        :meth:`add_entry` entry by entry: a fenced ledger refuses every entry
        that is not a recovery add. Returns how many failed.

        The records are located and checked in the same pass that appends
        them (no list of them first): ProtocolError for a truncated record, a
        negative id or a count that does not match, raised when the walk gets
        there, so the entries before a malformed record may be in the journal
        (the connection is closed and none of them is acknowledged, as when a
        client dies before its acknowledgement)."""
        if type(count) is not int or not 0 < count <= MAX_BATCH_ENTRIES:
            raise ProtocolError(f"ADD_BATCH with a bad entry count {count!r} "
                                f"(1..{MAX_BATCH_ENTRIES})")
        if type(records) is not bytes and type(records) is not memoryview:
            raise ProtocolError("ADD_BATCH records are not a bin")   # (a view: the
        src = memoryview(records)          # frame buffer's, see protocol.FrameBuffer)
        try:
            return self._add_batch(src, count, master_key, recovery, acked, errors)
        finally:
            src.release()

    def _add_batch(self, src, count, master_key, recovery, acked, errors) -> int:
        ledgers = self._ledgers
        wc = self._wc
        journal = self._journal
        unpack = unpack_record_head
        size = len(src)
        failed = 0
        i = off = 0
        while i < count:
            try:
                plen, lid, eid, lac, dlen = unpack(src, off)
            except struct.error:
                raise ProtocolError(f"ADD_BATCH record {i} is truncated: {size - off} "
                                    f"bytes left for a {REC_HEAD}-byte head") from None
            end = off + REC_HEAD + dlen + plen
            if end > size:
                raise ProtocolError(f"ADD_BATCH record {i} is truncated: it needs "
                                    f"{end - off} bytes, {size - off} are left")
            if lid < 0 or eid < 0:
                raise ProtocolError(f"ADD_BATCH record {i} has a negative ledger or entry id")
            st = ledgers.get(lid)
            t = wc.get(lid)
            if st is not None and t is not None and st.key == master_key \
                    and (recovery or not st.fenced) and eid - t.base == len(t.pos):
                # The fast path: a run of this ledger's next entries, located and
                # appended in one go, their positions straight into the tail.
                pa = t.pos
                k0 = len(pa)
                try:
                    off2, maxlac = journal.append_wire_run(src, off, lid, eid, pa)
                    bad = None
                except (JournalError, OSError) as e:
                    bad = e
                k = len(pa) - k0
                if not k and bad is None:    # cannot be (its first record was checked):
                    raise ProtocolError(f"ADD_BATCH record {i} was not appended")  # never spin
                if bad is not None:   # that entry refused; the next ones go one by one
                    log.error("add entry %d of ledger %d failed: %s", eid + k, lid, bad)
                    errors += (lid, eid + k, EBADREQ if isinstance(bad, RecordTooLargeError)
                               else EIO)
                    failed += 1
                    off2, maxlac = _skip_records(src, off, k)
                    off2 = _skip_records(src, off2, 1)[0]
                i += k + (bad is not None)
                off = off2
                if k:
                    self._wc_entries += k
                    if t.spans is not None:
                        p0 = pa[k0]
                        jend = journal.position
                        if (p0 ^ jend) >> 32:        # the run rolled to a new segment
                            r = bisect.bisect_left(pa, jend >> 32 << 32, k0)
                            t.note(eid, p0, journal.rolled_at, r - k0)
                            t.note(eid + r - k0, pa[r], jend, k0 + k - r)
                        else:
                            t.note(eid, p0, jend, k)
                    if maxlac > st.lac:
                        st.lac = maxlac
                    last = eid + k - 1
                    if last > st.last:
                        st.last = last
                    self._dirty.add(lid)
                    if acked and acked[-1] == eid - 1 and acked[-3] == lid:
                        acked[-1] = last
                    else:
                        acked += (lid, eid, last)
                if i > count:        # (after the accounting of what went in)
                    raise ProtocolError(f"ADD_BATCH announces {count} entries but carries "
                                        f"more")
                continue
            status = self._add_slow(st, lid, eid, lac, master_key, recovery, src, off + 4, end)
            if status == EOK:
                if acked and acked[-1] == eid - 1 and acked[-3] == lid:
                    acked[-1] = eid
                else:
                    acked += (lid, eid, eid)
            else:
                errors += (lid, eid, status)
                failed += 1
            i += 1
            off = end
        if off != size:
            raise ProtocolError(f"ADD_BATCH announces {count} entries but carries "
                                f"{size - off} more bytes")
        return failed

    def _add_slow(self, st, ledger, entry, lac, master_key, recovery, src, start, end) -> int:
        """:meth:`add_entry` for a record body of an ADD_BATCH (every case but the
        next entry of a ledger in the tail)."""
        append = self._journal.append_add_body
        if st is None:
            return self._first_add(ledger, entry, lac, master_key, append, src, start, end)
        st = self._admit(st, ledger, entry, master_key, recovery)
        if type(st) is int:
            return st
        return self._appended(st, ledger, entry, lac, append, src, start, end)

    def _append_entry(self, ledger: int, entry: int, append, args) -> int:
        """``append(*args)``: the journal position of the entry's record, or the
        negated status that refuses it (positions are never negative): EBADREQ
        (too large) or EIO (the journal failed)."""
        try:
            return append(*args)
        except RecordTooLargeError as e:
            log.warning("add entry %d of ledger %d refused: %s", entry, ledger, e)
            return -EBADREQ
        except (JournalError, OSError) as e:
            log.error("add entry %d of ledger %d failed: %s", entry, ledger, e)
            return -EIO

    def _appended(self, st, ledger, entry, lac, append, *args) -> int:
        """Append an admitted entry with ``append(*args)`` (the journal position) and
        account for it: EOK, or EBADREQ (too large) / EIO (the journal failed)."""
        pos = self._append_entry(ledger, entry, append, args)
        if pos < 0:
            return -pos
        self._tail_put(ledger, entry, pos, self._journal.position)
        if lac > st.lac:
            st.lac = lac
        if entry > st.last:
            st.last = entry
        self._dirty.add(ledger)
        return EOK

    def fence(self, ledger: int, master_key: bytes) -> int:
        """Fence a ledger (creating its state if unknown). EOK, EUA, EBADREQ (not this
        shard's ledger) or EIO."""
        st = self._ledgers.get(ledger)
        if st is None:
            if self.is_deleted(ledger):  # deleted: nothing to fence, nothing to create
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
                self._journal.append(J.FENCE, ledger)
            except (JournalError, OSError) as e:
                log.error("fence of ledger %d failed: %s", ledger, e)
                return EIO
            st.fenced = True
            self._dirty.add(ledger)
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
                self._journal.append(J.WRITE_LAC, ledger, lac)
            except (JournalError, OSError) as e:
                log.error("write LAC of ledger %d failed: %s", ledger, e)
                return EIO
            st.lac = lac
            self._dirty.add(ledger)
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
            self._journal.append_master_key(ledger, master_key)
        except (JournalError, OSError) as e:
            log.error("recording the master key of ledger %d failed: %s", ledger, e)
            return None
        st = _Ledger(bytes(master_key))
        self._ledgers[ledger] = st
        self._dirty.add(ledger)
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
        try:
            self._journal.append_master_key(ledger, master_key)
        except (JournalError, OSError) as e:
            log.error("recording the master key of ledger %d failed: %s", ledger, e)
            return EIO
        st.key = bytes(master_key)
        self._dirty.add(ledger)
        return EOK

    # --- reads ----------------------------------------------------------------
    def _tail_pos(self, ledger: int, entry: int) -> int:
        t = self._wc.get(ledger)
        if t is not None:
            p = t.get(entry)
            if p >= 0:
                return p
        if self._flushing is not None:
            t = self._flushing.get(ledger)
            if t is not None:
                return t.get(entry)
        return _NO_POS

    def _read_journal(self, ledger: int, entry: int, pos: int):
        try:
            rl, re_, lac, digest, payload = self._journal.read_add(pos)
        except CorruptRecordError as e:
            log.error("read of entry %d of ledger %d: %s", entry, ledger, e)
            return None
        if rl != ledger or re_ != entry:
            log.error("read of entry %d of ledger %d: the journal position holds entry %d "
                      "of ledger %d", entry, ledger, re_, rl)
            return None
        return lac, digest, payload

    def _read_run(self, run, i: int, j: int, out: list, want=None) -> bool:
        """Decode records ``i..j-1`` of a run into ``out``; False on a bad read."""
        a, b = run.rel(i), run.rel(j)
        try:
            data = self._logs.read(run.log, run.off + a, b - a)
            decode_records(data, 0, len(data), out, want)
        except (EntryLogError, OSError) as e:
            log.error("read of entries %d.. of ledger %d from entry log %d: %s",
                      run.first + i * run.step, run.ledger, run.log, e)
            return False
        return True

    def read_entry(self, ledger: int, entry: int) -> tuple[int, int, bytes, bytes]:
        """``(status, entry_lac, digest, payload)``; ENOLEDGER / ENOENTRY / EIO with
        ``(status, -1, b"", b"")``."""
        st = self._ledgers.get(ledger)
        if st is None:
            return ENOLEDGER, -1, b"", b""
        if entry < 0 or entry > st.last:
            return ENOENTRY, -1, b"", b""
        pos = self._tail_pos(ledger, entry)
        if pos >= 0:
            got = self._read_journal(ledger, entry, pos)
            if got is None:
                return EIO, -1, b"", b""
            return EOK, got[0], got[1], got[2]
        cache = self._cache
        hit = cache.get((ledger, entry))
        if hit is not None:
            return EOK, hit[0], hit[1], hit[2]
        cache.misses += 1
        run = self._index.lookup(ledger, entry)
        if run is None:
            return ENOENTRY, -1, b"", b""
        i = run.index_of(entry)
        # Read ahead: the next entries of the run come with the same pread.
        j = min(run.count, i + self.read_ahead_entries)
        a = run.rel(i)
        while j > i + 1 and run.rel(j) - a > READ_AHEAD_MAX_BYTES:
            j = i + 1 + (j - i - 1) // 2
        recs: list = []
        if not self._read_run(run, i, j, recs) or recs[0][1] != entry or recs[0][0] != ledger:
            return EIO, -1, b"", b""
        for rl, re_, lac, digest, payload in recs[1:]:
            cache.put((rl, re_), (lac, digest, payload))
        _, _, lac, digest, payload = recs[0]
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
        hi = min(last, st.last)
        e = first + (offset - first) % stride
        out: list = []
        total = 0
        if e > hi:
            return EOK, max(first, last + 1), out
        with self._index.read_txn() as txn:
            if self.prefetch_bytes:
                self._prefetch(ledger, e, max_bytes, txn)
            runs = self._index.runs_from(ledger, e, txn)
            run = next(runs, None)
            while e <= hi:
                while run is not None and run.last < e:
                    run = next(runs, None)
                pos = self._tail_pos(ledger, e)
                if pos >= 0:
                    got = self._read_journal(ledger, e, pos)
                    if got is None:
                        return (EIO if not out else EOK), e, out
                    n = len(got[2])
                    if out and total + n > max_bytes:
                        return EOK, e, out
                    out += (e, got[0], got[1], got[2])
                    total += n
                    if total >= max_bytes or len(out) >= 4 * max_count:
                        return EOK, e + 1, out
                    e += stride
                    continue
                if run is not None and run.first <= e:
                    i = run.index_of(e)
                    if i < 0 or stride % run.step:
                        if i >= 0:           # an odd stride: one entry at a time
                            recs: list = []
                            if not self._read_run(run, i, i + 1, recs):
                                return (EIO if not out else EOK), e, out
                            _, _, lac, digest, payload = recs[0]
                            if out and total + len(payload) > max_bytes:
                                return EOK, e, out
                            out += (e, lac, digest, payload)
                            total += len(payload)
                            if total >= max_bytes or len(out) >= 4 * max_count:
                                return EOK, e + stride, out
                        e += stride
                        continue
                    k = stride // run.step
                    i_max = min(run.count - 1, (hi - run.first) // run.step)
                    # The records of this run to read with one pread: by their sizes,
                    # what the byte and count budgets still allow. The budget is of
                    # payload (as the journal's entries above count it): with the
                    # digests counted too, an answer of 256 KiB of 1 KiB entries held
                    # 255 once flushed, and every request of a reader sizing them by
                    # its entries was followed up for the last one. A ledger's
                    # entries share a digest type: its length is learned from the
                    # first entry taken (until then, digests count as payload).
                    end = _fit(run, i, i_max, k, max_bytes - total, max_count - len(out) // 4,
                               len(out[-2]) if out else 0)
                    if end == i:
                        if out:
                            return EOK, e, out
                        end = i + 1               # at least one entry
                    want = None if k == 1 else set(range(e, run.first + end * run.step, stride))
                    a, b = run.rel(i), run.rel(end)
                    n0 = len(out)
                    try:
                        data = self._logs.read(run.log, run.off + a, b - a)
                        total += decode_flat(data, ledger, out, want)
                    except (EntryLogError, OSError) as err:
                        log.error("read of entries %d.. of ledger %d from entry log %d: %s",
                                  e, ledger, run.log, err)
                        # the records before the bad one are good: the range ends there
                        return (EIO if not out else EOK), \
                            (out[-4] + 1 if len(out) > n0 else e), out
                    e = run.first + (end - 1) * run.step + 1
                    if total >= max_bytes or len(out) >= 4 * max_count:
                        return EOK, e, out
                    e += (offset - e) % stride
                    continue
                # ``e`` is in no run and not in a tail: jump to the next entry held.
                target = run.first if run is not None else hi + 1
                for tails in (self._wc, self._flushing):
                    t = tails.get(ledger) if tails else None
                    if t is not None:
                        nt = t.next_at_or_after(e)
                        if nt is not None and nt < target:
                            target = nt
                if target <= e:
                    target = e + 1
                e = target + (offset - target) % stride
        return EOK, max(first, last + 1), out

    def _prefetch(self, ledger: int, e: int, size: int, txn) -> None:
        """Start the disk reads (``EntryLogs.prefetch``) of the ledger's runs from
        entry ``e`` on: the ``size`` bytes this READ_RANGE answers and
        ``prefetch_bytes`` more, skipping what an earlier one already started.
        The reads of a catch-up reader's next runs are then in flight, several
        at once, while this answer is built and sent. Until the reader passes
        the middle of what was started, the index is not walked again (a walk
        of 8 MiB of runs for every 256 KiB answer was ~0.3 µs per entry)."""
        ahead = self._ahead.pop(ledger, None)
        if ahead is not None and ahead[0] <= e < ahead[2]:
            self._ahead[ledger] = ahead          # far enough ahead still
            return
        done_to = ahead[1] if ahead is not None and ahead[0] <= e <= ahead[1] else e
        want = size + self.prefetch_bytes
        seen = 0
        end = e
        for run in self._index.runs_from(ledger, e, txn):
            i = _at_or_after(run, e)
            b = run.rel(run.count)
            seen += b - run.rel(i)
            s0 = run.rel(max(i, _at_or_after(run, done_to)))
            if s0 < b:
                self._logs.prefetch(run.log, run.off + s0, b - s0)
            end = run.last + 1
            if seen >= want:
                break
        end = max(end, done_to)
        # (first entry, end of what was started, where the next walk is due)
        self._ahead[ledger] = (e, end, e + (end - e) // 2)
        if len(self._ahead) > PREFETCH_LEDGERS:
            self._ahead.popitem(last=False)

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
        if ledger not in self._ledgers:
            return ENOLEDGER, []
        ranges: list[int] = []
        spans = []
        for run in self._index.runs_of(ledger):
            if run.step == 1:
                spans.append((run.first, run.last))
            else:
                spans.extend((x, x) for x in run.entries())
        for tails in (self._wc, self._flushing):
            t = tails.get(ledger) if tails else None
            if t is not None:
                spans.extend((e, e) for e, _ in t.items())
        spans.sort()
        for a, b in spans:
            if ranges and a <= ranges[-1] + 1:
                if b > ranges[-1]:
                    ranges[-1] = b
            else:
                ranges += (a, b)
        return EOK, ranges

    def ledgers(self) -> list[int]:
        return sorted(self._ledgers)

    def settled(self) -> set[int]:
        """The ledgers an over-replicated drop would change nothing of: fenced and
        holding no entry, as :meth:`drop_ledgers` leaves them. ``last`` says
        whether a ledger holds entries: every entry taken in (an add, a recovery
        add, a replayed ADD record) raises it, and only a drop (or a replayed
        DROP record) puts it back to -1, with every run and tail entry of the
        ledger gone. So a ledger dropped and then given entries again (this
        bookie picked to hold it again) is not settled, and a drop killed before
        its DROP record was synced left ``last`` as it was."""
        wc = self._wc
        return {lid for lid, st in self._ledgers.items()
                if st.last < 0 and st.fenced and lid not in wc}

    # --- flushes ----------------------------------------------------------------
    def maintain(self, now: float | None = None) -> None:
        """Called by the shard's loop on every pass: take back finished flusher
        jobs, start a flush when the tail is due, and wait for the one in flight
        when the new tail filled too (back-pressure). Most passes find nothing
        due: with no flusher job out, that is two comparisons (see _calm)."""
        fl = self._flusher
        now = time.monotonic() if now is None else now
        if now < self._calm_until and not fl.pending:
            j = self._journal
            if j.synced_bytes + j._unsynced < self._calm_bytes:
                return
        if self._flush_write is not None:
            self._release_flush()
        while fl.pending and not fl.done.empty():
            self._finish(fl.done.get())
        if now >= self._next_trim:
            self._next_trim = now + INDEX_TRIM_SECONDS
            self._trim_index()
        due = self._journal_bytes() - self._swap_at
        if self._flushing is None:
            if self._flush_failed is not None and now - self._last_swap < FLUSH_RETRY_SECONDS:
                self._calm(now, due)
                return                # the journal keeps it all meanwhile
            if due >= self._flush_at or (due and now - self._last_swap >= self.flush_interval):
                self._start_flush()
            elif not fl.pending:
                self._calm(now, due)
        elif due >= (self.write_cache_bytes - self.flush_bytes) // 2:
            # the next tail filled half of its room while the flush is paced:
            # write the rest at full speed before the loop has to wait for it
            self._flusher.hurry()
            if due >= self.write_cache_bytes - self.flush_bytes:
                log.warning("%s: the write cache is full while a flush runs; waiting for it",
                            self.index_dir)
                self._wait_flusher()

    def _calm(self, now: float, due: int) -> None:
        """No flush is due and no flusher job is out: until when (and below how many
        journal bytes) :meth:`maintain` has nothing to do, so that it need not look
        again before. Earliest of: the next index trim, a failed flush's retry, the
        flush interval (once the tail holds anything: a first byte past an expired
        interval makes the next pass look) and the tail's size limit."""
        until = self._next_trim
        limit = self._swap_at + self._flush_at
        if self._flush_failed is not None:
            until = min(until, self._last_swap + FLUSH_RETRY_SECONDS)
        interval_at = self._last_swap + self.flush_interval
        if now < interval_at:
            until = min(until, interval_at)
        elif not due:
            limit = self._swap_at + 1
        self._calm_until = until
        self._calm_bytes = limit

    def _trim_index(self) -> None:
        """Keep the index's mapped pages under ``index_cache_bytes``: RSS bounded
        by the configured caches, not by the entries held."""
        try:
            self._index_resident = self._index.trim(self.index_cache_bytes)
            if self._index_resident > self.index_cache_bytes:
                self.index_trims += 1
        except OSError as e:               # no /proc, or madvise refused: memory only
            log.warning("%s: cannot bound the index's memory: %s", self.index_dir, e)
            self._next_trim = float("inf")

    def _start_flush(self) -> None:
        j = self._journal
        # The flusher reads the region from the files. A direct write of its last
        # records may still be in flight (the group's, handed out in this pass):
        # the flusher waits for it, not the loop (see _release_flush).
        write = j.write_out(wait=False)
        mark = j.mark
        regions = []
        seq0, off0 = self._flushed_mark
        for seq in j.segments():
            if seq < seq0 or seq > mark[0]:
                continue
            lo = off0 if seq == seq0 else J.HEADER_SIZE
            hi = mark[1] if seq == mark[0] else j.segment_size_of(seq)
            if hi > lo:
                regions.append((seq, j.segment_path(seq), lo, hi))
        states = {lid: self._ledgers[lid].row() for lid in self._dirty if lid in self._ledgers}
        nbytes = self._journal_bytes() - self._swap_at
        job = FlushJob(self._wc, states, mark, regions=regions, nbytes=nbytes,
                       rate=flush_rate(nbytes, time.monotonic() - self._last_swap))
        if write is not None:
            job.written = threading.Event()
            self._flush_write = (write, job)
        if self._flusher.pending:
            self._flusher.hurry()              # a compaction must not hold this flush back
        self._flushing = self._wc
        self._flushing_entries = self._wc_entries
        self._wc = {}
        self._wc_entries = 0
        self._dirty = set()
        self._swap_at = self._journal_bytes()
        self._flush_at = flush_threshold(self.flush_bytes, self._rng)
        self._last_swap = time.monotonic()
        self._calm_until = 0.0
        self._flusher.submit(job)

    def _release_flush(self, wait: bool = False) -> None:
        """Let the flush that waits for a journal write in flight go on once that
        write completed (checked every pass, by :meth:`maintain`); ``wait``: wait
        for it here (the loop is about to wait for the flusher, which would
        otherwise wait for a write that only the loop takes back). A failed
        write fails the flush: it reads nothing and is merged back."""
        pending = self._flush_write
        if pending is None:
            return
        write, job = pending
        j = self._journal
        if j.writing(write):
            if not wait:
                return
            try:
                j.write_out()              # waits for it
            except JournalError:
                pass                       # write.error or the journal's failure says
        self._flush_write = None
        if write.error is not None or j._failed is not None:
            job.abandoned = True
        job.written.set()

    def _finish(self, job) -> None:
        self._flusher.pending -= 1
        if isinstance(job, CompactJob):
            self._finish_compaction(job)
            return
        if isinstance(job, UncacheJob):
            self.uncached_bytes += job.dropped
            if job.error is not None:      # advice only: the pages stay cached, no harm
                log.warning("%s: dropping flushed journal pages from the page cache "
                            "failed: %s", self.index_dir, job.error)
            return
        if isinstance(job, RemoveJob):
            if job.error is not None:
                log.warning("%s: deleting old journal segments failed: %s", self.index_dir,
                            job.error)
            return
        flushed = self._flushing
        self._flushing = None
        if job.error is not None:
            # Nothing was committed: the journal still has it all. Merge the tail
            # back (newer positions win) and try again at the next flush.
            self._flush_failed = job.error
            for lid, t in flushed.items():
                new = self._wc.get(lid)
                self._wc[lid] = t
                if new is not None:
                    t.spans = None         # the next flush takes this ledger entry by entry
                    for e, p in new.items():
                        t.put(e, p)
            self._wc_entries += self._flushing_entries
            self._dirty.update(job.states)
            return
        self._flush_failed = None
        if job.stats.get("merged"):
            # rewritten entries (recovery adds) replaced older copies: no stale
            # copy may stay in the read-ahead cache
            self._cache.clear()
        self._adopted |= job.stats.get("adopted", set())
        self._uncache(self._flushed_mark)
        self._flushed_mark = job.mark
        self.checkpoints += 1
        self.last_flush = dict(job.stats, journal_bytes=job.nbytes)
        self._flushing_entries = 0
        self._drop_old_segments(later=True)

    def _drop_old_segments(self, later: bool = False) -> None:
        """Journal segments wholly before the flushed mark are in the index: delete
        them (``later``: on the flusher thread, see ``RemoveJob``), but for those
        the index uses as entry logs, which the journal only stops mapping."""
        j = self._journal
        old = [seq for seq in j.segments() if seq < self._flushed_mark[0] and seq != j.active_seq]
        gone = []
        for seq in old:
            if seq in self._adopted:
                j.forget_segment(seq)
            elif later:
                gone.append(j.forget_segment(seq))
            else:
                j.remove_segment(seq)
        if gone:
            self._flusher.submit(RemoveJob(gone))

    def _uncache(self, upto) -> None:
        """Drop the journal from the page cache up to ``upto``, the mark of the
        flush before the one that just committed (see the module docstring,
        "Page cache")."""
        if not self.uncache_journal:
            return
        seq0, off0 = self._uncached_mark
        seq1, off1 = upto
        hi1 = off1 & _PAGE_MASK            # never the page the mark is in
        ranges = []
        for seq in range(seq0, seq1 + 1):
            lo = off0 & _PAGE_MASK if seq == seq0 else 0
            hi = hi1 if seq == seq1 else 0
            if seq == seq1 and hi <= lo:
                continue
            ranges.append((os.path.join(self.journal_dir, J.segment_name(seq)), lo, hi))
        self._uncached_mark = (seq1, hi1)
        if ranges:
            self._flusher.submit(UncacheJob(ranges))

    def _wait_flusher(self) -> None:
        self._release_flush(wait=True)
        fl = self._flusher
        if fl.pending:
            fl.hurry()                       # the loop waits: no job is held to a rate
        while fl.pending:
            self._finish(fl.done.get())

    def checkpoint(self, force: bool = False) -> None:
        """Flush everything written so far into entry logs and index, and wait for
        it (a restart then replays nothing). Raises if the flush failed."""
        self._wait_flusher()
        self._journal.sync()
        if force or self._wc or self._dirty or \
                tuple(self._journal.mark) != tuple(self._flushed_mark):
            self._start_flush()
            self._wait_flusher()
            if self._flush_failed is not None:
                raise JournalError(f"flush of {self.index_dir} failed: {self._flush_failed}")

    @property
    def entries(self) -> int:
        return self._index.entries() + self._wc_entries + self._flushing_entries

    # --- replay -------------------------------------------------------------------
    def _replay(self, mark) -> None:
        ledgers = self._ledgers
        journal = self._journal
        n = nbytes = 0
        keyless = set()
        report = self._replay_reporter(mark)
        for pos, rlen, rtype, f in journal.replay(mark):
            n += 1
            nbytes += rlen
            if not n & 0x3FFF and report is not None:
                report(pos)
            lid = f[0]
            st = ledgers.get(lid)
            if rtype == J.DELETE:
                if st is not None:
                    del ledgers[lid]
                self._wc.pop(lid, None)
                self._replayed_deletes.append(lid)
                continue
            if rtype == J.DROP:
                if st is not None:
                    self._forget(lid, st)
                continue
            if st is None:
                st = ledgers[lid] = _Ledger(None)
                keyless.add(lid)
            self._dirty.add(lid)
            if rtype == J.ADD:
                _, entry, lac = f
                if entry >= 0:
                    self._tail_put(lid, entry, pos, pos + rlen)
                    if lac > st.lac:
                        st.lac = lac
                    if entry > st.last:
                        st.last = entry
            elif rtype == J.MASTER_KEY:
                if st.key is None:
                    st.key = f[1]
                    keyless.discard(lid)
            elif rtype == J.FENCE:
                st.fenced = True
            elif rtype == J.WRITE_LAC:
                if f[1] > st.lac:
                    st.lac = f[1]
            elif rtype == J.STATE:
                _, fenced, lac, key = f
                st.fenced = st.fenced or fenced
                if lac > st.lac:
                    st.lac = lac
                if key is not None:
                    st.key = key
                    keyless.discard(lid)
        self.replayed_records = n
        self._replayed_bytes = nbytes
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
    def _forget(self, lid: int, st: _Ledger) -> None:
        """A DROP: the ledger's entries are gone, it stays fenced with its key."""
        t = self._wc.pop(lid, None)
        if t is not None:
            self._wc_entries -= t.count()
        st.last = -1
        st.fenced = True
        self._dirty.add(lid)
        with self._index.write() as w:
            w.delete_runs_of(lid)
            w.put_state(lid, *st.row())

    def delete_ledgers(self, ledger_ids) -> int:
        """Drop the state, entries and index of these ledgers, leaving a durable
        tombstone for each; return how many."""
        # Tombstones first: once a ledger's state is gone, only its tombstone keeps
        # an old writer's ADD from creating it anew.
        ledger_ids = list(ledger_ids)
        ids = [lid for lid in ledger_ids if lid in self._ledgers]
        self._tomb.add(ids)
        if len(ids) < len(ledger_ids):
            # deleted, and nothing of them here (yet): refuse what arrives late
            held = set(ids)
            self._gone.add(lid for lid in ledger_ids if lid not in held)
        if not ids:
            return 0
        self._wait_flusher()
        for lid in ids:
            self._journal.append(J.DELETE, lid)
        self._journal.sync()
        with self._index.write() as w:
            for lid in ids:
                del self._ledgers[lid]
                t = self._wc.pop(lid, None)
                if t is not None:
                    self._wc_entries -= t.count()
                self._dirty.discard(lid)
                w.delete_runs_of(lid)
                w.delete_state(lid)
        self._cache.clear()
        return len(ids)

    def drop_ledgers(self, ledger_ids) -> int:
        """Forget the entries of these ledgers but keep each fenced, with its key and
        no tombstone (over-replicated GC: the ledger lives on, re-replicated to
        other bookies). Fenced, so an old writer's ADD is refused (EFENCED) where
        an absent ledger would have been created anew; no tombstone, so recovery
        adds (this bookie picked again to hold it) are accepted. Returns how many
        had entries."""
        ids = [lid for lid in ledger_ids if lid in self._ledgers]
        if not ids:
            return 0
        self._wait_flusher()
        for lid in ids:
            self._journal.append(J.DROP, lid)
        self._journal.sync()
        dropped = 0
        for lid in ids:
            st = self._ledgers[lid]
            if st.last >= 0 or lid in self._wc or self._index.runs_of(lid):
                dropped += 1
            self._forget(lid, st)
        self._cache.clear()
        return dropped

    def _bury(self) -> None:
        """After loading: a ledger with a tombstone but state (a crash between the
        tombstone and its index update) is deleted; DELETE records whose tombstone
        is missing are re-tombstoned."""
        dead = [lid for lid in self._ledgers if lid in self._tomb]
        if dead:
            with self._index.write() as w:
                for lid in dead:
                    self._ledgers.pop(lid)
                    t = self._wc.pop(lid, None)
                    if t is not None:
                        self._wc_entries -= t.count()
                    self._dirty.discard(lid)
                    w.delete_runs_of(lid)
                    w.delete_state(lid)
            log.warning("dropped %d ledgers that have tombstones (e.g. %d)", len(dead),
                        dead[0])
        if self._replayed_deletes:
            ids = self._replayed_deletes
            self._tomb.add(ids)
            with self._index.write() as w:
                for lid in ids:
                    w.delete_runs_of(lid)
                    w.delete_state(lid)
            self._replayed_deletes = []

    @property
    def tombstones(self) -> int:
        return len(self._tomb)

    def is_deleted(self, ledger: int) -> bool:
        """A tombstone, or deleted lately while this shard held nothing of it."""
        return ledger in self._tomb or ledger in self._gone

    def start_compaction(self, threshold: float, max_bytes: int | None = None) -> bool:
        """Queue a compaction of the entry logs whose live fraction is under
        ``threshold`` (the flusher thread does it between flushes); its result
        comes back from :meth:`compaction_result`."""
        if threshold <= 0 or self._compaction is not None:
            return False
        self._wait_flusher()
        self._compaction = CompactJob(threshold, max_bytes,
                                      keep_from=journal_log_id(self._flushed_mark[0]))
        self._compaction_done = None
        self._flusher.submit(self._compaction)
        return True

    def compaction_result(self) -> dict | None:
        """The stats of the last compaction once it finished (then None again)."""
        fl = self._flusher
        while fl.pending and not fl.done.empty():
            self._finish(fl.done.get())
        done, self._compaction_done = self._compaction_done, None
        return done

    def _finish_compaction(self, job: CompactJob) -> None:
        self._compaction = None
        stats = dict(job.stats) or {"logs_removed": 0, "entries_moved": 0, "bytes_moved": 0,
                                    "bytes_freed": 0}
        if job.error is not None:
            stats["error"] = str(job.error)
        freed = 0
        paths = []
        for log_id in job.removable:
            if is_journal_log(log_id):
                seq = log_id & ~JOURNAL_LOG
                self._adopted.discard(seq)
                if seq in self._journal.segments():     # never: it is before the mark
                    self._journal.forget_segment(seq)
            path, size = self._logs.forget(log_id)
            paths.append(path)
            freed += size
        if paths:
            # Unlinked by the flusher thread, not the loop. A crash before leaves
            # files the index no longer names: removed at open (orphan logs, and
            # journal segments before the mark).
            self._flusher.submit(RemoveJob(paths))
        stats["bytes_freed"] = freed
        stats["segments_removed"] = stats.get("logs_removed", 0)
        self._compaction_done = stats

    def compact(self, threshold: float, max_bytes: int | None = None) -> dict:
        """Compact now and wait (see :meth:`start_compaction`); returns the stats."""
        stats = {"logs_removed": 0, "segments_removed": 0, "entries_moved": 0,
                 "bytes_moved": 0, "bytes_freed": 0}
        if not self.start_compaction(threshold, max_bytes):
            return stats
        self._wait_flusher()
        return self.compaction_result() or stats

    def _adopted_bytes(self) -> int:
        total = 0
        for seq in list(self._adopted):
            try:
                total += os.path.getsize(self._logs.path(journal_log_id(seq)))
            except FileNotFoundError:
                pass
        return total

    def stats(self) -> dict:
        if self._index is None:          # closed: what it was at the end (the last heartbeat)
            return dict(self._final_stats)
        j = self._journal
        return {
            "ledgers": len(self._ledgers),
            "entries": self.entries,
            "segments": len(j.segments()),
            "journal_bytes": j.disk_usage(),
            "entry_logs": len(self._logs.ids()),
            "journal_segments_as_logs": len(self._adopted),
            "journal_segments_as_logs_bytes": self._adopted_bytes(),
            "entry_log_bytes": self._logs.disk_usage(),
            "index_bytes": self._index.disk_usage(),
            "index_resident_bytes": self._index_resident,   # at the last check, before a trim
            "index_trims": self.index_trims,
            "syncs": j.syncs,
            "synced_records": j.synced_records,
            "synced_bytes": j.synced_bytes,
            "unsynced_bytes": j.unsynced_bytes,
            "journal_mark": J.format_mark(j.mark),
            "last_mark": J.format_mark(self._flushed_mark),
            "checkpoints": self.checkpoints,
            "flushing": self._flushing is not None,
            "compacting": self._compaction is not None,
            "write_cache_bytes": self._journal_bytes() - self._swap_at,
            "write_cache_entries": self._wc_entries + self._flushing_entries,
            "last_flush_bytes": self.last_flush.get("bytes", 0),
            "last_flush_seconds": round(self.last_flush.get("seconds", 0.0), 4),
            "read_cache_bytes": self._cache.bytes,
            "read_cache_hits": self._cache.hits,
            "read_cache_misses": self._cache.misses,
            "tombstones": len(self._tomb),
            "recent_deletions": len(self._gone),     # refused for a while: RecentDeletions
            "replayed_records": self.replayed_records,
        }

    def close(self) -> None:
        """Flush, stop the flusher and close everything (idempotent). After a journal
        failure the flush is skipped: the state may include records that are not
        durable."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._journal._failed is None:
                self.checkpoint()
            self._final_stats = self.stats()
        finally:
            self._shutdown()
