"""Passwords, master keys and entry digests (sans-IO).

Three values are derived from a ledger password, each for its own purpose, so
that none of them reveals another:

* the **master key** (:func:`master_key`) travels in ADD and fencing requests;
  a bookie remembers it per ledger and answers EUA to any other key;
* the **password digest** (:func:`password_digest`) is stored in the ledger
  metadata, salted, so that a client refuses a wrong password with
  :class:`BadPasswordError` before it touches a bookie;
* the **MAC key** keys the HMAC of the ``"mac"`` digest type.

The password itself is never sent or stored.

The ``digest`` field of an entry is opaque to the bookie. The client stores in
it the ledger's cumulative length after this entry (8 bytes, big-endian)
followed by a checksum of (ledger, entry, lac, length, payload) under the
ledger's digest type: 4 bytes for ``crc32`` and ``crc32c``, 20 for ``mac``
(HMAC-SHA1), none for ``dummy``. The length makes a recovered ledger's length
exact; covering ledger and entry ids catches a misplaced entry.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import zlib

import crc32c as _crc32c

from bk.errors import DigestMismatchError

DIGEST_TYPES = ("crc32", "crc32c", "mac", "dummy")

_HEADER = struct.Struct(">qqqq")     # ledger, entry, lac, length
_LENGTH = struct.Struct(">q")
_CRC_FIELD = struct.Struct(">qI")    # length, crc: the digest field of crc32/crc32c
_SALT_LEN = 16


def master_key(password: bytes) -> bytes:
    """The key bookies check on writes and fencing reads (20 bytes)."""
    return hashlib.sha1(b"bk-master-key\x00" + bytes(password)).digest()


def _mac_key(password: bytes) -> bytes:
    return hashlib.sha1(b"bk-mac-key\x00" + bytes(password)).digest()


def password_digest(password: bytes, salt: bytes | None = None) -> bytes:
    """Salted digest of ``password`` for the ledger metadata (salt + SHA-256)."""
    salt = os.urandom(_SALT_LEN) if salt is None else salt
    return salt + hashlib.sha256(salt + b"bk-password\x00" + bytes(password)).digest()


def password_matches(stored: bytes, password: bytes) -> bool:
    """True if ``password`` produced ``stored``. Metadata without a digest matches any."""
    if not stored:
        return True
    if len(stored) != _SALT_LEN + 32:
        return False
    return hmac.compare_digest(password_digest(password, stored[:_SALT_LEN]), stored)


def check_digest_type(digest_type) -> str:
    if digest_type not in DIGEST_TYPES:
        raise ValueError(f"unknown digest type {digest_type!r}: expected one of "
                         f"{', '.join(DIGEST_TYPES)}")
    return digest_type


class EntryDigest:
    """Signs and verifies the digest field of one ledger's entries.

    ``sign(entry, lac, length, payload)`` returns the digest field for the ADD
    request (an attribute holding a function, not a method: see ``__init__``);
    ``verify(entry, lac, digest, payload)`` returns the cumulative length stored
    in it or raises :class:`DigestMismatchError`.

    ``password=None`` means the password is unknown (an administrator holding
    only the ledger's master key): crc32/crc32c/dummy work as usual, but a
    ``mac`` digest can neither be signed nor its MAC checked, so ``verify``
    only checks the field's shape (``mac_unchecked`` is True) and ``sign``
    raises ValueError.
    """

    __slots__ = ("ledger_id", "digest_type", "_sum_len", "_checksum", "mac_unchecked", "sign",
                 "_crc")

    def __init__(self, ledger_id: int, digest_type: str, password: bytes | None = b""):
        check_digest_type(digest_type)
        self.ledger_id = ledger_id
        self.digest_type = digest_type
        header = _HEADER.pack
        length_pack = _LENGTH.pack
        self.mac_unchecked = False
        # checksum(entry, lac, length, payload) -> the checksum bytes (verify);
        # sign(...) -> the whole digest field. sign is a per-instance closure
        # rather than a method: it runs once per entry written, and the crc
        # variants pack length and checksum with one struct call (the crc32c
        # module's keyword argument parsing alone cost more than the checksum of
        # a 1 KiB payload, hence positional arguments).
        if digest_type == "mac" and password is None:
            self._sum_len = 20
            self.mac_unchecked = True

            def checksum(entry, lac, length, payload):
                raise ValueError(f"ledger {ledger_id}: cannot sign a mac digest without the "
                                 f"password")

            def sign(entry, lac, length, payload):
                return checksum(entry, lac, length, payload)
        elif digest_type in ("crc32c", "crc32"):
            crc = _crc32c.crc32c if digest_type == "crc32c" else zlib.crc32
            field = _CRC_FIELD.pack

            def checksum(entry, lac, length, payload):
                return (crc(payload, crc(header(ledger_id, entry, lac, length)))).to_bytes(4, "big")

            def sign(entry, lac, length, payload):
                return field(length, crc(payload, crc(header(ledger_id, entry, lac, length))))
            self._sum_len = 4
        elif digest_type == "mac":
            base = hmac.new(_mac_key(password), digestmod=hashlib.sha1)

            def checksum(entry, lac, length, payload):
                h = base.copy()
                h.update(header(ledger_id, entry, lac, length))
                h.update(payload)
                return h.digest()

            def sign(entry, lac, length, payload):
                return length_pack(length) + checksum(entry, lac, length, payload)
            self._sum_len = 20
        else:  # dummy
            def checksum(entry, lac, length, payload):
                return b""

            def sign(entry, lac, length, payload):
                return length_pack(length)
            self._sum_len = 0
        self._checksum = checksum
        self.sign = sign
        # no bound method of self is kept on self: that cycle would leave every
        # ledger handle's digest to the cyclic GC instead of its reference count
        self._crc = None
        if digest_type in ("crc32c", "crc32"):
            self._crc = _crc32c.crc32c if digest_type == "crc32c" else zlib.crc32

    def verify_flat(self, entries: list, ok: list, bad: list) -> None:
        """See :meth:`_verify_flat_each`."""
        if self._crc is not None:
            self._verify_flat_crc(entries, ok, bad)
        else:
            self._verify_flat_each(entries, ok, bad)

    def verify_run(self, entries: list, first: int, stride: int, make) -> list | None:
        """See :meth:`_verify_run_each`."""
        if self._crc is not None:
            return self._verify_run_crc(entries, first, stride, make)
        return self._verify_run_each(entries, first, stride, make)

    @property
    def size(self) -> int:
        """Bytes of the digest field of every entry of this ledger."""
        return 8 + self._sum_len

    def verify(self, entry: int, lac: int, digest, payload) -> int:
        what = f"entry {entry} of ledger {self.ledger_id}"
        if type(digest) is not bytes or len(digest) != 8 + self._sum_len:
            raise DigestMismatchError(
                f"{what}: digest field has {len(digest) if isinstance(digest, bytes) else digest!r}"
                f" bytes, expected {8 + self._sum_len} for digest type {self.digest_type}")
        if payload is None:
            raise DigestMismatchError(f"{what}: no payload")
        (length,) = _LENGTH.unpack_from(digest)
        if self.mac_unchecked:
            return length
        expected = self._checksum(entry, lac, length, payload)
        if not hmac.compare_digest(expected, digest[8:]):
            raise DigestMismatchError(f"{what}: {self.digest_type} digest mismatch "
                                      f"(corrupt copy or wrong password)")
        return length


    def _verify_flat_each(self, entries: list, ok: list, bad: list) -> None:
        """Verify a READ_RANGE answer's flat ``[entry, lac, digest, payload, ...]``:
        ``(entry, payload, length)`` of each good entry goes to ``ok`` (flat), each
        bad one's ``(entry, DigestMismatchError)`` to ``bad``."""
        verify = self.verify
        for i in range(0, len(entries), 4):
            e = entries[i]
            try:
                length = verify(e, entries[i + 1], entries[i + 2], entries[i + 3])
            except DigestMismatchError as err:
                bad.append((e, err))
                continue
            ok += (e, entries[i + 3], length)

    def _verify_flat_crc(self, entries: list, ok: list, bad: list) -> None:
        # One struct call and two CRC calls per entry, no string built unless an
        # entry is bad; the four fields come from one iterator zipped with itself
        # (no slice per entry).
        crc = self._crc
        header = _HEADER.pack
        unpack = _CRC_FIELD.unpack
        lid = self.ledger_id
        it = iter(entries)
        for e, lac, digest, payload in zip(it, it, it, it):
            try:
                length, want = unpack(digest)
                if crc(payload, crc(header(lid, e, lac, length))) == want:
                    ok += (e, payload, length)
                    continue
            except (TypeError, struct.error):
                pass                     # a field of the wrong type or size: said below
            try:
                self.verify(e, lac, digest, payload)
            except DigestMismatchError as err:
                bad.append((e, err))
                continue
            ok += (e, payload, length_of(digest))

    def _verify_run_each(self, entries: list, first: int, stride: int, make) -> list | None:
        """A READ_RANGE answer's flat ``[entry, lac, digest, payload, ...]`` as
        ``[make(ledger, entry, payload, length), ...]`` if its entries are exactly
        ``first, first + stride, ...`` and every digest is good; None otherwise
        (the caller then takes the entry-by-entry path, which says what is wrong)."""
        out = []
        verify = self.verify
        lid = self.ledger_id
        want = first
        try:
            for i in range(0, len(entries) - 3, 4):
                e = entries[i]
                if e != want:
                    return None
                out.append(make(lid, e, entries[i + 3],
                                verify(e, entries[i + 1], entries[i + 2], entries[i + 3])))
                want += stride
        except (DigestMismatchError, TypeError, struct.error):
            return None
        return out

    def _verify_run_crc(self, entries: list, first: int, stride: int, make) -> list | None:
        # The hot loop of a catch-up read: per entry one struct unpack, one pack,
        # two CRC calls and the object handed back; no check of types or sizes
        # (a field of the wrong type or size raises, and the careful path runs).
        crc = self._crc
        header = _HEADER.pack
        unpack = _CRC_FIELD.unpack
        lid = self.ledger_id
        out = []
        add = out.append
        want = first
        it = iter(entries)
        try:
            for e, lac, digest, payload in zip(it, it, it, it):
                length, c = unpack(digest)
                if e != want or crc(payload, crc(header(lid, e, lac, length))) != c:
                    return None
                add(make(lid, e, payload, length))
                want += stride
        except (TypeError, struct.error):
            return None
        return out


def length_of(digest) -> int:
    """The cumulative ledger length recorded in a digest field (unverified)."""
    return _LENGTH.unpack_from(digest)[0]
