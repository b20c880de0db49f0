"""Upgrade of a shard written by the previous storage format (v1) to entry logs + index (v2).

Theory of operation
-------------------
In v1 the journal held every entry for good, and the index (per ledger a
dense array entry -> journal position, plus its state) lived in memory and
was checkpointed whole to ``index_dir/checkpoint`` (a msgpack array ``[magic,
version, crc32c(content), content]``) with the journal mark after which a
restart replays.

The upgrade reads that checkpoint, replays the journal after its mark with
v1's rules (so it sees exactly what a v1 bookie would serve), then copies
every live entry, ledger by ledger in entry order, into entry logs, building
the index in a NEW directory (``index.upgrading``) through the same code a
flush uses (``bk.bookie.flusher``). Only when everything is copied, synced
and committed with the journal's end as the mark is that directory renamed to
``index`` (atomic; the parent fsync'd). Then the v1 checkpoint is removed;
the journal segments are deleted by the first open of the v2 storage (they
are all before the mark).

A crash (kill -9) at any point before the rename leaves the v1 data as it
was: the next start sees no ``index``, discards ``index.upgrading`` and the
entry logs it had written (the index does not name them) and converts again.
After the rename the shard is v2 and the leftover checkpoint is ignored. The
journal lock is held throughout, so a running bookie and ``bookie upgrade``
never convert the same shard at once.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from array import array

import msgpack
from crc32c import crc32c

from bk.bookie import journal as J
from bk.bookie.entrylog import EntryLogs
from bk.bookie.flusher import FlushJob, Flusher
from bk.bookie.index import INDEX_SUBDIR, Index
from bk.bookie.journal import Journal

log = logging.getLogger("bk.upgrade")

V1_CHECKPOINT = "checkpoint"
V1_MAGIC = "bk-shard-checkpoint"
V1_VERSION = 1
V1_FIELDS = ["ledger", "fenced", "key", "lac", "last", "index", "segment_bytes", "meta_seg",
             "base"]
UPGRADING = INDEX_SUBDIR + ".upgrading"
BATCH_ENTRIES = 256 * 1024          # entries copied per flush job (one index transaction)


def needs_upgrade(journal_dir: str, index_dir: str) -> bool:
    """Whether a shard's directories hold v1 data (a checkpoint file, or journal
    segments) and no v2 index yet."""
    if os.path.isdir(os.path.join(index_dir, INDEX_SUBDIR)):
        return False
    if os.path.exists(os.path.join(index_dir, V1_CHECKPOINT)):
        return True
    return os.path.isdir(journal_dir) and bool(J._list_segment_files(journal_dir))


class _V1Ledger:
    __slots__ = ("fenced", "key", "lac", "last", "base", "idx")

    def __init__(self, key):
        self.fenced = False
        self.key = key
        self.lac = -1
        self.last = -1
        self.base = 0
        self.idx = array("q")

    def put(self, entry: int, pos: int) -> None:
        idx = self.idx
        if not idx:
            self.base = entry
        i = entry - self.base
        if i < 0:
            self.idx = idx = array("q", [-1]) * (-i) + idx
            self.base = entry
            i = 0
        if i >= len(idx):
            idx.extend(array("q", [-1]) * (i - len(idx) + 1))
        idx[i] = pos

    def entries_positions(self):
        """``(entries, positions)`` of the entries held, in entry order (as a
        write-cache tail gives them to a flush)."""
        idx = self.idx
        if idx.count(-1) == 0:
            return range(self.base, self.base + len(idx)), idx
        base = self.base
        entries = [base + i for i, p in enumerate(idx) if p >= 0]
        return entries, [p for p in idx if p >= 0]


def _load_v1_checkpoint(path: str):
    """``(mark, {ledger: _V1Ledger})`` of a v1 checkpoint, or None if it is missing
    or unusable (then the whole journal is replayed, as v1 did)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    try:
        outer = msgpack.unpackb(data, raw=False)
        if not (isinstance(outer, list) and len(outer) == 4 and outer[0] == V1_MAGIC):
            raise ValueError("not a bk shard checkpoint")
        _, version, crc, content = outer
        if version != V1_VERSION:
            raise ValueError(f"checkpoint format version {version} is not supported")
        if crc32c(content) != crc:
            raise ValueError("CRC mismatch")
        body = msgpack.unpackb(content, raw=False, strict_map_key=False)
        if body["ledger_fields"] != V1_FIELDS:
            raise ValueError(f"unknown ledger fields {body['ledger_fields']}")
        swap = body["byteorder"] != sys.byteorder
        ledgers = {}
        for lid, fenced, key, lac, last, idx_bytes, _segb, _meta_seg, base in body["ledgers"]:
            st = _V1Ledger(key)
            st.fenced, st.lac, st.last, st.base = bool(fenced), lac, last, base
            st.idx.frombytes(idx_bytes)
            if swap:
                st.idx.byteswap()
            ledgers[lid] = st
        mark = tuple(body["mark"])
        J.parse_mark(mark)
    except Exception as e:   # any decoding failure means the same thing: unusable
        log.warning("v1 checkpoint %s is unusable (%s): replaying the whole journal", path, e)
        return None
    return mark, ledgers


def read_v1(journal: Journal, index_dir: str, tick=None) -> dict:
    """Every ledger of a v1 shard as v1 would serve it: the checkpoint, then the
    journal replayed after its mark (which also finds where appends continue).
    ``tick()`` is called about twice a second during a long replay."""
    loaded = _load_v1_checkpoint(os.path.join(index_dir, V1_CHECKPOINT))
    mark, ledgers = loaded if loaded is not None else (None, {})
    last = time.monotonic()
    for n, (pos, _n, rtype, f) in enumerate(journal.replay(mark)):
        if tick is not None and not n & 0x3FFF and time.monotonic() - last >= 0.5:
            last = time.monotonic()
            tick()
        lid = f[0]
        st = ledgers.get(lid)
        if rtype == J.DELETE:
            ledgers.pop(lid, None)
            continue
        if rtype == J.DROP:
            if st is not None:
                st.idx = array("q")
                st.last = -1
                st.fenced = True
            continue
        if st is None:
            st = ledgers[lid] = _V1Ledger(None)
        if rtype == J.ADD:
            _, entry, lac = f
            if entry >= 0:
                st.put(entry, pos)
                st.lac = max(st.lac, lac)
                st.last = max(st.last, entry)
        elif rtype == J.MASTER_KEY:
            if st.key is None:
                st.key = f[1]
        elif rtype == J.FENCE:
            st.fenced = True
        elif rtype == J.WRITE_LAC:
            st.lac = max(st.lac, f[1])
        elif rtype == J.STATE:
            _, fenced, lac, key = f
            st.fenced = st.fenced or fenced
            st.lac = max(st.lac, lac)
            if key is not None:
                st.key = key
    return ledgers


def _pieces(ledgers: dict):
    """``(ledger, part of its index, state)``: each ledger in id order, in slices of
    at most BATCH_ENTRIES positions (a huge ledger never becomes one huge list)."""
    for lid in sorted(ledgers):
        st = ledgers[lid]
        if not st.idx:
            yield lid, st, st                 # state only (e.g. fenced, or dropped)
            continue
        for a in range(0, len(st.idx), BATCH_ENTRIES):
            piece = _V1Ledger(st.key)
            piece.base = st.base + a
            piece.idx = st.idx[a:a + BATCH_ENTRIES]
            yield lid, piece, st


def _convert(flusher: Flusher, tails, states, mark, views, done, nbytes):
    """One flush job of the conversion, run and waited for."""
    job = FlushJob(tails, states, mark, views=views)
    flusher.submit(job)
    job = flusher.done.get()
    flusher.pending -= 1
    if job.error is not None:
        raise job.error
    return done + job.stats["entries"], nbytes + job.stats["bytes"]


def upgrade_shard(journal_dir: str, index_dir: str, ledger_dirs: list[str], *,
                  segment_size: int, log_size_limit: int = 256 << 20, progress=None,
                  tombstones=None) -> dict:
    """Convert one v1 shard in place (see the module docstring); returns
    ``{ledgers, entries, bytes, seconds}``. ``progress(done, total)`` is called
    with entries converted, at most twice a second (``total`` 0 while the old
    journal is still being read). ``tombstones``: a container of deleted ledger
    ids to leave out."""
    t0 = time.monotonic()
    work = os.path.join(index_dir, UPGRADING)
    if os.path.exists(work):
        log.warning("discarding %s: an upgrade of this shard was interrupted", work)
        shutil.rmtree(work)
    journal = Journal(journal_dir, segment_size, sync_data=True)
    try:
        ledgers = read_v1(journal, index_dir,
                          None if progress is None else lambda: progress(0, 0))
        if tombstones is not None:
            for lid in [lid for lid in ledgers if lid in tombstones]:
                del ledgers[lid]
        mark = journal.mark
        views = {seq: (journal.segment_view(seq), 0) for seq in journal.segments()}
        os.makedirs(work)
        index = Index(index_dir, subdir=UPGRADING)
        logs = EntryLogs(ledger_dirs, log_size_limit)
        for log_id in logs.ids():           # left by an interrupted upgrade: unreferenced
            logs.remove(log_id)
        flusher = Flusher(index, logs, name="bk-upgrade")
        total = sum(len(st.idx) - st.idx.count(-1) for st in ledgers.values())
        done = nbytes = 0
        last_report = 0.0
        try:
            batch, states, n = {}, {}, 0
            for lid, piece, st in _pieces(ledgers):
                batch[lid] = piece
                states[lid] = [st.fenced, st.key, st.lac, st.last]
                n += len(piece.idx)
                if n < BATCH_ENTRIES:
                    continue
                done, nbytes = _convert(flusher, batch, states, None, views, done, nbytes)
                batch, states, n = {}, {}, 0
                now = time.monotonic()
                if progress is not None and now - last_report >= 0.5:
                    last_report = now
                    progress(done, total)
            # The last transaction carries the mark: the index is complete with it.
            done, nbytes = _convert(flusher, batch, states, mark, views, done, nbytes)
        finally:
            flusher.stop()
            logs.close()
            index.close()
        del views
        os.rename(work, os.path.join(index_dir, INDEX_SUBDIR))
        J._fsync_dir(index_dir)
        try:
            os.unlink(os.path.join(index_dir, V1_CHECKPOINT))
        except FileNotFoundError:
            pass
        J._fsync_dir(index_dir)
    finally:
        journal.close()
    stats = {"ledgers": len(ledgers), "entries": done, "bytes": nbytes,
             "seconds": round(time.monotonic() - t0, 3)}
    if progress is not None:
        progress(done, total)
    log.info("upgraded shard %s to entry logs and an index: %s", index_dir, stats)
    return stats
