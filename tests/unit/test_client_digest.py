import pytest

from bk.client import digest as D
from bk.errors import DigestMismatchError


@pytest.mark.parametrize("dt", D.DIGEST_TYPES)
def test_round_trip_and_length(dt):
    d = D.EntryDigest(7, dt, b"pw")
    sig = d.sign(3, 2, 1234, b"payload")
    assert d.verify(3, 2, sig, b"payload") == 1234
    assert D.length_of(sig) == 1234
    assert len(sig) == 8 + {"crc32": 4, "crc32c": 4, "mac": 20, "dummy": 0}[dt]


@pytest.mark.parametrize("dt", ["crc32", "crc32c", "mac"])
@pytest.mark.parametrize("change", ["payload", "entry", "lac", "ledger", "length", "checksum"])
def test_tamper_detected(dt, change):
    d = D.EntryDigest(7, dt, b"pw")
    sig = d.sign(3, 2, 1234, b"payload")
    payload, entry, lac, verifier = b"payload", 3, 2, d
    if change == "payload":
        payload = b"paylaod"
    elif change == "entry":
        entry = 4
    elif change == "lac":
        lac = 1
    elif change == "ledger":
        verifier = D.EntryDigest(8, dt, b"pw")
    elif change == "length":
        sig = (1235).to_bytes(8, "big") + sig[8:]
    else:
        sig = sig[:-1] + bytes([sig[-1] ^ 1])
    with pytest.raises(DigestMismatchError) as ei:
        verifier.verify(entry, lac, sig, payload)
    assert f"entry {entry}" in str(ei.value)


def test_mac_depends_on_password():
    sig = D.EntryDigest(1, "mac", b"a").sign(0, -1, 1, b"x")
    with pytest.raises(DigestMismatchError):
        D.EntryDigest(1, "mac", b"b").verify(0, -1, sig, b"x")


@pytest.mark.parametrize("dt", D.DIGEST_TYPES)
def test_without_password(dt):
    """password=None (an admin with the master key): checksums still verified, a MAC
    only for its shape, and a MAC cannot be made."""
    sig = D.EntryDigest(7, dt, b"pw").sign(3, 2, 1234, b"payload")
    d = D.EntryDigest(7, dt, None)
    assert d.verify(3, 2, sig, b"payload") == 1234
    assert d.mac_unchecked == (dt == "mac")
    if dt == "mac":
        with pytest.raises(ValueError):
            d.sign(3, 2, 1234, b"payload")
        with pytest.raises(DigestMismatchError):
            d.verify(3, 2, sig[:-1], b"payload")
    elif dt != "dummy":
        with pytest.raises(DigestMismatchError):
            d.verify(3, 2, sig, b"paylaod")


def test_truncated_digest_field():
    d = D.EntryDigest(1, "crc32c")
    with pytest.raises(DigestMismatchError):
        d.verify(0, -1, b"\0" * 5, b"x")


def test_unknown_digest_type():
    with pytest.raises(ValueError):
        D.EntryDigest(1, "sha3")
    with pytest.raises(ValueError):
        D.check_digest_type("CRC32")


def test_password_digest_and_master_key():
    stored = D.password_digest(b"secret")
    assert b"secret" not in stored
    assert D.password_matches(stored, b"secret")
    assert not D.password_matches(stored, b"Secret")
    assert D.password_digest(b"secret") != stored          # salted
    assert D.password_matches(b"", b"anything")              # no digest recorded
    mk = D.master_key(b"secret")
    assert mk == D.master_key(b"secret") and mk != D.master_key(b"other")
    assert mk not in stored and len(mk) == 20


def _answer(d, entries, payloads):
    """A READ_RANGE answer's flat entries, signed by ``d``."""
    flat, length = [], 0
    for e, p in zip(entries, payloads):
        length += len(p)
        flat += (e, e - 1, d.sign(e, e - 1, length, p), p)
    return flat


def _made(ledger, entry, data, length):
    return (ledger, entry, data, length)


@pytest.mark.parametrize("dt", D.DIGEST_TYPES)
def test_verify_run_makes_every_entry_of_a_good_answer(dt):
    d = D.EntryDigest(7, dt, b"pw")
    payloads = [b"a" * (i + 1) for i in range(6)]
    flat = _answer(d, range(2, 14, 2), payloads)
    got = d.verify_run(flat, 2, 2, _made)
    lengths = [sum(map(len, payloads[:i + 1])) for i in range(6)]
    assert got == [(7, e, p, n) for e, p, n in zip(range(2, 14, 2), payloads, lengths)]


@pytest.mark.parametrize("dt", ["crc32", "crc32c", "mac"])
@pytest.mark.parametrize("bad", ["payload", "order", "digest type", "short digest",
                                 "payload type"])
def test_verify_run_leaves_any_odd_answer_to_the_careful_path(dt, bad):
    d = D.EntryDigest(7, dt, b"pw")
    flat = _answer(d, range(4), [b"x", b"y", b"z", b"w"])
    if bad == "payload":
        flat[4 * 2 + 3] = b"Z"                     # entry 2's payload changed
    elif bad == "order":
        flat[4:8], flat[8:12] = flat[8:12], flat[4:8]
    elif bad == "digest type":
        flat[4 * 3 + 2] = "not bytes"
    elif bad == "short digest":
        flat[4 * 1 + 2] = flat[4 * 1 + 2][:-1]
    else:
        flat[4 * 3 + 3] = None
    assert d.verify_run(flat, 0, 1, _made) is None
    ok, errs = [], []
    d.verify_flat(flat, ok, errs)                 # which says what is wrong
    assert errs or ok[0::3] != [0, 1, 2, 3]


@pytest.mark.parametrize("dt", ["crc32", "crc32c"])
@pytest.mark.parametrize("size", [0, 1, 1024, 70_000])
def test_crc_sign_is_the_checksum_of_its_definition(dt, size):
    """sign gives the documented field: the length, then the crc of (ledger, entry,
    lac, length) big-endian followed by the payload (what readers and other
    clients verify, however sign computes it)."""
    import struct
    import zlib

    import crc32c
    crc = crc32c.crc32c if dt == "crc32c" else zlib.crc32
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    d = D.EntryDigest(7, dt, b"pw")
    sig = d.sign(5, 4, 99_999, payload)
    want = crc(struct.pack(">qqqq", 7, 5, 4, 99_999) + payload)
    assert sig == struct.pack(">qI", 99_999, want)
    assert d.verify(5, 4, sig, payload) == 99_999
    if size:
        with pytest.raises(DigestMismatchError):
            d.verify(5, 4, sig, payload[:-1] + bytes([payload[-1] ^ 1]))
