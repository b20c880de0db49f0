"""bk.park: a thread parks on its own eventfd until another thread unparks it."""

from __future__ import annotations

import os
import resource
import threading

from bk import park
from bk.park import Parker, parker


def test_a_parked_thread_wakes_once_its_condition_is_set():
    got = []
    ready = threading.Event()
    done = [False]

    def waiter():
        p = parker()
        got.append(p)
        ready.set()
        while not done[0]:
            p.park()
        got.append("woken")

    t = threading.Thread(target=waiter)
    t.start()
    ready.wait(10)
    assert got[0] is not parker()           # one parker per thread
    done[0] = True
    got[0].unpark()
    t.join(10)
    assert not t.is_alive() and got[1] == "woken"


def test_a_wake_before_the_park_is_not_lost_and_a_stale_one_only_returns_early():
    p = Parker()
    p.unpark()
    p.park()                                 # returns at once: the wake was counted
    p.unpark()
    p.unpark()
    p.park()                                 # both wakes read at once
    p.park(timeout=0.05)                     # nothing left: times out


def test_the_lock_fallback_behaves_the_same(monkeypatch):
    monkeypatch.setattr(park, "_HAVE_EVENTFD", False)
    p = Parker()
    p.unpark()
    p.unpark()                               # a second wake while one is pending: ignored
    p.park()
    p.park(timeout=0.05)


def test_a_forked_child_gets_its_own_parker():
    mine = parker()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                             # child: a different eventfd than the parent's
        try:
            os.write(w, b"1" if parker() is not mine else b"0")
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.waitpid(pid, 0)


def test_a_timed_park_works_with_a_descriptor_past_fd_setsize():
    # a client with many connections (or a Spark executor) has fds past 1024,
    # where select.select() raises ValueError
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:                          # CI shells may keep the 1024 default
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    held = []
    try:
        while True:
            fd = os.open(os.devnull, os.O_RDONLY)
            held.append(fd)
            if fd > 1100:
                break
        p = Parker()
        assert p._fd > 1024
        p.park(timeout=0.01)                 # times out, no ValueError
        waker = threading.Timer(0.01, p.unpark)
        waker.start()
        p.park(timeout=30)                   # woken well before the deadline
        waker.join()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
