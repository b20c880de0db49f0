"""Write benchmark, modelled on BookKeeper's BenchThroughputLatency.

One client writes fixed-size entries to ``ledgers`` ledgers round-robin with
at most ``window`` adds outstanding (or at a fixed ``rate``), for ``duration``
seconds, and measures each add's latency from submission to acknowledgement.
Entries are acknowledged in order per ledger, so a per-ledger FIFO of send
times gives each acknowledgement its latency without a closure per entry.
"""

from __future__ import annotations

import collections
import gc
import threading
import time

from bk.bench import procstats
from bk.client.bookkeeper import BookKeeper
from bk.errors import BKError


class _LedgerStats:
    """Acknowledgement callback of one ledger (runs on the client's I/O thread)."""

    __slots__ = ("sent", "lat", "bench", "errors")

    def __init__(self, bench):
        self.sent = collections.deque()
        self.lat = []
        self.bench = bench
        self.errors = 0

    def __call__(self, exc, entry_id):
        t0 = self.sent.popleft()
        if exc is None:
            self.lat.append(time.perf_counter() - t0)
        else:
            self.errors += 1
            self.bench.error = exc
        b = self.bench
        b.acked += 1
        if b.waiting and b.acked >= b.wake_at:
            b.waiting = False       # notify once, not once per acknowledgement until it runs
            with b.cond:
                b.cond.notify()


class _Bench:
    def __init__(self):
        self.acked = 0
        self.waiting = False
        self.wake_at = 0        # acked count at which a waiting submitter is woken
        self.cond = threading.Condition()
        self.error = None


class GCWatch:
    """The client process's cyclic garbage collections over a measured time (a
    ``gc.callbacks`` hook): collections per generation and their pauses. A full
    (generation 2) collection of a client holding many objects stops every
    Python thread, the I/O thread included, for tens of milliseconds."""

    def __init__(self):
        self.pauses = ([], [], [])
        self._t0 = 0.0
        self.on = False

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.on:
            self.pauses[info["generation"]].append(time.perf_counter() - self._t0)

    def summary(self, seconds) -> dict:
        """Per generation: collections per second, p50 / p99 / max pause in ms."""
        out = {}
        for gen, p in enumerate(self.pauses):
            p = sorted(p)
            out[f"gen{gen}"] = {"per_sec": round(len(p) / seconds, 1) if seconds else None,
                                "p50_ms": round(percentile(p, 50) * 1e3, 3),
                                "p99_ms": round(percentile(p, 99) * 1e3, 3),
                                "max_ms": round(p[-1] * 1e3, 3) if p else None}
        return out


def percentile(sorted_values, p):
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, int(round(p / 100.0 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[k]


def bench_writes(uri, ensemble=3, write_quorum=3, ack_quorum=2, entry_size=1024, duration=10.0,
                 window=1000, ledgers=1, rate=None, warmup=1.0, client=None, proc=False,
                 sched=False, gc_mode="collect", **conf) -> dict:
    """Write for ``duration`` s; return throughput and latency percentiles.

    ``window``: most adds outstanding over all ledgers (BookKeeper's throttle).
    ``rate``: if given, submit at this many entries/s (open loop, still bounded
    by ``window``) to measure latency under a fixed load. The first ``warmup``
    seconds are not measured. ``proc``: also CPU and context switches per entry
    of this process and its children (bookies, etcd) over the measured time
    (:mod:`bk.bench.procstats`). ``sched``: also each thread's scheduling delay
    per wake-up, as percentiles (``perf sched``; needs perf and root).
    ``gc_mode``: what the bench process (the application) does about garbage
    collection once the client and its ledgers exist: "collect" (the default)
    runs a full collection then, so that the debt of building this run's client
    (and of earlier runs') is not paid inside the measured time, as a
    long-running application pays it once; "default" does nothing; "freeze"
    also moves every object alive then out of the collector's reach
    (``gc.freeze``) for the run. The library itself never changes a process's
    GC policy; results say which mode they were measured in.
    """
    if gc_mode not in ("default", "collect", "freeze"):
        raise ValueError(f"gc_mode must be 'default', 'collect' or 'freeze', not {gc_mode!r}")
    own = client is None
    if own:
        conf.setdefault("throttle", max(window, 1))
        client = BookKeeper(uri, **conf)
    rec = delays = snaps = None
    gcw = GCWatch()
    gc.callbacks.append(gcw)
    try:
        if sched:                   # recording through the warm-up
            rec = procstats.SchedRecord()
            if not rec.start():
                rec = None
        handles = [client.create_ledger(ensemble, write_quorum, ack_quorum,
                                        digest_type="crc32c", password=b"bench")
                   for _ in range(ledgers)]
        b = _Bench()
        stats = [_LedgerStats(b) for _ in handles]
        if proc:                    # /proc is read by a helper process (see Snapshots)
            snaps = procstats.Snapshots()
        if gc_mode != "default":
            gc.collect()
            if gc_mode == "freeze":
                gc.freeze()
        payload = bytes(entry_size)
        sent = 0
        t_start = time.perf_counter()
        t_measure = t_start + warmup
        t_end = t_measure + duration
        marks = None
        lag = 0.0
        step = max(1, window // 8)
        i = 0
        n = len(handles)
        pc = time.perf_counter
        while True:
            now = pc()
            if now >= t_end:
                break
            if marks is None and now >= t_measure:
                marks = (now, b.acked, [len(s.lat) for s in stats], time.process_time())
                gcw.on = True
                if snaps is not None:
                    snaps.request()     # returns at once: the helper reads /proc
                mono0 = time.monotonic()
            if b.error is not None:
                raise b.error
            if sent - b.acked >= window:
                # A full window is refilled in steps of window/8, like an application
                # submitting in batches: waking the submitter for every acknowledgement
                # would cost a thread switch per entry, which is the load generator's
                # cost, not the client's.
                with b.cond:
                    b.wake_at = sent - window + step
                    b.waiting = True
                    if sent - b.acked >= window:
                        b.cond.wait(0.01)
                    b.waiting = False
                continue
            if rate:
                # Open loop at a fixed rate, paced in 1 ms steps: sleeping between
                # single entries would cost more (GIL hand-offs) than the adds.
                behind = (now - t_start) * rate - sent
                if behind <= 0:
                    time.sleep(0.001)
                    continue
                if behind > lag and marks is not None:
                    lag = behind        # entries owed: the generator was held up
            k = i % n
            k = i % n
            i += 1
            st = stats[k]
            st.sent.append(pc())
            handles[k].add_entry_async(payload, st)
            sent += 1
        t_stop = pc()
        gcw.on = False
        cpu_stop = time.process_time()
        acked_at_stop = b.acked
        mono1 = time.monotonic()
        snap0 = snap1 = None
        if snaps is not None and marks is not None:
            snaps.request()
            snap0, snap1 = snaps.result(), snaps.result()
        if rec is not None:
            delays = rec.stop(snap1 or procstats.snapshot(), mono0 if marks else 0.0, mono1)
            rec = None
        # drain
        deadline = time.monotonic() + 30
        while b.acked < sent and time.monotonic() < deadline:
            time.sleep(0.005)
        if marks is None:
            marks = (t_start, 0, [0] * n, cpu_stop)
        elapsed = t_stop - marks[0]
        count = acked_at_stop - marks[1]
        lat = sorted(x for s, skip in zip(stats, marks[2]) for x in s.lat[skip:])
        for h in handles:
            try:
                h.close()
            except BKError:
                pass
        rate_measured = count / elapsed if elapsed > 0 else 0.0
        res = {
            "entries": count,
            "seconds": round(elapsed, 3),
            "entries_per_sec": round(rate_measured, 1),
            "mb_per_sec": round(rate_measured * entry_size / 1e6, 2),
            "latency_ms": {f"p{p}": round(percentile(lat, p) * 1000, 3)
                           for p in (50, 95, 99, 99.9)},
            "latency_max_ms": round(lat[-1] * 1000, 3) if lat else None,
            "errors": sum(s.errors for s in stats),
            # open loop: how far the submissions fell behind their schedule at worst
            # (the generator held up: a pause of the bench, not of the client's adds)
            "generator_lag_max_ms": round(lag / rate * 1000, 2) if rate else None,
            # CPU of this whole client process (all threads) per acknowledged entry
            "client_cpu_us_per_entry": round((cpu_stop - marks[3]) / count * 1e6, 1)
            if count else None,
            "ensemble": ensemble, "write_quorum": write_quorum, "ack_quorum": ack_quorum,
            "entry_size": entry_size, "window": window, "ledgers": ledgers, "rate": rate,
            "batching": bool(client.conf.frameBatching),
            # the client process's cyclic GC over the measured time
            "gc": gcw.summary(elapsed), "gc_mode": gc_mode,
            # the measured time on the clock every process shares (time.monotonic),
            # to line other processes' traces up with it (scripts/trace_adds.py)
            "window_monotonic": [mono0, mono1] if count else None,
        }
        if snap1 is not None:
            res["proc"] = procstats.per_entry(snap0, snap1, count)
        if sched and delays is not None:
            res["sched_delay_ms"] = delays
        return res
    finally:
        gc.callbacks.remove(gcw)
        if gc_mode == "freeze":
            gc.unfreeze()
        if rec is not None:         # the run failed before it was measured
            rec.cancel()
        if snaps is not None:
            snaps.close()
        if own:
            client.close()


def compare_writes(uri, **kw) -> dict:
    """The same benchmark with the single-entry path (``frameBatching=false``), then
    with batched frames, in one run; returns both and their ratios."""
    single = bench_writes(uri, frameBatching=False, **kw)
    batched = bench_writes(uri, frameBatching=True, **kw)

    def ratio(a, b):
        return round(a / b, 2) if a and b else None
    return {"single": single, "batched": batched, "ratio": {
        "entries_per_sec": ratio(batched["entries_per_sec"], single["entries_per_sec"]),
        "client_cpu_us_per_entry": ratio(batched["client_cpu_us_per_entry"],
                                         single["client_cpu_us_per_entry"]),
        "p99": ratio(batched["latency_ms"]["p99"], single["latency_ms"]["p99"])}}
