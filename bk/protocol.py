"""Sans-IO wire codec of the bookie protocol.

Theory of operation
-------------------
A frame is a 4-byte big-endian body length followed by one msgpack body. The
body is a msgpack *array* (positional fields, cheaper than maps on the hot
path). Every request starts with ``[op, request_id, ...]`` and every response
with ``[op, request_id, status, ...]``; the response echoes the request id so a
connection can pipeline many requests and match answers out of order.

The layouts, one per op (``->`` separates request from response)::

    HELLO        [op, rid, version, shard, auth_token]
              -> [op, rid, status, version, num_shards, bookie_id]
    ADD          [op, rid, ledger, entry, lac, master_key, flags, digest, payload]
              -> [op, rid, status, ledger, entry]
    READ         [op, rid, ledger, entry, flags, master_key, previous_lac, timeout_ms]
              -> [op, rid, status, ledger, entry, entry_lac, digest, payload, bookie_lac]
    READ_LAC     [op, rid, ledger, flags, master_key]
              -> [op, rid, status, ledger, lac, last_entry]
    WRITE_LAC    [op, rid, ledger, master_key, lac]
              -> [op, rid, status, ledger]
    GET_BOOKIE_INFO     [op, rid]        -> [op, rid, status, info_map]
    GET_LIST_OF_ENTRIES [op, rid, ledger] -> [op, rid, status, ledger, ranges]
    PING         [op, rid]               -> [op, rid, status]

* ``flags`` of ADD: ``FLAG_RECOVERY`` (recovery write, accepted on a fenced
  ledger). ``flags`` of READ / READ_LAC: ``FLAG_FENCE`` (fence the ledger,
  durably, before answering) and, for READ, ``FLAG_LONG_POLL`` (wait until the
  bookie's LAC passes ``previous_lac`` or ``timeout_ms`` elapses, then answer
  with ``bookie_lac`` and the entry if the bookie has it, else entry fields
  ``None`` with status EOK).
* ``digest`` is opaque to the bookie: it stores it with the entry and returns
  it on READ. The client puts the ledger's cumulative length after this entry
  (8 bytes, big-endian) followed by the checksum of (ledger, entry, lac,
  length, payload) under the ledger's digest type.
* ``master_key`` is the digest of the ledger password (never the password);
  ``None`` where no key is needed (plain reads).
* ``ranges`` is a flat list ``[first, last, first, last, ...]`` of inclusive
  runs of entry ids the bookie holds.
* HELLO: the client sends it first on a new connection and waits for the
  answer before sending anything else. ``shard`` names the shard worker the
  connection is for (``-1``: any, served by shard 0). The arbiter reads exactly
  this one frame and hands the socket to that worker, which answers it.

The codec never touches a socket: :func:`encode_frame` makes bytes and
:class:`FrameBuffer` takes bytes in and gives decoded bodies out.
"""

from __future__ import annotations

import struct

import msgpack

from bk.errors import ProtocolError

# 2: ledgers map to shards by shard_of() (1 used ledger_id % shards); a peer of
# another version is refused at HELLO rather than sent to the wrong shard.
PROTOCOL_VERSION = 2
DEFAULT_MAX_FRAME_SIZE = 5 * 1024 * 1024  # like nettyMaxFrameSizeBytes

_MIX = 0x9E3779B97F4A7C15   # 2**64 / golden ratio (Fibonacci hashing)
_MASK64 = (1 << 64) - 1


def shard_of(ledger_id: int, num_shards: int) -> int:
    """The shard of a bookie that owns ``ledger_id``: a multiplicative hash of the
    id, so consecutive or same-parity ids spread over the shards (``id % n`` put
    every other id on one shard when ids grow in even steps)."""
    return (((ledger_id * _MIX) & _MASK64) >> 32) % num_shards

# ops
HELLO = 0
ADD = 1
READ = 2
READ_LAC = 3
WRITE_LAC = 4
GET_BOOKIE_INFO = 5
GET_LIST_OF_ENTRIES = 6
PING = 7

OP_NAMES = {
    HELLO: "HELLO", ADD: "ADD", READ: "READ", READ_LAC: "READ_LAC",
    WRITE_LAC: "WRITE_LAC", GET_BOOKIE_INFO: "GET_BOOKIE_INFO",
    GET_LIST_OF_ENTRIES: "GET_LIST_OF_ENTRIES", PING: "PING",
}

# flags
FLAG_RECOVERY = 1      # ADD: recovery write, allowed on a fenced ledger
FLAG_FENCE = 1         # READ / READ_LAC: fence the ledger first
FLAG_LONG_POLL = 2     # READ: wait for the LAC to pass previous_lac

# Number of fields of each request, op and request id included.
REQUEST_ARITY = {
    HELLO: 5, ADD: 9, READ: 8, READ_LAC: 5, WRITE_LAC: 5,
    GET_BOOKIE_INFO: 2, GET_LIST_OF_ENTRIES: 3, PING: 2,
}

_LEN = struct.Struct(">I")
_packb = msgpack.Packer(use_bin_type=True).pack
_unpackb = msgpack.unpackb


def encode_frame(body) -> bytes:
    """Encode one message (a list) as a length-prefixed frame."""
    data = _packb(body)
    return _LEN.pack(len(data)) + data


def decode_body(data) -> list:
    """Decode one frame body; raise ProtocolError if it is not a msgpack array."""
    try:
        msg = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable frame: {e}") from None
    if type(msg) is not list or not msg:
        raise ProtocolError(f"frame body is not a non-empty array: {type(msg).__name__}")
    return msg


class FrameBuffer:
    """Accumulates bytes from a stream and yields decoded frame bodies.

    ``feed(data)`` appends; iterating ``frames()`` yields each complete body as a
    list. An announced length over ``max_frame_size`` or an undecodable body
    raises :class:`ProtocolError`; the connection must then be closed.
    """

    __slots__ = ("_buf", "_pos", "max_frame_size")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE):
        self._buf = bytearray()
        self._pos = 0
        self.max_frame_size = max_frame_size

    def feed(self, data) -> None:
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        self._buf += data

    @property
    def pending(self) -> int:
        """Bytes received but not yet returned as frames."""
        return len(self._buf) - self._pos

    def frames(self):
        buf = self._buf
        pos = self._pos
        end = len(buf)
        unpack_len = _LEN.unpack_from
        limit = self.max_frame_size
        try:
            while end - pos >= 4:
                (n,) = unpack_len(buf, pos)
                if n > limit:
                    raise ProtocolError(f"frame of {n} bytes exceeds the limit of {limit}")
                if n == 0:
                    raise ProtocolError("empty frame")
                if end - pos - 4 < n:
                    break
                # Decode straight out of the buffer (no copy of the body); the view is
                # released before yielding so the consumer may feed() again.
                with memoryview(buf) as mv:
                    try:
                        msg = _unpackb(mv[pos + 4:pos + 4 + n], raw=False, use_list=True,
                                       strict_map_key=False)
                    except Exception as e:  # msgpack raises several unrelated types
                        raise ProtocolError(f"undecodable frame: {e}") from None
                if type(msg) is not list or not msg:
                    raise ProtocolError(f"frame body is not a non-empty array: "
                                        f"{type(msg).__name__}")
                pos += 4 + n
                self._pos = pos
                yield msg
        finally:
            self._pos = pos
            # Compact once the consumed prefix dominates, so the buffer does not grow.
            if pos > 65536 and pos * 2 > len(buf):
                del buf[:pos]
                self._pos = 0


def check_request(msg: list) -> int:
    """Validate the shape of a request; return its op or raise ProtocolError."""
    op = msg[0]
    arity = REQUEST_ARITY.get(op) if type(op) is int else None
    if arity is None:
        raise ProtocolError(f"unknown op {op!r}")
    if len(msg) != arity:
        raise ProtocolError(f"{OP_NAMES[op]} request has {len(msg)} fields, expected {arity}")
    if type(msg[1]) is not int:
        raise ProtocolError(f"{OP_NAMES[op]} request id is not an integer")
    return op


# --- request builders (lists; pass to encode_frame) -------------------------

def hello(rid: int, shard: int, auth_token: str | None = None) -> list:
    return [HELLO, rid, PROTOCOL_VERSION, shard, auth_token]


def add(rid, ledger, entry, lac, master_key, digest, payload, recovery=False) -> list:
    return [ADD, rid, ledger, entry, lac, master_key,
            FLAG_RECOVERY if recovery else 0, digest, payload]


def read(rid, ledger, entry, fence=False, master_key=None,
         long_poll=False, previous_lac=-1, timeout_ms=0) -> list:
    flags = (FLAG_FENCE if fence else 0) | (FLAG_LONG_POLL if long_poll else 0)
    return [READ, rid, ledger, entry, flags, master_key, previous_lac, timeout_ms]


def read_lac(rid, ledger, fence=False, master_key=None) -> list:
    return [READ_LAC, rid, ledger, FLAG_FENCE if fence else 0, master_key]


def write_lac(rid, ledger, master_key, lac) -> list:
    return [WRITE_LAC, rid, ledger, master_key, lac]


def get_bookie_info(rid) -> list:
    return [GET_BOOKIE_INFO, rid]


def get_list_of_entries(rid, ledger) -> list:
    return [GET_LIST_OF_ENTRIES, rid, ledger]


def ping(rid) -> list:
    return [PING, rid]


def ranges_to_ids(ranges) -> list[int]:
    """Expand the flat ``[first, last, ...]`` runs of GET_LIST_OF_ENTRIES."""
    out: list[int] = []
    for i in range(0, len(ranges), 2):
        out.extend(range(ranges[i], ranges[i + 1] + 1))
    return out


def ids_to_ranges(ids) -> list[int]:
    """Compress sorted entry ids into flat inclusive runs."""
    out: list[int] = []
    for e in ids:
        if out and out[-1] == e - 1:
            out[-1] = e
        else:
            out.extend((e, e))
    return out
