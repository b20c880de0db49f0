"""The Future add_entry_async returns (bk.client.ledger._AddFuture): a
concurrent.futures.Future whose Condition is made only when someone waits on it
pending, completed as an add's callback ``(exc, entry_id)``."""

import concurrent.futures
import threading

import pytest

from bk.client.ledger import _AddFuture, _Waiter
from bk.errors import LedgerFencedError


def test_completed_before_anyone_looks():
    f = _AddFuture()
    assert not f.done()
    f(None, 7)
    assert "_condition" not in f.__dict__            # nobody waited: none was made
    assert f.done() and f.result() == 7 and f.exception() is None
    assert isinstance(f, concurrent.futures.Future)
    seen = []
    f.add_done_callback(lambda fut: seen.append(fut.result()))   # runs at once
    assert seen == [7]


def test_failure_is_raised_by_result():
    f = _AddFuture()
    f(LedgerFencedError("fenced"), None)
    assert isinstance(f.exception(), LedgerFencedError)
    with pytest.raises(LedgerFencedError):
        f.result()


def test_waiters_and_callbacks_registered_while_pending_are_woken():
    f = _AddFuture()
    seen, got = [], []
    f.add_done_callback(lambda fut: seen.append(fut.result()))
    t = threading.Thread(target=lambda: got.append(f.result(timeout=30)))
    t.start()
    with pytest.raises(concurrent.futures.TimeoutError):
        f.result(timeout=0.01)
    f(None, 3)
    t.join(30)
    assert got == [3] and seen == [3]


def test_works_with_concurrent_futures_wait():
    futs = [_AddFuture() for _ in range(4)]
    futs[0](None, 0)
    done, pending = concurrent.futures.wait(futs, timeout=0)
    assert done == {futs[0]} and len(pending) == 3
    threading.Timer(0.01, lambda: [f(None, i) for i, f in enumerate(futs[1:], 1)]).start()
    done, pending = concurrent.futures.wait(futs, timeout=30)
    assert not pending and [f.result() for f in futs] == [0, 1, 2, 3]
    assert sorted(f.result() for f in concurrent.futures.as_completed(futs, timeout=30)) \
        == [0, 1, 2, 3]


def test_completion_racing_a_first_waiter_is_never_lost():
    for _ in range(300):
        f = _AddFuture()
        go = threading.Barrier(2)

        def complete():
            go.wait()
            f(None, 1)
        t = threading.Thread(target=complete)
        t.start()
        go.wait()
        assert f.result(timeout=30) == 1
        t.join(30)


def test_waiter_returns_the_entry_or_raises():
    w = _Waiter()
    threading.Timer(0.01, w, (None, 5)).start()
    assert w.wait() == 5
    w = _Waiter()
    w(LedgerFencedError("fenced"), None)
    with pytest.raises(LedgerFencedError):
        w.wait()
