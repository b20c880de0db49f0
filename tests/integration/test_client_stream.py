"""A stream of asynchronous adds with callbacks on one ledger (E3 Qw3 Qa2: every
bookie gets the same ADD_BATCH frames, built once per write quorum) while a
bookie of its ensemble dies (kill -9) or hangs (SIGSTOP), plaintext and TLS:
callbacks come in entry order with dense ids and no error, the lost bookie is
replaced, and every acknowledged entry reads back as written."""

import threading

import pytest

from bk.meta.ledger import LedgerState
from bk.testing import bookie_lost, wait_until

pytestmark = pytest.mark.timeout(240)

PW = b"stream"


def _payload(i):
    return (b"s%d-" % i).ljust(700 + i % 600, b"p")


class _Stream:
    """Writes ``add_entry_async(data, callback)`` from one thread, up to ``window``
    unacknowledged, until stopped; ``calls`` lists each callback's (exc, entry id)
    in the order the client called them."""

    def __init__(self, lh, window=200):
        self.lh = lh
        self.window = window
        self.calls = []
        self.sent = []
        self.stop = threading.Event()
        self.errors = []
        self._cond = threading.Condition()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _done(self, exc, entry_id):
        with self._cond:
            self.calls.append((exc, entry_id))
            self._cond.notify()

    def _run(self):
        try:
            i = 0
            while not self.stop.is_set():
                with self._cond:
                    while i - len(self.calls) >= self.window and not self.stop.is_set():
                        self._cond.wait(0.1)
                burst = min(25, self.window - (i - len(self.calls)))
                for _ in range(burst):
                    data = _payload(i)
                    self.sent.append(data)
                    self.lh.add_entry_async(data, self._done)
                    i += 1
        except Exception as e:          # asserted by the test
            self.errors.append(e)

    def acked(self):
        return len(self.calls)


@pytest.mark.parametrize("secure", [False, True], ids=["plaintext", "tls"])
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_async_stream_survives_a_bookie_lost(cluster_factory, how, secure):
    # five bookies: a busy machine may make a second one miss addEntryTimeoutSec
    # (it is then replaced too, which must not leave the writer without bookies)
    cluster = cluster_factory(5, num_shards=1, secure=secure)
    with cluster.client(timeout=5, addEntryTimeoutSec=3, **cluster.client_settings()) as client:
        lh = client.create_ledger(3, 3, 2, password=PW)
        s = _Stream(lh)
        try:
            wait_until(lambda: s.acked() >= 2000 or s.errors, 60, "2000 adds acknowledged")
            assert not s.errors, s.errors
            victim = cluster.bookie(lh.metadata.last_ensemble[1])
            mark = s.acked()
            with bookie_lost(victim, how):
                try:
                    # a hung bookie is replaced once its oldest unconfirmed add is
                    # addEntryTimeoutSec old (Qa keeps acknowledging meanwhile)
                    wait_until(lambda: victim.bookie_id not in lh.metadata.last_ensemble
                               or s.errors, 90, "the lost bookie replaced")
                    wait_until(lambda: s.acked() >= mark + 3000 or s.errors, 90,
                               "3000 more adds acknowledged after the loss")
                    mark = s.acked()
                    wait_until(lambda: s.acked() >= mark + 1000 or s.errors, 90,
                               "1000 more adds acknowledged by the new ensemble")
                finally:
                    s.stop.set()
                    s.thread.join(30)
            assert not s.errors, s.errors
            lh.close()
        finally:
            s.stop.set()
        n = len(s.sent)
        assert [e for e, _ in s.calls if e is not None] == [], "an add failed"
        assert [eid for _, eid in s.calls] == list(range(n)), \
            "callbacks out of entry order, or ids not dense"
        md = client.ledger_metadata(lh.ledger_id)
        assert md.state == LedgerState.CLOSED and md.last_entry_id == n - 1
        assert victim.bookie_id in md.ensembles[0][1]
        assert victim.bookie_id not in md.last_ensemble
        rh = client.open_ledger_no_recovery(lh.ledger_id, password=PW)
        got = [e.data for e in rh.read_entries(0, n - 1)]
        assert got == s.sent, "what was read differs from what was acknowledged"
        assert rh.length == sum(map(len, s.sent))
