"""``close()`` ends every call pending on the client at once, with
ClientClosedError, never at the call's own deadline (real etcd, real bookie
processes).

The clients here wait 300 s for a bookie (reads, adds, connects; no
speculative reads), and the bookies are SIGSTOPped under the calls, so a
request's answer never comes: a call that ends within the tests' 60 s bound
ended because the client closed, not because its request timed out."""

import os
import signal
import sys
import threading
import traceback

import pytest

from bk import protocol
from bk.client import recovery
from bk.errors import ClientClosedError
from bk.testing import sigstop, stop_bookie, wait_until

pytestmark = pytest.mark.timeout(600)

PW = b"secret"
LONG = 300.0                    # every timeout of the clients under test (s)
ENDED_WITHIN = 60.0             # how long the test waits for the calls to end (s)


def _client(cluster):
    return cluster.client(timeout=LONG, clientConnectTimeoutMillis=int(LONG * 1000),
                          speculativeReadTimeout=0)


class _Calls:
    """Calls run each on a thread of its own; what each ended with."""

    def __init__(self):
        self.threads = []
        self.started = []
        self.ended = {}             # name -> ("ok", value) or ("error", exception)
        self.lock = threading.Lock()

    def start(self, name, fn):
        def run():
            with self.lock:
                self.started.append(name)
            try:
                out = ("ok", fn())
            except BaseException as e:      # noqa: B902 - the test looks at what it was
                out = ("error", e)
            with self.lock:
                self.ended[name] = out
        t = threading.Thread(target=run, name=f"call-{name}", daemon=True)
        self.threads.append(t)
        t.start()

    def wait_ended(self):
        try:
            wait_until(lambda: not any(t.is_alive() for t in self.threads),
                       timeout=ENDED_WITHIN, what="every pending call ended after close()")
        except AssertionError:
            # every thread's stack: the calls' and the client's (its I/O thread)
            frames = sys._current_frames()
            stuck = {t.name: "".join(traceback.format_stack(frames[t.ident])[-8:])
                     for t in threading.enumerate() if t.ident in frames and
                     (t in self.threads or not t.name.startswith("call-"))}
            raise AssertionError(f"calls still running {ENDED_WITHIN:g}s after close(): "
                                 + "\n".join(f"{n}:\n{st}" for n, st in stuck.items())) from None

    def assert_all_closed(self):
        assert sorted(self.ended) == sorted(self.started)
        wrong = {n: out for n, out in self.ended.items()
                 if out[0] != "error" or not isinstance(out[1], ClientClosedError)}
        assert wrong == {}, wrong


def _request(client, bookie_id, ledger_id):
    """A PING through the client's I/O thread; its error, which the thread raises."""
    call = client._io.request(client._connection(bookie_id, ledger_id), protocol.ping,
                              timeout=LONG)
    assert call.wait(LONG * 2)
    if call.error is not None:
        raise call.error
    return call.reply


def _in_flight(client) -> int:
    """Requests, reads and adds the client's connections hold."""
    n = 0
    for conn in list(client._io._conns.values()):
        n += len(conn.inflight) + len(conn.waiting) + sum(len(d) for d in
                                                          list(conn.adds.values()))
    return n


def _setup(cluster):
    """A closed ledger of 10 entries (reads), an open one of 10 (tails, LAC
    reads), one open ledger per recovery (left IN_RECOVERY by the closes), a
    log with an open segment (a log reader's tail); the writer stays open."""
    w = cluster.client()
    closed = w.create_ledger(3, 3, 2, password=PW)
    for i in range(10):
        closed.add_entry(b"closed-%d" % i)
    closed.close()
    tail = w.create_ledger(3, 3, 2, password=PW)
    for i in range(10):
        tail.add_entry(b"tail-%d" % i)
    to_recover = w.create_ledger(3, 3, 2, password=PW)
    for i in range(5):
        to_recover.add_entry(b"rec-%d" % i)
    lw = w.open_log_writer("close-test")
    lw.append(b"record-0")
    return w, closed.ledger_id, tail, to_recover.ledger_id, lw


@pytest.mark.parametrize("rounds", [6])
def test_calls_pending_on_stopped_bookies_end_when_the_client_closes(cluster, rounds):
    """Each round: a client reads a closed ledger and opens the open one, then
    every bookie is SIGSTOPped and threads start, each with one call that
    waits on them: two reads, a LAC read, two long polls, an open without
    recovery (its LAC read), a recovery open (its fencing), a blocking add,
    a PING through ``request()``, a log reader tailing, a log append. Once the client holds
    their requests, another thread closes it: every call ends with
    ClientClosedError (they used to end only when their 300 s ran out, a
    long poll with "nothing came", a recovery with "could not fence", a read
    with "no bookie answered"). Then every call made on the closed client
    (reads, polls, adds, twice, an open, a request) raises it at once, and
    the client's I/O thread, sockets and task queue are gone."""
    w, closed_id, tail, rec_id, lw = _setup(cluster)
    bookies = list(cluster.bookies)
    try:
        for _ in range(rounds):
            c = _client(cluster)
            rh = c.open_ledger_no_recovery(closed_id, password=PW)
            assert [e.data for e in rh.read_entries(0, 9)] == [b"closed-%d" % i
                                                                for i in range(10)]
            th = c.open_ledger_no_recovery(tail.ledger_id, password=PW)
            assert th.last_add_confirmed == 8       # the writer's last minus one
            lr = c.open_log_reader("close-test", start="latest")
            law = c.open_log_writer("close-append")         # (takes the log over)
            law.append(b"before")
            wh = c.create_ledger(3, 3, 2, password=PW)
            assert wh.add_entry(b"before") == 0
            idle = c.create_ledger(3, 3, 2, password=PW)     # nothing in flight at the close
            assert idle.add_entry(b"before") == 0
            stopped = [stop_bookie(b) for b in bookies]
            try:
                calls = _Calls()
                calls.start("read-1", lambda: rh.read_entries(0, 9))
                calls.start("read-2", lambda: rh.read_entries(3, 7))
                calls.start("lac", th.read_last_add_confirmed)
                calls.start("poll-1", lambda: th.read_last_add_confirmed_and_entry(
                    9, timeout=LONG))
                calls.start("poll-2", lambda: th.read_last_add_confirmed_and_entry(
                    12, timeout=LONG))
                calls.start("open", lambda: c.open_ledger_no_recovery(tail.ledger_id,
                                                                      password=PW))
                calls.start("recover", lambda: c.open_ledger(rec_id, password=PW))
                calls.start("add", lambda: wh.add_entry(b"after"))
                calls.start("request", lambda: _request(c, bookies[0].bookie_id, closed_id))
                calls.start("log-tail", lambda: lr.read_next(timeout=LONG))
                calls.start("log-append", lambda: law.append(b"after"))
                # every call's requests are with the (stopped) bookies: two reads'
                # READ_RANGEs, a LAC read, two polls, the open's LAC read, the
                # recovery's fencing, the add, the ping, the log's poll and append
                wait_until(lambda: _in_flight(c) >= 11 and len(calls.started) == 11,
                           what="every call waiting on the stopped bookies")
                closer = threading.Thread(target=c.close)
                closer.start()
                calls.wait_ended()
                closer.join(ENDED_WITHIN)
                assert not closer.is_alive()
                calls.assert_all_closed()
                # and every call made now fails at once, with the same error (an
                # idle writer's adds too, the second one included: the first used
                # to leave the flush armed and the next one parked forever)
                after = _Calls()
                for name, fn in [
                        ("read", lambda: rh.read_entries(0, 1)),
                        ("poll", lambda: th.read_last_add_confirmed_and_entry(9, 1.0)),
                        ("lac", th.read_last_add_confirmed),
                        ("add", lambda: wh.add_entry(b"x")),
                        ("idle add", lambda: idle.add_entry(b"x")),
                        ("idle add again", lambda: idle.add_entry(b"y")),
                        ("idle async add", lambda: idle.add_entry_async(b"z").result(LONG)),
                        ("close ledger", wh.close),
                        ("close idle ledger", idle.close),
                        ("open", lambda: c.open_ledger(rec_id, password=PW)),
                        ("recover", lambda: recovery.recover_ledger(c, rec_id, password=PW)),
                        ("request", lambda: _request(c, bookies[0].bookie_id, closed_id)),
                        ("log read", lambda: lr.read_next(timeout=1.0)),
                        ("log append", lambda: law.append(b"late"))]:
                    after.start(name, fn)
                    after.threads[-1].join(ENDED_WITHIN)     # one after the other
                after.wait_ended()
                after.assert_all_closed()
                loop = c._io
                assert not loop._thread.is_alive()
                assert [conn for conn in loop._conns.values() if conn.sock is not None] == []
                assert not loop._submit and loop.unknown_events == 0 and loop._dead is None
            finally:
                for pids in stopped:
                    for pid in pids:
                        os.kill(pid, signal.SIGCONT)
    finally:
        lw.close()
        w.close()


def test_calls_racing_close_end_with_the_closed_error(cluster):
    """100 clients, each closed while threads read, tail, read the LAC and send
    requests in a loop against running bookies: every thread's loop ends with
    ClientClosedError (a call begun before, during or after the close), none
    with another error (no bookie answered, the store closed), none left
    waiting."""
    w, closed_id, tail, _rec, lw = _setup(cluster)
    try:
        for i in range(100):
            c = _client(cluster)
            rh = c.open_ledger_no_recovery(closed_id, password=PW)
            th = c.open_ledger_no_recovery(tail.ledger_id, password=PW)
            go = threading.Event()

            def loop_of(fn):
                def run():
                    go.set()
                    while True:
                        fn()
                return run
            calls = _Calls()
            calls.start("reads", loop_of(lambda: rh.read_entries(0, 9)))
            calls.start("entry", loop_of(lambda: rh.read_entry(i % 10)))
            calls.start("lac", loop_of(th.read_last_add_confirmed))
            calls.start("poll", loop_of(lambda: th.read_last_add_confirmed_and_entry(
                12, timeout=LONG)))
            calls.start("request", loop_of(lambda: _request(c, cluster.bookies[i % 3].bookie_id,
                                                            closed_id)))
            assert go.wait(30)
            c.close()
            calls.wait_ended()
            calls.assert_all_closed()
            assert not c._io._thread.is_alive() and not c._io._submit
    finally:
        lw.close()
        w.close()


def test_calls_handed_over_after_the_shutdown_end_at_the_loops_end(cluster):
    """Calls begun before close() whose tasks reach the I/O thread after its
    shutdown was queued, in the pass that runs it, never ran: the loop left
    that pass and dropped them (only a request was failed), so a read waited
    for its deadline (20 minutes here), a long poll and a recovery too. Held
    here in exactly that window (each call stopped at its hand-over until a
    task ahead of the shutdown, in the same pass, runs): the loop's last
    drain runs them, each fails at its first send, and every call ends with
    ClientClosedError."""
    w, closed_id, tail, rec_id, lw = _setup(cluster)
    try:
        c = _client(cluster)
        rh = c.open_ledger_no_recovery(closed_id, password=PW)
        assert rh.read_entry(0).data == b"closed-0"
        th = c.open_ledger_no_recovery(tail.ledger_id, password=PW)
        wh = c.create_ledger(3, 3, 2, password=PW)
        assert wh.add_entry(b"before") == 0
        loop = c._io
        held, release_held = threading.Event(), threading.Event()
        in_pass, release_pass = threading.Event(), threading.Event()
        loop.call_soon(lambda: (held.set(), release_held.wait(30)))
        assert held.wait(30)                        # the I/O thread is held
        loop.call_soon(lambda: (in_pass.set(), release_pass.wait(30)))
        # the calls' threads stop at their first hand-over until the shutdown's
        # pass began
        hand_over, at_hand_over = threading.Event(), []
        call_soon = loop.call_soon

        def held_call_soon(fn, *args):
            if threading.current_thread().name.startswith("call-"):
                at_hand_over.append(fn)
                assert hand_over.wait(30)
            return call_soon(fn, *args)
        loop.call_soon = held_call_soon
        calls = _Calls()
        calls.start("read", lambda: rh.read_entries(0, 9))
        calls.start("single read", lambda: rh.read_entry(4))
        calls.start("poll", lambda: th.read_last_add_confirmed_and_entry(12, timeout=LONG))
        calls.start("lac", th.read_last_add_confirmed)
        calls.start("recover", lambda: c.open_ledger(rec_id, password=PW))
        calls.start("request", lambda: _request(c, cluster.bookies[0].bookie_id, closed_id))
        calls.start("add", lambda: wh.add_entry(b"late"))
        wait_until(lambda: len(at_hand_over) == 7, what="every call at its hand-over")
        closer = threading.Thread(target=c.close)
        closer.start()
        wait_until(lambda: any(fn == loop._shutdown for fn, _ in list(loop._submit)),
                   what="close() handed the shutdown over")
        release_held.set()
        assert in_pass.wait(30)     # the pass of [that task, the shutdown] began
        hand_over.set()
        # each handed its tasks over: a task per read and for the add, the
        # request, three requests each for the poll, the LAC read and the
        # recovery's fencing, all behind the shutdown
        wait_until(lambda: len(loop._submit) == 1 + 1 + 1 + 3 + 3 + 3 + 1 + 1,
                   what="every call's tasks handed over behind the shutdown")
        release_pass.set()
        calls.wait_ended()
        closer.join(ENDED_WITHIN)
        assert not closer.is_alive()
        calls.assert_all_closed()
        assert not loop._thread.is_alive() and not loop._submit
        assert [conn for conn in loop._conns.values() if conn.sock is not None] == []
    finally:
        lw.close()
        w.close()


def _waiting_in_store(threads) -> bool:
    """Whether every thread's stack is inside a metadata store call."""
    frames = sys._current_frames()
    for t in threads:
        f = frames.get(t.ident)
        inside = False
        while f is not None:
            if f.f_code.co_filename.endswith(os.path.join("bk", "meta", "store.py")):
                inside = True
                break
            f = f.f_back
        if not inside:
            return False
    return True


def test_metadata_calls_waiting_on_a_silent_etcd_end_when_the_client_closes(cluster_factory):
    """etcd is SIGSTOPped under a create, a delete, a listing, a metadata read and
    a list of the bookies, each waiting inside the store (its stack shows it) with
    a 300 s metadata timeout, and an asynchronous create; close() ends every one with ClientClosedError, not
    the store's MetadataError, and not at the timeout."""
    c = cluster_factory(3)
    client = c.client(timeout=LONG, metadataTimeoutMillis=int(LONG * 1000))
    lh = client.create_ledger(3, 2, 2, password=PW)
    lh.close()
    calls = _Calls()
    sigstop(c.etcd.pid)
    try:
        calls.start("create", lambda: client.create_ledger(3, 2, 2, password=PW))
        calls.start("delete", lambda: client.delete_ledger(lh.ledger_id))
        calls.start("list", lambda: list(client.list_ledgers()))
        calls.start("metadata", lambda: client.ledger_metadata(lh.ledger_id))
        calls.start("bookies", lambda: client.bookies())
        wait_until(lambda: len(calls.started) == 5 and _waiting_in_store(calls.threads),
                   timeout=ENDED_WITHIN, what="every call waiting on etcd")
        # an asynchronous create: its request waits in the store, its caller on the future
        fut = client.create_ledger_async(3, 2, 2, password=PW)
        calls.start("create_async", lambda: fut.result(LONG))
        wait_until(lambda: len(calls.started) == 6, timeout=ENDED_WITHIN,
                   what="the future awaited")
        assert calls.ended == {}
        client.close()
        calls.wait_ended()
        calls.assert_all_closed()
    finally:
        os.kill(c.etcd.pid, signal.SIGCONT)
