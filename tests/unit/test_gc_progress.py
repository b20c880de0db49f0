"""A long full reconcile says how far it got (bk.bookie.gc._Progress): in the GC
state while it runs, in the bookie's log every PROGRESS_EVERY seconds and at its
end; a short one logs nothing."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

from bk.bookie import gc as G


def collector():
    return SimpleNamespace(_lock=threading.Lock(), _checking=None)


def test_progress_shows_in_the_state_and_in_the_log_of_a_long_reconcile(caplog, monkeypatch):
    gc = collector()
    rnd = G.GcRound(True, "interval", set(), 0, [0, 1])
    monkeypatch.setattr(G, "PROGRESS_EVERY", 0.0)     # every group counts as long
    with caplog.at_level(logging.INFO, logger="bk.bookie.gc"):
        p = G._Progress(gc, rnd, [0, 1], 300_000)
        assert gc._checking == {"shards": [0, 1], "reason": "interval", "checked": 0,
                                "ledgers": 300_000}
        p(120_000, 300_000)
        assert gc._checking["checked"] == 120_000
        p.finished(7)
    lines = [r.getMessage() for r in caplog.records]
    assert "gc: full reconcile (interval), shards 0,1: 120000 of 300000 ledgers checked" \
        in lines[0]
    assert "300000 ledgers checked in" in lines[1] and "7 without metadata" in lines[1]


def test_a_short_reconcile_logs_nothing(caplog):
    gc = collector()
    rnd = G.GcRound(True, "start", set(), 0, [0])
    with caplog.at_level(logging.INFO, logger="bk.bookie.gc"):
        p = G._Progress(gc, rnd, [0], 10)
        p(10, 10)
        p.finished(0)
    assert gc._checking["checked"] == 10
    assert not caplog.records
