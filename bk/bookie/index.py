"""The on-disk index of one shard: runs of entries, ledger state and entry logs, in LMDB.

Theory of operation
-------------------
The index maps (ledger, entry) to where the entry lives in an entry log
(``bk.bookie.entrylog``). It does not hold one record per entry but one per
*run*: a flush writes the entries of a ledger it carries sorted and back to
back into one entry log, so a run ``(ledger, first) -> (log, offset, count,
step, bytes, record sizes)`` covers entries ``first, first+step, ...`` (step
1 for a ledger this bookie holds whole, E for a stripe). Record sizes are one
fixed size when every record of the run has it (the common case of a writer
with fixed-size entries: nothing per entry), else a u32 offset per entry.
A lookup is one floor seek (the run with the greatest ``first <= entry``)
and arithmetic in the run; at 500 entries a run, 100M entries are ~200k
index records.

Invariant: the runs of one ledger cover disjoint entry ranges. A flush whose
entries fall into the range of existing runs (re-replication filling a gap,
a recovery add) merges them: it reads the old runs' records and writes the
union as new runs (see ``bk.bookie.flusher``). Hence a floor seek finds the
only run that can hold an entry.

Why LMDB (``lmdb``) rather than RocksDB (``rocksdict``): measured on this
workload (200k runs written in 200 synced transactions, then 100k random
floor lookups; docs/architecture.md has the numbers), LMDB's lookups are ~2x
faster (a B+tree read through a mapping, no block cache or compaction
threads in the worker process), its commit is one fsync'd copy-on-write
transaction (a crash leaves the previous commit whole, without a WAL to
replay), and it has no background threads competing with the shard's loop
for the GIL's CPU. RocksDB wrote faster and smaller, which matters little
here: the index is small because it holds runs.

Sub-databases:

* ``runs``: key ``>QQ`` (ledger, first entry), value :class:`Run` packed;
* ``ledgers``: key ``>Q`` ledger, value msgpack ``[fenced, key, lac, last]``;
* ``logs``: key ``>Q`` log id, value msgpack ``[dir index, bytes, live bytes]``;
* ``meta``: ``version``, ``mark`` (the journal position a restart replays
  from), ``entries`` (entries indexed).

A flush commits its new runs, the ledger states that changed, the logs'
sizes and the new mark in ONE transaction: after a crash either all of it is
visible or none (and then the journal from the old mark is replayed).

Memory. LMDB reads through one read-only shared mapping of ``data.mdb``: the
pages a lookup touches stay mapped, so the worker's RSS would grow with the
index (54 MiB at 100M entries) although nothing is allocated. The shard caps
that part (``dbStorage_rocksDB_blockCacheSize``, BookKeeper's size of the
index's block cache): :meth:`Index.trim` counts the mapping's present pages
(``/proc/self/pagemap``, 8 bytes a page of the file, read in bulk) and, over
the cap, drops them with ``madvise(MADV_DONTNEED)``. That is safe at any time, readers included: the
map is read-only and shared (writes go through ``pwrite``, LMDB without
``writemap``), so a dropped page holds nothing that is not in the file, and
the next access maps it again from the page cache (a minor fault; the page
cache keeps it as long as the kernel likes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
from array import array
from itertools import accumulate, islice
from typing import Iterator

import lmdb
import msgpack

from bk.bookie.journal import JournalError

INDEX_SUBDIR = "index"
FORMAT_VERSION = b"2"
MAP_SIZE = 1 << 40                 # address space only: the file grows as needed
_KEY = struct.Struct(">QQ")
_LKEY = struct.Struct(">Q")
_RUN = struct.Struct("<QQIIII")   # log, offset, count, step, bytes, fixed record size (0: varies)
MAX_RUN_ENTRIES = 4096
MAX_STEP = 0xFFFFFFFF


MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _libc_madvise():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


def _file_maps(path: str, pid: str, smaps: bool) -> list[tuple]:
    """``(start, end, file offset[, resident bytes])`` of each mapping of the file
    ``path`` in a process, from ``/proc/<pid>/maps`` (or ``smaps``, which also
    gives the resident bytes but costs the kernel a walk of every mapping's
    pages: ~8 ms of CPU for a worker's ~300 mappings). Matched by device and
    inode."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    ino = str(st.st_ino)
    out = []
    cur = None
    with open(f"/proc/{pid}/{'smaps' if smaps else 'maps'}") as f:
        for line in f:
            if line.startswith("Rss:"):
                if cur is not None:
                    out.append((*cur, int(line.split()[1]) << 10))
                    cur = None
                continue
            head = line.split(None, 5)
            if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                if head[3] == dev and head[4] == ino:
                    a, _, b = head[0].partition("-")
                    cur = (int(a, 16), int(b, 16), int(head[2], 16))
                    if not smaps:
                        out.append(cur)
                else:
                    cur = None
    return out


def mapped_resident(path: str, pid: str = "self") -> list[tuple[int, int, int, int]]:
    """``(start, end, file offset, resident bytes)`` of each mapping of the file
    ``path`` in a process, from ``/proc/<pid>/smaps`` (what tools and tests see)."""
    return _file_maps(path, pid, smaps=True)


# Page table entries from /proc/self/pagemap are 8 bytes, little-endian, bit 63
# "present": the top byte of each is >= 0x80 when the page is mapped.
_TOP_BIT = bytes(1 if b >= 0x80 else 0 for b in range(256))


def _present_pages(pagemap_fd: int, start: int, npages: int) -> int:
    """Pages of ``npages`` from address ``start`` present in this process's page
    tables (``/proc/self/pagemap``: no per-page Python, ~8 bytes read a page)."""
    n = 0
    at = start // _PAGE
    while npages > 0:
        k = min(npages, 1 << 17)                   # 1 MiB of entries at a time
        data = os.pread(pagemap_fd, k * 8, at * 8)
        if not data:
            break
        n += data[7::8].translate(_TOP_BIT).count(1)
        got = len(data) // 8
        at += got
        npages -= got
    return n


class IndexFormatError(JournalError):
    """The index cannot be opened or is of another format."""


class Run:
    """A run of a ledger's entries stored back to back in one entry log."""

    __slots__ = ("ledger", "first", "log", "off", "count", "step", "nbytes", "rlen", "offs")

    def __init__(self, ledger, first, log, off, count, step, nbytes, rlen, offs=None):
        self.ledger = ledger
        self.first = first
        self.log = log
        self.off = off
        self.count = count
        self.step = step
        self.nbytes = nbytes
        self.rlen = rlen
        self.offs = offs            # array('I') of offsets in the run, when rlen == 0

    @property
    def last(self) -> int:
        return self.first + (self.count - 1) * self.step

    def index_of(self, entry: int) -> int:
        """Position of ``entry`` in the run, or -1."""
        d = entry - self.first
        if d < 0:
            return -1
        i, r = divmod(d, self.step)
        return i if not r and i < self.count else -1

    def rel(self, i: int) -> int:
        """Offset of record ``i`` from the run's start (``count`` -> its end)."""
        if i >= self.count:
            return self.nbytes
        return i * self.rlen if self.rlen else self.offs[i]

    def entries(self) -> range:
        return range(self.first, self.last + 1, self.step)

    def slice(self, a: int, b: int) -> "Run":
        """The run of records ``a..b-1`` of this one (same log, same bytes)."""
        base = self.rel(a)
        offs = None
        if not self.rlen:
            offs = array("I", [o - base for o in self.offs[a:b]])
        return Run(self.ledger, self.first + a * self.step, self.log, self.off + base, b - a,
                   self.step, self.rel(b) - base, self.rlen, offs)

    def pack(self) -> bytes:
        head = _RUN.pack(self.log, self.off, self.count, self.step, self.nbytes, self.rlen)
        return head if self.rlen else head + self.offs.tobytes()

    @classmethod
    def unpack(cls, key, value) -> "Run":
        ledger, first = _KEY.unpack(key)
        log_id, off, count, step, nbytes, rlen = _RUN.unpack_from(value)
        offs = None
        if not rlen:
            offs = array("I")
            offs.frombytes(bytes(value[_RUN.size:]))
        return cls(ledger, first, log_id, off, count, step, nbytes, rlen, offs)

    def key(self) -> bytes:
        return _KEY.pack(self.ledger, self.first)


def make_runs(ledger: int, entries: list, sizes: list, log_id: int, off: int) -> list:
    """Split sorted ``entries`` (with their record ``sizes``, stored back to back
    from ``off`` of ``log_id``) into runs of constant step."""
    runs = []
    n = len(entries)
    dense = isinstance(entries, range) and entries.step == 1
    i = 0
    while i < n:
        j = i + 1
        step = entries[j] - entries[i] if j < n else 1
        # a step that does not fit its u32 field ends the run at one entry
        limit = min(n, i + MAX_RUN_ENTRIES) if step <= MAX_STEP else j
        if dense:
            j = limit                     # consecutive entries: no need to look
        while j < limit and entries[j] - entries[j - 1] == step:
            j += 1
        part = sizes[i:j]
        nbytes = sum(part)
        rlen = part[0]
        if nbytes != rlen * len(part) or min(part) != rlen:
            rlen = 0
            offs = array("I", accumulate(islice(part, len(part) - 1), initial=0))
        else:
            offs = None
        runs.append(Run(ledger, entries[i], log_id, off, j - i, step if j - i > 1 else 1,
                        nbytes, rlen, offs))
        off += nbytes
        i = j
    return runs


def uniform_runs(ledger: int, first: int, count: int, rlen: int, log_id: int,
                 off: int) -> list:
    """The runs of ``count`` consecutive entries from ``first``, records of ``rlen``
    bytes each stored back to back from ``off`` of ``log_id`` (no per-entry work)."""
    runs = []
    for a in range(0, count, MAX_RUN_ENTRIES):
        k = min(MAX_RUN_ENTRIES, count - a)
        runs.append(Run(ledger, first + a, log_id, off + a * rlen, k, 1, k * rlen, rlen))
    return runs


class Index:
    """The LMDB environment of one shard's index (see the module docstring).

    Reads may come from any thread (each uses its own read transaction);
    writes are serialised by LMDB (one write transaction at a time)."""

    def __init__(self, index_dir: str, *, create: bool = True, sync: bool = True,
                 subdir: str = INDEX_SUBDIR):
        self.path = os.path.join(index_dir, subdir)
        self._maps = None
        if not create and not os.path.isdir(self.path):
            raise IndexFormatError(f"no index in {index_dir}")
        os.makedirs(self.path, exist_ok=True)
        try:
            self.env = lmdb.open(self.path, map_size=MAP_SIZE, max_dbs=4, sync=sync,
                                 metasync=sync, readahead=False, max_readers=64)
        except lmdb.Error as e:
            raise IndexFormatError(f"cannot open the index {self.path}: {e}") from None
        self.runs = self.env.open_db(b"runs")
        self.ledgers_db = self.env.open_db(b"ledgers")
        self.logs_db = self.env.open_db(b"logs")
        self.meta = self.env.open_db(b"meta")
        with self.env.begin(write=True, db=self.meta) as txn:
            v = txn.get(b"version")
            if v is None:
                txn.put(b"version", FORMAT_VERSION)
            elif v != FORMAT_VERSION:
                self.env.close()
                raise IndexFormatError(f"index {self.path} has format version {v!r}, this bookie "
                                  f"reads {FORMAT_VERSION!r}")

    # --- reads -----------------------------------------------------------------
    def mark(self):
        with self.env.begin(db=self.meta) as txn:
            v = txn.get(b"mark")
        return None if v is None else tuple(msgpack.unpackb(v))

    def entries(self) -> int:
        with self.env.begin(db=self.meta) as txn:
            v = txn.get(b"entries")
        return 0 if v is None else msgpack.unpackb(v)

    def ledger_states(self) -> Iterator[tuple[int, list]]:
        with self.env.begin(db=self.ledgers_db) as txn:
            for k, v in txn.cursor():
                yield _LKEY.unpack(k)[0], msgpack.unpackb(v)

    def logs(self) -> dict[int, list]:
        """``{log id: [dir index, bytes, live bytes]}``."""
        with self.env.begin(db=self.logs_db) as txn:
            return {_LKEY.unpack(k)[0]: msgpack.unpackb(v) for k, v in txn.cursor()}

    def lookup(self, ledger: int, entry: int, txn=None) -> Run | None:
        """The run holding ``entry`` of ``ledger``, or None."""
        if txn is None:
            with self.env.begin(db=self.runs) as txn:
                return self.lookup(ledger, entry, txn)
        cur = txn.cursor(db=self.runs)
        key = _KEY.pack(ledger, entry)
        if cur.set_range(key):
            if cur.key() == key:
                return Run.unpack(cur.key(), cur.value())
            if not cur.prev():
                return None
        elif not cur.last():
            return None
        k = cur.key()
        if k[:8] != key[:8]:
            return None
        run = Run.unpack(k, cur.value())
        return run if run.index_of(entry) >= 0 else None

    def runs_from(self, ledger: int, entry: int, txn) -> Iterator[Run]:
        """The ledger's runs in order, from the one that may hold ``entry``."""
        cur = txn.cursor(db=self.runs)
        prefix = _LKEY.pack(ledger)
        key = _KEY.pack(ledger, entry)
        found = cur.set_range(key)
        if not (found and cur.key() == key):
            # the floor run, if it is this ledger's, may hold ``entry``
            moved = cur.prev() if found else cur.last()
            if not moved or cur.key()[:8] != prefix:
                if not cur.set_range(key):
                    return
        while True:
            k = cur.key()
            if k[:8] != prefix:
                return
            yield Run.unpack(k, cur.value())
            if not cur.next():
                return

    def runs_of(self, ledger: int, txn=None) -> list[Run]:
        if txn is None:
            with self.env.begin(db=self.runs) as txn:
                return self.runs_of(ledger, txn)
        return list(self.runs_from(ledger, 0, txn))

    def overlapping(self, ledger: int, lo: int, hi: int, txn) -> list[Run]:
        """The ledger's runs whose entry range meets ``[lo, hi]``."""
        out = []
        for run in self.runs_from(ledger, lo, txn):
            if run.first > hi:
                break
            if run.last >= lo:
                out.append(run)
        return out

    def read_txn(self):
        return self.env.begin(db=self.runs)

    def all_runs(self, txn) -> Iterator[Run]:
        for k, v in txn.cursor(db=self.runs):
            yield Run.unpack(k, v)

    def disk_usage(self) -> int:
        try:
            return os.path.getsize(os.path.join(self.path, "data.mdb"))
        except FileNotFoundError:
            return 0

    def _mapped(self) -> list[tuple[int, int, int]]:
        """Where LMDB maps ``data.mdb`` in this process (once: the map never moves,
        its size is fixed at open)."""
        if self._maps is None:
            self._maps = _file_maps(os.path.join(self.path, "data.mdb"), "self", smaps=False)
        return self._maps

    def resident_bytes(self) -> int:
        """Bytes of the index mapped in this process's memory (its share of RSS),
        counted from the page tables of the file's extent (``/proc/self/pagemap``)."""
        size = os.path.getsize(os.path.join(self.path, "data.mdb"))
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        try:
            pages = 0
            for start, end, off in self._mapped():
                n = min(end - start, size - off)    # nothing past the file's end is mapped
                if n > 0:
                    pages += _present_pages(fd, start, -(-n // _PAGE))
        finally:
            os.close(fd)
        return pages * _PAGE

    def trim(self, cap: int) -> int:
        """Drop the mapped index pages from this process when more than ``cap``
        bytes are resident (see the module docstring); returns the resident
        bytes found. Any thread, any time."""
        resident = self.resident_bytes()
        if resident > cap and _madvise is not None:
            size = os.path.getsize(os.path.join(self.path, "data.mdb"))
            for start, end, off in self._mapped():
                n = min(end - start, -(-(size - off) // _PAGE) * _PAGE)
                if n > 0 and _madvise(start, n, MADV_DONTNEED) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"madvise of the index map: {os.strerror(err)}")
        return resident

    # --- writes ----------------------------------------------------------------
    def write(self) -> "IndexWriter":
        return IndexWriter(self)

    def close(self) -> None:
        self.env.close()


def read_mark(index_dir: str):
    """``(mark, mtime)`` of a shard's index: the journal position its restart
    replays from and when the index last changed; ``(None, None)`` without an
    index. Read-only, safe while the bookie runs (LMDB's reader lock)."""
    path = os.path.join(index_dir, INDEX_SUBDIR)
    if not os.path.isfile(os.path.join(path, "data.mdb")):
        return None, None
    env = lmdb.open(path, readonly=True, max_dbs=4, lock=True)
    try:
        meta = env.open_db(b"meta", create=False)
        with env.begin(db=meta) as txn:
            v = txn.get(b"mark")
    finally:
        env.close()
    mark = None if v is None else tuple(msgpack.unpackb(v))
    return mark, os.path.getmtime(os.path.join(path, "data.mdb"))


class IndexWriter:
    """One write transaction (a context manager: commits on success)."""

    def __init__(self, index: Index):
        self.index = index
        self.txn = index.env.begin(write=True)
        self._logs: dict[int, list] = {}
        self.entries_delta = 0

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.txn.abort()
            return False
        self.commit()
        return False

    def _log(self, log_id: int) -> list:
        rec = self._logs.get(log_id)
        if rec is None:
            v = self.txn.get(_LKEY.pack(log_id), db=self.index.logs_db)
            rec = self._logs[log_id] = msgpack.unpackb(v) if v is not None else [0, 0, 0]
        return rec

    def put_run(self, run: Run) -> None:
        self.txn.put(run.key(), run.pack(), db=self.index.runs)
        self._log(run.log)[2] += run.nbytes
        self.entries_delta += run.count

    def delete_run(self, run: Run) -> None:
        self.txn.delete(run.key(), db=self.index.runs)
        self._log(run.log)[2] -= run.nbytes
        self.entries_delta -= run.count

    def delete_runs_of(self, ledger: int) -> int:
        """Delete every run of a ledger; return how many entries they held."""
        runs = self.index.runs_of(ledger, self.txn)
        n = 0
        for run in runs:
            self.delete_run(run)
            n += run.count
        return n

    def set_log(self, log_id: int, dir_index: int, size: int) -> None:
        rec = self._log(log_id)
        rec[0] = dir_index
        rec[1] = size

    def drop_log(self, log_id: int) -> None:
        self._logs[log_id] = None

    def put_state(self, ledger: int, fenced: bool, key, lac: int, last: int) -> None:
        self.txn.put(_LKEY.pack(ledger), msgpack.packb([fenced, key, lac, last]),
                     db=self.index.ledgers_db)

    def delete_state(self, ledger: int) -> None:
        self.txn.delete(_LKEY.pack(ledger), db=self.index.ledgers_db)

    def set_mark(self, mark) -> None:
        self.txn.put(b"mark", msgpack.packb(list(mark)), db=self.index.meta)

    def commit(self) -> None:
        txn = self.txn
        for log_id, rec in self._logs.items():
            if rec is None:
                txn.delete(_LKEY.pack(log_id), db=self.index.logs_db)
            else:
                txn.put(_LKEY.pack(log_id), msgpack.packb(rec), db=self.index.logs_db)
        if self.entries_delta:
            v = txn.get(b"entries", db=self.index.meta)
            n = (msgpack.unpackb(v) if v is not None else 0) + self.entries_delta
            txn.put(b"entries", msgpack.packb(n), db=self.index.meta)
        txn.commit()
