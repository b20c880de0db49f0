"""A client's connections are its I/O thread's alone, and nothing waits on that
thread once it is gone (real etcd, real bookie processes): a recovery whose
reads reconnect to a bookie that was killed and restarted connects from the
I/O thread, never from the caller's; an add handed over while the client
closes fails."""

import threading
import time

import pytest

from bk.client import recovery
from bk.errors import BookieUnavailableError
from bk.testing import wait_until

pytestmark = pytest.mark.timeout(120)

PW = b"secret"


class _MapLate:
    """Stands in for the loop's epoll: a registration made off the I/O thread is
    held back from the loop's fd map until the loop has polled once with it
    (the window in which a soak's I/O thread died, made wide enough to hit every
    time). The registrations it saw: ``(bookie id, on the I/O thread)``."""

    def __init__(self, loop):
        self.loop = loop
        self.ep = loop.sel._ep
        self.seen = []

    def register(self, fd, mask):
        self.ep.register(fd, mask)
        loop = self.loop
        on_loop = threading.current_thread() is loop._thread
        conn = [c for c in list(loop._conns.values()) if c.sock is not None
                and c.sock.fileno() == fd]
        self.seen.append((conn[0].bookie_id if conn else None, on_loop))
        if not on_loop:
            # the caller's thread is between the epoll registration and the map
            # entry (bk.client.connection._Poller.register): the loop polls now
            deadline = time.monotonic() + 10
            while loop.unknown_events == 0 and loop._dead is None \
                    and time.monotonic() < deadline:
                time.sleep(0.001)

    def modify(self, fd, mask):
        self.ep.modify(fd, mask)

    def unregister(self, fd):
        self.ep.unregister(fd)

    def close(self):
        self.ep.close()


def test_a_recovery_reconnects_to_a_restarted_bookie_on_the_io_thread(cluster_factory,
                                                                       monkeypatch):
    """A writer's ledger (E=Qw=3, Qa=2, 20 entries) is left open; a recovery
    fences it, then, before it reads the tail, one bookie is killed -9 and
    restarted (so the recovery client's connection to it is broken, and the
    bookie serves again), as the soak's nemesis did. The recovery's fencing
    READ_RANGEs then reconnect to it. They used to be sent from the caller's
    thread, which connected the socket there: the I/O loop's poll saw it before
    its fd map did (KeyError: the I/O thread died, and the client could do no
    more I/O; with the guard of IOLoop._known, the event was dropped, the
    connection never heard of again and its connect timeout killed the thread).
    Now every connect is the I/O thread's: no event of an unknown fd, the loop
    alive, the ledger recovered at its last entry and read back whole."""
    cluster = cluster_factory(3)
    victim = cluster.bookies[0]
    writer = cluster.client()
    try:
        lh = writer.create_ledger(3, 3, 2, password=PW)
        lid = lh.ledger_id
        for i in range(20):
            assert lh.add_entry(b"entry-%d" % i) == i
        with cluster.client(timeout=3) as rc:
            loop = rc._io
            ep = loop.sel._ep = _MapLate(loop)
            broken = []
            get = recovery._RecoveryReader.get

            def kill_then_get(reader, entry_id):
                if not broken:
                    victim.kill()
                    wait_until(lambda: all(c.sock is None for c in list(loop._conns.values())
                                           if c.bookie_id == victim.bookie_id),
                               what="the recovery client's connections to the killed "
                                    "bookie failed")
                    victim.start()
                    broken.append(len(ep.seen))
                return get(reader, entry_id)

            monkeypatch.setattr(recovery._RecoveryReader, "get", kill_then_get)
            rh = rc.open_ledger(lid, password=PW)
            assert broken, "the recovery never read the tail"
            assert rh.is_closed and rh.last_add_confirmed == 19
            assert [e.data for e in rh.read_entries(0, 19)] == \
                [b"entry-%d" % i for i in range(20)]
            # it did reconnect to the restarted bookie while recovering, and only
            # ever connected on the I/O thread
            assert (victim.bookie_id, True) in ep.seen[broken[0]:]
            assert [s for s in ep.seen if not s[1]] == []
            assert loop.unknown_events == 0 and loop._dead is None
    finally:
        writer.close()


def test_an_add_handed_over_while_the_client_closes_fails_and_never_waits_forever(cluster):
    """``close()`` hands the I/O thread its shutdown; an add another thread hands
    over right after it (before the thread ran it) lands in the same pass, after
    the shutdown failed the connections: it used to reconnect them and go out
    after the loop's end, its adder parked forever on a thread that was gone
    (seen closing clients under a writer: 3 hangs in 150). Now whatever reached
    the loop after its shutdown fails when the loop ends (the add with
    BookieUnavailableError) and no socket is left open."""
    c = cluster.client()
    lh = c.create_ledger(3, 3, 2, password=PW)
    assert lh.add_entry(b"first") == 0              # connections up
    loop = c._io
    busy, gate = threading.Event(), threading.Event()
    loop.call_soon(lambda: (busy.set(), gate.wait(30)))
    assert busy.wait(30)                            # the I/O thread holds its pass
    closer = threading.Thread(target=c.close)
    closer.start()
    wait_until(lambda: any(fn == loop._shutdown for fn, _ in list(loop._submit)),
               what="close() handed the shutdown over")
    out = {}

    def add():
        try:
            out["id"] = lh.add_entry(b"late")
        except Exception as e:      # noqa: B902 - the test looks at what it was
            out["error"] = e
    adder = threading.Thread(target=add, daemon=True)
    adder.start()
    wait_until(lambda: len(loop._submit) == 2, what="the add handed over after the shutdown")
    gate.set()
    closer.join(30)
    adder.join(30)
    assert not closer.is_alive()
    assert not adder.is_alive(), "the add waits forever on a closed client"
    assert "id" not in out and isinstance(out["error"], BookieUnavailableError), out
    assert [conn for conn in loop._conns.values() if conn.sock is not None] == []
    assert loop.unknown_events == 0 and loop._dead is None
