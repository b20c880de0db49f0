"""Sans-IO wire codec of the bookie protocol.

Theory of operation
-------------------
A frame is a 4-byte big-endian body length followed by one msgpack body. The
body is a msgpack *array* (positional fields, cheaper than maps on the hot
path). Every request starts with ``[op, request_id, ...]`` and every response
with ``[op, request_id, status, ...]``; the response echoes the request id so a
connection can pipeline many requests and match answers out of order.

The layouts, one per op (``->`` separates request from response)::

    HELLO        [op, rid, version, shard, hello_flags]
              -> [op, rid, status, version, num_shards, bookie_id, features, reason]
    AUTH         [op, rid, token]        -> [op, rid, status, role or reason]
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
    ADD_BATCH    [op, rid, master_key, flags, count, records]
              -> (group acknowledgement, see below) [op, rid, status, acked, errors]
    READ_RANGE   [op, rid, ledger, first, last, max_bytes, flags, master_key, stride, offset]
              -> [op, rid, status, ledger, next, entries, bookie_lac]

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
* HELLO's answer may carry a 7th field, ``features``, a bitmask of what the
  bookie takes besides the ops above: ``FEATURE_ADD_BATCH`` (ADD_BATCH and
  its group acknowledgements) and ``FEATURE_READ_RANGE``. A peer that does not
  announce a feature is never sent it: a client talks to an older bookie with
  single ADDs and READs, and an older client simply never sends the new ops.
* HELLO: the client sends it first on a new connection and waits for the
  answer before sending anything else. ``shard`` names the shard worker the
  connection is for (``-1``: any, served by shard 0). The arbiter reads exactly
  this one frame and hands the socket to that worker, which answers it. HELLO
  carries no secret: ``hello_flags`` holds ``HELLO_START_TLS`` when the client
  will run a TLS handshake right after the answer (BookKeeper's START_TLS). A
  bookie that requires TLS refuses a plaintext HELLO, and one without a
  certificate refuses START_TLS, with ESECURITY and a ``reason``; a bookie with
  TLS announces ``FEATURE_TLS``, one that checks identities ``FEATURE_AUTH``.
* AUTH: sent after HELLO (and after the TLS handshake, if any) when the bookie
  announced ``FEATURE_AUTH``, and always after a TLS handshake (its answer is
  where a certificate refused by the bookie shows). ``token`` is a signed token
  or None; the answer names the role, or is EAUTH with the reason, and the
  bookie closes the connection. Until AUTH succeeded a bookie that checks
  identities serves nothing else; after it, only the ops of the role.

Batched adds
------------
ADD_BATCH carries ``count`` entries of one or more ledgers of one shard that
share a master key and flags. ``records`` is ONE msgpack bin holding the
entries back to back, each a little-endian binary record::

    plen:u32  ledger:i64  entry:i64  lac:i64  dlen:u16  digest[dlen]  payload[plen]

Everything after ``plen`` is byte for byte the body of the journal's ADD
record (``bk.bookie.journal``), so a bookie appends each entry from the
received frame with one copy, and a client sends each entry as two buffers
(its 30-byte head with the digest, made once when the entry is signed, and
the caller's payload object) in a ``sendmsg`` without joining them. A record
that runs past the bin, a negative id, a count that does not match, or a count over
``MAX_BATCH_ENTRIES`` is a protocol error (the connection is closed). A bookie
checks each record as it appends it (one pass over the batch), so the entries
before a malformed record may be in its journal; none of them is acknowledged.
A bookie's :class:`FrameBuffer` (``views``) does not let msgpack copy a large
ADD_BATCH's records out of the received bytes: it reads the head as
:func:`add_batch_head` frames it and hands the records on as a view of its
buffer, which the worker journals before it reads more.

A bookie does not answer ADD_BATCH frame by frame: after the group commit
that made them durable, it sends each connection ONE group acknowledgement
(op ADD_BATCH, the rid of the last batch it covers, status EOK) for every
batched entry of that group the connection carried. ``acked`` is a flat list
of runs ``[ledger, first, last, ledger, first, last, ...]`` (inclusive);
``errors`` a flat list ``[ledger, entry, status, ...]`` naming only the
entries that failed (EFENCED, EUA, EBADREQ, EREADONLY, EIO), so a fenced
ledger rejects every entry of a batch that arrives after the fence, one by
one, while recovery adds (FLAG_RECOVERY) still go in. A client therefore
matches batched adds by (ledger, entry), not by request id. A read-only bookie
answers a batch at once, every entry in ``errors``.

Range reads
-----------
READ_RANGE asks for the entries ``first..last`` of a ledger whose id is
``offset`` modulo ``stride`` (``stride`` 1: all; a client reading a striped
ensemble asks each bookie for the entries it is the first replica of). The
answer holds them as a flat list ``[entry, entry_lac, digest, payload, ...]``
in entry order, entries the bookie lacks skipped, and ``next``: the first entry
id it did not look at (it stops after ``max_bytes`` of payload, at least one
entry, or at ``last``). ``FLAG_FENCE`` fences the ledger first (durably, before
answering), as for READ.

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
ADD_BATCH = 8
READ_RANGE = 9
AUTH = 10

OP_NAMES = {
    HELLO: "HELLO", ADD: "ADD", READ: "READ", READ_LAC: "READ_LAC",
    WRITE_LAC: "WRITE_LAC", GET_BOOKIE_INFO: "GET_BOOKIE_INFO",
    GET_LIST_OF_ENTRIES: "GET_LIST_OF_ENTRIES", PING: "PING", ADD_BATCH: "ADD_BATCH",
    READ_RANGE: "READ_RANGE", AUTH: "AUTH",
}

# features a bookie announces in its HELLO answer (7th field)
FEATURE_ADD_BATCH = 1
FEATURE_READ_RANGE = 2
FEATURES = FEATURE_ADD_BATCH | FEATURE_READ_RANGE
FEATURE_TLS = 4        # the bookie offers TLS (HELLO_START_TLS)
FEATURE_AUTH = 8       # the bookie checks identities: AUTH comes next

# hello_flags (5th field of HELLO)
HELLO_START_TLS = 1
MAX_BATCH_ENTRIES = 1 << 16

# flags
FLAG_RECOVERY = 1      # ADD: recovery write, allowed on a fenced ledger
FLAG_FENCE = 1         # READ / READ_LAC: fence the ledger first
FLAG_LONG_POLL = 2     # READ: wait for the LAC to pass previous_lac

# Number of fields of each request, op and request id included.
REQUEST_ARITY = {
    HELLO: 5, ADD: 9, READ: 8, READ_LAC: 5, WRITE_LAC: 5,
    GET_BOOKIE_INFO: 2, GET_LIST_OF_ENTRIES: 3, PING: 2, ADD_BATCH: 6, READ_RANGE: 10,
    AUTH: 3,
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


IN_PLACE_MIN = 8192    # frames from this size decode an ADD_BATCH's records in place
_UINTS = {0xCC: struct.Struct(">B"), 0xCD: struct.Struct(">H"), 0xCE: struct.Struct(">I"),
          0xCF: struct.Struct(">Q")}
_BIN32_LEN = struct.Struct(">I")


def _add_batch_in_place(mv, a: int, e: int):
    """The ADD_BATCH body ``mv[a:e]`` framed as :func:`add_batch_head` frames it
    (a 6-array of non-negative ints, a bin8 or nil key, then the records as one
    bin32): ``[op, rid, key, flags, count, records]`` with ``records`` a view of
    ``mv`` -- msgpack would copy them into a bytes (~0.28 µs an entry of 1 KiB,
    measured in a worker). None for any other framing, which the caller
    decodes the general way. The view is valid until the buffer takes more
    bytes: the worker's dispatch journals the records at once."""
    i = a + 2                               # after the array header and the op
    vals = [ADD_BATCH]
    for _ in range(4):                      # rid, key, flags, count
        if i >= e:
            return None
        t = mv[i]
        if t < 0x80:
            vals.append(t)
            i += 1
        elif t == 0xC4:
            k = i + 2 + mv[i + 1]
            if k > e:
                return None
            vals.append(bytes(mv[i + 2:k]))
            i = k
        elif t == 0xC0:
            vals.append(None)
            i += 1
        else:
            st = _UINTS.get(t)
            if st is None or i + 1 + st.size > e:
                return None
            vals.append(st.unpack_from(mv, i + 1)[0])
            i += 1 + st.size
    if i + 5 > e or mv[i] != 0xC6 or i + 5 + _BIN32_LEN.unpack_from(mv, i + 1)[0] != e:
        return None
    vals.append(mv[i + 5:e])
    return vals


class FrameBuffer:
    """Accumulates bytes from a stream and yields decoded frame bodies.

    Bytes come in by ``feed(data)``, or without a copy by receiving straight
    into the buffer: ``view = recv_buffer(n)`` is a writable memoryview of ``n``
    free bytes (``sock.recv_into(view)``), and ``commit(k)`` takes the ``k``
    bytes received. Iterating ``frames()`` yields each complete body as a list,
    decoded in place. With ``views`` (a bookie's connections), the records of
    an ADD_BATCH of :data:`IN_PLACE_MIN` bytes or more come as a memoryview of
    the buffer (no copy), valid only until the buffer next takes bytes
    (``feed``, ``recv_buffer``): the consumer must be done with them by then. An announced length over ``max_frame_size`` or an
    undecodable body raises :class:`ProtocolError`; the connection must then be
    closed. The buffer is reused: consumed bytes are dropped by moving the
    unread tail to its front, and it only grows for a frame larger than itself.
    """

    __slots__ = ("_buf", "_mv", "_pos", "_end", "_cap", "max_frame_size", "views")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, capacity: int = 1 << 18,
                 views: bool = False):
        self.views = views
        self._cap = capacity
        self._buf = bytearray(capacity)
        self._mv = memoryview(self._buf)
        self._pos = 0
        self._end = 0
        self.max_frame_size = max_frame_size

    def _room(self, n: int) -> None:
        pos, end = self._pos, self._end
        if pos == end:
            self._pos = self._end = pos = end = 0
            if len(self._buf) > 16 * self._cap and n <= self._cap:  # back from a large frame
                self._buf = bytearray(self._cap)
                self._mv = memoryview(self._buf)
        size = len(self._buf)
        if size - end >= n:
            return
        live = end - pos
        if live + n <= size:
            self._mv[0:live] = self._mv[pos:end]       # memmove of the unread tail
        else:
            buf = bytearray(max(live + n, size * 2))
            buf[:live] = self._mv[pos:end]
            self._buf = buf
            self._mv = memoryview(buf)
        self._pos, self._end = 0, live

    def feed(self, data) -> None:
        n = len(data)
        self._room(n)
        end = self._end
        self._mv[end:end + n] = data
        self._end = end + n

    def recv_buffer(self, n: int) -> memoryview:
        """A writable view of ``n`` free bytes at the end of the data (see commit)."""
        self._room(n)
        return self._mv[self._end:self._end + n]

    def commit(self, k: int) -> None:
        """Take ``k`` bytes written into the last :meth:`recv_buffer` view."""
        self._end += k

    @property
    def pending(self) -> int:
        """Bytes received but not yet returned as frames."""
        return self._end - self._pos

    def frames(self):
        unpack_len = _LEN.unpack_from
        limit = self.max_frame_size
        in_place = IN_PLACE_MIN if self.views else 1 << 62
        while True:
            # Re-read after every yield: the consumer may have fed more meanwhile.
            pos, end, mv = self._pos, self._end, self._mv
            if end - pos < 4:
                return
            (n,) = unpack_len(mv, pos)
            if n > limit:
                raise ProtocolError(f"frame of {n} bytes exceeds the limit of {limit}")
            if n == 0:
                raise ProtocolError("empty frame")
            if end - pos - 4 < n:
                return
            # Decode straight out of the buffer (no copy of the body); a large
            # ADD_BATCH keeps its records there too (see _add_batch_in_place).
            msg = None
            if n >= in_place and mv[pos + 4] == 0x96 and mv[pos + 5] == ADD_BATCH:
                msg = _add_batch_in_place(mv, pos + 4, pos + 4 + n)
            if msg is None:
                try:
                    msg = _unpackb(mv[pos + 4:pos + 4 + n], raw=False, use_list=True,
                                   strict_map_key=False)
                except Exception as e:  # msgpack raises several unrelated types
                    raise ProtocolError(f"undecodable frame: {e}") from None
            if type(msg) is not list or not msg:
                raise ProtocolError(f"frame body is not a non-empty array: "
                                    f"{type(msg).__name__}")
            self._pos = pos + 4 + n
            yield msg


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

def hello(rid: int, shard: int, start_tls: bool = False) -> list:
    return [HELLO, rid, PROTOCOL_VERSION, shard, HELLO_START_TLS if start_tls else 0]


def auth(rid: int, token: str | None) -> list:
    return [AUTH, rid, token]


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


# --- batched adds -------------------------------------------------------------

_REC = struct.Struct("<IqqqH")       # plen, ledger, entry, lac, dlen: the head of a record
REC_HEAD = _REC.size                 # 30 bytes; the journal body starts at offset 4
_unpack_rec = _REC.unpack_from
unpack_record_head = _REC.unpack_from  # (buf, offset=0) -> (plen, ledger, entry, lac, dlen)
_BIN32 = struct.Struct(">BI")


def add_record_struct(dlen: int) -> struct.Struct:
    """The struct packing a record's head and its ``dlen``-byte digest in one call:
    ``pack(plen, ledger, entry, lac, dlen, digest)`` (the payload follows it)."""
    return struct.Struct(f"<IqqqH{dlen}s")


def add_record_head(ledger: int, entry: int, lac: int, digest: bytes, plen: int) -> bytes:
    """The head of one ADD_BATCH record (the payload of ``plen`` bytes follows)."""
    return _REC.pack(plen, ledger, entry, lac, len(digest)) + digest


def add_batch_head(rid: int, master_key: bytes, flags: int, count: int, nbytes: int) -> bytes:
    """Length prefix and msgpack head of an ADD_BATCH frame whose ``count`` records
    take ``nbytes``: the records follow it as they are (``sendmsg``)."""
    head = _packb([ADD_BATCH, rid, master_key, flags, count])
    # [op, rid, key, flags, count] as a 6-array, then the bin32 header of the records.
    body_len = len(head) + 5 + nbytes
    return _LEN.pack(body_len) + b"\x96" + head[1:] + _BIN32.pack(0xC6, nbytes)


def encode_add_batch(rid: int, master_key: bytes, flags: int, entries) -> bytes:
    """A whole ADD_BATCH frame of ``entries``: (ledger, entry, lac, digest, payload)."""
    parts = []
    for ledger, entry, lac, digest, payload in entries:
        parts.append(add_record_head(ledger, entry, lac, digest, len(payload)))
        parts.append(payload)
    records = b"".join(parts)
    return add_batch_head(rid, master_key, flags, len(entries), len(records)) + records


def split_add_batch(records, count: int) -> list:
    """Check an ADD_BATCH's records and locate them: a list of ``(ledger, entry,
    lac, start, end)`` where ``records[start:end]`` is the journal body of the
    entry (ledger .. payload). Raises ProtocolError for a truncated record, a
    count that does not match, too many entries, or a negative id."""
    if type(count) is not int or not 0 < count <= MAX_BATCH_ENTRIES:
        raise ProtocolError(f"ADD_BATCH with a bad entry count {count!r} "
                            f"(1..{MAX_BATCH_ENTRIES})")
    if type(records) is not bytes and type(records) is not memoryview:
        raise ProtocolError("ADD_BATCH records are not a bin")
    size = len(records)
    out = []
    append = out.append
    off = 0
    try:
        for _ in range(count):
            plen, ledger, entry, lac, dlen = _unpack_rec(records, off)
            end = off + REC_HEAD + dlen + plen
            if end > size:
                raise ProtocolError(f"ADD_BATCH record {len(out)} is truncated: it needs "
                                    f"{end - off} bytes, {size - off} are left")
            if ledger < 0 or entry < 0:
                raise ProtocolError(f"ADD_BATCH record {len(out)} has a negative ledger or "
                                    f"entry id")
            append((ledger, entry, lac, off + 4, end))
            off = end
    except struct.error:
        raise ProtocolError(f"ADD_BATCH record {len(out)} is truncated: {size - off} bytes "
                            f"left for a {REC_HEAD}-byte head") from None
    if off != size:
        raise ProtocolError(f"ADD_BATCH announces {count} entries but carries "
                            f"{size - off} more bytes")
    return out


def decode_add_batch(records, count: int) -> list:
    """The entries of an ADD_BATCH: a list of (ledger, entry, lac, digest, payload)."""
    out = []
    for ledger, entry, lac, start, end in split_add_batch(records, count):
        (dlen,) = struct.unpack_from("<H", records, start + 24)
        d = start + 26
        out.append((ledger, entry, lac, bytes(records[d:d + dlen]),
                    bytes(records[d + dlen:end])))
    return out


def add_ack(rid: int, acked: list, errors: list) -> list:
    """A group acknowledgement: runs ``[ledger, first, last, ...]`` and errors
    ``[ledger, entry, status, ...]``."""
    return [ADD_BATCH, rid, 0, acked, errors]


def ack_run(acked: list, ledger: int, entry: int) -> None:
    """Add ``entry`` of ``ledger`` to the runs of a group acknowledgement."""
    if acked and acked[-1] == entry - 1 and acked[-3] == ledger:
        acked[-1] = entry
    else:
        acked += (ledger, entry, entry)


def check_add_ack(msg: list) -> None:
    """Validate a group acknowledgement's shape (a client's check)."""
    if len(msg) != 5 or type(msg[3]) is not list or type(msg[4]) is not list \
            or len(msg[3]) % 3 or len(msg[4]) % 3:
        raise ProtocolError("malformed ADD_BATCH acknowledgement")


def read_range(rid, ledger, first, last, max_bytes, fence=False, master_key=None,
               stride=1, offset=0) -> list:
    return [READ_RANGE, rid, ledger, first, last, max_bytes, FLAG_FENCE if fence else 0,
            master_key, stride, offset]
