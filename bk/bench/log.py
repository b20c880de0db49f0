"""Log benchmark (``bkshell bench log``): append throughput and tailing latency.

Phase 1: one writer appends ``record_size``-byte records with ``append_many``
(chunks of ``chunk`` records, batched into record sets by the writer) for
``duration`` seconds: records/s durable.

Phase 2: the writer appends (``append_many_async``: no Future per record) at
``rate_fraction`` of that rate (open loop, paced every millisecond) while a tailing reader in
another process (its own interpreter, so the two do not share a GIL) reads
the log; each record carries its append wall-clock time, so the reader
measures append-to-read latency (p50/p99/max). ``gc_off`` disables Python's
cyclic garbage collector in both processes during phase 2: its full
collections are most of the p99 at 100k-200k records/s.
"""

from __future__ import annotations

import gc
import multiprocessing
import struct
import time
import uuid

from bk.client.bookkeeper import BookKeeper

_STAMP = struct.Struct(">dQ")


def _percentile(sorted_values, p):
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, int(round(p / 100.0 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[k]


def _tail_reader(uri, name, expected, ready, out, gc_off=False):
    """Child process: tail ``name`` from its earliest record until ``expected``
    records arrived; send back the latencies' percentiles."""
    lat = []
    with BookKeeper(uri) as c:
        r = c.open_log_reader(name, start="earliest")
        r.read_next(timeout=60)       # the writer's warm-up record: both are connected
        gc.freeze()                   # see bench_log
        if gc_off:
            gc.disable()
        ready.set()
        unpack = _STAMP.unpack_from
        deadline = time.monotonic() + 120
        while len(lat) < expected and time.monotonic() < deadline:
            for rec in r.read_batch(10_000, timeout=1.0):
                lat.append(time.time() - unpack(rec.data)[0])
        r.close()
    lat.sort()
    out.send({"records": len(lat),
              "latency_ms": {f"p{p}": round(_percentile(lat, p) * 1000, 2)
                             for p in (50, 90, 99, 99.9)},
              "latency_max_ms": round(lat[-1] * 1000, 2) if lat else None})


def bench_log(uri, record_size=100, duration=10.0, ensemble=3, write_quorum=3, ack_quorum=2,
              rate_fraction=0.5, chunk=50_000, latency_duration=None, tail_rate=None,
              gc_off=False, **writer_opts) -> dict:
    if record_size < _STAMP.size:
        raise ValueError(f"record size must be at least {_STAMP.size} bytes")
    shape = dict(ensemble_size=ensemble, write_quorum_size=write_quorum,
                 ack_quorum_size=ack_quorum)
    result = {"record_size": record_size, "ensemble": ensemble, "write_quorum": write_quorum,
              "ack_quorum": ack_quorum, **writer_opts}
    with BookKeeper(uri) as c:
        # --- phase 1: throughput -------------------------------------------------------
        name = f"bench-{uuid.uuid4().hex[:8]}"
        w = c.open_log_writer(name, **shape, **writer_opts)
        rec = b"x" * record_size
        batch = [rec] * chunk
        w.append_many(batch[:1000])                 # warm-up: connections, first entries
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duration:
            w.append_many(batch)
            n += chunk
        secs = time.perf_counter() - t0
        w.close()
        info = c.log_info(name)
        result.update(records=n, seconds=round(secs, 3), records_per_sec=round(n / secs),
                      mb_per_sec=round(n * record_size / secs / 1e6, 2),
                      entries=sum(max(0, s["last_entry_id"] + 1) for s in info.segments))
        # Deleted only at the end: the bookies' garbage collection of a GB of
        # deleted ledgers (unlinking journal segments) would stall phase 2.
        first_log = name

        # --- phase 2: tailing latency at a fraction of that rate ------------------------
        rate = tail_rate or max(1.0, result["records_per_sec"] * rate_fraction)
        secs2 = latency_duration or duration
        expected = int(rate * secs2)
        name = f"bench-{uuid.uuid4().hex[:8]}"
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Event()
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_tail_reader,
                           args=(uri, name, expected, ready, child, gc_off), daemon=True)
        w = c.open_log_writer(name, **shape, **writer_opts)
        w.append(b"warm-up")
        # Full collections of the interpreter's heap (modules, gRPC, ...) were the
        # p99: keep what exists now out of them, as a long-running service would.
        gc.freeze()
        if gc_off:
            gc.disable()
        proc.start()
        try:
            if not ready.wait(60):
                raise RuntimeError("the tailing reader did not start")
            pad = bytes(record_size - _STAMP.size)
            pack = _STAMP.pack
            sent = 0
            t0 = time.perf_counter()
            while sent < expected:
                due = min(expected, int((time.perf_counter() - t0) * rate) + 1)
                if due > sent:
                    now = time.time()
                    w.append_many_async([pack(now, i) + pad for i in range(sent, due)])
                    sent = due
                time.sleep(0.001)
            w.flush()
            send_secs = time.perf_counter() - t0
            if not parent.poll(120):
                raise RuntimeError("the tailing reader did not finish")
            tail = parent.recv()
            w.close()
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        c.delete_log(name)
        c.delete_log(first_log)
        if gc_off:
            gc.enable()
        result["tail"] = {"rate": round(rate), "gc_off": gc_off, "records_sent": sent,
                          "achieved_rate": round(sent / send_secs), **tail}
    return result
