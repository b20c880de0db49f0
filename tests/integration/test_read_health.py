"""Reads around a bookie that does not answer (SIGSTOPped, on loopback): a
speculative read to the next replica, and a quarantined bookie read from last."""

import signal
import threading

import bk
from bk.exposition import client_metrics
from bk.testing import stop_bookie, wait_until


def _read_in_thread(h, first, last):
    out = {}

    def run():
        try:
            out["entries"] = h.read_entries(first, last)
        except Exception as e:          # reported by the test
            out["error"] = e
    threading.Thread(target=run, daemon=True).start()
    return out


def test_speculative_read_goes_to_the_next_replica(cluster):
    with bk.BookKeeper(cluster.metadata_uri) as w:
        lh = w.create_ledger(3, 3, 2)
        lh.add_entries([b"e%d" % i for i in range(6)])
        lh.close()
    first = lh.metadata.last_ensemble[0]       # entry 0's first replica
    paused = cluster.bookie(first)
    spec = client_metrics().speculative_reads
    before = spec._value.get()
    with bk.BookKeeper(cluster.metadata_uri, speculativeReadTimeout=200,
                       readEntryTimeoutSec=120) as r:
        h = r.open_ledger_no_recovery(lh.ledger_id)
        h.read_entries(0, 5)          # connections up: the pause below is a silent peer
        stop_bookie(paused)
        try:
            out = _read_in_thread(h, 0, 0)
            # without speculation this waits readEntryTimeoutSec (120 s)
            wait_until(lambda: out, timeout=30, what="the read answered by another replica")
            assert "error" not in out, out.get("error")
            assert [e.data for e in out["entries"]] == [b"e0"]
            assert spec._value.get() > before
            # a whole range whose first replica is paused: every entry still arrives
            out = _read_in_thread(h, 0, 5)
            wait_until(lambda: out, timeout=30, what="the range read, speculated")
            assert [e.data for e in out["entries"]] == [b"e%d" % i for i in range(6)]
        finally:
            paused.kill(signal.SIGCONT)


def test_quarantined_bookie_is_read_from_last(cluster):
    with bk.BookKeeper(cluster.metadata_uri) as w:
        lh = w.create_ledger(3, 3, 2)
        lh.add_entries([b"q%d" % i for i in range(9)])
        lh.close()
    victim = cluster.bookie(lh.metadata.last_ensemble[0])
    with bk.BookKeeper(cluster.metadata_uri, speculativeReadTimeout=0,
                       readEntryTimeoutSec=1, clientConnectTimeoutMillis=1000) as r:
        stop_bookie(victim)
        try:
            h = r.open_ledger_no_recovery(lh.ledger_id)
            assert [e.data for e in h.read_entries(0, 8)] == [b"q%d" % i for i in range(9)]
            health = r.bookie_health()
            assert health[victim.bookie_id]["quarantined"] is True
            failures = health[victim.bookie_id]["failures"]
            # later reads go to the healthy replicas first: no new failure
            for _ in range(3):
                h2 = r.open_ledger_no_recovery(lh.ledger_id)
                assert [e.data for e in h2.read_entries(0, 8)] == [b"q%d" % i for i in range(9)]
            assert r.bookie_health()[victim.bookie_id]["failures"] == failures
        finally:
            victim.kill(signal.SIGCONT)
