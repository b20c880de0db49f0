#!/usr/bin/env python3
"""Micro-benchmark of the client's I/O loop's wake-up (bk.client.connection.IOLoop):
one task handed over with ``call_soon`` while the loop sleeps in its poll, the
caller waiting for it, N times; the CPU time of the I/O thread and of the caller
per round trip (``time.pthread_getcpuclockid``). No bookie, no socket.

    scripts/bench_ioloop.py                          # 5,000 round trips, 3 rounds
    scripts/bench_ioloop.py --compare /tmp/base      # alternating with another tree's
                                                     # bk (A B B A ...), and the ratios

What it measures is what every wake-up of a sleeping client costs: the eventfd
write of the caller, the poll returning, the task, the poll again. On this VM a
wake-up is dear (a sleeping thread woken by another core: tens of µs of CPU),
so the numbers move with the machine's load; compare within one run.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r'''
import json, sys, threading, time
from bk.client.connection import IOLoop
n = int(sys.argv[1])
loop = IOLoop(name="bk-io")
ev = threading.Event()
loop.call_soon(ev.set); ev.wait(); ev.clear()
clk = time.pthread_getcpuclockid(loop._thread.ident)

def trips(k):
    for _ in range(k):
        while not loop._sleeping:       # back in its poll: the hand-over wakes it
            time.sleep(0)
        loop.call_soon(ev.set)
        ev.wait()
        ev.clear()

trips(500)
t0, m0 = time.clock_gettime(clk), time.thread_time()
trips(n)
t1, m1 = time.clock_gettime(clk), time.thread_time()
loop.stop()
print(json.dumps({"io_us": round((t1 - t0) / n * 1e6, 2),
                  "caller_us": round((m1 - m0) / n * 1e6, 2)}))
'''


def run(tree, count):
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree
    out = subprocess.run([sys.executable, "-c", _CHILD, str(count)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--count", type=int, default=5000, help="round trips per run")
    p.add_argument("--rounds", type=int, default=3, help="runs (pairs with --compare)")
    p.add_argument("--compare", metavar="TREE",
                   help="another checkout's bk, alternating A B B A with this one's")
    a = p.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not a.compare:
        for _ in range(a.rounds):
            print(run(here, a.count))
        return
    trees = {"base": a.compare, "this": here}
    res = {"base": [], "this": []}
    for i in range(a.rounds):
        for name in (("base", "this", "this", "base") if i % 2 == 0
                     else ("this", "base", "base", "this")):
            r = run(trees[name], a.count)
            res[name].append(r)
            print(name, r, flush=True)
    for k in ("io_us", "caller_us"):
        b = statistics.median(r[k] for r in res["base"])
        t = statistics.median(r[k] for r in res["this"])
        print(f"{k}: base median {b:.2f}, this {t:.2f}, this/base {t / b:.2f}x")


if __name__ == "__main__":
    main()
