"""The client's I/O loop's thread-safe entry points, without bookies."""

import gc
import os
import select
import socket
import threading
import time

import pytest

from bk import protocol
from bk.client import connection
from bk.client.connection import IOLoop
from bk.errors import BKError, ClientClosedError
from bk.testing import wait_until


def test_stop_while_another_thread_starts_the_loop(monkeypatch):
    """A client closed while another thread's first request is starting the I/O
    thread (seen in the soak: a crashed client closed by its recovery) waits
    until that thread started, then stops and joins it: no "cannot join thread
    before it is started"."""
    loop = IOLoop(name="bk-io-test")
    in_start, go = threading.Event(), threading.Event()
    start = threading.Thread.start

    def slow_start(self):
        if self.name == "bk-io-test":
            in_start.set()
            assert go.wait(30)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    ran = threading.Event()
    starter = threading.Thread(target=loop.call_soon, args=(ran.set,))
    starter.start()
    assert in_start.wait(30)
    errors = []

    def stop():
        try:
            loop.stop(timeout=30)
        except BaseException as e:      # noqa: B902 - the test reports whatever it is
            errors.append(e)

    stopper = threading.Thread(target=stop)
    stopper.start()
    stopper.join(0.5)       # give it the time to reach the loop's lock (the fix waits there)
    go.set()
    starter.join(30)
    stopper.join(30)
    assert not stopper.is_alive() and not starter.is_alive()
    assert errors == []
    assert ran.is_set()                 # the task handed over before the stop ran
    assert loop._thread is not None and not loop._thread.is_alive()


def _on_io_thread(loop, fn, timeout=30):
    """Run ``fn()`` on ``loop``'s thread; its result (or exception)."""
    done = threading.Event()
    box = {}

    def run():
        try:
            box["v"] = fn()
        except BaseException as e:      # noqa: B902 - handed back to the test
            box["e"] = e
        done.set()

    loop.call_soon(run)
    assert done.wait(timeout), "the I/O thread did not run the task"
    if "e" in box:
        raise box["e"]
    return box.get("v")


@pytest.mark.parametrize("where", ["epoll", "no eventfd", "no epoll"])
def test_every_wake_up_of_a_sleeping_loop_runs_its_task(monkeypatch, where):
    """Tasks handed over one at a time, each after the loop went back to sleep
    in its poll, all run: the waker (an eventfd the loop watches
    edge-triggered and never reads; elsewhere a socketpair, or a ``selectors``
    selector, both level-triggered and read) reports every wake-up. Without a
    working wake-up each task would wait for the poll's 1 s timeout. And it
    reports each once: the loop sleeps between them (an eventfd watched
    level-triggered and never read would keep every poll returning at once,
    a busy loop)."""
    if where == "no eventfd":
        monkeypatch.delattr(os, "eventfd")
    elif where == "no epoll":
        monkeypatch.delattr(select, "epoll")
    loop = IOLoop(name="bk-io-test")
    assert loop._waker.edge is (where == "epoll")
    polls = []
    poll = loop.sel.poll

    def counted(timeout):
        polls.append(timeout)
        return poll(timeout)
    loop.sel.poll = counted             # before the thread starts and takes it
    try:
        _on_io_thread(loop, lambda: None)
        ran = []
        deadline = time.monotonic() + 20
        for i in range(100):
            while not loop._sleeping:        # back in its poll (no tickers: 1 s timeout)
                assert time.monotonic() < deadline, "the loop never went back to sleep"
                time.sleep(0.0005)
            ev = threading.Event()
            loop.call_soon(lambda i=i, ev=ev: (ran.append(i), ev.set()))
            assert ev.wait(max(0.0, deadline - time.monotonic())), \
                f"task {i} did not run: the sleeping loop was not woken"
        assert ran == list(range(100))
        # one poll per task (the one it sleeps in, which the wake-up ends; 102
        # seen), one more for each 1 s timeout that expires while the test waits
        assert len(polls) < 300, f"{len(polls)} polls for 100 wake-ups: a busy loop"
    finally:
        loop.stop()


class _FakeConn:
    """Stands in for a Connection in the loop's poll: READY, records its events."""

    def __init__(self, name, sock, log):
        self.name, self.sock, self.log = name, sock, log
        self.state = connection.READY
        self.other = None

    def _on_readable(self):
        self.log.append(self.name)
        try:
            self.sock.recv(100)         # drained: readable once
        except BlockingIOError:         # (a spurious event: nothing to read)
            pass
        if self.other is not None and self.other.sock is not None:
            # handling this one closes the other, whose number a new socket
            # (a reconnect, say) takes at once, within the same pass
            other, self.other = self.other, None
            loop = self.loop
            fd = other.sock.fileno()
            loop.sel.unregister(other.sock)
            other.sock.close()
            other.sock = None
            a, b = socket.socketpair()
            if a.fileno() == fd:            # it took the number itself
                new = a
            else:
                os.dup2(a.fileno(), fd)
                a.close()
                new = socket.socket(fileno=fd)
            assert new.fileno() == fd
            new.setblocking(False)
            self.keep.append(b)
            fresh = _FakeConn("fresh", new, self.log)
            loop.sel.register(new, connection._EV_R, fresh)
            self.keep.append(fresh)

    def _on_writable(self):
        self.log.append(self.name + "/w")


def test_a_connection_closed_in_a_pass_gets_none_of_its_events():
    """Two sockets ready in one poll; handling the first closes the second and a
    new socket takes its number before the second's event is handled: that event
    goes to nobody (the closed connection is skipped, the new one has nothing
    to read), never to the new socket's connection."""
    loop = IOLoop(name="bk-io-test")
    log, keep = [], []
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        for a, _ in pairs:
            a.setblocking(False)
        conns = [_FakeConn(n, a, log) for n, (a, _) in zip("ab", pairs)]
        for c, o in ((conns[0], conns[1]), (conns[1], conns[0])):
            c.other, c.loop, c.keep = o, loop, keep
        for _, b in pairs:
            b.send(b"x")                # both readable before they are registered

        def register():
            for c in conns:
                loop.sel.register(c.sock, connection._EV_R, c)
        _on_io_thread(loop, register)
        deadline = time.monotonic() + 20
        while not log:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        _on_io_thread(loop, lambda: None)   # a whole pass later
        assert len(log) == 1 and log[0] in ("a", "b"), log
        assert "fresh" not in log
    finally:
        loop.stop()
        for c in keep:
            if isinstance(c, socket.socket):
                c.close()
            elif c.sock is not None:
                c.sock.close()
        for a, b in pairs:
            a.close()
            b.close()


def test_an_event_of_an_fd_no_connection_holds_is_dropped_and_the_loop_goes_on():
    """epoll reports a ready fd that is not in the loop's map (the map lost it
    while epoll still watched it; in a soak the I/O thread died of the
    KeyError and the client could do no more I/O): the event is dropped, the
    fd no longer watched, and the loop runs on, its other connections too."""
    loop = IOLoop(name="bk-io-test")
    log = []
    lost, lost_peer = socket.socketpair()
    kept, kept_peer = socket.socketpair()
    try:
        for s in (lost, kept):
            s.setblocking(False)
        conn = _FakeConn("kept", kept, log)

        def register():
            loop.sel.register(lost, connection._EV_R, _FakeConn("lost", lost, log))
            loop.sel.register(kept, connection._EV_R, conn)
            del loop.sel.data[lost.fileno()]     # watched, but no connection holds it
        _on_io_thread(loop, register)
        lost_peer.send(b"x")                     # level-triggered: ready at every poll
        deadline = time.monotonic() + 20
        while loop.unknown_events == 0:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        kept_peer.send(b"y")
        while log != ["kept"]:
            assert time.monotonic() < deadline and loop._dead is None, (log, loop._dead)
            time.sleep(0.001)
        _on_io_thread(loop, lambda: None)        # passes later: the fd is no longer watched
        _on_io_thread(loop, lambda: None)
        assert loop.unknown_events == 1 and loop._dead is None
    finally:
        loop.stop()
        for s in (lost, lost_peer, kept, kept_peer):
            s.close()


def _listener():
    """A TCP socket on 127.0.0.1 that accepts connections (its backlog) and never
    answers: a bookie that has not said HELLO yet."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    return srv


def test_a_connection_connects_on_the_io_thread_only():
    """A request handed straight to an idle connection from another thread (as
    a recovery's READ_RANGEs were) would connect its socket there, and the
    loop's poll could see it before its fd map does (the soak's KeyError): the
    connection refuses, registering nothing, and the same request handed over
    with call_soon connects on the I/O thread."""
    loop = IOLoop(name="bk-io-test")
    srv = _listener()
    try:
        bid = "127.0.0.1:%d" % srv.getsockname()[1]
        conn = loop.conn(bid, 0)
        _on_io_thread(loop, lambda: None)           # the loop runs
        call = connection.Call(b"")
        with pytest.raises(RuntimeError, match="not the client's I/O thread"):
            conn.send(1, call, b"")
        assert conn.sock is None and list(loop.sel.data) == [loop._waker.fd]
        loop.call_soon(conn.send, 2, connection.Call(b""), b"")
        state, mapped = _on_io_thread(
            loop, lambda: (conn.state, loop.sel.data.get(conn.sock.fileno())))
        assert state in (connection.CONNECTING, connection.HELLO) and mapped is conn
    finally:
        loop.stop()
        srv.close()


def test_a_connection_epoll_no_longer_watches_still_fails_whole():
    """A connection whose socket epoll no longer watches (the loop's guard
    ``_known`` unwatched its fd after the race above) fails like any other:
    socket closed, fd map entry gone, its requests failed, the I/O thread alive.
    The epoll's "no such file" used to come out of the unregister, before the
    socket was closed and the requests failed, and killed the I/O thread when
    the connect timeout's ``_fail`` ran it."""
    loop = IOLoop(name="bk-io-test")
    srv = _listener()
    try:
        conn = loop.conn("127.0.0.1:%d" % srv.getsockname()[1], 0)
        call = connection.Call(b"")
        loop.call_soon(conn.send, 1, call, b"")
        sock = _on_io_thread(loop, lambda: conn.sock)
        assert sock is not None

        def unwatched_then_failed():
            loop.sel._ep.unregister(sock.fileno())          # epoll forgot it
            conn._fail(connection.BookieUnavailableError("gone"))
        _on_io_thread(loop, unwatched_then_failed)
        assert conn.sock is None and sock.fileno() == -1
        assert list(loop.sel.data) == [loop._waker.fd]
        assert call.wait(10) and isinstance(call.error, connection.BookieUnavailableError)
        assert _on_io_thread(loop, lambda: loop._dead) is None
    finally:
        loop.stop()
        srv.close()


def test_a_stopped_loop_keeps_its_eventfd_until_no_thread_can_wake_it():
    """A thread that saw the loop asleep may be between its look at the waker's
    fd and its write when the loop stops. The eventfd stays open as long as the
    waker exists, so that late write lands in it, never in a file that took
    the number since (another client's socket); it is closed once garbage."""
    loop = IOLoop(name="bk-io-test")
    _on_io_thread(loop, lambda: None)
    waker = loop._waker
    fd = waker.fd                           # what such a thread holds
    t = loop._thread
    loop.stop()
    t.join(30)
    assert not t.is_alive()
    assert os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
    os.eventfd_write(fd, 1)                 # the late wake-up: into the eventfd
    del loop, waker, t
    gc.collect()
    with pytest.raises(FileNotFoundError):
        os.readlink(f"/proc/self/fd/{fd}")


def _held(loop):
    """Hold the I/O thread in a task until the returned event is set."""
    held, release = threading.Event(), threading.Event()
    loop.call_soon(lambda: (held.set(), release.wait(30)))
    assert held.wait(30)
    return release


def test_work_reaching_a_connection_after_the_shutdown_fails_there_and_never_connects(
        monkeypatch):
    """A request handed over while the client closes, behind the shutdown, reaches
    its connection after the shutdown failed it: it fails there with
    ClientClosedError, and no socket is opened for it (one connected then was
    read by nobody: a read moving on to its next replica waited for its
    deadline). The peer accepts connections and never answers."""
    srv = socket.create_server(("127.0.0.1", 0))
    loop = IOLoop(name="bk-io-test")
    connects = []
    connect = connection.Connection._connect

    def recording_connect(self):
        connects.append(self.loop._refuse is not None)      # after the shutdown?
        return connect(self)
    monkeypatch.setattr(connection.Connection, "_connect", recording_connect)
    try:
        conn = loop.conn(f"127.0.0.1:{srv.getsockname()[1]}", 0)
        release = _held(loop)
        stopper = threading.Thread(target=loop.stop, kwargs={"timeout": 30})
        stopper.start()
        wait_until(lambda: any(fn == loop._shutdown for fn, _ in list(loop._submit)),
                   what="the shutdown handed over")
        call = loop.request(conn, protocol.ping, timeout=300)
        release.set()
        assert call.wait(30), "the request waits on a closed client"
        assert isinstance(call.error, ClientClosedError), call.error
        stopper.join(30)
        assert not stopper.is_alive() and not loop._thread.is_alive()
        assert connects == [] and conn.sock is None
    finally:
        srv.close()


def test_a_task_appended_after_the_loops_last_drain_is_taken_back_and_refused():
    """A thread that saw the loop running may append its task after the loop's
    last drain: nobody would ever run it (its caller waited forever). call_soon
    sees the drain began, takes the task back and raises ClientClosedError; a
    task is either run by the drain or refused, never left queued."""
    loop = IOLoop(name="bk-io-test")
    _on_io_thread(loop, lambda: None)
    loop.stop()
    assert not loop._thread.is_alive()
    ran = []
    with pytest.raises(ClientClosedError):
        loop.call_soon(ran.append, 1)           # the plain case: refused
    loop._closing = False                       # what that thread saw
    with pytest.raises(ClientClosedError):
        loop.call_soon(ran.append, 2)
    assert not loop._submit and ran == []


def _in_child(fn) -> int:
    """Run ``fn()`` in a forked child; its exit code (0: it returned True)."""
    pid = os.fork()
    if pid == 0:                                # the child: no pytest from here on
        code = 3
        try:
            code = 0 if fn() else 1
        except BaseException:       # noqa: B902 - reported by the exit code
            code = 2
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_forked_childs_copy_of_a_closed_loop_stays_closed():
    """A client closed before its process forked is closed in the child too:
    a call there raises ClientClosedError and starts no I/O thread (the
    child's loop used to start afresh, serving a closed client)."""
    loop = IOLoop(name="bk-io-test")
    _on_io_thread(loop, lambda: None)
    loop.stop()

    def child():
        try:
            loop.call_soon(lambda: None)
        except ClientClosedError:
            return loop._thread is None
        return False
    assert _in_child(child) == 0


def test_a_forked_childs_stop_closes_its_copy_of_the_loop():
    """A child closing its copy of a running client (never used in the child)
    must not touch the parent's thread or sockets, and its copy is closed from
    then on: a call raises ClientClosedError, no thread starts. The parent's
    loop goes on."""
    loop = IOLoop(name="bk-io-test")
    _on_io_thread(loop, lambda: None)
    try:
        def child():
            loop.stop()
            try:
                loop.call_soon(lambda: None)
            except ClientClosedError:
                return loop._thread is None
            return False
        assert _in_child(child) == 0
        assert _on_io_thread(loop, lambda: "alive") == "alive"
    finally:
        loop.stop()


class _Die(BaseException):
    """Not an Exception: escapes the I/O thread's task guard, as a bug would."""


def _raise_die():
    raise _Die("injected failure of the I/O thread")


class _Request:
    """A request object as reads make them: on_reply / on_error, once."""

    def __init__(self):
        self.error = None
        self.done = threading.Event()

    def on_reply(self, conn, msg):
        self.done.set()

    def on_error(self, conn, exc):
        self.error = exc
        self.done.set()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_work_left_when_the_io_thread_dies_ends_with_its_death():
    """The I/O thread dies (a bug) with a request in flight to a peer that never
    answers, and behind the fatal task, not yet run: a task that sends a read's
    request (as read_entries hands over) and a request. Each ends at once with
    the BKError naming the death (the read's task used to be dropped, its
    reader waiting for its deadline), and later calls raise it."""
    srv = socket.create_server(("127.0.0.1", 0))
    loop = IOLoop(name="bk-io-test")
    try:
        conn = loop.conn(f"127.0.0.1:{srv.getsockname()[1]}", 0)
        first = loop.request(conn, protocol.ping, timeout=300)
        wait_until(lambda: conn.sock is not None, what="the connection to the silent peer")
        release = _held(loop)
        loop.call_soon(_raise_die)
        read = _Request()
        loop.call_soon(lambda: conn.send(next(loop.rids), read, b"", 300))
        late = loop.request(conn, protocol.ping, timeout=300)
        release.set()
        assert first.wait(30) and read.done.wait(30) and late.wait(30)
        for err in (first.error, read.error, late.error):
            assert isinstance(err, BKError) and "I/O thread died" in str(err), err
        with pytest.raises(BKError, match="I/O thread died"):
            loop.call_soon(lambda: None)
        loop._thread.join(30)       # (its exception is reported inside the test)
        assert not loop._thread.is_alive()
        assert not loop._submit and conn.sock is None
    finally:
        srv.close()


def test_a_thread_with_the_ended_io_threads_id_is_refused_like_any_other():
    """glibc hands a new thread the stack, so the thread id, of the last thread
    that exited: after a loop's thread ended, the next thread the application
    starts is usually given its id. Taken for the loop's own thread, its
    call_soon queued a task nobody would run (an idle writer's add after
    close() parked forever). Each trial starts one thread after the loop ended;
    the test needs the id reused in some of them (on glibc nearly all), and
    every one refused."""
    reused = refused = 0
    for _ in range(10):
        loop = IOLoop()
        ran = threading.Event()
        loop.call_soon(ran.set)
        assert ran.wait(10)
        old = loop._thread.ident
        loop.stop()
        assert not loop._thread.is_alive()
        out = {}

        def late():
            out["same id"] = threading.get_ident() == old
            try:
                loop.call_soon(out.setdefault, "ran", True)
                out["call"] = "queued"
            except ClientClosedError:
                out["call"] = "refused"
        t = threading.Thread(target=late)
        t.start()
        t.join(10)
        reused += out["same id"]
        refused += out["call"] == "refused"
        assert not loop._submit and "ran" not in out
    assert reused > 0          # the case this test is about did occur
    assert refused == 10
