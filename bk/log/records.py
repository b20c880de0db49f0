"""Record sets and positions of a log (sans-IO: bytes in, bytes out, no sockets).

A log writer packs several records into one ledger entry, a *record set*::

    header  version (1 byte) | flags (1 byte) | count (u32) | records_before (u64)
            | bytes_before (u64)
    count x length (u32) | data

``records_before`` / ``bytes_before`` are the number and total size of the
records of the same segment in earlier entries. They make the last entry of a
segment enough to know the segment's totals, so a new writer that fences a
crashed writer's ledger can close the segment in the log record without
reading the whole ledger.

:class:`Position` ``(segment, entry_id, slot)`` names one record: the log's
segment number (never reused), the entry id in that segment's ledger, and the
record's index in the entry's record set.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

VERSION = 1
_HEADER = struct.Struct(">BBIQQ")
_LEN = struct.Struct(">I")
HEADER_SIZE = _HEADER.size           # 22
END_OF_SEGMENT = 0x01
RECORD_OVERHEAD = _LEN.size          # 4 per record
MAX_NAME_BYTES = 200


class RecordSetError(ValueError):
    """An entry's payload is not a well-formed record set."""


class Position(NamedTuple):
    """Where a record is: ``(segment, entry_id, slot)``, ordered as a tuple."""

    segment: int
    entry_id: int
    slot: int

    def __str__(self) -> str:
        return f"{self.segment}:{self.entry_id}:{self.slot}"

    @classmethod
    def parse(cls, text) -> "Position":
        """``Position.parse("3:17:0")``; a Position is returned as is."""
        if isinstance(text, Position):
            return text
        if isinstance(text, tuple) and len(text) == 3:
            parts = list(text)
        else:
            if not isinstance(text, str):
                raise ValueError(f"position {text!r}: expected 'segment:entry:slot'")
            parts = text.strip().split(":")
        if len(parts) != 3:
            raise ValueError(f"position {text!r}: expected 'segment:entry:slot'")
        try:
            nums = [int(p) for p in parts]
        except (TypeError, ValueError):
            raise ValueError(f"position {text!r}: segment, entry and slot must be integers") \
                from None
        if any(n < 0 for n in nums):
            raise ValueError(f"position {text!r}: parts must not be negative")
        return cls(*nums)


class LogRecord(NamedTuple):
    """One record read from a log: its :class:`Position` and its bytes."""

    position: Position
    data: bytes


class RecordSet(NamedTuple):
    """A decoded entry: the records and the segment totals before it."""

    records: list
    records_before: int
    bytes_before: int
    flags: int = 0

    @property
    def end_of_segment(self) -> bool:
        return bool(self.flags & END_OF_SEGMENT)

    @property
    def records_after(self) -> int:
        return self.records_before + len(self.records)

    @property
    def bytes_after(self) -> int:
        return self.bytes_before + sum(len(r) for r in self.records)


def encoded_size(record_lengths_total: int, count: int) -> int:
    """Size of a record set holding ``count`` records of ``record_lengths_total`` bytes."""
    return HEADER_SIZE + count * RECORD_OVERHEAD + record_lengths_total


def encode_record_set(records, records_before: int = 0, bytes_before: int = 0,
                      flags: int = 0) -> bytes:
    """The entry payload for ``records`` (a sequence of bytes)."""
    parts = [_HEADER.pack(VERSION, flags, len(records), records_before, bytes_before)]
    pack = _LEN.pack
    for r in records:
        parts.append(pack(len(r)))
        parts.append(r)
    return b"".join(parts)


def decode_record_set(payload) -> RecordSet:
    """Decode an entry payload; RecordSetError if it is truncated or malformed."""
    mv = memoryview(payload)
    n = len(mv)
    if n < HEADER_SIZE:
        raise RecordSetError(f"record set of {n} bytes is shorter than its header")
    version, flags, count, before, bytes_before = _HEADER.unpack_from(mv, 0)
    if version != VERSION:
        raise RecordSetError(f"record set version {version} is not supported")
    if count > (n - HEADER_SIZE) // RECORD_OVERHEAD:
        raise RecordSetError(f"record set claims {count} records in {n} bytes")
    out = []
    off = HEADER_SIZE
    unpack = _LEN.unpack_from
    for i in range(count):
        if off + RECORD_OVERHEAD > n:
            raise RecordSetError(f"record set truncated at record {i}")
        (ln,) = unpack(mv, off)
        off += RECORD_OVERHEAD
        if off + ln > n:
            raise RecordSetError(f"record {i} of {ln} bytes runs past the record set's end")
        out.append(bytes(mv[off:off + ln]))
        off += ln
    if off != n:
        raise RecordSetError(f"{n - off} trailing bytes after {count} records")
    return RecordSet(out, before, bytes_before, flags)


def check_log_name(name) -> str:
    """Return ``name`` if it can name a log, else ValueError naming it."""
    if not isinstance(name, str):
        raise ValueError(f"log name {name!r}: must be a string")
    if not name:
        raise ValueError("log name '': must not be empty")
    if "/" in name:
        raise ValueError(f"log name {name!r}: must not contain '/'")
    if name in (".", ".."):
        raise ValueError(f"log name {name!r}: '.' and '..' are reserved")
    if any(ord(ch) < 32 or 0x7f <= ord(ch) < 0xa0 for ch in name):
        raise ValueError(f"log name {name!r}: must not contain control characters")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"log name {name!r}: not encodable as UTF-8") from None
    if size > MAX_NAME_BYTES:
        raise ValueError(f"log name {name[:40]!r}...: {size} bytes, over the limit of "
                         f"{MAX_NAME_BYTES}")
    return name
