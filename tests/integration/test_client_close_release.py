"""What ``client.close()`` guarantees when it returns: nothing of the client runs
any more (no I/O thread, no metadata thread) and none of its sockets is open
(bookies, etcd), even with every bookie SIGSTOPped under TLS connections and a
last pass of the I/O thread that takes longer than the old 5 s bound on
joining it (an add callback that blocks)."""

from __future__ import annotations

import os
import signal
import threading

import psutil
import pytest

import bk
from bk.errors import ClientClosedError
from bk.testing import wait_until

# longer than the 5 s that IOLoop.stop() used to wait for its thread
SLOW_CALLBACK = 6.0


@pytest.fixture
def secure_cluster(cluster_factory):
    return cluster_factory(3, secure=True)


def _port(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1].split("/")[0])


def _tcp_peers(ports) -> list:
    """This process's TCP sockets connected to one of ``ports`` (fd, peer)."""
    return [(c.fd, c.raddr) for c in psutil.Process().net_connections("tcp")
            if c.raddr and c.raddr.port in ports]


def _client_threads() -> list:
    return [t.name for t in threading.enumerate()
            if t.name.startswith(("bk-io", "bk-meta")) and t.is_alive()]


def _stopped(cluster):
    pids = []
    for b in cluster.bookies:
        pids += [b.pid, *b.worker_pids()]
    return pids


def test_close_returns_with_nothing_left_running_or_open(secure_cluster):
    cluster = secure_cluster
    etcd_port = _port(cluster.metadata_uri.split("//", 1)[1].split("/")[0])
    bookie_ports = {_port(b.bookie_id) for b in cluster.bookies}
    assert _client_threads() == []
    etcd_before = len(_tcp_peers({etcd_port}))
    client = bk.BookKeeper(cluster.metadata_uri, addEntryTimeoutSec=60,
                           readEntryTimeoutSec=60, **cluster.client_settings())
    lh = client.create_ledger(3, 3, 2)
    lh.add_entries([b"x" * 1000] * 50)
    lh.flush_lac()
    reader = client.open_ledger_no_recovery(lh.ledger_id)
    assert len(_tcp_peers(bookie_ports)) >= 3          # TLS connections, one per bookie
    assert len(_tcp_peers({etcd_port})) > etcd_before  # and the client's etcd channel

    pids = _stopped(cluster)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        # Adds, a read and a long poll waiting on the stopped bookies; one add's
        # callback (on the I/O thread) is slow when the close fails it.
        seen = []
        slow_done = threading.Event()

        def slow(exc, entry_id):
            seen.append(type(exc))
            threading.Event().wait(SLOW_CALLBACK)   # a callback that blocks a while
            slow_done.set()
        lh.add_entry_async(b"slow", callback=slow)
        # A metadata thread busy when the client closes: a writer's close_async
        # (an add outstanding: it closes on a metadata thread) whose callback
        # there is slow too, and ends after the I/O thread's.
        meta_seen = []
        meta_done = threading.Event()

        def slow_meta(exc, _none):
            meta_seen.append(type(exc))
            slow_done.wait(60)
            threading.Event().wait(1.0)
            meta_done.set()
        lh2 = client.create_ledger(3, 3, 2)
        lh2.add_entry_async(b"pending")
        lh2.close_async(callback=slow_meta)
        futs = [lh.add_entry_async(b"y" * 10000) for _ in range(100)]
        errors = []

        def call(fn):
            try:
                fn()
            except Exception as e:       # noqa: BLE001
                errors.append(type(e))
        waiters = [threading.Thread(target=call, args=(fn,)) for fn in (
            lambda: reader.read_last_add_confirmed_and_entry(1000, timeout=60),
            lambda: lh.add_entry(b"z"))]
        for t in waiters:
            t.start()
        client.close()
        # When close() returns: the slow callback has run to its end, no thread of
        # the client is alive, no socket of it is open.
        assert slow_done.is_set() and meta_done.is_set()
        assert seen == [ClientClosedError] and meta_seen == [ClientClosedError]
        assert _client_threads() == []
        assert _tcp_peers(bookie_ports) == []
        assert len(_tcp_peers({etcd_port})) <= etcd_before
        for f in futs:
            assert isinstance(f.exception(timeout=0), ClientClosedError)
        for t in waiters:
            t.join(30)
        assert sorted(map(str, errors)) == sorted(map(str, [ClientClosedError] * 2))
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def test_close_from_an_add_callback_does_not_wait_for_itself(cluster):
    """close() on the I/O thread (from an add callback) cannot join that thread:
    it returns, and the loop ends once the callback has returned."""
    client = cluster.client()
    lh = client.create_ledger(3, 2, 2)
    out = []

    def cb(exc, entry_id):
        client.close()
        out.append(exc)
    lh.add_entry_async(b"a", callback=cb)
    wait_until(lambda: out, what="the callback's close() returning")
    assert out == [None]
    wait_until(lambda: _client_threads() == [], what="the client's threads ending")
    with pytest.raises(ClientClosedError):
        lh.add_entry(b"b")


def test_close_from_a_metadata_thread_does_not_wait_for_itself(cluster):
    """close() on one of the client's metadata threads (a close_async callback
    runs there) cannot join that thread: it returns, and the thread ends once
    the callback has returned."""
    client = cluster.client()
    client.create_ledger(3, 2, 2).add_entry(b"a")
    # what a close_async callback that closes the client does, on that thread
    client._executor.submit(client.close).result(timeout=60)
    assert client._closed
    wait_until(lambda: _client_threads() == [], what="the client's threads ending")


def _in_function(name: str) -> bool:
    """True if some thread is running the function ``name`` now."""
    import sys
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name == name:
                return True
            frame = frame.f_back
    return False


def test_close_does_not_wait_out_a_close_async_settling(cluster):
    """A writer's close_async waits (bounded: twice addEntryTimeoutSec and more)
    for a silent bookie to confirm acknowledged entries; the client's close(),
    which waits for its metadata threads, ends that wait at once."""
    client = cluster.client(timeout=60.0)
    lh = client.create_ledger(3, 3, 2)
    lh.add_entry(b"first")
    silent = cluster.bookies[2]
    pids = [silent.pid, *silent.worker_pids()]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        lh.add_entries([b"x"] * 10)            # acknowledged by the other two
        fut = lh.close_async()
        wait_until(lambda: _in_function("_settle"), what="close_async settling")
        closer = threading.Thread(target=client.close)
        closer.start()
        wait_until(lambda: not closer.is_alive(), timeout=30,
                   what="client.close() returning (not after the settle bound)")
        assert isinstance(fut.exception(timeout=0), ClientClosedError)
        assert _client_threads() == []
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
