"""The client's I/O loop's thread-safe entry points, without bookies."""

import threading

from bk.client.connection import IOLoop


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
