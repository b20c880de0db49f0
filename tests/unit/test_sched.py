"""bk.sched: a thread's own time-slice request, read back from the kernel, and a
no-op (never an error) where the kernel cannot take it."""

from __future__ import annotations

import ctypes
import errno
import threading

from bk import sched

# a kernel with per-thread slices (Linux 6.12+ on a known machine) reports one
SUPPORTED = sched.current_slice() is not None


def _in_thread(fn):
    """``fn()``'s result, run on a fresh thread: a request lasts as long as the
    thread, so pytest's own thread is never changed."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(30)
    assert not t.is_alive()
    return out[0]


def test_a_request_is_applied_to_the_calling_thread_only():
    def body():
        before = sched.current_slice()
        got = sched.request_slice(300)
        child = _in_thread(sched.current_slice)     # started after the request
        return before, got, sched.current_slice(), child

    default = sched.current_slice()
    before, got, after, child = _in_thread(body)
    if SUPPORTED:
        assert before == default and default != 300
        assert got == 300 and after == 300          # read back with sched_getattr
        assert child == default                     # reset on fork: not inherited
    else:
        assert got is None and after is None
    assert sched.current_slice() == default         # the test's thread untouched


def test_the_kernel_clamps_and_zero_asks_nothing():
    def body():
        return (sched.request_slice(0), sched.current_slice(), sched.request_slice(10),
                sched.request_slice(10**6))

    nothing, unchanged, low, high = _in_thread(body)
    assert nothing is None and unchanged == sched.current_slice()
    if SUPPORTED:
        assert (low, high) == (100, 100_000)


def test_another_thread_is_set_and_reset_by_its_id():
    ready, done = threading.Event(), threading.Event()
    tid = []

    def body():
        tid.append(threading.get_native_id())
        ready.set()
        done.wait(30)

    t = threading.Thread(target=body)
    t.start()
    try:
        assert ready.wait(30)
        default = sched.current_slice(tid[0])
        got = sched.set_slice(tid[0], 250)
        if SUPPORTED:
            assert got == 250 and sched.current_slice(tid[0]) == 250
            assert sched.set_slice(tid[0], 0) == default == sched.current_slice(tid[0])
        else:
            assert got is None
    finally:
        done.set()
        t.join(30)


def test_no_such_syscall_is_a_no_op(monkeypatch):
    # numbers no kernel has: the real kernel answers ENOSYS to both calls
    monkeypatch.setattr(sched, "_NUMBERS", (1_000_000, 1_000_001))
    assert _in_thread(lambda: (sched.request_slice(200), sched.current_slice())) == (None, None)
    monkeypatch.setattr(sched, "_NUMBERS", None)         # not Linux, or an unknown machine
    assert _in_thread(lambda: (sched.request_slice(200), sched.current_slice())) == (None, None)


def test_no_c_library_to_call_through_is_a_no_op(monkeypatch):
    monkeypatch.setattr(sched, "_libc", object())        # no syscall() to call
    assert _in_thread(lambda: (sched.request_slice(200), sched.current_slice())) == (None, None)


def test_a_refused_request_is_a_no_op(monkeypatch):
    real = sched._syscall
    seen = []

    def refuse_set(nr, *args):               # EINVAL (e.g. a seccomp filter's answer)
        if sched._NUMBERS and nr == sched._NUMBERS[0]:
            seen.append(nr)
            return errno.EINVAL
        return real(nr, *args)

    monkeypatch.setattr(sched, "_syscall", refuse_set)
    before, got, after = _in_thread(lambda: (sched.current_slice(), sched.request_slice(200),
                                             sched.current_slice()))
    assert got is None and after == before
    assert seen or not SUPPORTED


def test_a_kernel_that_ignores_the_slice_is_reported_as_not_applied(monkeypatch):
    # before 6.12 sched_setattr takes a fair thread's sched_runtime and drops it,
    # and sched_getattr reports 0
    real = sched._syscall

    def old_kernel(nr, *args):
        if sched._NUMBERS and nr == sched._NUMBERS[0]:
            return 0
        err = real(nr, *args)
        ctypes.cast(args[1], ctypes.POINTER(sched._Attr)).contents.sched_runtime = 0
        return err

    monkeypatch.setattr(sched, "_syscall", old_kernel)
    assert _in_thread(lambda: (sched.request_slice(200), sched.current_slice())) == (None, None)
