"""A frame that arrives in pieces wakes the shard worker once, when it is whole:
the worker sets the socket's SO_RCVLOWAT to what is still missing of it (see
``bk.bookie.worker.RCVLOWAT_MIN``), so that epoll does not report the socket
for every piece; and sets it back once the frame is in, so that a small frame
after it wakes the loop at once. A real worker on real storage, real loopback
sockets watched by a real epoll (tests/unit/test_group_commit.py's step worker)."""

from __future__ import annotations

import array
import fcntl
import select
import socket
import termios

from bk import protocol as P
from bk.bookie import worker as W
from bk.testing import wait_until

from test_group_commit import KEY, LID, Client, make_worker  # noqa: F401 (a fixture)


def big_batch(rid: int, first: int, count: int) -> bytes:
    return P.encode_add_batch(rid, KEY, 0, [(LID, e, e - 1, b"", b"p" * 1000)
                                            for e in range(first, first + count)])


def lowat(c: Client) -> int:
    return c.conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


def readable(ep: select.epoll) -> bool:
    return bool(ep.poll(0))


def arrived(c: Client, n: int):
    """Wait until the worker's end of the connection holds ``n`` unread bytes
    (the loopback delivers at once; the wait is for a busy machine)."""
    def queued():
        buf = array.array("i", [0])
        fcntl.ioctl(c.conn.sock.fileno(), termios.FIONREAD, buf)
        return buf[0]
    wait_until(lambda: queued() >= n, timeout=10, what=f"{n} bytes queued")


def test_a_frame_in_pieces_wakes_the_loop_once_it_is_whole(make_worker):
    w = make_worker()
    c = Client(w)
    ep = select.epoll()
    ep.register(c.conn.sock.fileno(), select.EPOLLIN)
    frame = big_batch(50, 0, 100)              # ~100 KiB
    first, rest = frame[:30_000], frame[30_000:]
    c.sock.sendall(first)
    arrived(c, len(first))
    assert readable(ep)                        # no mark yet: the first piece wakes it
    w._on_readable(c.conn)
    assert w.held == []                        # nothing whole to dispatch
    assert c.conn.fb.missing() == len(rest)
    mark = lowat(c)
    assert W.RCVLOWAT_MIN <= mark <= len(rest) and c.conn.lowat == mark
    # more of the frame, but less than the mark: epoll does not report the socket
    c.sock.sendall(rest[:mark - 1000])
    arrived(c, mark - 1000)
    assert not readable(ep)
    c.sock.setblocking(True)
    c.sock.sendall(rest[mark - 1000:])
    c.sock.setblocking(False)
    wait_until(lambda: readable(ep), timeout=10, what="the socket reported readable")
    wait_until(lambda: (w._on_readable(c.conn), w.held)[1], timeout=10,
               what="the whole frame dispatched")
    # dispatched: its entries held for the group's sync, the mark back at 1
    assert c.conn.fb.pending == 0 and len(w.held) == 1
    assert lowat(c) == 1 and c.conn.lowat == 1
    w._start_sync()
    w.complete()
    assert c.acked() == [(LID, e) for e in range(100)]
    c.sock.sendall(P.encode_frame(P.add(99, LID, 100, 99, KEY, b"", b"x")))
    arrived(c, 10)
    assert readable(ep)                        # a small frame after it wakes it at once
    w._on_readable(c.conn)
    assert len(w.held) == 1


def test_a_small_remainder_sets_no_mark(make_worker):
    w = make_worker()
    c = Client(w)
    frame = big_batch(50, 0, 40)               # ~40 KiB: 10 KiB missing after 30
    c.sock.sendall(frame[:30_000])
    w._on_readable(c.conn)
    assert 0 < c.conn.fb.missing() < W.RCVLOWAT_MIN
    assert lowat(c) == 1 and c.conn.lowat == 1
    c.send(frame[30_000:])
    assert len(w.held) == 1


def test_the_mark_never_exceeds_a_quarter_of_the_receive_buffer(make_worker):
    w = make_worker()
    c = Client(w)
    frame = big_batch(50, 0, 3000)             # ~3 MiB: more than the buffer holds
    c.sock.setblocking(True)
    c.sock.sendall(frame[:100_000])
    c.sock.setblocking(False)
    w._on_readable(c.conn)
    rcvbuf = c.conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    assert W.RCVLOWAT_MIN <= lowat(c) <= rcvbuf // 4 < c.conn.fb.missing()
    # the rest, a piece at a time as the worker reads: every piece is read (no hang)
    sent = 100_000
    while sent < len(frame):
        try:
            sent += c.sock.send(frame[sent:sent + 65536])
        except BlockingIOError:
            pass
        ep = select.epoll()
        ep.register(c.conn.sock.fileno(), select.EPOLLIN)
        if ep.poll(0.05):
            w._on_readable(c.conn)
        ep.close()
    wait_until(lambda: (w._on_readable(c.conn), w.held)[1], timeout=10,
               what="the whole frame dispatched")
    assert lowat(c) == 1
    w._start_sync()
    w.complete()
    assert c.acked() == [(LID, e) for e in range(3000)]
