"""Entry logs of one shard: append-only files of entries sorted by (ledger, entry).

Theory of operation
-------------------
A flush (``bk.bookie.flusher``) copies the journal's ADD records of the
entries written since the previous flush into the shard's *current* entry
log, ledger after ledger and entry after entry, so that a ledger's entries
end up next to each other (BookKeeper's DbLedgerStorage sorts its write cache
the same way). The records are copied byte for byte: an entry log record is
a journal ADD record (``crc32c length type ledger entry lac dlen digest
payload``, see ``bk.bookie.journal``), CRC included, so a copy is a slice and
a read verifies the same CRC the journal wrote.

Files are named ``<id as 16 hex digits>.log`` and start with a 64-byte header
(magic, format version, header size, log id, CRC32C of the header). Ids grow
forever; a shard spreads its logs over its ledger directories round-robin
(``ledgerDirectories``, so several disks share the reads and writes).

Which logs exist, how many bytes each holds and how many of them are live is
recorded in the index (``bk.bookie.index``), in the same LMDB transaction that
makes a flush's runs visible. A log file the index does not name is the
leftover of a flush or a compaction that crashed before its commit: nothing
points into it and it is removed at open. A log is never appended to after a
restart (a new one is started), so bytes past the committed size are never
read.

Writing: records are gathered in a buffer written with ``os.write`` every
:data:`WRITE_CHUNK` bytes, and each chunk's writeback is started at once
(``sync_file_range(SYNC_FILE_RANGE_WRITE)``, through libc: Python has no
binding) and waited for one chunk later, so a flush never leaves a burst of
dirty pages for the journal's next ``fdatasync`` (on the same disk) to queue
behind: that sync's cache flush waits for the writes in flight, which the
pacing keeps to two chunks of the flush (so the chunk is small: 256 KiB). Where the call is missing, an ``fdatasync`` every :data:`SYNC_STEP`
bytes does the pacing. That is how a flush the loop waits for is written.
Any other flush (and compaction) is written *gently* (:class:`WritePacer`):
in :data:`GENTLE_CHUNK` pieces, each ``fdatasync``'d at once, with a pause as
long as that sync took after each, and at most at a rate (twice the rate the
flush's tail filled at). Why: the journal's ``fdatasync`` ends with a cache
flush of the device, which waits for everything the flush wrote since the
last one, not only for the writes in flight; started writeback alone (what
``sync_file_range`` gives) leaves megabytes in the device's cache for the
journal to pay for. Measured on this project's VM, a journal syncing 3 KiB
records every ms beside a 32 MiB write loop: alone p99 0.7-0.9 ms; beside
per-chunk writeback 7.5-13 ms; beside 64 KiB pieces each synced with an
equal pause 0.7-0.9 ms, the writer still doing ~116 MB/s.
:meth:`LogWriter.sync` makes everything durable before the index is
committed.

Journal segments as entry logs. A stretch of one ledger's records that lies
back to back in the journal is sorted already; a flush (``bk.bookie.flusher``)
leaves a long one (:data:`ADOPT_MIN_BYTES`) where it is and indexes it in the
journal segment, which then serves as an entry log too: its log id is
:data:`JOURNAL_LOG` ``| seq`` and its path the segment's. A single-ledger
shard then writes its data once, as BookKeeper's journal-only path would,
instead of twice. Such a segment is kept after the flushed mark passes it
while the index has live runs in it, and compaction removes it like any log.

Reading: ``pread`` on a descriptor cached per log (a bounded LRU), so reads
never depend on mappings another thread may change, and a file removed by
compaction stays readable through an open descriptor until it is closed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import struct
import time
from collections import OrderedDict

from crc32c import crc32c

from bk.bookie.journal import ADD, JournalError, _fsync_dir, segment_name

log = logging.getLogger("bk.entrylog")

LOG_MAGIC = b"BKELOG\r\n"
LOG_VERSION = 1
HEADER_SIZE = 64
_HDR = struct.Struct("<8sHHIQ")          # magic, version, header size, reserved, id
_CRC = struct.Struct("<I")
_PREFIX = struct.Struct("<IIB")          # crc, length, type
_ADD_FIELDS = struct.Struct("<qqqH")     # ledger, entry, lac, dlen (after the prefix)
_ADD_HEAD = struct.Struct("<IIBqqqH")    # the whole head of an ADD record
_LOG_NAME = re.compile(r"^([0-9a-f]{16})\.log$")
LOG_SUBDIR = "entrylogs"
WRITE_CHUNK = 256 << 10
GENTLE_CHUNK = 64 << 10                  # a gently written log is synced this often
SYNC_STEP = 8 << 20
MAX_OPEN_READERS = 128
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4
JOURNAL_LOG = 1 << 62                    # log ids of journal segments: JOURNAL_LOG | seq
ADOPT_MIN_BYTES = 256 << 10              # a span this long stays in the journal segment


def journal_log_id(seq: int) -> int:
    return JOURNAL_LOG | seq


def is_journal_log(log_id: int) -> bool:
    return log_id >= JOURNAL_LOG


def _libc_sync_file_range():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6",
                         use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


class EntryLogError(JournalError):
    """An entry log is unreadable, or a record in it fails its CRC."""


def log_name(log_id: int) -> str:
    return f"{log_id:016x}.log"


def _header(log_id: int) -> bytes:
    head = _HDR.pack(LOG_MAGIC, LOG_VERSION, HEADER_SIZE, 0, log_id)
    return (head + _CRC.pack(crc32c(head))).ljust(HEADER_SIZE, b"\0")


def decode_records(buf, start: int, end: int, out: list, want=None) -> int:
    """Append ``(ledger, entry, lac, digest, payload)`` of each record of
    ``buf[start:end]`` to ``out`` (all of them, or those whose entry id is in
    ``want``); return how many were decoded. EntryLogError if a record fails
    its CRC or is not an ADD."""
    mv = memoryview(buf)
    unpack = _PREFIX.unpack_from
    fields = _ADD_FIELDS.unpack_from
    off = start
    n = 0
    try:
        while off < end:
            crc, length, rtype = unpack(mv, off)
            rend = off + 8 + length
            if rtype != ADD or rend > end or crc32c(mv[off + 4:rend]) != crc:
                raise EntryLogError(f"bad record at offset {off} of an entry log read")
            ledger, entry, lac, dlen = fields(mv, off + 9)
            if want is None or entry in want:
                d = off + 35
                out.append((ledger, entry, lac, bytes(mv[d:d + dlen]), bytes(mv[d + dlen:rend])))
                n += 1
            off = rend
    finally:
        mv.release()
    return n


def decode_flat(buf: bytes, ledger: int, out: list, want=None) -> int:
    """READ_RANGE's decode of a run read with one pread: append ``entry, lac,
    digest, payload`` of each record of ``buf`` (whole records of ``ledger``;
    those whose entry id is in ``want``, if given) to the flat list ``out``,
    the digest sliced from ``buf``, the payload a memoryview of it (the answer's
    encoding copies it once, from the read buffer); return the payload bytes
    appended. EntryLogError if a record fails its CRC or is not an ADD of
    ``ledger``."""
    mv = memoryview(buf)
    head = _ADD_HEAD.unpack_from
    end = len(buf)
    off = got = 0
    try:
        while off < end:
            crc, length, rtype, lid, entry, lac, dlen = head(mv, off)
            rend = off + 8 + length
            if rtype != ADD or lid != ledger or rend > end or crc32c(mv[off + 4:rend]) != crc:
                raise EntryLogError(f"bad record at offset {off} of an entry log read")
            if want is None or entry in want:
                d = off + 35 + dlen
                out += (entry, lac, buf[off + 35:d], mv[d:rend])
                got += rend - d
            off = rend
    except struct.error:
        raise EntryLogError(f"truncated record at offset {off} of an entry log read") from None
    finally:
        mv.release()
    return got


class WritePacer:
    """Holds the writes of the flusher's jobs back: job number ``seq`` is written
    gently (see the module docstring) at most at ``rate`` bytes a second (0:
    not paced at all) until :meth:`hurry` names it, from any thread (a loop
    that needs it done; a hurry may come before the job starts). The writer
    sleeps in steps of at most :data:`PACE_STEP` seconds, so a hurry is seen
    within one."""

    def __init__(self, clock=time.monotonic, sleep=time.sleep):
        self._clock = clock
        self._sleep = sleep
        self.rate = 0.0
        self.slept = 0.0              # seconds the current job was held back
        self._seq = 0
        self._hurried = 0             # jobs up to this number are not held back
        self._t0 = 0.0
        self._bytes = 0

    def start(self, rate: float, seq: int) -> None:
        """Job ``seq`` begins, to be written at ``rate`` bytes/s."""
        self.rate = rate
        self.slept = 0.0
        self._seq = seq
        self._t0 = self._clock()
        self._bytes = 0

    def hurry(self, upto: int) -> None:
        """Jobs numbered up to ``upto`` go as fast as they can from now on."""
        if upto > self._hurried:
            self._hurried = upto

    def gentle(self) -> bool:
        """Whether the current job is still to be written gently."""
        return bool(self.rate) and self._seq > self._hurried

    def wrote(self, n: int, busy: float = 0.0) -> None:
        """``n`` more bytes are on disk, which took the disk ``busy`` seconds: pause
        as long again, and until the rate allows them."""
        if not self.rate:
            return
        self._bytes += n
        until = max(self._clock() + busy, self._t0 + self._bytes / self.rate)
        while self._seq > self._hurried:
            ahead = until - self._clock()
            if ahead <= 0:
                return
            step = min(ahead, PACE_STEP)
            self._sleep(step)
            self.slept += step


PACE_STEP = 0.05


class LogWriter:
    """The entry log a flush (or a compaction) appends to; one thread at a time."""

    def __init__(self, log_id: int, path: str, dir_index: int, pacer: WritePacer | None = None):
        self.id = log_id
        self.path = path
        self.dir_index = dir_index
        self.pacer = pacer
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._buf = bytearray(_header(log_id))
        self.size = HEADER_SIZE          # bytes appended, header included
        self._written = 0                # bytes handed to the kernel
        self._unsynced = 0
        self._synced_to = 0              # writeback waited for up to here
        self._new = True

    def append(self, data) -> int:
        """Append bytes (whole records); return the offset they start at."""
        off = self.size
        self._buf += data
        self.size += len(data)
        if len(self._buf) >= WRITE_CHUNK:
            self._write()
        return off

    def append_pieces(self, pieces) -> int:
        """Append byte pieces (whole records, in order); return the offset the
        first starts at. A piece of a chunk or more is written from where it is
        (no copy into the buffer while holding the GIL)."""
        off = self.size
        for piece in pieces:
            if len(piece) < WRITE_CHUNK:
                self._buf += piece
                self.size += len(piece)
                if len(self._buf) >= WRITE_CHUNK:
                    self._write()
                continue
            if self._buf:
                self._write()
            self._write_from(memoryview(piece))
            self.size += len(piece)
        return off

    def _write_from(self, view) -> None:
        at = 0
        while at < len(view):
            step = GENTLE_CHUNK if self.pacer is not None and self.pacer.gentle() else WRITE_CHUNK
            chunk = view[at:at + step]
            at += step
            start = self._written
            while chunk:
                k = os.write(self._fd, chunk)
                chunk = chunk[k:]
                self._written += k
                self._unsynced += k
            self._pace(start)

    def _write(self) -> None:
        data, self._buf = self._buf, bytearray()
        self._write_from(memoryview(data))

    def _pace(self, start: int) -> None:
        """Writeback of what was written since ``start`` begins now; the chunks
        before it are waited for; or, written gently, it is synced and followed
        by a pause (see the module docstring)."""
        pacer = self.pacer
        if pacer is not None and pacer.gentle():
            t0 = time.monotonic()
            os.fdatasync(self._fd)
            busy = time.monotonic() - t0
            self._synced_to = self._written
            self._unsynced = 0
            pacer.wrote(self._written - start, busy)
            return
        if _sync_file_range is not None:
            _sync_file_range(self._fd, start, self._written - start, _SFR_WRITE)
            if self._synced_to < start:
                _sync_file_range(self._fd, self._synced_to, start - self._synced_to,
                                 _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER)
                self._synced_to = start
        elif self._unsynced >= SYNC_STEP:
            os.fdatasync(self._fd)
            self._unsynced = 0
        if pacer is not None:
            pacer.wrote(self._written - start)

    def sync(self) -> None:
        """Everything appended so far is on disk (and the file's name, once)."""
        if self._buf:
            self._write()
        os.fdatasync(self._fd)
        self._unsynced = 0
        if self._new:
            _fsync_dir(os.path.dirname(self.path))
            self._new = False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class EntryLogs:
    """The entry log files of one shard over its ledger directories."""

    def __init__(self, dirs: list[str], size_limit: int, journal_dir: str | None = None):
        self.dirs = [os.path.join(d, LOG_SUBDIR) for d in dirs]
        self.size_limit = size_limit
        self.journal_dir = journal_dir   # where the segments used as logs are (None: none)
        self._paths: dict[int, str] = {}
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)
            for name in os.listdir(d):
                m = _LOG_NAME.match(name)
                if m:
                    self._paths[int(m.group(1), 16)] = os.path.join(d, name)
        self._next = max(self._paths, default=0) + 1
        self._readers: OrderedDict[int, int] = OrderedDict()

    def ids(self) -> list[int]:
        return sorted(list(self._paths))

    def reserve_ids(self, at_least: int) -> None:
        """Never hand out an id below ``at_least`` (ids the index has seen)."""
        self._next = max(self._next, at_least)

    def new_writer(self, pacer: WritePacer | None = None) -> LogWriter:
        """A new log in the next directory round-robin (called by the flusher)."""
        log_id = self._next
        self._next += 1
        di = log_id % len(self.dirs)
        path = os.path.join(self.dirs[di], log_name(log_id))
        w = LogWriter(log_id, path, di, pacer)
        self._paths[log_id] = path
        return w

    def path(self, log_id: int) -> str:
        if log_id >= JOURNAL_LOG:
            if self.journal_dir is None:
                raise EntryLogError(f"log {log_id:#x} is a journal segment, and these entry "
                                    f"logs have no journal")
            return os.path.join(self.journal_dir, segment_name(log_id & ~JOURNAL_LOG))
        return self._paths.get(log_id) or os.path.join(self.dirs[log_id % len(self.dirs)],
                                                       log_name(log_id))

    def _reader(self, log_id: int) -> int:
        fd = self._readers.get(log_id)
        if fd is not None:
            self._readers.move_to_end(log_id)
            return fd
        try:
            fd = os.open(self.path(log_id), os.O_RDONLY)
        except FileNotFoundError:
            raise EntryLogError(f"entry log {self.path(log_id)} is missing") from None
        # No kernel read-ahead: a log interleaves ledgers, so the pages after a
        # run are another ledger's (with read_ahead_kb at 8 MiB, a cold read of
        # a 300 KiB run pulled ~1 MiB); reads ask for the runs they need, and
        # prefetch() for the ones next.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._readers[log_id] = fd
        if len(self._readers) > MAX_OPEN_READERS:
            _, old = self._readers.popitem(last=False)
            os.close(old)
        return fd

    def read(self, log_id: int, off: int, n: int) -> bytes:
        """``n`` bytes of a log from ``off`` (EntryLogError if it is shorter)."""
        data = os.pread(self._reader(log_id), n, off)
        if len(data) != n:
            raise EntryLogError(f"entry log {self.path(log_id)}: read of {n} bytes at "
                                f"{off} returned {len(data)}")
        return data

    def prefetch(self, log_id: int, off: int, n: int) -> None:
        """Start reading ``n`` bytes of a log from ``off`` into the page cache
        without waiting (``POSIX_FADV_WILLNEED``): the disk works on the next
        runs of a ledger while the loop answers from the current ones."""
        try:
            os.posix_fadvise(self._reader(log_id), off, n, os.POSIX_FADV_WILLNEED)
        except (EntryLogError, OSError):
            pass                         # only a hint; the read itself reports errors

    def remove(self, log_id: int) -> int:
        """Delete a log file; return the bytes freed."""
        path, size = self.forget(log_id)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return 0
        _fsync_dir(os.path.dirname(path))
        return size

    def forget(self, log_id: int) -> tuple[str, int]:
        """Stop reading a log: ``(path, bytes)`` of the file, for the caller to
        delete (elsewhere: unlinking a large file takes ext4 tens of ms)."""
        fd = self._readers.pop(log_id, None)
        if fd is not None:
            os.close(fd)
        path = self._paths.pop(log_id, None) or self.path(log_id)
        try:
            return path, os.path.getsize(path)
        except FileNotFoundError:
            return path, 0

    def disk_usage(self) -> int:
        total = 0
        for p in list(self._paths.values()):   # the flusher thread may add one meanwhile
            try:
                total += os.path.getsize(p)
            except FileNotFoundError:
                pass
        return total

    def close(self) -> None:
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()
