"""The cheap paths of a shard worker's pass, checked against what they replace:
a ledger's first add (its own path in ShardStorage: no state yet), the flush
checks ShardStorage.maintain skips while nothing is due, and the loop's epoll
(_Poller), whose masks must mean what ``selectors`` made them mean."""

from __future__ import annotations

import socket
import time

import pytest

from bk.bookie import journal as J
from bk.bookie.storage import ShardStorage
from bk.bookie.worker import _READABLE, _WRITABLE, _Poller
from bk.errors import EBADREQ, EFENCED, ENOLEDGER, EOK, EUA
from bk.protocol import encode_add_batch

KEY = b"k" * 20


def open_storage(tmp_path, **kw):
    kw.setdefault("flush_bytes", 1 << 30)
    return ShardStorage(str(tmp_path / "journal"), str(tmp_path / "index"),
                        segment_size=1 << 20, **kw)


def lone_batch(s, ledger, entry, payload, key=KEY, lac=-1):
    """One entry as an ADD_BATCH brings it: (status, acked runs, errors)."""
    frame = encode_add_batch(1, key, 0, [(ledger, entry, lac, b"digest", payload)])
    records = frame[-(len(frame) - frame.index(b"\xc6") - 5):]
    acked, errors = [], []
    failed = s.add_batch(records, 1, key, False, acked, errors)
    return (errors[2] if failed else EOK), acked, errors


def journal_records(tmp_path):
    """(type, ledger) of every record in the journal, in order."""
    return [(r.type, r.fields[0]) for r in J.iter_records(str(tmp_path / "journal"))]


@pytest.mark.parametrize("how", ["single", "batch"])
def test_first_add_records_the_key_before_the_entry_and_survives_a_restart(tmp_path, how):
    s = open_storage(tmp_path)
    if how == "single":
        assert s.add_entry(3, 0, -1, KEY, b"digest", b"first", False) == EOK
    else:
        status, acked, errors = lone_batch(s, 3, 0, b"first")
        assert (status, acked, errors) == (EOK, [3, 0, 0], [])
    assert s.read_entry(3, 0) == (EOK, -1, b"digest", b"first")
    assert s.read_lac(3) == (EOK, -1, 0)
    assert s.list_entries(3) == (EOK, [0, 0])
    # the ledger's next entries take the tail the first add made
    assert s.add_entry(3, 1, 0, KEY, b"digest", b"second", False) == EOK
    status, acked, _ = lone_batch(s, 3, 2, b"third", lac=1)
    assert (status, acked) == (EOK, [3, 2, 2])
    assert s.read_lac(3) == (EOK, 1, 2)
    assert s._wc[3].spans is not None and s._wc[3].count() == 3
    s.sync()
    s.close()
    assert [r for r in journal_records(tmp_path) if r[1] == 3][:2] == \
        [(J.MASTER_KEY, 3), (J.ADD, 3)]
    s = open_storage(tmp_path)
    try:
        assert s.check_master_key(3, KEY) == EOK
        assert s.check_master_key(3, b"x" * 20) == EUA
        assert [s.read_entry(3, e)[3] for e in range(3)] == [b"first", b"second", b"third"]
        assert s.read_lac(3) == (EOK, 1, 2)
    finally:
        s.close()


def test_first_add_of_a_deleted_or_foreign_ledger_creates_nothing(tmp_path):
    s = open_storage(tmp_path, owns=lambda lid: lid % 2 == 0)
    try:
        assert s.add_entry(4, 0, -1, KEY, b"d", b"p", False) == EOK
        s.sync()
        s.delete_ledgers([4])
        assert s.add_entry(4, 1, -1, KEY, b"d", b"p", False) == EFENCED
        assert s.add_entry(4, 1, -1, KEY, b"d", b"p", True) == EFENCED   # recovery too
        assert lone_batch(s, 4, 1, b"p")[0] == EFENCED
        assert s.add_entry(5, 0, -1, KEY, b"d", b"p", False) == EBADREQ  # another shard's
        assert lone_batch(s, 7, 0, b"p")[0] == EBADREQ
        assert s.add_entry(6, -1, -1, KEY, b"d", b"p", False) == EBADREQ
        for lid in (4, 5, 6, 7):
            assert s.read_lac(lid) == (ENOLEDGER, -1, -1)
            assert lid not in s._wc
    finally:
        s.close()


def test_a_calm_maintain_still_flushes_when_the_tail_is_full(tmp_path):
    s = open_storage(tmp_path, flush_bytes=1 << 20, write_cache_bytes=4 << 20,
                     flush_interval=3600.0)
    try:
        s.maintain()
        assert s._calm_until > time.monotonic()    # nothing due: later passes skip
        e, flushes = 0, s.checkpoints
        at = s._flush_at                           # this shard's point, at most 1 MiB
        assert 0 < at <= 1 << 20
        while s._flushing is None and s.checkpoints == flushes:
            assert e < 200, "no flush after the tail passed flush_bytes"
            assert s.add_entry(8, e, e - 1, KEY, b"d", b"x" * 16384, False) == EOK
            s.sync()
            s.maintain()
            e += 1
        assert (e - 2) * 16384 < at <= e * 16500   # its tail passed the point, not before
        s.checkpoint()
        assert s.read_entry(8, e - 1)[3] == b"x" * 16384
    finally:
        s.close()


def test_a_calm_maintain_still_flushes_after_the_interval(tmp_path):
    s = open_storage(tmp_path, flush_interval=60.0)
    try:
        now = time.monotonic()
        s.maintain(now)
        assert s.add_entry(9, 0, -1, KEY, b"d", b"p", False) == EOK
        s.sync()
        s.maintain(now + 1)
        assert s._flushing is None                 # not due yet
        s.maintain(now + 61)                       # the interval passed with a tail
        assert s._flushing is not None
        s.checkpoint()
        # an interval that passes while the tail is empty: the first byte flushes
        s._wait_flusher()
        later = time.monotonic() + 120
        s.maintain(later)
        assert s._flushing is None
        assert s.add_entry(9, 1, 0, KEY, b"d", b"p", False) == EOK
        s.sync()
        s.maintain(later + 0.5)                    # (before the next index trim)
        assert s._flushing is not None
    finally:
        s.close()


def test_poller_masks_mean_what_selectors_meant():
    a, b = socket.socketpair()
    p = _Poller()
    try:
        p.register(a, 1, "conn")                   # selectors.EVENT_READ
        assert p.select(0) == []
        b.send(b"x")
        ((data, mask),) = p.select(0)
        assert data == "conn" and mask & _READABLE and not mask & _WRITABLE
        a.recv(1)
        p.modify(a, 2, "again")                    # selectors.EVENT_WRITE
        ((data, mask),) = p.select(0)
        assert data == "again" and mask & _WRITABLE and not mask & _READABLE
        p.modify(a, 1, "conn")
        b.close()                                  # a hang-up: readable (recv says EOF)
        ((data, mask),) = p.select(0.5)
        assert mask & _READABLE and a.recv(1) == b""
        p.unregister(a)
        assert p.select(0) == []
        with pytest.raises(KeyError):
            p.unregister(a)
        r, w = socket.socketpair()
        p.register(r.fileno(), 1, None)            # a bare fd, as the sync pipe
        w.send(b"s")
        assert [d for d, _ in p.select(0)] == [None]
        r.close()
        w.close()
    finally:
        a.close()
