#!/usr/bin/env python
"""The write bench with and without a short CPU time slice (ioThreadSliceMicros),
alternating A B B A on one cluster, so that the VM's drift hits both alike.

    python scripts/bench_slice.py                       # TLS, 4 pairs, 200 us vs the default
    python scripts/bench_slice.py --slice 100 --plaintext --sched

One cluster (3 bookies x 2 shards, TLS offered) serves every run. Per run the
slice of each shard worker's loop thread is set from here (bk.sched.set_slice;
the same user or root) and the client's I/O thread gets it through the
client's ioThreadSliceMicros, as a bookie with the setting would have them.
Prints each run (p50/p99/p99.9 ms, CPU us per entry, with --sched the wake-up
delay percentiles of bk-io and the worker loops), then the medians per variant
and the B/A ratio of p99 per pair.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bk import sched  # noqa: E402
from bk.bench.writes import bench_writes  # noqa: E402
from bk.localcluster import LocalCluster  # noqa: E402
from bk.security import pki  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--slice", type=int, default=200, help="B's slice in us (A: the default)")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--rate", type=float, default=30000, help="entries/s; 0: as fast as possible")
    p.add_argument("--plaintext", action="store_true", help="a plaintext run beside each TLS run")
    p.add_argument("--client-only", action="store_true", help="B: the slice on bk-io only")
    p.add_argument("--bookies-only", action="store_true", help="B: the slice on the workers only")
    p.add_argument("--sched", action="store_true", help="wake-up delays per thread (perf sched)")
    p.add_argument("--proc", action="store_true",
                   help="CPU us and context switches per entry (all processes, bk-io, workers)")
    p.add_argument("--json", metavar="FILE", help="write every run's result to FILE")
    a = p.parse_args()
    ca = pki.throwaway_ca("bk-bench-ca-")
    crt, key = ca.issue("bookie", ["127.0.0.1"])
    tls_conf = {"tlsCertificatePath": crt, "tlsKeyStore": key, "tlsRequired": False}
    modes = {"tls": {"tlsEnabled": True, "tlsTrustStore": ca.cert_path}}
    if a.plaintext:
        modes["plain"] = {}
    runs = []
    with tempfile.TemporaryDirectory(prefix="bk-bench-") as d:
        with LocalCluster(num_bookies=3, base_dir=d, num_shards=2, conf_overrides=tls_conf) as c:
            loops = [pid for b in c.bookies for pid in b.worker_pids()]
            for i in range(a.pairs):
                for variant in ("AB" if i % 2 == 0 else "BA"):
                    us = a.slice if variant == "B" else 0
                    got = [sched.set_slice(t, 0 if a.client_only else us) for t in loops]
                    for mode, conf in modes.items():
                        r = bench_writes(c.metadata_uri, duration=a.duration, rate=a.rate or None,
                                         sched=a.sched, proc=a.proc, ioThreadSliceMicros=0 if
                                         a.bookies_only else us, **conf)
                        r.update(variant=variant, mode=mode, pair=i, loop_slices=got)
                        runs.append(r)
                        show(r)
    summary(runs, modes)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f)


def _delays(r, kind):
    v = r.get("sched_delay_ms", {}).get(kind)
    return f" {kind} wake p99/p99.9 {v['p99']:.2f}/{v['p999']:.2f}" if v else ""


def show(r):
    lat = r["latency_ms"]
    print(f"pair {r['pair']} {r['variant']} {r['mode']:<5} slices {r['loop_slices']}: "
          f"p50 {lat['p50']:.2f} p99 {lat['p99']:.2f} p99.9 {lat['p99.9']:.2f} "
          f"max {r['latency_max_ms']:.1f} ms, {r['entries_per_sec']:.0f}/s, client CPU "
          f"{r['client_cpu_us_per_entry']} us/entry"
          + _delays(r, "client/bk-io") + _delays(r, "worker/main") + _cpu(r), flush=True)


def _cpu(r):
    pr = r.get("proc")
    if not pr:
        return ""
    out = f"; CPU in all {pr['cpu_us_total']} us/entry, run-queue wait {pr['wait_us_total']}"
    for k in ("client/bk-io", "worker/main"):
        v = pr["per_entry"].get(k)
        if v:
            out += (f"; {k} cpu {v['cpu_us']:.1f} wait {v['wait_us']:.1f} "
                    f"vcs/ics {v['vcs']:.3f}/{v['ics']:.3f}")
    return out


def summary(runs, modes):
    for mode in modes:
        for q in ("p99", "p99.9"):
            med = {v: statistics.median(r["latency_ms"][q] for r in runs
                                        if r["mode"] == mode and r["variant"] == v)
                   for v in "AB"}
            pairs = {}
            for r in runs:
                if r["mode"] == mode:
                    pairs.setdefault(r["pair"], {})[r["variant"]] = r["latency_ms"][q]
            ratios = [round(x["B"] / x["A"], 2) for x in pairs.values() if x["A"]]
            print(f"{mode} {q}: median A {med['A']:.2f} ms, B {med['B']:.2f} ms; "
                  f"B/A per pair {ratios}")
        rates = {v: [r["entries_per_sec"] for r in runs if r["mode"] == mode and r["variant"] == v]
                 for v in "AB"}
        print(f"{mode} entries/s: A {rates['A']}, B {rates['B']}; B/A "
              f"{sum(rates['B']) / max(1, sum(rates['A'])):.2f}")


if __name__ == "__main__":
    main()
