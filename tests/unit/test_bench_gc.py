"""bench_writes' account of the client process's cyclic GC (a gc.callbacks hook):
collections counted per generation only while measuring, with their pauses."""

import gc

from bk.bench.writes import GCWatch


def test_gc_watch_counts_collections_only_while_on():
    w = GCWatch()
    gc.callbacks.append(w)
    try:
        gc.collect()                    # before the measured time: not counted
        w.on = True
        gc.collect()
        gc.collect(1)
        w.on = False
        gc.collect()
    finally:
        gc.callbacks.remove(w)
    s = w.summary(2.0)
    assert s["gen2"]["per_sec"] == 0.5 and s["gen1"]["per_sec"] == 0.5
    assert s["gen2"]["max_ms"] > 0 and s["gen2"]["p50_ms"] == s["gen2"]["max_ms"]
