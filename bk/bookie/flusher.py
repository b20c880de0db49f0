"""The flusher of one shard: a thread that turns the journal's tail into entry logs and index.

Theory of operation
-------------------
Entries written since the last flush are durable in the journal already; the
shard's loop keeps only their journal positions (the *write cache* of
``bk.bookie.storage``). When that tail reaches half of
``dbStorage_writeCacheMaxSizeMb`` (or ``flushIntervalBytes``, or every
``flushInterval`` ms; a random point of the last quarter below that size,
drawn at every swap, so that an ensemble's bookies do not flush together:
``bk.bookie.storage.flush_threshold``), the loop *swaps* it: the filled
tail, the ledger states that changed and the journal mark become a
:class:`FlushJob` and a new empty tail takes the writes. The loop goes on serving meanwhile; reads of the
swapped tail still go to the journal until the job is done.

A flush, on this thread:

0. with direct journal writes, waits until the journal's write of the
   region's last records completed (:attr:`FlushJob.written`): the loop
   swapped the tail right after handing that write out, and lets the flush go
   on once it took the write back (``ShardStorage._release_flush``) rather
   than wait for the disk itself;
1. maps the journal segments between the previous mark and the job's mark
   read-only (its own mappings: nothing is copied into fresh buffers, whose
   page faults once cost more than the copy itself). With buffered journal
   writes the pages are in the page cache already; with direct writes (the
   default) each write dropped its blocks from it, so a flush reads them from
   the disk: its mappings are of the files, never of the journal's windows
   (see "Direct writes" in ``bk.bookie.journal``);
2. for each ledger in id order, copies its records in entry order into the
   current entry log (log records are journal records), merging with
   existing runs whose range it meets (see ``bk.bookie.index``). A ledger
   whose entries came in order (the tail's ``spans``, see
   ``bk.bookie.storage._Tail``) is stored span by span, a batch of records
   at a time, and its runs are made from the spans: the record sizes come
   from the journal positions in bulk, with no Python work per entry. A span
   of ``ADOPT_MIN_BYTES`` or more is sorted already and is not copied at all:
   its runs point into the journal segment, which becomes an entry log too
   (see ``bk.bookie.entrylog``). Other ledgers are gathered entry by entry;
3. ``fdatasync``s the entry log (its writeback was started chunk by chunk
   on the way, and held to the job's ``rate``: see ``bk.bookie.entrylog``,
   :class:`~bk.bookie.entrylog.WritePacer`) and the journal segments the runs point
   into (the journal's last group before the mark may not be synced yet);
4. commits in ONE LMDB transaction: the new runs, the ledger states, the
   logs' sizes and live bytes, and the mark.

Only then does the loop drop the swapped tail and remove the journal segments
wholly before the mark that the index does not use (their files are
unlinked by this thread, see :class:`RemoveJob`). A crash before step 4
leaves the index as it was and the journal from the old mark (replayed at
restart); the entry log bytes the crashed flush wrote are unreferenced (a
log the index does not know is removed at open). A crash after step 4
replays from the new mark, and removes at open the segments before it that
the index does not use. Either way every acknowledged entry is readable.

After the commit the loop also hands this thread the journal range the
flush *before* took, to be advised out of the page cache (:class:`UncacheJob`,
see ``bk.bookie.storage``, "Page cache").

Compaction (:class:`CompactJob`) runs on the same thread, between flushes,
so the index has one writer at a time: it copies the live runs of the logs
whose live fraction is under the threshold into the current log, syncs,
repoints the runs in one transaction, and hands the emptied logs back to the
loop, which deletes their files (a reader may hold one open meanwhile).
"""

from __future__ import annotations

import logging
import mmap
import operator
import os
import queue
import struct
import sys
import threading
import time
from array import array

from bk.bookie.entrylog import ADOPT_MIN_BYTES, JOURNAL_LOG, EntryLogs, WritePacer, journal_log_id
from bk.bookie.index import Index, Run, make_runs, uniform_runs
from bk.bookie.journal import _fsync_dir

log = logging.getLogger("bk.flusher")

_LEN = struct.Struct("<I")
# Bytes/s a flush writes at least (it aims at twice the rate its tail filled at,
# see ShardStorage._start_flush), and a compaction: fast enough that a flush of
# a default write cache's half takes ~2 s, slow enough that the journal's syncs
# on the same disk do not queue behind it (bk.bookie.entrylog, WritePacer).
FLUSH_MIN_RATE = 16 << 20
COMPACT_RATE = 64 << 20
_OFF_MASK = 0xFFFFFFFF


class FlushJob:
    """One swapped tail: ``tails`` {ledger: Tail}, ``states`` {ledger: [fenced,
    key, lac, last]}, ``mark``, ``regions`` [(seq, path, lo, hi)] of the journal
    to read (or ``views`` {seq: (buffer, base)} already in memory)."""

    def __init__(self, tails, states, mark, regions=(), views=None, nbytes=0, rate=0.0):
        self.tails = tails
        self.rate = rate                 # bytes/s the flush writes at (0: unpaced)
        self.states = states
        self.mark = mark
        self.regions = regions
        self.views = views
        self.nbytes = nbytes
        self.error: BaseException | None = None
        self.stats: dict = {}
        # direct journal writes: set by the loop once the journal's write of the
        # region's last records completed (ShardStorage._release_flush); until then
        # the files may not hold them. ``abandoned``: that write failed, or the
        # storage closed first: nothing is read, the flush fails.
        self.written: threading.Event | None = None
        self.abandoned = False

    def run(self, fl: "Flusher") -> None:
        if self.written is not None:
            self.written.wait()
            if self.abandoned:
                raise OSError("the journal's write of the flushed region did not complete")
        t0 = time.monotonic()
        views = self.views
        if views is None:
            views = _SegmentViews({seq: path for seq, path, _lo, _hi in self.regions})
        adopted = {} if isinstance(views, _SegmentViews) and fl.logs.journal_dir else None
        try:
            copied = fl.copy_tails(self.tails, views, self.states, self.mark, adopted)
        finally:
            if isinstance(views, _SegmentViews):
                views.close()
        self.stats = {"bytes": copied[0], "entries": copied[1], "runs": copied[2],
                      "merged": copied[3], "adopted": set(adopted or ()),
                      "seconds": time.monotonic() - t0, "paced_seconds": fl.pacer.slept}


class _SegmentViews:
    """``{seq: (buffer, base)}`` of journal segments, each mapped read-only on
    first use by the flusher itself (never the journal's own mappings, which the
    loop may change meanwhile)."""

    def __init__(self, paths: dict):
        self._paths = paths
        self._maps: dict = {}

    def path(self, seq: int) -> str:
        return self._paths[seq]

    def __getitem__(self, seq: int):
        got = self._maps.get(seq)
        if got is None:
            fd = os.open(self._paths[seq], os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            got = self._maps[seq] = (mm, 0)
        return got

    def close(self) -> None:
        for mm, _ in self._maps.values():
            try:
                mm.close()
            except BufferError:         # a view is still held (an error path): GC unmaps it
                pass
        self._maps.clear()


class CompactJob:
    """Copy the live runs of sparse entry logs forward; ``stats`` says what was done
    and ``removable`` which logs the loop may delete."""

    def __init__(self, threshold: float, max_bytes: int | None, keep_from: int | None = None):
        self.threshold = threshold
        self.max_bytes = max_bytes
        # journal segments from this log id on (the one holding the flushed mark and
        # later) are the journal's still: never compacted away
        self.keep_from = keep_from
        self.rate = COMPACT_RATE
        self.error: BaseException | None = None
        self.stats: dict = {}
        self.removable: list[int] = []

    def run(self, fl: "Flusher") -> None:
        fl.compact(self)


class RemoveJob:
    """Delete files the index no longer needs (journal segments before the mark)
    off the shard's loop: ext4 takes tens of ms to unlink a preallocated 256 MiB
    segment, a stall every add of the loop would wait for."""

    def __init__(self, paths: list[str]):
        self.paths = paths
        self.error: BaseException | None = None

    def run(self, fl: "Flusher") -> None:
        dirs = set()
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            dirs.add(os.path.dirname(path))
        for d in dirs:
            _fsync_dir(d)


class UncacheJob:
    """Drop flushed journal ranges from the page cache (``posix_fadvise(DONTNEED)``),
    so that the page cache the journal fills stays bounded and the next appends
    land on pages the kernel just freed rather than on new ones (see
    ``ShardStorage._uncache``). ``ranges``: ``[(path, lo, hi)]``, ``hi`` 0 for the
    file's end. Advice only: a file gone meanwhile is skipped, and dirty or
    mapped pages stay where they are (the kernel skips them)."""

    def __init__(self, ranges: list):
        self.ranges = ranges
        self.error: BaseException | None = None
        self.dropped = 0                 # bytes advised (not necessarily resident)

    def run(self, fl: "Flusher") -> None:
        for path, lo, hi in self.ranges:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:    # removed by a RemoveJob: its pages went with it
                continue
            try:
                os.posix_fadvise(fd, lo, hi - lo if hi else 0, os.POSIX_FADV_DONTNEED)
                self.dropped += (hi or os.fstat(fd).st_size) - lo
            finally:
                os.close(fd)


def _pread_all(path: str, lo: int, hi: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        parts = []
        off = lo
        while off < hi:
            b = os.pread(fd, min(hi - off, 16 << 20), off)
            if not b:
                break
            parts.append(b)
            off += len(b)
    finally:
        os.close(fd)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class Flusher:
    """The flush/compaction thread of one shard. The loop submits jobs and takes
    them back finished from :attr:`done` (see ``ShardStorage.maintain``)."""

    def __init__(self, index: Index, logs: EntryLogs, name: str = "bk-flush"):
        self.index = index
        self.logs = logs
        self.writer = None
        self.pacer = WritePacer()        # the loop may hurry it from its own thread
        self.pending = 0
        self._submitted = 0              # jobs numbered 1, 2, ... for the pacer                 # jobs submitted and not yet taken back
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job) -> None:
        self.pending += 1
        self._submitted += 1
        job.seq = self._submitted
        self._q.put(job)

    def hurry(self) -> None:
        """Every job submitted so far writes at full speed (the loop waits for them)."""
        self.pacer.hurry(self._submitted)

    def stop(self) -> None:
        self._q.put(None)
        self._thread.join()
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            self.pacer.start(getattr(job, "rate", 0.0), job.seq)
            try:
                job.run(self)
            except BaseException as e:     # reported to the loop, which decides
                log.error("%s failed: %s", type(job).__name__, e, exc_info=True)
                job.error = e
            self.done.put(job)

    # --- the entry log being written -------------------------------------------
    def _writer(self, closed: list):
        """The log to append to: the current one, or a new one once it passed
        ``logSizeLimit`` (the full one is synced and noted in ``closed`` as
        ``(id, dir index, size)`` for the next commit)."""
        w = self.writer
        if w is None or w.size >= self.logs.size_limit:
            if w is not None:
                w.sync()
                w.close()
                closed.append((w.id, w.dir_index, w.size))
            w = self.writer = self.logs.new_writer(self.pacer)
        return w

    # --- flush --------------------------------------------------------------------
    def copy_tails(self, tails, views, states, mark, adopted=None) -> tuple[int, int, int, int]:
        """Steps 2-4 of a flush (see the module docstring); returns (bytes, entries,
        runs, old runs merged). ``adopted``: a dict that gets ``{seq: path}`` of
        the journal segments the new runs point into (None: copy everything)."""
        index = self.index
        runs: list[Run] = []
        old: list[Run] = []
        closed = []                       # logs finished during this flush: (id, dir, size)
        nbytes = nentries = 0
        with index.read_txn() as rtx:
            for lid in sorted(tails):
                t = tails[lid]
                spans = getattr(t, "spans", None)
                if spans and not t.extra:
                    done = self._copy_spans(lid, t, spans, views, rtx, runs, closed, adopted)
                    if done is not None:
                        nbytes += done[0]
                        nentries += done[1]
                        continue
                entries, positions = t.entries_positions()
                if not entries:
                    continue
                pieces, sizes = _gather(entries, positions, views)
                over = index.overlapping(lid, entries[0], entries[-1], rtx)
                if over:
                    entries, data, sizes = self._merge(over, entries, b"".join(pieces), sizes)
                    pieces = [data]
                    old += over
                w = self._writer(closed)
                off = w.append_pieces(pieces)
                runs += make_runs(lid, entries, sizes, w.id, off)
                nbytes += sum(sizes)
                nentries += len(entries)
        w = self.writer
        if w is not None:
            w.sync()
        sizes_of = {}
        for seq, path in (adopted or {}).items():
            # The runs that point into a segment are durable before the index names
            # them: the journal's last group before the mark may not be synced yet.
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                sizes_of[seq] = os.fstat(fd).st_size
            finally:
                os.close(fd)
        with index.write() as wtx:
            for run in old:
                wtx.delete_run(run)
            for run in runs:
                wtx.put_run(run)
            for log_id, di, size in closed:
                wtx.set_log(log_id, di, size)
            if w is not None:
                wtx.set_log(w.id, w.dir_index, w.size)
            for seq, size in sizes_of.items():
                wtx.set_log(journal_log_id(seq), -1, size)
            for lid, (fenced, key, lac, last) in states.items():
                wtx.put_state(lid, fenced, key, lac, last)
            if mark is not None:
                wtx.set_mark(mark)
        return nbytes, nentries, len(runs), len(old)

    def _copy_spans(self, lid, t, spans, views, rtx, runs, closed, adopted):
        """Store a ledger's tail that came in order (``spans``: first, count, start,
        end per stretch of records back to back in the journal, see
        ``bk.bookie.storage._Tail``) span by span: a long span stays in its journal
        segment (``adopted`` permitting), a short one is copied into the current
        entry log. Adds the runs to ``runs``; returns ``(bytes, entries)``, or
        None when the entries meet existing runs (the caller merges them entry by
        entry)."""
        first = spans[0]
        count = spans[-4] + spans[-3] - first
        if self.index.overlapping(lid, first, first + count - 1, rtx):
            return None
        pa = t.pos
        base = t.base
        # Where each span went: [log, offset, first entry, count, record size or 0
        # (sizes vary), start position, end position].
        placed = []
        nbytes = 0
        for k in range(0, len(spans), 4):
            e0, n, p0, p1 = spans[k:k + 4]
            size = p1 - p0
            r = size // n
            # One record size iff the positions step by it: checked in bulk.
            if r * n != size or (n > 1 and not _steps_by(pa, e0 - base, n, r)):
                r = 0
            seq = p0 >> 32
            if adopted is not None and size >= ADOPT_MIN_BYTES:
                adopted[seq] = views.path(seq)
                placed.append([journal_log_id(seq), p0 & _OFF_MASK, e0, n, r, p0, p1])
            else:
                buf, vbase = views[seq]
                a = (p0 & _OFF_MASK) - vbase
                w = self._writer(closed)
                off = w.append_pieces([memoryview(buf)[a:a + size]])
                placed.append([w.id, off, e0, n, r, p0, p1])
            nbytes += size
        # Runs: spans stored back to back in one log make one group.
        i = 0
        while i < len(placed):
            log_id, off, e0, n, r, p0, p1 = placed[i]
            j = i + 1
            end = off + p1 - p0
            while j < len(placed) and placed[j][0] == log_id and placed[j][1] == end:
                end += placed[j][6] - placed[j][5]
                if placed[j][4] != r:
                    r = 0
                j += 1
            total = placed[j - 1][2] + placed[j - 1][3] - e0
            if r:
                runs += uniform_runs(lid, e0, total, r, log_id, off)
            else:
                # Records of different sizes: each one's size is the distance to the
                # next position (the span's end for the last of a span).
                sizes: list = []
                for _, _, f, m, _, q0, q1 in placed[i:j]:
                    part = pa[f - base:f - base + m]
                    sizes += map(operator.sub, part[1:], part)
                    sizes.append(q1 - part[-1])
                runs += make_runs(lid, range(e0, e0 + total), sizes, log_id, off)
            i = j
        return nbytes, count

    def _merge(self, over: list[Run], entries, data, sizes):
        """The union of existing runs' records and a flush's (the flush's copy wins):
        ``(entries, record bytes, sizes)``."""
        recs = {}
        for run in over:
            old = memoryview(self._read_run(run))
            for i, e in enumerate(run.entries()):
                recs[e] = old[run.rel(i):run.rel(i + 1)]
        mv = memoryview(data)
        at = 0
        for e, n in zip(entries, sizes):
            recs[e] = mv[at:at + n]
            at += n
        entries = sorted(recs)
        chunks = [recs[e] for e in entries]
        return entries, b"".join(chunks), [len(c) for c in chunks]

    def _read_run(self, run: Run) -> bytes:
        return _pread_all(self.logs.path(run.log), run.off, run.off + run.nbytes)

    # --- compaction -----------------------------------------------------------------
    def compact(self, job: CompactJob) -> None:
        index = self.index
        current = self.writer.id if self.writer is not None else None
        logs = index.logs()
        cands = []
        for log_id, (_di, size, live) in logs.items():
            if log_id == current or size <= 0:
                continue
            if log_id >= JOURNAL_LOG and (job.keep_from is None or log_id >= job.keep_from):
                continue
            frac = max(0, live) / size
            if frac < job.threshold:
                cands.append((frac, log_id))
        cands.sort()
        stats = {"logs_removed": 0, "entries_moved": 0, "bytes_moved": 0, "bytes_freed": 0}
        job.stats = stats
        if not cands:
            return
        chosen = []
        budget = 0
        for _, log_id in cands:
            live = max(0, logs[log_id][2])
            if live and job.max_bytes is not None and chosen and budget + live > job.max_bytes:
                break
            chosen.append(log_id)
            budget += live
        victims = set(chosen)
        moves = []
        with index.read_txn() as rtx:
            for run in index.all_runs(rtx):
                if run.log in victims:
                    moves.append(run)
        closed = []
        new_runs = []
        for run in moves:
            data = self._read_run(run)
            w = self._writer(closed)
            off = w.append(data)
            new_runs.append(Run(run.ledger, run.first, w.id, off, run.count, run.step,
                                run.nbytes, run.rlen, run.offs))
            stats["entries_moved"] += run.count
            stats["bytes_moved"] += run.nbytes
        w = self.writer
        if new_runs and w is not None:
            w.sync()
        with index.write() as wtx:
            for run in moves:
                wtx.delete_run(run)
            for run in new_runs:
                wtx.put_run(run)
            for log_id, di, size in closed:
                wtx.set_log(log_id, di, size)
            if new_runs and w is not None:
                wtx.set_log(w.id, w.dir_index, w.size)
            for log_id in chosen:
                wtx.drop_log(log_id)
        job.removable = chosen
        stats["logs_removed"] = len(chosen)


_LANE = array("q", [1]).tobytes()
_STEP_CHUNK = 4096
_ONES = int.from_bytes(_LANE * _STEP_CHUNK, sys.byteorder)


def _steps_by(pa: array, a: int, n: int, r: int) -> bool:
    """Whether ``pa[a:a+n]`` (journal positions, all in [0, 2**63)) step by ``r``.

    Without an int object per entry: a slice of the array read as one big
    integer is the sum of its 64-bit lanes ``p[k] * 2**(64k)``, so the slice
    shifted by one minus the slice is the sum of the lanes' differences
    (each in (-2**64, 2**64) with ``r`` subtracted: a zero sum means every
    lane is zero, as with base-2**64 digits), compared with ``r`` in every
    lane. A few C loops over the bytes per 4096 entries instead of ~50 ns
    of Python per entry."""
    mv = memoryview(pa)
    order = sys.byteorder
    last = a + n - 1
    while a < last:
        m = min(_STEP_CHUNK, last - a)
        d = int.from_bytes(mv[a + 1:a + 1 + m], order) - int.from_bytes(mv[a:a + m], order)
        ones = _ONES if m == _STEP_CHUNK else int.from_bytes(_LANE * m, order)
        if d != r * ones:
            return False
        a += m
    return True


BIG_SPAN = 64 * 1024          # a span this large is written from the journal's buffer


def _gather(entries, positions, views):
    """``(record pieces, sizes)`` of one ledger's tail, entries in order. Records
    that follow each other in the journal (a batch of this ledger's entries) are
    one span; small spans are copied together, large ones handed on as views
    (written from there, with the GIL released, rather than copied while the
    shard's loop waits for it). No object is kept per record: a flush of 200k
    entries that held a memoryview per record spent most of its time in the GC."""
    sizes = []
    pieces = []
    small = bytearray()
    unpack = _LEN.unpack_from
    add_size = sizes.append
    cur_seq = -1
    mv = None
    base = a = b = 0

    def take(a, b):
        nonlocal small
        if b - a >= BIG_SPAN:
            if small:
                pieces.append(small)
                small = bytearray()
            pieces.append(mv[a:b])
        else:
            small += mv[a:b]

    for p in positions:
        seq = p >> 32
        if seq != cur_seq:
            if b > a:
                take(a, b)
            buf, base = views[seq]
            mv = memoryview(buf)
            cur_seq = seq
            a = b = -1
        i = (p & _OFF_MASK) - base
        n = unpack(mv, i + 4)[0] + 8
        if i != b:
            if b > a:
                take(a, b)
            a = i
        b = i + n
        add_size(n)
    if b > a:
        take(a, b)
    if small:
        pieces.append(small)
    return pieces, sizes
