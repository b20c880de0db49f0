#!/usr/bin/env python
"""What a silent cut between a writer and one bookie costs the writer (needs root).

    .venv/bin/python scripts/bench_partition.py [--cut 20] [--entry-size 4096]

Four bookies on network-namespace hosts (bk.netns), a writer on a fifth with
E3 Qw3 Qa2 adding pipelined entries flat out. After --before seconds the writer
is silently cut from one bookie of its ensemble for --cut seconds. Prints the
writer's RSS and acknowledged entries per second before and during the cut, and
when the ensemble changed: before the add timeout's replacement of a bookie that
stays silent after Qa, the RSS grew with every entry for the cut bookie.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bk import netns  # noqa: E402
from bk.testing import TEST_DEFAULTS  # noqa: E402

WRITER = """
import threading, time, psutil, bk
c = bk.BookKeeper({uri!r}, addEntryTimeoutSec={timeout}, throttle=2000)
lh = c.create_ledger(3, 3, 2)
payload = b"x" * {size}
acked = [0]
stop = threading.Event()
def _cb(exc, eid):
    if exc is None:
        acked[0] += 1
def _write():
    while not stop.is_set():
        lh.add_entry_async(payload, _cb)
threading.Thread(target=_write, daemon=True).start()
def sample():
    return [time.monotonic(), psutil.Process().memory_info().rss, acked[0],
            len(lh.metadata.ensembles)]
"""


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=float, default=5.0)
    p.add_argument("--cut", type=float, default=20.0)
    p.add_argument("--entry-size", type=int, default=4096)
    p.add_argument("--add-timeout", type=float, default=10.0,
                   help="addEntryTimeoutSec of the writer (default 10, the registry's)")
    a = p.parse_args()
    if netns.unavailable():
        sys.exit(f"bench_partition: {netns.unavailable()}")
    with netns.Network() as net, tempfile.TemporaryDirectory(prefix="bk-bench-cut-") as d:
        hosts = [net.add_host(f"b{i}") for i in range(4)]
        cluster = netns.HostCluster(net, d, hosts, net.add_host("meta"), TEST_DEFAULTS)
        with cluster:
            ch = net.add_host("writer")
            py = ch.python()
            py.exec(WRITER.format(uri=cluster.metadata_uri, timeout=a.add_timeout,
                                  size=a.entry_size))
            samples = []

            def run_for(seconds, phase):
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    t, rss, n, frags = py.eval("sample()")
                    samples.append((phase, t, rss, n, frags))
                    time.sleep(1.0)

            run_for(a.before, "before")
            victim = py.eval("lh.metadata.last_ensemble[1]")
            net.partition(ch, cluster.bookie(victim).host)
            t_cut = time.monotonic()
            run_for(a.cut, "cut")
            py.exec("stop.set()")
            changed = next((s for s in samples if s[0] == "cut" and s[4] > 1), None)
            for phase in ("before", "cut"):
                ss = [s for s in samples if s[0] == phase]
                rate = (ss[-1][3] - ss[0][3]) / max(1e-9, ss[-1][1] - ss[0][1])
                print(f"{phase:6s}: RSS {ss[0][2] / 2**20:6.0f} -> {ss[-1][2] / 2**20:6.0f} MiB "
                      f"(max {max(s[2] for s in ss) / 2**20:.0f}), {rate:8.0f} entries/s acked")
            print("ensemble change: " + (f"{changed[1] - t_cut:.1f}s after the cut"
                                          if changed else "none during the cut"))


if __name__ == "__main__":
    main()
