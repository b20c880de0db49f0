#!/usr/bin/env python3
"""What the bookie's metrics cost: scripts/bench_bookie.py with enableStatistics
on and off, alternating (on, off, on, off, ...) so that a noisy machine hits both
alike. Prints each run and the medians of adds/s and shard-worker CPU per add.

    scripts/bench_metrics.py                     # 5 pairs of 300k adds
    scripts/bench_metrics.py --pairs 8 --count 500000 --shards 2
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_bookie.py")


def run(stats: str, a) -> dict:
    out = subprocess.run([sys.executable, BENCH, "--json", "--stats", stats,
                          "--count", str(a.count), "--shards", str(a.shards)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--count", type=int, default=300_000)
    ap.add_argument("--shards", type=int, default=1)
    a = ap.parse_args()
    res = {"true": [], "false": []}
    for i in range(a.pairs):
        for stats in (("true", "false") if i % 2 == 0 else ("false", "true")):
            r = run(stats, a)
            res[stats].append(r)
            print(f"pair {i} stats={stats:5}  {r['adds_per_sec']:>9,.0f} adds/s  "
                  f"{r['bookie_cpu_us_per_add']} us CPU/add  p99 {r['latency_ms']['p99']:.1f} ms",
                  flush=True)
    med = {k: statistics.median(r["adds_per_sec"] for r in v) for k, v in res.items()}
    cpu = {k: statistics.median(r["bookie_cpu_us_per_add"] for r in v) for k, v in res.items()}
    print(f"median adds/s: on {med['true']:,.0f}  off {med['false']:,.0f}  "
          f"on/off {med['true'] / med['false']:.3f}")
    print(f"median shard CPU per add: on {cpu['true']} us  off {cpu['false']} us  "
          f"on/off {cpu['true'] / cpu['false']:.3f}")


if __name__ == "__main__":
    main()
