"""Bounded memory and a client that never hangs: a bookie's output per
connection is bounded (a slow reader of 5 MiB entries), the client's read
window is sized in bytes, completed requests leave the timeout structures, and
a dead client I/O thread fails its waiters. Real etcd and bookie processes."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import psutil
import pytest

import bk
from bk import protocol as P
from bk.errors import BKError, EOK
from bk.testing import BookieConnection, stop_bookie, wait_until

BIG = 5 * 1024 * 1024
FRAME = 6 * 1024 * 1024
PW = b"pw"




def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


@pytest.fixture(scope="module")
def big_cluster(module_cluster_factory):
    """Bookies that take 5 MiB entries, shared by the tests that only add and read."""
    return module_cluster_factory(3, num_shards=1, conf_overrides={
        "nettyMaxFrameSizeBytes": FRAME, "journalPreAllocSizeMB": 16})


def test_slow_reader_of_big_entries_keeps_the_bookie_bounded(big_cluster):
    b = big_cluster.bookies[0]
    lid = 1 << 50
    entries = [os.urandom(16) * (BIG // 16) for _ in range(4)]
    with BookieConnection(b.bookie_id, 0) as c:
        for eid, data in enumerate(entries):
            r = c.call(P.add(c.next_rid(), lid, eid, eid - 1, b"k" * 20, b"", data))
            assert r[2] == EOK
    worker = b.worker_pids()[0]
    base = rss(worker)
    n = 100                                         # 500 MiB of responses asked for at once
    with BookieConnection(b.bookie_id, 0) as c:
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        rids = []
        for i in range(n):
            rid = c.next_rid()
            rids.append(rid)
            c.send(P.read(rid, lid, i % len(entries)))
        # The reader does not read for a while: the worker must not queue it all.
        peak = base
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            peak = max(peak, rss(worker))
            time.sleep(0.05)
        assert peak - base < 150 * 1024 * 1024, (base, peak)
        # Then every response arrives, complete and in order.
        for i, rid in enumerate(rids):
            r = c.recv()
            assert r[1] == rid and r[2] == EOK and r[7] == entries[i % len(entries)]
            peak = max(peak, rss(worker))
    assert peak - base < 150 * 1024 * 1024, (base, peak)


def test_client_reads_big_entries_with_a_byte_window(big_cluster):
    with bk.BookKeeper(big_cluster.metadata_uri, nettyMaxFrameSizeBytes=FRAME,
                       readWindowBytes=12 * 1024 * 1024) as client:
        lh = client.create_ledger(3, 2, 2, password=PW)
        data = [bytes([65 + i]) * BIG for i in range(6)]
        lh.add_entries(data)
        lh.close()
        rh = client.open_ledger(lh.ledger_id, password=PW)
        got = rh.read_entries(0, 5)
        assert [e.data for e in got] == data
        assert rh.length == 6 * BIG


def test_completed_reads_leave_the_timeout_structures(shared_cluster):
    with bk.BookKeeper(shared_cluster.metadata_uri, readEntryTimeoutSec=300) as client:
        lh = client.create_ledger(3, 2, 2, password=PW)
        lh.add_entries([b"x" * 100_000 for _ in range(50)])
        lh.close()
        rh = client.open_ledger_no_recovery(lh.ledger_id, password=PW)
        for _ in range(3):
            assert len(rh.read_entries(0, 49)) == 50
        timeouts = client._io._timeouts
        # 150 reads answered long before their 300 s deadline: none is remembered.
        wait_until(lambda: sum(len(od) for od in list(timeouts.values())) == 0,
                   what="the timeout map to empty")


class _Die(BaseException):
    """Not an Exception: escapes the I/O thread's task guard, as a bug would."""


def _raise_die():
    raise _Die("injected failure of the I/O thread")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_io_thread_fails_waiters_instead_of_hanging(cluster):
    client = bk.BookKeeper(cluster.metadata_uri, addEntryTimeoutSec=300)
    stopped = None
    try:
        lh = client.create_ledger(3, 3, 3, password=PW)
        lh.add_entry(b"first")
        stopped = cluster.bookie(lh.metadata.ensembles[0][1][0])
        stop_bookie(stopped)                         # Qa=3: the next add waits
        result = {}

        def add():
            try:
                result["ok"] = lh.add_entry(b"second")
            except BKError as e:
                result["error"] = e

        t = threading.Thread(target=add)
        t.start()
        wait_until(lambda: len(lh._pending) == 1, what="the add to be pending")
        client._io.call_soon(_raise_die)
        t.join(30)
        assert not t.is_alive(), "the add hung after its I/O thread died"
        assert "ok" not in result
        assert "I/O thread died" in str(result["error"]) and "injected" in str(result["error"])
        with pytest.raises(BKError, match="I/O thread died"):
            lh.add_entry(b"third")
        with pytest.raises(BKError, match="I/O thread died"):
            client._io.call_soon(lambda: None)
    finally:
        if stopped is not None:
            stopped.kill(signal.SIGCONT)
        client.close()
