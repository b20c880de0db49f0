"""The arbiter <-> worker control channel without processes: a socketpair in memory,
the vocabulary declared once, dispatch by name."""
import os

from bk.bookie import control
from bk.bookie.arbiter import Arbiter


class Recorder:
    def __init__(self):
        self.calls = []

    def handle_readonly(self, flag):
        self.calls.append(("readonly", flag))

    def handle_conn(self, body, fds):
        self.calls.append(("conn", body, len(fds)))
        for fd in fds:
            os.close(fd)


def test_messages_reach_their_handler_with_their_descriptors():
    a, w = control.pair()
    r, x = os.pipe()
    try:
        control.send(a, "readonly", True)
        control.send(a, "conn", b"hello", fds=[r])
        rec = Recorder()
        for _ in range(2):
            msg, fds = control.recv(w)
            control.dispatch(rec, control.TO_WORKER, msg, fds=fds)
        assert rec.calls == [("readonly", True), ("conn", b"hello", 1)]
    finally:
        for s in (a, w):
            s.close()
        os.close(r)
        os.close(x)


def test_unknown_or_unhandled_messages_are_logged_and_their_descriptors_closed(caplog):
    rec = Recorder()
    r, x = os.pipe()
    try:
        control.dispatch(rec, control.TO_WORKER, ["launch_missiles", 1], fds=[r])
        control.dispatch(rec, control.TO_WORKER, ["stop"])          # declared, not handled
        assert rec.calls == []
        assert caplog.text.count("not understood") == 2
        try:
            os.fstat(r)
            assert False, "the descriptor of an unknown message stayed open"
        except OSError:
            pass
    finally:
        os.close(x)


def test_the_arbiter_handles_every_message_a_worker_sends():
    missing = [n for n in control.TO_ARBITER if not hasattr(Arbiter, f"handle_{n}")]
    assert not missing
    for sig in ("term", "int", "usr1"):
        assert hasattr(Arbiter, f"handle_{sig}")


def test_chunked_lists_arrive_whole():
    a, w = control.pair()
    try:
        items = list(range(control.CHUNK * 2 + 5))
        control.send_chunked(a, "gc_ledgers", items)
        got, last = [], False
        while not last:
            (name, chunk, last), _ = control.recv(w)
            assert name == "gc_ledgers"
            got += chunk
        assert got == items
    finally:
        a.close()
        w.close()
