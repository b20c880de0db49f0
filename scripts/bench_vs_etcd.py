#!/usr/bin/env python
"""Durable 1 KiB writes: bk (E=3 Qw=3 Qa=2) against a 3-member etcd cluster.

    .venv/bin/python scripts/bench_vs_etcd.py                  # 10 s per measurement
    .venv/bin/python scripts/bench_vs_etcd.py --duration 20 --writers 8,32,128 --json

What runs, all on this machine:

* a 3-member etcd cluster (``EtcdCluster``) that receives the etcd puts;
* three bookies (``LocalCluster``, 2 shards each) whose metadata lives in a
  separate single etcd server of their own (metadata is off the write path:
  a bk add touches only the bookies), so the two systems never share an etcd.

etcd: every put is durable when acknowledged (raft commit + WAL fsync on a
quorum, etcd's defaults). Writers are client threads spread over worker
processes (``spawn``ed, each with its own gRPC channel, endpoints assigned
round-robin over the 3 members, like etcd's own ``benchmark put``); keys are
unique. Several writer counts are tried and the fastest is compared, because
etcd batches concurrent proposals into one fsync and only goes fast with many
writers.

bk: ``bk.bench.writes.bench_writes`` (one client, pipelined adds, ``--window``
outstanding), every add acknowledged by 2 of 3 bookies after their group
commit (msync). Measured at full speed, and also open-loop at etcd's best
throughput, so that latencies are compared at the same load too.

The first second of each measurement is warm-up and not counted. Latencies are
from submission to acknowledgement, in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _pct(sorted_values, p):
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, int(round(p / 100.0 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[k]


# --- etcd writer processes -------------------------------------------------------------------

def _etcd_worker(endpoints, first_ep, threads, value_size, start, t_measure, t_end, wid, out,
                 mode="threads"):
    """One process putting unique keys until t_end: ``threads`` blocking writer threads
    (mode "threads"), or one thread keeping ``threads`` puts in flight with gRPC
    futures (mode "async", far less client CPU per put)."""
    from pyetcd.client import Endpoint, MultiEndpointEtcd3Client
    host, port = endpoints[first_ep % len(endpoints)]
    client = MultiEndpointEtcd3Client(endpoints=[Endpoint(host, port, secure=False)],
                                      timeout=30, failover=False)
    value = os.urandom(value_size)
    results = [None] * threads
    client.get("/bench/warm")                  # connect before the common start
    time.sleep(max(0.0, start - time.time()))
    if mode == "async":
        out.put(_async_puts(client, threads, value, t_measure, t_end, wid))
        return

    def writer(t):
        lat = []
        errors = 0
        n = 0
        clock = time.time
        key_prefix = f"/bench/{wid}-{t}-"
        while True:
            t0 = clock()
            if t0 >= t_end:
                break
            try:
                client.put(key_prefix + str(n), value)
            except Exception:
                errors += 1
                continue
            t1 = clock()
            n += 1
            if t0 >= t_measure and t1 <= t_end:
                lat.append(t1 - t0)
        results[t] = (lat, errors)

    ts = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    lat = [x for r in results for x in r[0]]
    out.put((lat, sum(r[1] for r in results)))
    client.close()


def _async_puts(client, window, value, t_measure, t_end, wid):
    from pyetcd import etcdrpc
    stub = client.kvstub
    sem = threading.Semaphore(window)
    lat = []
    errors = [0]
    clock = time.time

    def done(fut, t0):
        t1 = clock()
        if fut.exception() is not None:
            errors[0] += 1
        elif t0 >= t_measure and t1 <= t_end:
            lat.append(t1 - t0)
        sem.release()

    n = 0
    prefix = f"/bench/{wid}-a-".encode()
    while True:
        sem.acquire()
        t0 = clock()
        if t0 >= t_end:
            break
        f = stub.Put.future(etcdrpc.PutRequest(key=prefix + str(n).encode(), value=value), 30,
                            credentials=client.call_credentials, metadata=client.metadata)
        f.add_done_callback(lambda fut, t0=t0: done(fut, t0))
        n += 1
    for _ in range(window - 1):     # wait for the outstanding puts
        sem.acquire(timeout=30)
    return list(lat), errors[0]


def bench_etcd(endpoints, writers, procs, value_size, duration, warmup=1.0,
               mode="threads") -> dict:
    ctx = mp.get_context("spawn")
    procs = max(1, min(procs, writers))
    per = [writers // procs + (1 if i < writers % procs else 0) for i in range(procs)]
    out = ctx.Queue()
    start = time.time() + 2.0 + 0.2 * procs       # time for the spawned interpreters to start
    t_measure = start + warmup
    t_end = t_measure + duration
    ps = [ctx.Process(target=_etcd_worker,
                      args=(endpoints, i, n, value_size, start, t_measure, t_end, i, out,
                            mode))
          for i, n in enumerate(per)]
    for p in ps:
        p.start()
    lat, errors = [], 0
    for _ in ps:
        l, e = out.get(timeout=duration + warmup + 120)
        lat.extend(l)
        errors += e
    for p in ps:
        p.join(30)
    lat.sort()
    return {
        "system": "etcd", "client": mode, "writers": writers, "processes": procs,
        "puts": len(lat), "seconds": duration,
        "ops_per_sec": round(len(lat) / duration, 1),
        "latency_ms": {f"p{p}": round(_pct(lat, p) * 1000, 3) for p in (50, 99, 99.9)},
        "errors": errors,
    }


def clear_etcd(endpoints):
    from pyetcd.client import Endpoint, MultiEndpointEtcd3Client
    host, port = endpoints[0]
    c = MultiEndpointEtcd3Client(endpoints=[Endpoint(host, port, secure=False)], timeout=60,
                                 failover=False)
    c.delete_prefix("/bench/")
    try:   # keep the next run's database as small as the first one's
        c.compact(c.get_response(b"/x").header.revision)
    except Exception:
        pass
    c.close()


# --- main ---------------------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=10.0, help="seconds measured per run")
    p.add_argument("--entry-size", type=int, default=1024)
    p.add_argument("--writers", default="1,16,64,256",
                   help="etcd concurrent writer counts to try (comma-separated)")
    p.add_argument("--etcd-client", default="threads,async",
                   help="etcd writer styles to try: threads (blocking puts, one per thread), "
                        "async (gRPC futures, N puts in flight per process)")
    p.add_argument("--procs", type=int, default=0,
                   help="etcd writer processes (default: CPU count, at least 2)")
    p.add_argument("--window", type=int, default=1000, help="bk adds outstanding")
    p.add_argument("--ledgers", type=int, default=1, help="bk ledgers written round-robin")
    p.add_argument("--shards", type=int, default=2, help="shards per bookie")
    p.add_argument("--dir", default=None, help="where the data goes (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON document at the end")
    a = p.parse_args()

    from bk.bench.writes import bench_writes
    from bk.meta.etcd_server import EtcdCluster
    from bk.localcluster import LocalCluster

    base = a.dir or tempfile.mkdtemp(prefix="bk-vs-etcd-")
    procs = a.procs or max(2, os.cpu_count() or 1)
    writer_counts = [int(x) for x in a.writers.split(",") if x.strip()]
    say = (lambda *x: print(*x, file=sys.stderr, flush=True))
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version(), "dir": base},
              "entry_size": a.entry_size, "duration": a.duration,
              "layout": "etcd: 3-member cluster for the etcd puts; bk: 3 bookies with their "
                        "metadata in a separate single etcd"}
    etcd = EtcdCluster(os.path.join(base, "etcd-cluster"), size=3)
    cluster = LocalCluster(num_bookies=3, base_dir=os.path.join(base, "bk"),
                           num_shards=a.shards,
                           conf_overrides={"journalPreAllocSizeMB": 256})
    try:
        say(f"starting a 3-member etcd cluster and 3 bookies in {base} ...")
        etcd.start()
        cluster.start()
        endpoints = [(m.host, m.client_port) for m in etcd.members]

        runs = []
        for mode in [m.strip() for m in a.etcd_client.split(",") if m.strip()]:
            for w in writer_counts:
                say(f"etcd ({mode}): {w} concurrent writers for {a.duration:g}s ...")
                r = bench_etcd(endpoints, w, procs, a.entry_size, a.duration, mode=mode)
                say(f"  {r['ops_per_sec']:.0f} puts/s  p50 {r['latency_ms']['p50']} ms  "
                    f"p99 {r['latency_ms']['p99']} ms  errors {r['errors']}")
                runs.append(r)
                clear_etcd(endpoints)
        best_etcd = max(runs, key=lambda r: r["ops_per_sec"])
        result["etcd_runs"] = runs

        say(f"bk: E=3 Qw=3 Qa=2, window {a.window}, {a.ledgers} ledger(s), full speed for "
            f"{a.duration:g}s ...")
        bkr = bench_writes(cluster.metadata_uri, 3, 3, 2, a.entry_size, a.duration, a.window,
                           a.ledgers)
        say(f"  {bkr['entries_per_sec']:.0f} adds/s  p50 {bkr['latency_ms']['p50']} ms  "
            f"p99 {bkr['latency_ms']['p99']} ms  errors {bkr['errors']}")
        rate = best_etcd["ops_per_sec"]
        say(f"bk: open loop at etcd's best rate, {rate:.0f}/s ...")
        bkl = bench_writes(cluster.metadata_uri, 3, 3, 2, a.entry_size, a.duration, a.window,
                           a.ledgers, rate=rate)
        say(f"  {bkl['entries_per_sec']:.0f} adds/s  p50 {bkl['latency_ms']['p50']} ms  "
            f"p99 {bkl['latency_ms']['p99']} ms")
        result["bk_max"] = bkr
        result["bk_at_etcd_rate"] = bkl
        result["best_etcd"] = best_etcd
        ratio = bkr["entries_per_sec"] / best_etcd["ops_per_sec"] if best_etcd["ops_per_sec"] \
            else float("inf")
        result["throughput_ratio_bk_over_etcd"] = round(ratio, 2)
        result["p99_ms"] = {"etcd_best": best_etcd["latency_ms"]["p99"],
                            "bk_max": bkr["latency_ms"]["p99"],
                            "bk_at_etcd_rate": bkl["latency_ms"]["p99"]}
    finally:
        cluster.stop()
        etcd.stop()
        if not a.dir:
            import shutil
            shutil.rmtree(base, ignore_errors=True)

    if a.json:
        print(json.dumps(result, indent=1))
        return
    e, b, bl = result["best_etcd"], result["bk_max"], result["bk_at_etcd_rate"]
    print(f"\n{a.entry_size}-byte durable writes, {a.duration:g}s each, {os.cpu_count()} CPUs "
          f"({platform.platform()})")
    print(f"{'':34}{'ops/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
    for r in runs:
        print(f"{'etcd %s, %d writers' % (r['client'], r['writers']):34}{r['ops_per_sec']:>10.0f}"
              f"{r['latency_ms']['p50']:>10.2f}{r['latency_ms']['p99']:>10.2f}")
    print(f"{'bk E3 Qw3 Qa2, window %d' % a.window:34}{b['entries_per_sec']:>10.0f}"
          f"{b['latency_ms']['p50']:>10.2f}{b['latency_ms']['p99']:>10.2f}")
    print(f"{'bk at %.0f/s (etcd best rate)' % e['ops_per_sec']:34}{bl['entries_per_sec']:>10.0f}"
          f"{bl['latency_ms']['p50']:>10.2f}{bl['latency_ms']['p99']:>10.2f}")
    print(f"\nthroughput bk / etcd (best, {e['writers']} writers): "
          f"{result['throughput_ratio_bk_over_etcd']}x ({e['client']} client); p99 at full speed: bk "
          f"{b['latency_ms']['p99']} ms vs etcd {e['latency_ms']['p99']} ms")


if __name__ == "__main__":
    main()
