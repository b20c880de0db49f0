"""The journal of one shard: preallocated segments of checksummed records, read through mmap.

Theory of operation
-------------------
The journal is where a shard writes first: every ADD (with its payload),
every FENCE, every MASTER_KEY and every explicit LAC goes into it once, and
the entries written since the last flush are read back from it by position.
``bk.bookie.storage`` keeps their positions (its write cache) and flushes them
into entry logs and the index; a segment the index still reads from (a
stretch of one ledger's records left in place, see ``bk.bookie.entrylog``)
outlives the flush mark. The journal knows nothing about ledgers.

Segments. A journal directory holds segment files named by a monotonically
increasing sequence number, ``0000000000000001.seg``, ``...0002.seg``. Each is
preallocated to its full size with ``posix_fallocate`` (so an append never
hits ENOSPC and never changes the file's size; the filesystem still marks each
newly written extent as written, metadata that a group's ``fdatasync`` carries:
measured on ext4 without a journal, ~30 µs of a ~110 µs sync, more where the
filesystem journals it) and starts with a 64-byte header
(magic, format version, header size, sequence number, segment size, CRC32C of
the header). A ``*.seg`` file whose header does not verify, or whose name does
not match its sequence number or whose size does not match its header, is
refused with :class:`ForeignSegmentError`: we never append to or delete a
file we did not write. Other names in the directory are ignored (the index
and lock files may share it). A new segment is written as ``*.seg.tmp``,
fallocated, its header fsync'd, then renamed into place, so a crash never
leaves a half-initialised ``.seg`` (a ``.seg.tmp`` left by a crash is deleted
at the next open).

Preparing the next segment. Creating a segment takes the disk milliseconds
(the fallocate, the header's fsync, the directory's fsync) for little CPU, and
with every bookie of an ensemble writing the same bytes their rolls come at the
same moment: done at the roll, on the shard's loop, it stalled all of them at
once. So once the active segment is more than ``PREPARE_AT`` full (checked at
each group commit), a thread of the journal's own creates the next one as
above, then fsyncs the directory and maps it; the roll only takes it (waiting
for the thread if it is not done, or creating the segment itself if the thread
failed, under the same sequence number). The prepared segment takes its
sequence number when its preparation starts, so numbers stay contiguous, and it
is not one of the journal's segments (:meth:`Journal.segments`,
:meth:`Journal.disk_usage`) until the roll activates it; :meth:`Journal.close`
waits for a preparation under way and leaves its file. A crash after its
rename and before its first record leaves a valid segment holding no record
after the last one written: the next open's replay reaches its clean end and
appends continue in it (or, after a torn segment before it, it is removed as
any empty later segment is, and the next number follows the last segment
kept).

Records. Records follow the header back to back, little-endian::

    crc32c:u32  length:u32  type:u8  body[length-1]

``length`` counts the bytes after the 8-byte (crc, length) prefix, i.e. type
plus body; the CRC covers ``length``, ``type`` and ``body`` (everything but
itself), so a corrupted length is caught too. Bodies (``q`` = i64, ``H`` = u16)::

    ADD        ledger:q entry:q lac:q dlen:H digest[dlen] payload[rest]
    FENCE      ledger:q
    MASTER_KEY ledger:q key[rest]
    WRITE_LAC  ledger:q lac:q
    STATE      ledger:q fenced:u8 lac:q key_len:i32 key[key_len]   (key_len -1: no key)
    DELETE     ledger:q
    DROP       ledger:q

STATE carries a ledger's whole non-entry state (written by compaction before
it removes a segment holding that ledger's FENCE / MASTER_KEY / WRITE_LAC
records); DELETE records a deleted ledger; DROP a ledger whose entries this bookie no
longer needs (re-replicated elsewhere: over-replicated GC), which stays fenced
with its key and no entries. Segments are zero-filled, so a
zero ``length`` means "no record written here yet": the end of the data.

Positions. A record is addressed by ``seq << 32 | offset`` (segments are at
most 2 GiB, so the offset fits in 32 bits); a *mark* is the pair ``(seq,
offset)`` where replay starts, serialised as ``"seq:offset"``.

Appending builds the record in a staging buffer (a preallocated bytearray
that mirrors the file from the *written* mark on): a ``struct.pack_into`` of
the fixed header, slice assignments of the variable fields, one CRC32C over a
memoryview (no copy) and a second ``pack_into`` of the CRC. An ADD_BATCH's
records already are ADD bodies behind a 4-byte length (see ``bk.protocol``):
:meth:`Journal.append_wire_run` walks a run of one ledger's next entries in
the received bytes, reading each wire head in the same loop (the caller
checks the run's first record; a later one that is truncated or does not
continue the run ends it), and appends each with one slice copy of its body
and one ``pack_into`` of its 9-byte prefix, CRC included: the CRC of the
(length, type) pair, computed once per record size, continued over the
received body (the same CRC32C as over the staged bytes). A stretch of the
run whose records all have one size (a writer's entries usually do) goes in
chunks instead: one ``unpack_from`` of all their heads, checks by tuple
slices, one ``unpack_from`` of their bodies, their CRCs in a comprehension
and one ``pack_into`` of the whole chunk (a few C calls for up to
:data:`RUN_CHUNK` records, not some fifteen bytecode lines each). The record
format is the same whichever way an ADD was appended: each record of a chunk
has its own prefix and CRC, so a write torn inside a chunk is truncated at
its first bad record like any other. The group's bytes reach the
file with ONE ``pwrite`` when its sync begins (or when the buffer is
full, or before a read of a record still in it). Records are written with
``pwrite`` and not stored through the mapping because of what it does to the
sync: on ext4 a page dirtied through a shared mapping goes through
``page_mkwrite`` and the file's timestamps, and ``fdatasync`` then waits for a
journal commit — measured on this project's VM with three concurrent
journals, fdatasync after mmap stores has p99 5-8 ms, after ``pwrite`` 0.5-0.75
ms (``scripts/bench_sync.py``). A process killed mid-``pwrite`` leaves a
record that fails its CRC, as a torn write does. When a record does not fit
before the segment's roll point (drawn per segment in its last eighth, so that
the bookies of an ensemble do not roll at once: :func:`roll_point`; a fresh
segment takes any record that fits a segment), the journal *rolls*: the old segment is written out and, with ``sync_data``,
fdatasync'd first (so an older segment is always durable before anything is
written to a newer one), then the prepared segment is activated (see above;
if none is at hand it is created there, and the directory is then fsync'd by
the next :meth:`Journal.sync`). That fdatasync stays on the roll's thread: the
records that follow go to the new segment at the next group commit, and
handing the old segment's sync to that group's sync thread would let the new
segment's pages reach the disk before the old one's tail. (With direct writes
a roll usually comes at a group's start instead, and waits for nothing: see
"Rolls at a group's start" below.)

Sync (group commit). :meth:`Journal.sync` makes everything appended since
the last sync durable: the staging buffer is written out, then with
``sync_data`` one ``fdatasync`` of the active segment, plus an fsync of the
directory if a segment was created. Without ``sync_data`` it only writes out
and moves the synced mark: the data is in the page cache and survives a
process crash but not a power loss. A failed write or sync poisons the journal
(every later append or sync raises :class:`JournalError`): after an fdatasync
error the kernel may have dropped the dirty pages, so nothing may be
acknowledged any more; the worker restarts and replays.

Direct writes (``journalDirectWrites``, with ``sync_data`` only). The
buffered write-out costs the kernel a copy into the page cache and, at each
group's ``fdatasync``, a writeback walk of the dirty pages; an ``O_DIRECT``
write with ``RWF_DSYNC`` of the group's whole blocks does neither (the data
goes from our memory to the device and is durable when the write completes:
about half the kernel's work per group measured, docs/performance-log.md). Direct
writes need aligned whole blocks (the filesystem's block size, ``f_bsize``)
from aligned memory, and they invalidate the page cache of their range, so
that every read of a recent entry through the file would go to the disk. So
the active segment has a *window* in memory: an anonymous mapping of
``journalDirectMemoryMB``/2 (8 MiB by default; never more than a segment),
which replaces the staging buffer and, like it, mirrors the file from
``_wbase``, the file offset of its first byte (a multiple of the block size
and the page size). Appends build records there as before; a group's write
covers from the block holding the *written mark* (``_wend``) up to the end of
its last record, the last partial block copied into a one-block bounce buffer
and padded with zeros (the window's bytes after the last record are stale:
never written, never read; and appends go on filling that block while the
write is in flight). So each write rewrites the partial block the previous
one ended in, with more records in it. The write is a :class:`SyncJob` like an
``fdatasync``: submitted through Linux AIO by the worker (``IOCB_CMD_PWRITEV``
with ``RWF_DSYNC``, see ``bk.bookie.aiosync``) or run by the sync thread
(``pwritev``). A write on the journal's own thread of blocks a handed-out
write also covers (a roll's write of the old segment's tail,
:meth:`Journal.write_out`, :meth:`Journal.sync`) first waits for that write
(:meth:`SyncJob.wait`): two writes of the same block in flight at once could
reach the disk in either order, the older copy last. A handed-out write is
started exactly once, by whoever claims it first: the sync thread's
:meth:`SyncJob.run`, a submit to AIO (:meth:`SyncJob.started`), or the
journal's own thread, which runs one that nobody has started instead of
waiting for it (a job handed to a thread that never takes it, or lost on a
failure path before its submit, must not hang the journal). A healthy
:meth:`Journal.close` finishes it so; a close after a failure cancels one
never started, waits at most ``CLOSE_WAIT`` seconds for one started, and then
leaves its descriptor and the windows mapped for good (the kernel may still
read them), with an error log, rather than hang.

The window *slides* (:meth:`Journal._slide`): its base moves up to the block
an eighth of the window before the last record (never past the block holding
the written mark), and the bytes from there on (recent records, the partial
block the last write ended in, the records not yet written) are moved to its
start: the last eighth stays readable from memory for tailing readers. A
handed-out write reads its window until it completes, so a slide never moves
bytes under a write in flight: it slides at a group's start
(:meth:`Journal.begin_sync`, :meth:`Journal.sync`, once the window is three
quarters full), where the worker has taken the group before back and nothing
is in flight, and an append that finds the window full (a group larger than
its free quarter) first waits for the window's write in flight (or runs it:
:meth:`Journal._drain`). Whatever then still does not fit is written out
without ``RWF_DSYNC`` (made durable by the group's write, as a write-out is),
and a record larger than the window makes it grow, logged. After a slide the
records before the base are read through the file: their writes completed
(the base is not past the written mark's block, and the mark is a record's
end, so a record the base cuts ends before the mark and is wholly in the
file).

Two windows alternate: at a roll the old segment keeps its window (its tail
stays readable from memory while it is the previous segment, and a group's
write at a roll ahead reads it) and the new one takes the other, whose older
segment is then read through its file again (written long before). Both are
made, their pages touched, when the journal opens, and reused after, so that
no new page of the VM is touched by an append (a first touch costs here:
0.12-0.14 s of CPU per 64 MiB in a busy bookie). They are the memory this
costs: ``journalDirectMemoryMB`` per shard, whatever the segment size (before,
two images of a whole segment: 128 MiB per shard at the default). Reads of
records older than the window (a catch-up read of entries not flushed yet)
go to the disk, as a flush's do (docs/operations.md).
:meth:`Journal.write_out` (a flush's, whose thread reads the journal from the
files) writes without ``RWF_DSYNC``; the next group's write (or, with nothing
left to write, an ``fdatasync`` job) makes it durable. The segment stays
fallocated: the first write of each block converts its extent, metadata
that ``RWF_DSYNC`` writes with the data. Where the filesystem refuses
``O_DIRECT`` (one probe write of a scratch file at open) the journal logs it
and writes through the page cache. Everything else is as without it: the
record format, replay and truncation (which read the files), the roll order
(an older segment durable before a newer one gets anything), prepared
segments, segments adopted as entry logs.

Rolls at a group's start (direct writes). A roll in the middle of an append
must wait on the loop for the write in flight and then write the old tail
with ``RWF_DSYNC`` itself (a disk round trip or two with nothing read
meanwhile: 1-5 ms measured, every ~2 s per bookie at the issue's load). So
once the active segment is past ``_ahead_at`` (``ROLL_AHEAD`` of its room
before the roll point) the next group commit rolls as soon as it has handed
out its write (:meth:`begin_sync`; or, inline, once :meth:`sync` wrote it):
that write is the old segment's last, and the roll itself writes nothing and
waits for nothing; the group's records all fit before the roll point. The
order still holds without a wait: the new segment's first write is the next
group's, begun only after this one completed (one job at a time), and every
write on the journal's own thread first waits for a write in flight
(:meth:`_drain`). The write in flight goes on through the old segment's
``O_DIRECT`` descriptor, kept open until the next roll. A group that starts
before ``_ahead_at`` and outgrows the roll point still rolls in its append,
and so does one whose next segment is still being prepared when it starts
(the group-start roll does not wait for the preparation: a later one rolls).

Replay. :meth:`Journal.replay` iterates the records from a mark, segment
after segment, verifying each CRC. It stops at the first record that is not
valid:

* a zero length with nothing but zeros after it: the clean end of the data of
  that segment; replay continues with the next segment, if any;
* anything else (CRC mismatch, length running past the segment, zero length
  followed by non-zero bytes, unknown type): a torn or corrupt tail. The rest
  of that segment is zeroed (and msync'd) so appends continue right there, and
  one warning names the segment and the offset. Nothing before the bad record
  is touched.

Later segments after a torn record. Because a roll syncs the old segment
before writing the new one, a normal crash (even a power loss with
``sync_data``) only ever tears the *last* segment. A bad record in an earlier
segment therefore means either a power loss without ``sync_data`` or media
corruption; the records after it cannot be trusted as a continuation of the
journal (and under ``sync_data`` were never acknowledged if the tear is a
crash). Later segments that hold no valid record are deleted; later
segments that do hold records are moved to ``quarantine/`` (never deleted),
with an error log, so that an operator can inspect them. The storage's index
never points into them: the checkpoint mark is before the bad record.

Reading. Every segment stays mapped (the active one read-write, for the
repair of a torn tail; the others read-only) so :meth:`Journal.read` serves
any record of any segment straight from the page cache; it verifies the CRC
and raises :class:`CorruptRecordError` on a mismatch. With direct writes the
records of the active and the previous segment from their window's base on
are read from the windows instead, every other one through its file (from
the disk: direct writes leave nothing in the page cache).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import random
import re
import struct
import threading
import time
from typing import Iterator, NamedTuple

from crc32c import crc32c

from bk.errors import BKError
from bk.protocol import REC_HEAD, unpack_record_head

log = logging.getLogger("bk.journal")

# --- format ---------------------------------------------------------------

SEGMENT_MAGIC = b"BKJSEG\r\n"     # CR LF: catches text-mode mangling too
FORMAT_VERSION = 1
HEADER_SIZE = 64                  # records start here
_SEG_HDR = struct.Struct("<8sHHIQQ")   # magic, version, header_size, reserved, seq, size
_SEG_CRC = struct.Struct("<I")           # CRC32C of _SEG_HDR, right after it

ADD = 1
FENCE = 2
MASTER_KEY = 3
WRITE_LAC = 4
STATE = 5
DELETE = 6
DROP = 7

TYPE_NAMES = {ADD: "ADD", FENCE: "FENCE", MASTER_KEY: "MASTER_KEY",
              WRITE_LAC: "WRITE_LAC", STATE: "STATE", DELETE: "DELETE", DROP: "DROP"}

_PREFIX = struct.Struct("<II")            # crc, length
_PREFIX_T = struct.Struct("<IIB")         # crc, length, type
_ADD_HDR = struct.Struct("<IIBqqqH")      # crc, length, type, ledger, entry, lac, dlen
ADD_OVERHEAD = _ADD_HDR.size              # record bytes of an ADD besides digest + payload
_ADD_FIELDS = struct.Struct("<qqqH")
_LEDGER_HDR = struct.Struct("<IIBq")      # FENCE, DELETE, DROP; prefix of MASTER_KEY
_pack_ledger_hdr = _LEDGER_HDR.pack_into
_MK_SIZE = _LEDGER_HDR.size
_WLAC_HDR = struct.Struct("<IIBqq")
_STATE_HDR = struct.Struct("<IIBqBqi")
_Q = struct.Struct("<q")
_QQ = struct.Struct("<qq")
_STATE_FIELDS = struct.Struct("<qBqi")
_CRC = struct.Struct("<I")
_LEN_T = struct.Struct("<IB")             # length, type: what an ADD's CRC covers first
_LEN = struct.Struct("<I")

MIN_SEGMENT_SIZE = 2 * mmap.PAGESIZE
MAX_SEGMENT_SIZE = 1 << 31        # offsets must fit the low 32 bits of a position
_PAGE_MASK = ~(mmap.PAGESIZE - 1)
_OFF_MASK = 0xFFFFFFFF
_SEG_NAME = re.compile(r"^(\d{16})\.seg$")
_ZEROS = bytes(1 << 20)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_LIBC = []


def _libc():
    if not _LIBC:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise.restype = ctypes.c_int
        _LIBC.append(libc)
    return _LIBC[0]
STAGING_SIZE = 4 << 20            # bytes of records built before a pwrite is forced
QUARANTINE_DIR = "quarantine"
PREPARE_AT = 0.5                  # fill of the active segment past which the next is prepared
ROLL_STAGGER = 0.125              # the last part of a segment its roll point is drawn in
ROLL_AHEAD = 1 / 32               # direct writes: part of the room before the roll point
                                  # from which a group's start rolls (see Journal._roll_ahead)
LOCK_FILE = "journal.lock"
CLOSE_WAIT = 10.0                 # seconds a close waits for a direct write in flight
DIRECT_MEMORY = 16 << 20          # direct writes: bytes of the two windows (journalDirectMemoryMB)
MIN_WINDOW = 256 << 10            # the smallest window (half of DIRECT_MEMORY) taken
_ABANDONED: list = []             # what such a write may still read (see Journal._let_go)


RUN_CHUNK = 64        # most records :meth:`Journal.append_wire_run` appends in one chunk
_CALM = 16            # records it takes one by one after a chunk failed to check
_RUN_STRUCTS: dict = {}


def _run_structs(w: int, k: int):
    """``(heads, bodies, pack)`` for a chunk of ``k`` ADD_BATCH records of ``w``
    bytes each: ``heads(src, off)`` unpacks every record's (plen, ledger, entry,
    lac, dlen), flat; ``bodies(src, off)`` every record's ADD body as bytes;
    ``pack(buf, i, crc, length, type, body, ...)`` writes the k journal records."""
    fns = _RUN_STRUCTS.get((w, k))
    if fns is None:
        if len(_RUN_STRUCTS) >= 64:          # sizes vary: keep only recent ones
            _RUN_STRUCTS.clear()
        fns = _RUN_STRUCTS[w, k] = (
            struct.Struct("<" + f"IqqqH{w - REC_HEAD}x" * k).unpack_from,
            struct.Struct("<" + f"4x{w - 4}s" * k).unpack_from,
            struct.Struct("<" + f"IIB{w - 4}s" * k).pack_into)
    return fns


class JournalError(BKError):
    """The journal cannot be opened, appended to or synced; the message says why."""


class ForeignSegmentError(JournalError):
    """A ``*.seg`` file in the journal directory was not written by this journal."""


class RecordTooLargeError(JournalError):
    """A record does not fit in one segment."""


class CorruptRecordError(JournalError):
    """A record read by position fails its CRC or does not decode."""


def segment_name(seq: int) -> str:
    return f"{seq:016d}.seg"


def make_position(seq: int, offset: int) -> int:
    return seq << 32 | offset


def split_position(pos: int) -> tuple[int, int]:
    return pos >> 32, pos & _OFF_MASK


def format_mark(mark) -> str:
    """``(seq, offset)`` -> ``"seq:offset"`` (for checkpoints, logs and the shell)."""
    seq, off = mark
    return f"{seq}:{off}"


def parse_mark(text) -> tuple[int, int]:
    """Inverse of :func:`format_mark`; also accepts a ``(seq, offset)`` pair or a position."""
    if isinstance(text, int):
        return split_position(text)
    if isinstance(text, (tuple, list)) and len(text) == 2:
        return int(text[0]), int(text[1])
    try:
        seq, off = str(text).split(":")
        return int(seq), int(off)
    except ValueError:
        raise ValueError(f"bad journal mark {text!r}: expected 'seq:offset'") from None


def _segment_header(seq: int, size: int) -> bytes:
    head = _SEG_HDR.pack(SEGMENT_MAGIC, FORMAT_VERSION, HEADER_SIZE, 0, seq, size)
    head += _SEG_CRC.pack(crc32c(head))
    return head + bytes(HEADER_SIZE - len(head))


def roll_point(size: int, rng: random.Random, spread: float = ROLL_STAGGER) -> int:
    """The offset past which appends to a segment of ``size`` bytes roll: a random
    point in its last ``spread`` of the room after the header, drawn anew for
    every segment activated.

    The bookies of an ensemble receive the same bytes, so with every segment
    full to its size their rolls (the old segment's ``fdatasync`` and the
    remap on the loop, a ~1-3 ms stall) fell on the same moment on all three:
    a stall of two bookies at once, which the ack quorum cannot ride out. A
    draw per segment makes their phases drift apart by a random walk (as
    ``bk.bookie.storage.flush_threshold`` does for the flushes). Lower, never
    higher: the segment's size still bounds it, and a fresh segment takes any
    record that fits one (:meth:`Journal._room`)."""
    return size - int((size - HEADER_SIZE) * spread * rng.random())


def _check_header(path: str, buf, seq: int, file_size: int) -> None:
    if file_size < HEADER_SIZE:
        raise ForeignSegmentError(f"{path}: {file_size} bytes, too short for a bk journal "
                                  "segment; not written by bk (remove or move it)")
    magic, version, hsize, _, hseq, hsize_total = _SEG_HDR.unpack_from(buf, 0)
    if magic != SEGMENT_MAGIC:
        raise ForeignSegmentError(f"{path}: bad magic {bytes(magic)!r}, not a bk journal "
                                  "segment (remove or move it out of the journal directory)")
    (crc,) = _SEG_CRC.unpack_from(buf, _SEG_HDR.size)
    if crc != crc32c(bytes(buf[:_SEG_HDR.size])):
        raise ForeignSegmentError(f"{path}: segment header fails its CRC (corrupt header)")
    if version != FORMAT_VERSION or hsize != HEADER_SIZE:
        raise ForeignSegmentError(f"{path}: journal format version {version} (header "
                                  f"{hsize} bytes) is not supported; this bk reads version "
                                  f"{FORMAT_VERSION}")
    if hseq != seq:
        raise ForeignSegmentError(f"{path}: header says segment {hseq}, name says {seq}")
    if hsize_total != file_size:
        raise ForeignSegmentError(f"{path}: file is {file_size} bytes, header says "
                                  f"{hsize_total} (truncated or extended by someone else)")


def _list_segment_files(directory: str) -> list[tuple[int, str]]:
    out = []
    for name in os.listdir(directory):
        m = _SEG_NAME.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(directory, name)))
        elif name.endswith(".seg"):
            raise ForeignSegmentError(f"{os.path.join(directory, name)}: not a bk journal "
                                      "segment name (expected 16 digits + .seg)")
    out.sort()
    return out


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_zero(mv, start: int, end: int) -> bool:
    chunk = len(_ZEROS)
    while start < end:
        stop = min(end, start + chunk)
        if mv[start:stop] != _ZEROS[:stop - start]:
            return False
        start = stop
    return True


def _decode(mv, off: int, length: int, full: bool):
    """(type, fields) of the record whose body starts at off+8; ValueError if malformed.

    With ``full`` false, an ADD decodes to (ledger, entry, lac) only (replay
    does not need the payload and must not copy every one of them).
    """
    rtype = mv[off + 8]
    b = off + 9
    blen = length - 1
    if rtype == ADD:
        if blen < _ADD_FIELDS.size:
            raise ValueError("short ADD")
        ledger, entry, lac, dlen = _ADD_FIELDS.unpack_from(mv, b)
        if not full:
            if blen < _ADD_FIELDS.size + dlen:
                raise ValueError("ADD digest runs past the record")
            return rtype, (ledger, entry, lac)
        d = b + _ADD_FIELDS.size
        if d + dlen > b + blen:
            raise ValueError("ADD digest runs past the record")
        return rtype, (ledger, entry, lac, bytes(mv[d:d + dlen]), bytes(mv[d + dlen:b + blen]))
    if rtype == FENCE or rtype == DELETE or rtype == DROP:
        if blen != 8:
            raise ValueError("bad FENCE/DELETE/DROP length")
        return rtype, _Q.unpack_from(mv, b)
    if rtype == MASTER_KEY:
        if blen < 8:
            raise ValueError("short MASTER_KEY")
        return rtype, (_Q.unpack_from(mv, b)[0], bytes(mv[b + 8:b + blen]))
    if rtype == WRITE_LAC:
        if blen != 16:
            raise ValueError("bad WRITE_LAC length")
        return rtype, _QQ.unpack_from(mv, b)
    if rtype == STATE:
        if blen < _STATE_FIELDS.size:
            raise ValueError("short STATE")
        ledger, fenced, lac, klen = _STATE_FIELDS.unpack_from(mv, b)
        k = b + _STATE_FIELDS.size
        if blen != _STATE_FIELDS.size + max(klen, 0):
            raise ValueError("bad STATE length")
        return rtype, (ledger, bool(fenced), lac, None if klen < 0 else bytes(mv[k:k + klen]))
    raise ValueError(f"unknown record type {rtype}")


# Scan outcome: a record, the clean end of a segment, or a bad record.
_END = "end"


def _scan(mv, size: int, off: int, full: bool):
    """Yield (offset, record_length, type, fields) of the valid records from ``off``.

    The last item yielded is always ``(offset, 0, None, reason)``: ``reason`` is
    ``"end"`` for a clean end (zeros up to the segment's end), else a text
    saying why the record at ``offset`` is bad.
    """
    unpack = _PREFIX.unpack_from
    while True:
        if off + 9 > size:
            yield off, 0, None, (_END if _is_zero(mv, off, size) else
                                 "non-zero bytes after the last record")
            return
        crc, length = unpack(mv, off)
        if length == 0:
            if crc == 0 and _is_zero(mv, off, size):
                yield off, 0, None, _END
            else:
                yield off, 0, None, "zero length followed by non-zero bytes"
            return
        end = off + 8 + length
        if end > size:
            yield off, 0, None, f"length {length} runs past the segment end"
            return
        if crc32c(mv[off + 4:end]) != crc:
            yield off, 0, None, "CRC mismatch"
            return
        try:
            rtype, fields = _decode(mv, off, length, full)
        except ValueError as e:
            yield off, 0, None, f"malformed record: {e}"
            return
        yield off, 8 + length, rtype, fields
        off = end


class _Segment:
    __slots__ = ("seq", "path", "size", "mm", "mv", "writable", "image", "wbase", "end")

    def __init__(self, seq: int, path: str, size: int, mm, writable: bool):
        self.seq = seq
        self.path = path
        self.size = size
        self.mm = mm
        self.mv = memoryview(mm)
        self.writable = writable
        self.image: "_Image | None" = None   # direct writes: its window (see Journal._locate)
        self.wbase = 0        # the file offset of the window's first byte
        self.end = 0          # where the data of a rolled segment holding a window ends

    def close(self) -> None:
        self.mv.release()
        self.mm.close()             # (a window is the journal's, reused)


class _Image:
    """A window of a segment in memory (direct writes, see "Direct writes" in the
    module docstring): an anonymous mapping of the window's size (page-aligned,
    as O_DIRECT wants its source), reused from one segment to another."""

    __slots__ = ("mm", "mv", "addr", "_ref", "owner")

    def __init__(self, size: int):
        self.mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.mv = memoryview(self.mm)
        self._ref = ctypes.c_char.from_buffer(self.mm)     # for its address (AIO's iovecs)
        self.addr = ctypes.addressof(self._ref)
        # Its pages are touched here, once, when the journal opens (both windows),
        # not by the appends: a page new to this VM costs a fault, zeroing and the
        # host's fault on first touch (measured in a busy bookie: 0.12-0.14 s of CPU
        # per 64 MiB; with huge pages asked for, 1 s, the kernel compacting memory
        # for them). Through ctypes, which lets go of the GIL (mmap.madvise holds it).
        if _libc().madvise(ctypes.c_void_p(self.addr), ctypes.c_size_t(size),
                           _MADV_POPULATE_WRITE):
            for off in range(0, size, mmap.PAGESIZE):      # before Linux 5.14
                self.mm[off] = 0
        self.owner: _Segment | None = None

    def close(self) -> None:
        self.mv.release()
        self._ref = None
        try:
            self.mm.close()
        except BufferError:          # a view still held somewhere: the GC unmaps it
            pass


def _map(path: str, writable: bool) -> tuple[object, int]:
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < HEADER_SIZE:
            return None, size
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        return mm, size
    finally:
        os.close(fd)


def _make_segment(directory: str, seq: int, size: int, sync_dir: bool) -> tuple[str, object]:
    """Create segment ``seq`` of ``size`` bytes: as ``.seg.tmp``, fallocated, its
    header written and fsync'd, then renamed into place (and with ``sync_dir``
    the directory fsync'd). Returns its path and a read-write mapping."""
    path = os.path.join(directory, segment_name(seq))
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, size)      # filesystem without fallocate: sparse file
        os.pwrite(fd, _segment_header(seq, size), 0)
        os.fsync(fd)
        os.rename(tmp, path)
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        os.close(fd)
    if sync_dir:
        try:
            _fsync_dir(directory)
        except BaseException:
            mm.close()
            raise
    return path, mm


class _Preparation:
    """The next segment, made by a thread of its own while the loop appends to
    the active one (see "Segments" in the module docstring). :meth:`result`
    waits for it: the segment's path and mapping, or the OSError it met."""

    __slots__ = ("seq", "_thread", "_out", "_error")

    def __init__(self, directory: str, seq: int, size: int):
        self.seq = seq
        self._out = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(directory, seq, size),
                                        name=f"journal-prep-{seq}", daemon=True)
        self._thread.start()

    def _run(self, directory, seq, size):
        try:
            self._out = _make_segment(directory, seq, size, True)
        except BaseException as e:    # handed to the roll, which creates it itself
            self._error = e

    def done(self) -> bool:
        """Whether its thread has finished (made the segment, or failed)."""
        return not self._thread.is_alive()

    def result(self) -> tuple[str, object]:
        self._thread.join()
        if self._error is not None:
            if isinstance(self._error, OSError):
                raise self._error
            raise OSError(errno.EIO, f"preparing a journal segment failed: {self._error!r}")
        return self._out


class Record(NamedTuple):
    """One decoded record, as :func:`iter_records` yields it."""
    position: int
    seq: int
    offset: int
    length: int
    type: int
    fields: tuple

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.type, str(self.type))


class Journal:
    """The segments of one journal directory; see the module docstring.

    Open, then consume :meth:`replay` (from the checkpoint's mark, or from
    the first segment) before appending: replay is what finds where appends
    continue.
    """

    def __init__(self, directory: str, segment_size: int, sync_data: bool = True,
                 roll_stagger: float = ROLL_STAGGER, direct: bool = False, *,
                 direct_memory: int = DIRECT_MEMORY):
        if not MIN_SEGMENT_SIZE <= segment_size <= MAX_SEGMENT_SIZE:
            raise JournalError(f"segment size {segment_size} out of range "
                               f"[{MIN_SEGMENT_SIZE}, {MAX_SEGMENT_SIZE}]")
        self.directory = directory
        self.segment_size = segment_size
        self.sync_data = sync_data
        self.roll_stagger = roll_stagger       # see roll_point; 0: roll only when full
        self._rng = random.Random()
        os.makedirs(directory, exist_ok=True)
        # A file object (not a bare fd) so that a Journal dropped without close()
        # (a simulated crash) releases its lock when it is garbage collected.
        self._lock = open(os.path.join(directory, LOCK_FILE), "ab")
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self._lock.close()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise JournalError(f"journal {directory} is in use by another process "
                                   "(or another open Journal)") from None
            raise
        self._segs: dict[int, _Segment] = {}
        try:
            for name in os.listdir(directory):
                if name.endswith(".seg.tmp"):     # a roll interrupted by a crash
                    os.unlink(os.path.join(directory, name))
            files = _list_segment_files(directory)
            for i, (seq, path) in enumerate(files):
                last = i == len(files) - 1
                mm, size = _map(path, writable=last)
                if mm is None:
                    _check_header(path, b"", seq, size)
                try:
                    _check_header(path, mm, seq, size)
                except BaseException:
                    mm.close()
                    raise
                self._segs[seq] = _Segment(seq, path, size, mm, last)
        except BaseException:
            self._close_maps()
            self._lock.close()
            raise
        self._next_seq = self._following_seq()
        # Direct writes (see the module docstring): only where they make the data
        # durable (sync_data) and the filesystem takes them.
        self.direct = False
        self._bs = 0
        self._images: list[_Image] = []      # the two windows
        self._image: _Image | None = None    # the active segment's window
        self._memory = direct_memory   # bytes of the two windows
        self._window = 0               # bytes of a window (set by the probe)
        self._align = 0                # a window's base is a multiple of this
        self._slide_at = 1 << 62       # fill past which a group's start slides the window
        self.slides = 0                # windows slid (for tests and traces)
        self.slide_waits = 0           # slides that first waited for the write in flight
        self._dfd = -1                 # the active segment, opened O_DIRECT
        self._wend = 0                 # bytes before it are in the file (direct writes)
        self._inflight: SyncJob | None = None    # a direct write handed out, not yet waited
        self._bounce = None
        self.direct_writes = 0         # direct writes done on this thread (roll, write_out, sync)
        if direct and sync_data:
            try:
                self.direct = self._probe_direct()
            except BaseException:
                self._close_maps()
                self._lock.close()
                raise
        # Append state: set by replay. _size 0 makes every append take the slow
        # path, which refuses until replay has run (and after a failed sync).
        self._active: _Segment | None = None
        self._fd = -1                  # the active segment, for pwrite and fdatasync
        self._buf = bytearray(STAGING_SIZE)
        self._bv = memoryview(self._buf)
        self._wbase = 0                # file offset of _buf[0]: bytes before it are written
        self._seqbase = 0
        self.rolled_at = 0             # where the data of the segment before the last roll ends
        self._off = 0
        self._size = 0
        self._synced = 0
        self._dir_dirty = False
        self._prep: _Preparation | None = None   # the next segment, being made off the loop
        self._prep_at = 1 << 62        # offset past which it is (set when a segment is activated)
        self._ahead_at = 1 << 62       # direct writes: offset past which a group's start rolls
        self._retired_dfd = -1         # the rolled segment's O_DIRECT descriptor, its last
                                       # write in flight at the roll (see _roll_ahead)
        self.rolls_ahead = 0           # rolls at a group's start (for tests and traces)
        self.prepared = 0              # segments prepared off the loop (for tests and traces)
        self._ready = False
        self._failed: BaseException | None = None
        self._unsynced = 0
        self._unsynced_records = 0
        self.syncs = 0
        self.synced_records = 0
        self.synced_bytes = 0

    # --- replay ---------------------------------------------------------------
    def replay(self, mark=None) -> Iterator[tuple[int, int, int, tuple]]:
        """Yield ``(position, record_length, type, fields)`` of every valid record
        after ``mark`` (``None``: from the first segment), then repair the tail
        and make the journal ready for appends. ADD fields are ``(ledger, entry,
        lac)`` here; use :meth:`read` for the digest and payload.
        """
        if self._ready:
            raise JournalError("replay() may only run once, before any append")
        seqs = sorted(self._segs)
        if mark is None:
            start_seq, off = (seqs[0], HEADER_SIZE) if seqs else (None, HEADER_SIZE)
        else:
            start_seq, off = parse_mark(mark)
            if start_seq not in self._segs:
                raise JournalError(
                    f"journal {self.directory}: the checkpoint mark {format_mark((start_seq, off))}"
                    f" names segment {segment_name(start_seq)}, which does not exist (segments: "
                    f"{', '.join(segment_name(s) for s in seqs) or 'none'}); the journal "
                    "directory does not belong with this index directory")
            if not HEADER_SIZE <= off <= self._segs[start_seq].size:
                raise JournalError(f"journal mark {format_mark((start_seq, off))} is outside "
                                   f"segment {segment_name(start_seq)}")
        if start_seq is None:
            self._activate(self._create_segment())
            self._ready = True
            return
        todo = [s for s in seqs if s >= start_seq]
        for i, seq in enumerate(todo):
            seg = self._segs[seq]
            base = seq << 32
            stop_off = reason = None
            for roff, n, rtype, fields in _scan(seg.mv, seg.size, off, False):
                if rtype is None:
                    stop_off, reason = roff, fields
                    break
                yield base | roff, n, rtype, fields
            later = todo[i + 1:]
            if reason == _END and later:
                off = HEADER_SIZE
                continue
            if reason != _END:
                log.warning("journal %s: torn or corrupt record at offset %d of segment %s "
                            "(%s); truncating the segment there, every record before it is "
                            "kept", self.directory, stop_off, seg.path, reason)
                self._truncate(seg, stop_off)
                self._dispose_later(seq, later)
            self._activate(seg, stop_off)
            self._ready = True
            return

    def _following_seq(self) -> int:
        """The sequence number after every segment, kept or quarantined."""
        nxt = (max(self._segs) + 1) if self._segs else 1
        qdir = os.path.join(self.directory, QUARANTINE_DIR)
        if os.path.isdir(qdir):
            for seq, _ in _list_segment_files(qdir):
                nxt = max(nxt, seq + 1)
        return nxt

    def _truncate(self, seg: _Segment, off: int) -> None:
        if not seg.writable:
            self._remap(seg, writable=True)
        mv = seg.mv
        chunk = len(_ZEROS)
        pos = off
        while pos < seg.size:
            stop = min(seg.size, pos + chunk)
            if mv[pos:stop] != _ZEROS[:stop - pos]:
                mv[pos:stop] = _ZEROS[:stop - pos]
            pos = stop
        if self.sync_data:
            start = off & _PAGE_MASK
            seg.mm.flush(start, seg.size - start)

    def _dispose_later(self, bad_seq: int, later: list[int]) -> None:
        for seq in later:
            seg = self._segs.pop(seq)
            has_data = False
            for _, _, rtype, _ in _scan(seg.mv, seg.size, HEADER_SIZE, False):
                has_data = rtype is not None
                break
            seg.close()
            if not has_data:
                log.warning("journal %s: removing empty segment %s that follows the torn "
                            "segment %s", self.directory, seg.path, segment_name(bad_seq))
                os.unlink(seg.path)
            else:
                qdir = os.path.join(self.directory, QUARANTINE_DIR)
                os.makedirs(qdir, exist_ok=True)
                dest = os.path.join(qdir, os.path.basename(seg.path))
                log.error("journal %s: segment %s follows the torn segment %s; its records "
                          "cannot be replayed in order and were never acknowledged after a "
                          "crash under journalSyncData; moved to %s for inspection",
                          self.directory, seg.path, segment_name(bad_seq), dest)
                os.rename(seg.path, dest)
        if later:
            _fsync_dir(self.directory)
            # the next segment follows the last one kept (or quarantined): no gap
            self._next_seq = self._following_seq()

    def _remap(self, seg: _Segment, writable: bool) -> None:
        seg.close()
        mm, size = _map(seg.path, writable)
        seg.mm, seg.mv, seg.size, seg.writable = mm, memoryview(mm), size, writable

    # --- direct writes -------------------------------------------------------------
    def _probe_direct(self) -> bool:
        """Whether this directory's filesystem takes O_DIRECT writes of whole blocks
        (its block size, ``f_bsize``) from page-aligned memory: one such write to a
        scratch file, removed again. Refused (EINVAL, e.g. a filesystem without
        O_DIRECT): False, with one log line; the journal then writes through the
        page cache as without the setting."""
        bs = os.statvfs(self.directory).f_bsize
        if bs < 512 or bs & (bs - 1) or bs > (64 << 10) or mmap.PAGESIZE % min(bs, mmap.PAGESIZE):
            log.warning("journal %s: block size %d does not suit direct writes; writing "
                        "through the page cache", self.directory, bs)
            return False
        path = os.path.join(self.directory, ".direct-probe")
        buf = mmap.mmap(-1, max(bs, mmap.PAGESIZE))
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC,
                         0o644)
            try:
                os.pwrite(fd, memoryview(buf)[:bs], 0)
            finally:
                os.close(fd)
                os.unlink(path)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            log.warning("journal %s: the filesystem refuses O_DIRECT writes (%s); writing "
                        "through the page cache", self.directory, e)
            return False
        finally:
            buf.close()
        self._bs = bs
        self._bounce = _Image(max(bs, mmap.PAGESIZE))   # the partial last block of a write
        # Two windows of half the memory each, a multiple of the alignment, never
        # more than a segment needs (a window that holds a whole segment never slides).
        align = self._align = max(bs, mmap.PAGESIZE)
        whole = -(-self.segment_size // align) * align
        self._window = min(whole, max(MIN_WINDOW, self._memory // 2 // align * align))
        log.info("journal %s: direct writes (O_DIRECT, %d-byte blocks); their two windows "
                 "take %.1f MiB of memory (journalDirectMemoryMB; journalDirectWrites=false: "
                 "none)", self.directory, bs, 2 * self._window / (1 << 20))
        return True

    def _take_image(self, seg: _Segment, off: int) -> None:
        """Give the segment being activated a window: the one the previous active
        segment (``self._active``, whose tail stays readable from memory) does not
        hold; the older segment holding it goes back to reading its file (written
        long ago). The window starts at the aligned offset before ``off`` (where
        appends continue) and holds the file's bytes from there to ``off`` (a
        fresh segment: the header), which the first write rewrites."""
        prev = self._active
        if not self._images:           # both at once, when the journal opens
            self._images = [_Image(self._window), _Image(self._window)]
        img = None
        for im in self._images:
            if prev is None or im.owner is not prev:
                img = im
                break
        old = img.owner
        if old is not None and old is not prev:
            old.image = None           # read from its file from now on
        base = off & -self._align
        img.mv[:off - base] = seg.mv[base:off]
        seg.image, seg.wbase = img, base
        img.owner = seg
        self._image = img
        self._buf, self._bv = img.mm, img.mv
        self._slide_at = len(img.mm) - (len(img.mm) >> 2)
        self._wbase = base

    def _slide(self, n: int = 0) -> None:
        """Move the active window's base up (direct writes), so that it has room
        for an ``n``-byte record: to the block an eighth of the window before the
        last record (those bytes stay readable from memory, for tailing readers),
        or, if the unwritten records and ``n`` need more, to the block where the
        next write starts; the bytes from the new base on are moved to the
        window's start. Never past the written mark's block: every record before
        the new base is in the file, its write completed, as a write of this
        window still in flight is waited for (or run, if nobody started it:
        :meth:`_drain`) first: it reads the bytes the move overwrites. Called at
        a group's start once the window is three quarters full
        (:meth:`begin_sync`, :meth:`sync`: nothing is in flight then, nothing
        waits), and by an append that finds the window full (a group larger than
        the free quarter: that one may wait). Records that still do not fit are
        written out (not synced: the next group's write or sync makes them
        durable); a record larger than the window gets a larger window
        (:meth:`_grow`)."""
        job = self._inflight
        if job is not None and job.seq == self._seqbase >> 32:
            self._drain()
            self.slide_waits += 1
        align = self._align
        size = len(self._buf)
        lim = self._wend & -align      # never past the written mark's block
        new = min(lim, (self._off - (size >> 3)) & -align)   # the last eighth stays
        if self._off - new + n > size:
            new = lim
        if self._off - new + n > size:
            self._drain()              # (a previous segment's write: _direct_write's rule)
            self._direct_write(self._off, dsync=False)
            new = self._wend & -align
            if self._off - new + n > size:
                self._grow(self._off - new + n)
        wbase = self._wbase
        if new > wbase:
            self._bv[:self._off - new] = self._bv[new - wbase:self._off - wbase]
            self._wbase = self._active.wbase = new
            self.slides += 1

    def _grow(self, need: int) -> None:
        """Give the active segment a window of at least ``need`` bytes for good (a
        record larger than the window: journalDirectMemoryMB set below twice the
        largest entry). Nothing is in flight (:meth:`_slide` drained)."""
        old = self._image
        size = -(-need // self._align) * self._align
        log.warning("journal %s: a record of the active segment needs a window of %d "
                    "bytes, more than the %d of journalDirectMemoryMB/2; the window grows",
                    self.directory, size, len(old.mm))
        img = _Image(size)
        img.mv[:self._off - self._wbase] = old.mv[:self._off - self._wbase]
        img.owner = self._active
        self._active.image = img
        self._images[self._images.index(old)] = img
        old.owner = None
        old.close()
        self._image = img
        self._buf, self._bv = img.mm, img.mv
        self._slide_at = size - (size >> 2)

    def _direct_parts(self, end: int) -> tuple[int, list]:
        """``(offset, [(address, view), ...])``: the write that brings the file up to
        ``end`` from the written mark, in whole blocks: the window's from the block
        holding the mark, then the partial last block copied into the bounce
        buffer with zeros after the data (never the window itself: appends go on
        filling that block while the write is in flight)."""
        bs = self._bs
        lo = self._wend & -bs
        full = end & -bs
        wb = self._wbase               # (a multiple of the block size, not past lo)
        parts = []
        if full > lo:
            parts.append((self._image.addr + lo - wb, self._bv[lo - wb:full - wb]))
        tail = end - full
        if tail:
            b = self._bounce.mv
            b[:tail] = self._bv[full - wb:end - wb]
            b[tail:bs] = _ZEROS[:bs - tail]
            parts.append((self._bounce.addr, b[:bs]))
        return lo, parts

    def _direct_write(self, end: int, dsync: bool) -> None:
        """Write the file up to ``end`` on this thread (no write may be in flight)."""
        lo, parts = self._direct_parts(end)
        if parts:
            views = [v for _, v in parts]
            try:
                n = sum(len(v) for v in views)
                got = os.pwritev(self._dfd, views, lo, os.RWF_DSYNC if dsync else 0)
                if got != n:
                    raise OSError(errno.EIO, f"short direct write: {got} of {n} bytes")
            except OSError as e:
                self._fail(e)
                raise JournalError(f"write to journal {self._active.path} failed: {e}") from e
            finally:
                for v in views:
                    v.release()
            self.direct_writes += 1
        self._wend = end

    def _drain(self) -> None:
        """Wait for the direct write handed out by :meth:`begin_sync`, if one is in
        flight: before another write of the same blocks (a roll, a write-out, a
        sync), which could otherwise reach the disk before it and be overwritten
        by its older copy of the block they share. A write nobody has started yet
        (handed to a sync thread that has not taken it, or never handed on: a
        failure path between :meth:`begin_sync` and the submit) is run here, on
        this thread (:meth:`SyncJob.run` claims it, so it is written once, by
        whoever comes first); waiting for it instead could wait forever. A write
        whose completion nothing can report any more (its AIO context gone)
        poisons the journal rather than be waited for."""
        job = self._inflight
        if job is None:
            return
        self._inflight = None
        job.run()                     # (returns at once if started elsewhere)
        if not job.wait():
            job.error = job.error or OSError(errno.EIO, "the completion of a direct "
                                             "write in flight was lost")
        self._settle(job, "write")

    def _settle(self, job: "SyncJob", what: str) -> None:
        """A finished job's outcome: its error poisons the journal (JournalError);
        else its end moves the synced mark (unless a roll has moved on since: the
        roll made the old segment durable itself)."""
        if job.error is not None:
            self._fail(job.error)
            raise JournalError(f"{what} of journal {self.directory} failed: {job.error}")
        if job.seq == self._seqbase >> 32 and job.end > self._synced:
            self._synced = job.end

    def _activate(self, seg: _Segment, off: int = HEADER_SIZE) -> None:
        dfd = -1
        if self.direct:
            dfd = os.open(seg.path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        elif not seg.writable:
            self._remap(seg, writable=True)
        try:
            fd = os.open(seg.path, os.O_RDWR)
        except BaseException:
            if dfd >= 0:
                os.close(dfd)
            raise
        if self._fd >= 0:
            os.close(self._fd)
        if self._retired_dfd >= 0:      # its write completed before any later one began
            os.close(self._retired_dfd)
            self._retired_dfd = -1
        if self._dfd >= 0:
            if self._inflight is not None:   # a roll ahead: that write goes through it
                self._retired_dfd = self._dfd
            else:
                os.close(self._dfd)
        self._fd = fd
        self._dfd = dfd
        if dfd >= 0:
            self._take_image(seg, off)
            self._wend = off
        else:
            self._wbase = off
        self._active = seg
        self._seqbase = seg.seq << 32
        self._off = off
        self._synced = off
        self._size = roll_point(seg.size, self._rng, self.roll_stagger)
        self._prep_at = int(seg.size * PREPARE_AT)
        if dfd >= 0:
            self._ahead_at = self._size - int((seg.size - HEADER_SIZE) * ROLL_AHEAD)

    def _create_segment(self, seq: int | None = None) -> _Segment:
        """Create the next segment on this thread (the first one, and the fallback
        when no prepared one is at hand); ``seq``: the one a failed preparation
        had taken, so that sequence numbers stay contiguous."""
        if seq is None:
            seq = self._next_seq
            self._next_seq = seq + 1
        path, mm = _make_segment(self.directory, seq, self.segment_size, False)
        self._dir_dirty = True
        seg = _Segment(seq, path, self.segment_size, mm, True)
        self._segs[seq] = seg
        return seg

    # --- the next segment, prepared off the loop --------------------------------
    def _maybe_prepare(self) -> None:
        """Start preparing the next segment once the active one is past
        PREPARE_AT of its size (one compare per group commit)."""
        if self._off > self._prep_at and self._prep is None and self._failed is None:
            seq = self._next_seq
            self._next_seq = seq + 1
            self._prep = _Preparation(self.directory, seq, self.segment_size)
            self.prepared += 1

    def _take_prepared(self) -> _Segment:
        """The next segment for a roll: the prepared one (waiting for its thread if
        it is still at work), else one created here."""
        prep, self._prep = self._prep, None
        if prep is None:
            return self._create_segment()
        try:
            path, mm = prep.result()
        except OSError as e:
            log.warning("journal %s: preparing segment %s failed (%s); creating it at the "
                        "roll", self.directory, segment_name(prep.seq), e)
            return self._create_segment(prep.seq)
        seg = _Segment(prep.seq, path, self.segment_size, mm, True)
        self._segs[prep.seq] = seg
        return seg

    def _drop_preparation(self) -> None:
        """Wait for a preparation under way and unmap its segment (at close): the
        file stays, an empty segment that the next open's replay continues into."""
        prep, self._prep = self._prep, None
        if prep is not None:
            try:
                _, mm = prep.result()
                mm.close()
            except OSError:
                pass

    # --- appends --------------------------------------------------------------
    def _room(self, n: int) -> None:
        """Make room for an n-byte record: refuse, or roll to a new segment."""
        if self._failed is not None:
            raise JournalError(f"journal {self.directory} failed earlier and takes no more "
                               f"writes: {self._failed}")
        if not self._ready:
            raise JournalError("journal not ready: replay() must run before appends")
        if n > self.segment_size - HEADER_SIZE:
            raise RecordTooLargeError(f"a record of {n} bytes does not fit in a journal "
                                      f"segment of {self.segment_size} bytes")
        if self._off + n <= self._size:
            return
        self._roll()
        if self._off + n > self._size:   # past a fresh segment's roll point: it still
            self._size = self._active.size   # takes any record that fits a segment

    def _roll(self) -> None:
        """Continue in the next segment: write out and sync the active one's tail,
        then activate the prepared one (see the module docstring)."""
        old = self._active
        if self.direct:
            self._drain()
            if self._off > self._synced:     # the tail written and durable at once
                if self._off > self._wend:
                    self._direct_write(self._off, dsync=True)
                else:                        # written by write_out, not synced
                    try:
                        os.fdatasync(self._dfd)
                    except OSError as e:
                        self._fail(e)
                        raise JournalError(f"fdatasync of {old.path} failed: {e}") from e
            end = self._off
            new = self._take_prepared()
            self.rolled_at = self._seqbase | end
            self._activate(new)
            self._synced = HEADER_SIZE
            old.end = end                  # its window stays readable until the next roll
            return
        self._write_out()
        if self.sync_data and self._off > self._synced:
            # The old segment must be durable before anything lands in the new one:
            # replay relies on only the last segment ever being torn.
            try:
                os.fdatasync(self._fd)
            except OSError as e:
                self._fail(e)
                raise JournalError(f"fdatasync of {old.path} failed: {e}") from e
        new = self._take_prepared()
        self.rolled_at = self._seqbase | self._off
        self._activate(new)
        self._synced = HEADER_SIZE
        self._remap(old, writable=False)

    def _roll_ahead(self) -> None:
        """Roll at the start of a group commit (direct writes), once the active
        segment is past ``_ahead_at`` (a little before its roll point): its last
        records have just been handed out to be written (:meth:`begin_sync`, the
        write in flight, ``_inflight``) or written (:meth:`sync`), so the roll
        itself writes nothing and waits for nothing. The roll order holds all
        the same: the new segment's first write waits for the old one's
        (:meth:`_drain` before every write on this thread; a group's write is
        begun only after the group before it completed, one at a time). The old
        segment's ``O_DIRECT`` descriptor stays open for that write until the
        next roll. A group that outgrows the room left still rolls in the middle
        of an append (:meth:`_roll`). While the next segment is still being
        prepared (after a restart near the end of a segment) this waits for
        nothing either: a later group's start rolls, once it is ready."""
        if self._prep is not None and not self._prep.done():
            return
        old = self._active
        end = self._off
        new = self._take_prepared()
        self.rolled_at = self._seqbase | end
        self._activate(new)
        self._synced = HEADER_SIZE
        old.end = end
        self.rolls_ahead += 1

    def _reserve(self, n: int) -> None:
        """Slow path of an append: room in the segment (maybe a roll), then room
        in the staging buffer (write it out; a record larger than the buffer gets
        a buffer of its own size until the next write-out)."""
        self._room(n)
        if self._off - self._wbase + n > len(self._buf):
            if self.direct:
                self._slide(n)
                return
            self._write_out()
            if n > len(self._buf):
                self._bv.release()
                self._buf = bytearray(n)
                self._bv = memoryview(self._buf)

    def _write_out(self) -> None:
        """pwrite the staged records to the active segment (page cache, not disk);
        with direct writes, write the file up to the last record (not synced)."""
        if self.direct:
            if self._off > self._wend:
                self._drain()
                self._direct_write(self._off, dsync=False)
            return
        k = self._off - self._wbase
        if k <= 0:
            return
        if self._failed is not None:
            raise JournalError(f"journal {self.directory} failed earlier: {self._failed}")
        done = 0
        try:
            while done < k:
                done += os.pwrite(self._fd, self._bv[done:k], self._wbase + done)
        except OSError as e:
            self._fail(e)
            raise JournalError(f"write to journal {self._active.path} failed: {e}") from e
        self._wbase = self._off
        if len(self._buf) > STAGING_SIZE:      # back from a one-off large record
            self._bv.release()
            self._buf = bytearray(STAGING_SIZE)
            self._bv = memoryview(self._buf)

    def write_out(self, wait: bool = True) -> "SyncJob | None":
        """pwrite every staged record (no sync): another thread may then read them
        from the segment files (a flush does). With direct writes a group's write
        handed out (:meth:`begin_sync`) may still be in flight and hold the last
        records (a group's write goes up to the last record; after a roll at a
        group's start it is the old segment's tail): ``wait`` waits for it here;
        without ``wait`` it is returned instead (None: nothing in flight), and
        the files hold every record once :meth:`writing` says it is no longer
        in flight and it has no ``error``."""
        if self.direct and wait:
            self._drain()
        self._write_out()
        return self._inflight if self.direct else None

    def writing(self, job: "SyncJob") -> bool:
        """Whether ``job`` (from :meth:`write_out`) is still in flight: not yet
        completed and taken back (:meth:`end_sync`, or waited for by a write)."""
        return self._inflight is job

    def segment_view(self, seq: int):
        """The read mapping of a segment (for an offline conversion of the whole
        journal; never while appends may remap it)."""
        return self._segs[seq].mm

    def append_add(self, ledger: int, entry: int, lac: int, digest: bytes, payload: bytes) -> int:
        """Append an ADD record; return its position (hot path)."""
        dlen = len(digest)
        n = ADD_OVERHEAD + dlen + len(payload)
        off = self._off
        i = off - self._wbase
        if off + n > self._size or i + n > len(self._buf):
            self._reserve(n)
            off = self._off
            i = off - self._wbase
        buf = self._buf
        end = i + n
        _ADD_HDR.pack_into(buf, i, 0, n - 8, ADD, ledger, entry, lac, dlen)
        d = i + ADD_OVERHEAD
        buf[d:d + dlen] = digest
        buf[d + dlen:end] = payload
        _CRC.pack_into(buf, i, crc32c(self._bv[i + 4:end]))
        self._off = off + n
        self._unsynced += n
        self._unsynced_records += 1
        return self._seqbase | off

    def append_add_body(self, src, start: int, end: int) -> int:
        """Append an ADD record whose body (ledger .. payload, see the format) is
        ``src[start:end]``, e.g. straight from a received ADD_BATCH; return its
        position (hot path: one copy into the staging buffer, one CRC)."""
        n = 9 + end - start
        off = self._off
        i = off - self._wbase
        if off + n > self._size or i + n > len(self._buf):
            self._reserve(n)
            off = self._off
            i = off - self._wbase
        buf = self._buf
        e = i + n
        _PREFIX_T.pack_into(buf, i, 0, n - 8, ADD)
        buf[i + 9:e] = src[start:end]
        _CRC.pack_into(buf, i, crc32c(self._bv[i + 4:e]))
        self._off = off + n
        self._unsynced += n
        self._unsynced_records += 1
        return self._seqbase | off

    def append_wire_run(self, src, off: int, ledger: int, entry: int,
                        positions) -> tuple[int, int]:
        """Append, straight from an ADD_BATCH's records ``src`` (each ``plen:u32``
        then an ADD body, see ``bk.protocol``), the record at ``off`` and each
        record after it that is the next entry of the same ledger and lies
        wholly within ``src`` (the first being ``entry`` of ``ledger``, as the
        caller read it); each position is appended to ``positions`` (so
        that, if one raises, the ones before it are known). Returns ``(offset
        after the last one appended, greatest LAC among them)``. The caller
        checked the first record (ids, bounds) and checks the count; an entry
        that does not continue the run, or a truncated record, ends it, for the
        caller to look at. The hot path of a batch: the records are located,
        checked and appended in this one loop, with no object made per entry
        but its position.

        Records of one size (a writer's entries usually are) go in *chunks*
        of up to :data:`RUN_CHUNK`: one ``unpack_from`` reads every head of
        the chunk, tuple slices check them (ledger, consecutive ids, sizes),
        a second ``unpack_from`` takes the bodies, a comprehension computes
        their CRCs and one ``pack_into`` writes the whole chunk, prefixes
        and bodies (the structs made once per record size and chunk length,
        :func:`_run_structs`): a few C calls a chunk instead of some fifteen
        bytecode lines a record. The chunk's last head is read first, so a
        chunk that cannot be one costs one unpack and no struct. A chunk
        that does not check (the run ends in it, sizes vary) is halved; when
        none does, the next records go one by one for a while
        (:data:`_CALM`), so entries of varying sizes pay for a failed attempt
        only now and then."""
        buf = self._buf
        bv = self._bv
        unpack = unpack_record_head          # an ADD_BATCH record: plen, then an ADD body
        head = REC_HEAD
        pack_prefix = _PREFIX_T.pack_into
        out = positions.append
        size = len(src)
        wbase = self._wbase
        b = b0 = self._off - wbase           # the next record's index in the buffer
        blimit = min(self._size, wbase + len(buf)) - wbase
        base = self._seqbase | wbase         # the position of buf[0]: seq | offset
        n0 = len(positions)
        nxt = entry
        maxlac = -1
        last_n = pre = 0
        calm = 0                             # records to take one by one before a chunk
        try:
            while off < size:        # (a test, not the struct.error at the end: that
                # raise costs as much as some 50 of these tests)
                plen, lid, eid, lac, dlen = unpack(src, off)   # struct.error: truncated
                end = off + head + dlen + plen
                if eid != nxt or lid != ledger or end > size:
                    break
                w = end - off
                n = w + 5                    # the 9-byte prefix replaces the 4-byte plen
                if b + n > blimit:
                    self._off = wbase + b
                    self._unsynced += b - b0
                    b0 = b                   # (accounted, should _reserve raise)
                    self._reserve(n)
                    buf, bv, wbase = self._buf, self._bv, self._wbase
                    b = b0 = self._off - wbase
                    blimit = min(self._size, wbase + len(buf)) - wbase
                    base = self._seqbase | wbase
                if n != last_n:      # the CRC of (length, type): once per record size
                    last_n = n
                    pre = crc32c(_LEN_T.pack(n - 8, ADD))
                if calm:
                    calm -= 1
                elif off + w + w <= size:            # room in src for a chunk of two
                    k = min((size - off) // w, (blimit - b) // n, RUN_CHUNK)
                    while k > 1:
                        k = 1 << (k.bit_length() - 1)
                        # The chunk's last head first: one unpack, before any struct
                        # is made for a chunk that cannot be one.
                        pl, li, ei, _, dl = unpack(src, off + (k - 1) * w)
                        if ei == eid + k - 1 and li == ledger and pl == plen and dl == dlen:
                            heads, bodies, pack_run = _run_structs(w, k)
                            h = heads(src, off)
                            if h[2::5] == tuple(range(eid, eid + k)) \
                                    and h[1::5] == (ledger,) * k \
                                    and h[0::5] == (plen,) * k and h[4::5] == (dlen,) * k:
                                break
                        k >>= 1
                    if k > 1:
                        bodies = bodies(src, off)
                        args = [0, n - 8, ADD, None] * k
                        args[0::4] = [crc32c(body, pre) for body in bodies]
                        args[3::4] = bodies
                        pack_run(buf, b, *args)
                        p = base + b
                        positions.extend(range(p, p + k * n, n))
                        lac = max(h[3::5])
                        if lac > maxlac:
                            maxlac = lac
                        b += k * n
                        off += k * w
                        nxt += k
                        continue
                    calm = _CALM
                body = src[off + 4:end]
                bv[b + 9:b + n] = body       # (a bytearray's slice assignment copies a
                # memoryview into a new bytearray first; the memoryview's does not)
                pack_prefix(buf, b, crc32c(body, pre), n - 8, ADD)   # the CRC continued
                out(base + b)
                b += n
                off = end
                nxt += 1
                if lac > maxlac:
                    maxlac = lac
        except struct.error:
            pass                             # less than a head left: the caller's to refuse
        finally:
            self._unsynced_records += len(positions) - n0
            self._unsynced += b - b0
            self._off = wbase + b
        return off, maxlac

    def _append_raw(self, st: struct.Struct, args: tuple, tail: bytes = b"") -> int:
        n = st.size + len(tail)
        off = self._off
        if off + n > self._size or off - self._wbase + n > len(self._buf):
            self._reserve(n)
            off = self._off
        i = off - self._wbase
        end = i + n
        buf = self._buf
        st.pack_into(buf, i, 0, n - 8, *args)
        if tail:
            buf[i + st.size:end] = tail
        _CRC.pack_into(buf, i, crc32c(self._bv[i + 4:end]))
        self._off = off + n
        self._unsynced += n
        self._unsynced_records += 1
        return self._seqbase | off

    def append_master_key(self, ledger: int, key: bytes) -> int:
        """Append a ledger's MASTER_KEY record; return its position (hot path: a
        ledger's first add makes one, and with a ledger per entry every add does)."""
        n = _MK_SIZE + len(key)
        off = self._off
        i = off - self._wbase
        if off + n > self._size or i + n > len(self._buf):
            self._reserve(n)
            off = self._off
            i = off - self._wbase
        buf = self._buf
        end = i + n
        _pack_ledger_hdr(buf, i, 0, n - 8, MASTER_KEY, ledger)
        buf[i + _MK_SIZE:end] = key
        _CRC.pack_into(buf, i, crc32c(self._bv[i + 4:end]))
        self._off = off + n
        self._unsynced += n
        self._unsynced_records += 1
        return self._seqbase | off

    def append(self, rtype: int, *fields) -> int:
        """Append one record of any type (fields as :func:`iter_records` decodes them)."""
        if rtype == ADD:
            return self.append_add(*fields)
        if rtype == FENCE or rtype == DELETE or rtype == DROP:
            (ledger,) = fields
            return self._append_raw(_LEDGER_HDR, (rtype, ledger))
        if rtype == MASTER_KEY:
            return self.append_master_key(*fields)
        if rtype == WRITE_LAC:
            ledger, lac = fields
            return self._append_raw(_WLAC_HDR, (rtype, ledger, lac))
        if rtype == STATE:
            ledger, fenced, lac, key = fields
            klen = -1 if key is None else len(key)
            return self._append_raw(_STATE_HDR, (rtype, ledger, 1 if fenced else 0, lac, klen),
                                    b"" if key is None else bytes(key))
        raise ValueError(f"unknown journal record type {rtype!r}")

    def sync(self) -> None:
        """Make every record appended so far durable (see the module docstring)."""
        if not self._unsynced:
            return
        if self._failed is not None:
            raise JournalError(f"journal {self.directory} failed earlier: {self._failed}")
        if self.direct:
            self._drain()
            if self._off - self._wbase > self._slide_at:
                self._slide()                # at a group's start: nothing in flight
            durable = self._off > self._wend     # else written by write_out, not synced
            if durable:
                self._direct_write(self._off, dsync=True)
        else:
            self._write_out()
            durable = False
        if self.sync_data:
            try:
                if not durable:
                    os.fdatasync(self._fd)
                if self._dir_dirty:
                    _fsync_dir(self.directory)
                    self._dir_dirty = False
            except OSError as e:
                self._fail(e)
                raise JournalError(f"fdatasync of journal {self._active.path} failed: {e}") from e
        self._synced = self._off
        self._maybe_prepare()
        self.syncs += 1
        self.synced_records += self._unsynced_records
        self.synced_bytes += self._unsynced
        self._unsynced = 0
        self._unsynced_records = 0
        if self._off > self._ahead_at:       # (direct writes only) all of it durable now
            self._roll_ahead()

    # --- pipelined group commit ------------------------------------------------
    def begin_sync(self) -> "SyncJob | None":
        """Start a group commit of every record appended so far, without waiting.

        Returns None when nothing is unsynced. Otherwise run the job's
        :meth:`SyncJob.run` on any thread (it blocks in ``fdatasync`` with the GIL
        released, so the caller's thread can append the next group meanwhile),
        then call :meth:`end_sync` on this journal's thread: only then are the
        records covered by the job durable. One job at a time; :meth:`sync` must
        not run while a job is open.
        """
        if not self._unsynced:
            return None
        if self.direct:
            if self._failed is not None:
                raise JournalError(f"journal {self.directory} failed earlier: {self._failed}")
            self._drain()
            if self._off - self._wbase > self._slide_at:
                self._slide()                # at a group's start: nothing in flight
            job = SyncJob(self._active.path, self.directory if self._dir_dirty else None,
                          self._seqbase >> 32, self._off, self._unsynced_records,
                          self._unsynced)
            if self._off > self._wend:   # else written by write_out: an fdatasync's job
                lo, parts = self._direct_parts(self._off)
                job.direct(self._dfd, lo, parts)
                self._wend = self._off
                self._inflight = job
        else:
            self._write_out()        # raises if the journal failed
            job = SyncJob(self._active.path if self.sync_data else None,
                          self.directory if self._dir_dirty and self.sync_data else None,
                          self._seqbase >> 32, self._off, self._unsynced_records,
                          self._unsynced)
        self._dir_dirty = False
        self._unsynced = 0
        self._unsynced_records = 0
        self._maybe_prepare()
        if self._off > self._ahead_at and self._inflight is job:
            # (direct writes) the segment's last write is handed out; not after a
            # job that only fdatasyncs (a write-out's blocks): nothing would wait for it
            self._roll_ahead()
        return job

    def end_sync(self, job: "SyncJob") -> None:
        """Finish a job begun by :meth:`begin_sync`; JournalError (and a poisoned
        journal) if its sync failed."""
        if self._inflight is job:
            self._inflight = None
        job.release()
        self._settle(job, "sync")
        self.syncs += 1
        self.synced_records += job.records
        self.synced_bytes += job.bytes

    def _fail(self, exc: BaseException) -> None:
        self._failed = exc
        self._size = 0          # every append now takes the refusing slow path
        log.error("journal %s: sync failed (%s); refusing further writes", self.directory, exc)

    @property
    def unsynced_bytes(self) -> int:
        return self._unsynced

    @property
    def mark(self) -> tuple[int, int]:
        """Where the next record goes: replay after a checkpoint starts here."""
        return self._seqbase >> 32, self._off

    @property
    def active_seq(self) -> int:
        return self._seqbase >> 32

    @property
    def position(self) -> int:
        """The position the next record gets (where the last one appended ends)."""
        return self._seqbase | self._off

    # --- reads ----------------------------------------------------------------
    def _locate(self, pos: int):
        """``(buffer, index, length)`` of the record at ``pos``, its CRC verified: the
        buffer is the segment's file mapping, or (direct writes) its window for a
        record from the window's base on. A record before the base is wholly in
        the file, its write completed: the base is never past the block of the
        written mark, which is a record's end (a group's or a write-out's), so a
        record the base cuts ends before the mark; and the write that put it
        there is over before the window slides (:meth:`_slide`)."""
        seg = self._segs.get(pos >> 32)
        off = pos & _OFF_MASK
        if off >= self._wbase and seg is self._active and not self.direct:
            self._write_out()     # still staged: rare (recovery reads of the open group)
        if seg is None:
            raise CorruptRecordError(f"position {format_mark(split_position(pos))}: segment "
                                     "does not exist")
        if off + 9 > seg.size:
            raise CorruptRecordError(f"position {format_mark(split_position(pos))} is past "
                                     "the end of its segment")
        img = seg.image
        if img is None or off < seg.wbase:
            mm, mv, i, lim = seg.mm, seg.mv, off, seg.size
        else:
            i = off - seg.wbase
            mm, mv, lim = img.mm, img.mv, min(len(img.mm), seg.size - seg.wbase)
            if i + 9 > lim:
                raise CorruptRecordError(f"position {format_mark(split_position(pos))} is "
                                         "past the end of its segment's window")
        crc, length = _PREFIX.unpack_from(mv, i)
        end = i + 8 + length
        if length == 0 or end > lim or crc32c(mv[i + 4:end]) != crc:
            raise CorruptRecordError(f"record at {format_mark(split_position(pos))} of "
                                     f"{seg.path} fails its CRC")
        return mm, i, length

    def read(self, pos: int) -> tuple[int, tuple]:
        """``(type, fields)`` of the record at ``pos``, CRC verified."""
        buf, off, length = self._locate(pos)
        try:
            return _decode(buf, off, length, True)
        except ValueError as e:
            raise CorruptRecordError(f"record at {format_mark(split_position(pos))}: {e}") from None

    def read_add(self, pos: int) -> tuple[int, int, int, bytes, bytes]:
        """``(ledger, entry, lac, digest, payload)`` of the ADD at ``pos``."""
        mm, off, length = self._locate(pos)
        if mm[off + 8] != ADD or length < 1 + _ADD_FIELDS.size:
            raise CorruptRecordError(f"record at {format_mark(split_position(pos))} is not an ADD")
        ledger, entry, lac, dlen = _ADD_FIELDS.unpack_from(mm, off + 9)
        d = off + ADD_OVERHEAD
        end = off + 8 + length
        if d + dlen > end:
            raise CorruptRecordError(f"ADD at {format_mark(split_position(pos))}: bad digest length")
        return ledger, entry, lac, mm[d:d + dlen], mm[d + dlen:end]

    def record_length(self, pos: int) -> int:
        """Total bytes of the record at ``pos`` (no CRC check: for accounting only)."""
        seg = self._segs[pos >> 32]
        off = pos & _OFF_MASK
        if seg is self._active and off >= self._wbase and not self.direct:
            self._write_out()     # still staged: reads see the file, one rule for all
        if seg.image is not None and off >= seg.wbase:        # in the window
            return 8 + _LEN.unpack_from(seg.image.mm, off - seg.wbase + 4)[0]
        return 8 + _LEN.unpack_from(seg.mm, off + 4)[0]

    def scan_segment(self, seq: int, full: bool = True):
        """Yield ``(position, record_length, type, fields)`` of every record of a segment."""
        seg = self._segs[seq]
        size = seg.size
        if seg.image is not None:     # read from the file, every write of it completed
            size = self._off if seg is self._active else seg.end
            self.write_out()
        elif seg is self._active:
            self._write_out()
        base = seq << 32
        for off, n, rtype, fields in _scan(seg.mv, size, HEADER_SIZE, full):
            if rtype is None:
                return
            yield base | off, n, rtype, fields

    # --- maintenance ----------------------------------------------------------
    def segments(self) -> list[int]:
        return sorted(self._segs)

    def segment_size_of(self, seq: int) -> int:
        return self._segs[seq].size

    def segment_path(self, seq: int) -> str:
        return self._segs[seq].path

    def remove_segment(self, seq: int) -> int:
        """Unmap and delete a segment (never the active one); return the bytes freed."""
        path = self.forget_segment(seq)
        size = os.stat(path).st_size
        os.unlink(path)
        _fsync_dir(self.directory)
        return size

    def forget_segment(self, seq: int) -> str:
        """Unmap a segment (never the active one) and stop knowing it; return its
        path, for the caller to delete (elsewhere: unlinking a preallocated
        segment takes ext4 tens of ms). A segment left behind by a crash before
        its deletion is wholly before the mark: deleted at the next open."""
        if self._active is not None and seq == self._active.seq:
            raise JournalError(f"segment {segment_name(seq)} is the active segment")
        seg = self._segs.pop(seq)
        seg.close()
        return seg.path

    def disk_usage(self) -> int:
        """Bytes the segment files occupy (they are preallocated: their full size)."""
        return sum(seg.size for seg in self._segs.values())

    def _close_maps(self) -> None:
        for seg in self._segs.values():
            try:
                seg.close()
            except (BufferError, ValueError):
                pass
        self._segs.clear()

    def close(self) -> None:
        """Sync, unmap everything and release the directory lock (idempotent)."""
        if self._lock.closed:
            return
        try:
            self._prep_at = 1 << 62       # the last sync prepares no segment
            self._ahead_at = 1 << 62      # nor rolls
            if self._ready and self._failed is None:
                self._drain()         # a group's write still handed out: finished here
                self.sync()
        finally:
            abandoned = False
            try:
                job, self._inflight = self._inflight, None
                if job is not None:   # (failed: its write must not outlive the window)
                    abandoned = not self._let_go(job)
            finally:
                self._drop_preparation()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if abandoned:             # the kernel may still read them: never reused
                _ABANDONED.append((job, self._dfd, self._images, self._bounce))
                # (a rolled segment's descriptor the write may go through: left
                # open too, as the windows are left mapped)
            else:
                if self._dfd >= 0:
                    os.close(self._dfd)
                if self._retired_dfd >= 0:
                    os.close(self._retired_dfd)
            self._dfd = -1
            self._retired_dfd = -1
            self._active = None
            self._size = 0
            self._ready = False
            self._failed = self._failed or JournalError("journal closed")
            self._close_maps()
            if self.direct:
                self._bv = self._buf = None
                self._image = None
                if not abandoned:
                    for im in self._images:
                        im.close()
                    self._bounce.close()
                self._images = []
                self._bounce = None
            self._lock.close()

    def _let_go(self, job: "SyncJob") -> bool:
        """At close, the direct write still handed out (only after a failure: a
        healthy close syncs, which waits for it): True once nothing will read its
        memory any more. Never started: cancelled, so it never will be. Started
        (the sync thread runs it, or the kernel has it through AIO): waited for,
        but at most CLOSE_WAIT seconds, so that a close never hangs on a
        completion that will not come (a job handed to a thread that has gone, a
        device that stopped answering); then False, with an error log: its
        descriptor and the windows stay open and mapped for good (the kernel may
        still read them), and the journal's lock is released all the same."""
        if job.cancel():
            return True
        try:
            if job.wait(CLOSE_WAIT):
                return True
        except Exception as e:        # (a waiter's io_getevents failing)
            log.error("journal %s: waiting for the direct write in flight at close "
                      "failed: %s", self.directory, e)
        log.error("journal %s: a direct write in flight did not complete within %.0f s "
                  "of the close; its window stays mapped", self.directory, CLOSE_WAIT)
        return False


class SyncFile:
    """The segment file a sync thread keeps open from one job to the next.

    A job syncs through a descriptor of the sync thread's own, so that a roll on
    the journal's thread cannot close it under the sync. Opening and closing
    one per job cost two syscalls and, worse, two more times the sync thread
    gave up and took back the GIL while the loop was running (each a chance of
    a forced switch): it is kept instead and reopened only when a job names
    another segment. A kept descriptor also sees every writeback error of the
    file since it was opened, as ``fdatasync`` must. Segment paths are never
    reused (sequence numbers only grow), so a path names one file for good; the
    descriptor of a segment deleted meanwhile only keeps its blocks until the
    next segment's job or :meth:`close`. Used by one thread at a time.
    """

    __slots__ = ("path", "fd")

    def __init__(self):
        self.path = None
        self.fd = -1

    def descriptor(self, path: str) -> int:
        """A descriptor of ``path`` (OSError if it cannot be opened)."""
        if path != self.path:
            self.close()
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self.path = path
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd, self.path = self.fd, -1, None
            os.close(fd)


class SyncJob:
    """One group commit handed to a sync thread (see :meth:`Journal.begin_sync`).

    It names the segment by path and syncs it through a descriptor of its own
    (or of the thread's :class:`SyncFile`), so a segment roll on the journal's
    thread meanwhile cannot close the descriptor under it. ``fdatasync`` flushes
    the file's dirty pages: the records the journal pwrote before handing the job
    over.

    A direct write (:meth:`direct`) reads the journal's memory (the segment's
    window) until it completes, so the journal must know, before it writes those
    blocks again, moves them (a slide) or unmaps the window, whether it will
    still run. It is started
    exactly once, by whoever *claims* it first: :meth:`run` (the sync thread's,
    or the journal's own when it finds the write not started, ``Journal._drain``),
    :meth:`started` (a submit to Linux AIO), or :meth:`cancel` (a close after a
    failure: then it never runs). A job handed to a thread that never takes it
    (a failure path, a test that runs no thread) is therefore never waited for
    in vain: the journal runs it or cancels it.
    """

    __slots__ = ("path", "directory", "seq", "end", "records", "bytes", "error", "seconds",
                 "fd", "offset", "parts", "done", "waiter", "_claim")

    def __init__(self, path, directory, seq, end, records, nbytes):
        self.path = path
        self.directory = directory
        self.seq = seq
        self.end = end
        self.records = records
        self.bytes = nbytes
        self.error: BaseException | None = None
        self.seconds = 0.0       # how long the disk took (run's own time, no hand-off)
        self.parts = None        # a direct write: [(address, view)] of whole blocks
        self.done = None         # (direct) set once its write completed, on any thread
        self.waiter = None       # (direct, through AIO) waiter(job, timeout): reaps it
        self._claim = None       # (direct) held by whoever started it (or cancelled it)

    def direct(self, fd: int, offset: int, parts: list) -> None:
        """Make this job a direct write (``O_DIRECT`` descriptor ``fd``, at ``offset``,
        of ``parts``' views, with ``RWF_DSYNC``) instead of an ``fdatasync``: see
        "Direct writes" in the module docstring. Run on the sync thread with
        ``pwritev``, or through Linux AIO from the addresses (``bk.bookie.aiosync``:
        whoever submits it there calls :meth:`started`)."""
        self.fd = fd
        self.offset = offset
        self.parts = parts
        self.done = threading.Event()
        self._claim = threading.Lock()

    def started(self, waiter) -> None:
        """The direct write was submitted elsewhere (Linux AIO); ``waiter(job,
        timeout)`` reaps its completion into the job (sets :attr:`error` and
        :attr:`done`), waiting at most ``timeout`` seconds (None: until it
        completes). Called by the submitter right after a successful submit, on
        the journal's thread, before anything else could claim the job."""
        if not self._claim.acquire(False):
            raise RuntimeError("a direct write submitted twice")
        self.waiter = waiter

    def cancel(self) -> bool:
        """Make sure a direct write nobody started never will (its :attr:`error` says
        so and :attr:`done` is set); True if it is not running now (never started,
        or completed, or not a direct write), False if it has started."""
        if self.done is None or self.done.is_set():
            return True
        if not self._claim.acquire(False):
            return False
        self.error = self.error or OSError(errno.ECANCELED, "the journal closed before "
                                           "this direct write started")
        self.release()
        self.done.set()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a direct write that has started completed (the journal, before
        it writes the same blocks again), at most ``timeout`` seconds; whether it
        did. Only for a started job (see :meth:`Journal._drain`, :meth:`cancel`):
        one nobody starts would never complete."""
        if self.done is None or self.done.is_set():
            return True
        if self.waiter is not None:
            self.waiter(self, timeout)
        else:
            self.done.wait(timeout)
        return self.done.is_set()

    def release(self) -> None:
        if self.parts is not None:
            for _, v in self.parts:
                v.release()
            self.parts = None

    def run(self, keep: SyncFile | None = None) -> None:
        """Blocking; safe on any thread. Never raises: failures land in ``error``.
        With ``keep`` (the calling thread's), the segment's descriptor is kept
        there for the next job instead of being opened and closed for this one.
        A direct write someone else claimed (started, or cancelled) is left to
        them: this returns at once."""
        if self.path is None:
            return
        if self._claim is not None and not self._claim.acquire(False):
            return
        t0 = time.monotonic()
        try:
            if self.parts is not None:
                views = [v for _, v in self.parts]
                n = sum(len(v) for v in views)
                got = os.pwritev(self.fd, views, self.offset, os.RWF_DSYNC)
                if got != n:
                    raise OSError(errno.EIO, f"short direct write: {got} of {n} bytes")
            elif keep is not None:
                os.fdatasync(keep.descriptor(self.path))
            else:
                fd = os.open(self.path, os.O_RDONLY)
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
            if self.directory:
                _fsync_dir(self.directory)
        except OSError as e:
            self.error = e
        self.seconds = time.monotonic() - t0
        if self.done is not None:
            self.done.set()


def iter_records(journal_dir: str, start_mark=None) -> Iterator[Record]:
    """Decode the records of a journal directory, read-only (for the admin shell).

    Starts at ``start_mark`` (``"seq:offset"`` or a pair; default: the first
    segment) and stops at the end of the data or at the first bad record,
    which is logged but never truncated.
    """
    files = _list_segment_files(journal_dir)
    if start_mark is not None:
        start_seq, off = parse_mark(start_mark)
    else:
        start_seq, off = (files[0][0] if files else 0), HEADER_SIZE
    for i, (seq, path) in enumerate(files):
        if seq < start_seq:
            continue
        mm, size = _map(path, writable=False)
        if mm is None:
            _check_header(path, b"", seq, size)
        mv = memoryview(mm)
        try:
            _check_header(path, mm, seq, size)
            base = seq << 32
            for roff, n, rtype, fields in _scan(mv, size, off if seq == start_seq else HEADER_SIZE,
                                                True):
                if rtype is None:
                    if fields != _END:
                        log.warning("journal %s: bad record at offset %d of %s (%s); stopping",
                                    journal_dir, roff, path, fields)
                        return
                    break
                yield Record(base | roff, seq, roff, n, rtype, fields)
        finally:
            mv.release()
            mm.close()


def journal_disk_usage(journal_dir: str) -> int:
    """Bytes of the segment files of a journal directory (without opening it)."""
    return sum(os.path.getsize(p) for _, p in _list_segment_files(journal_dir))
