#!/usr/bin/env python
"""Where an open-loop write load's latency tail comes from, over time.

Writes 1 KiB entries to one ledger (E=3 Qw=3 Qa=2 on a fresh 3-bookie
LocalCluster, production defaults) at ``--rate`` entries/s for ``--duration``
seconds, keeps each entry's (submitted, acknowledged) times, and prints the
percentiles and every 100 ms window whose slowest add took longer than
``--slow-ms``: bursts that hit every entry of a window point at a stall of
the bookies (all of them, or an ack quorum could hide it), lone slow adds at
the client or the network.

    python scripts/bench_tail.py --rate 30000
    python scripts/bench_tail.py --rate 30000 --set journalSyncData=false
"""

import argparse
import array
import collections
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bk  # noqa: E402
from bk.bench.writes import percentile  # noqa: E402
from bk.localcluster import LocalCluster  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rate", type=float, default=30000, help="entries/s")
    p.add_argument("--duration", type=float, default=10.0, help="seconds measured")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds written first and not "
                   "measured (connections, first segments), as bench writes does")
    p.add_argument("--slow-ms", type=float, default=5.0, help="a window is shown when its "
                   "slowest add took longer than this")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a bookie setting for this run (repeatable)")
    a = p.parse_args()
    overrides = dict(kv.split("=", 1) for kv in a.set)
    with tempfile.TemporaryDirectory(prefix="bk-bench-") as d, \
            LocalCluster(num_bookies=3, base_dir=d, conf_overrides=overrides) as c, \
            bk.BookKeeper(c.metadata_uri, throttle=1000) as client:
        lh = client.create_ledger(3, 3, 2, digest_type="crc32c", password=b"bench")
        sent = collections.deque()
        # Two arrays of floats, not a list of tuples: 300,000 tuples kept alive
        # would make this process's own garbage collector pause for tens of ms
        # every second or two, and those pauses would be the tail it measures.
        t_sent = array.array("d")
        t_acked = array.array("d")
        errors = []
        pc = time.perf_counter

        def acked(exc, entry_id):
            t_sent.append(sent.popleft())
            t_acked.append(pc())
            if exc is not None:
                errors.append(exc)

        payload = bytes(1024)
        t0 = pc()
        n = 0
        while pc() - t0 < a.warmup + a.duration:
            if n >= (pc() - t0) * a.rate:
                time.sleep(0.001)       # paced in 1 ms steps, as bench writes --rate
                continue
            sent.append(pc())
            lh.add_entry_async(payload, acked)
            n += 1
        lh.close()
    t0 += a.warmup
    pairs = [(s, b) for s, b in zip(t_sent, t_acked) if s >= t0]
    lat = sorted(b - s for s, b in pairs)
    print(f"{len(pairs)} entries at {a.rate:g}/s, errors={len(errors)}: " + " ".join(
        f"p{q}={percentile(lat, q) * 1e3:.2f}" for q in (50, 95, 99, 99.9)) + " ms")
    windows = collections.defaultdict(list)
    for s, b in pairs:
        windows[int((s - t0) * 10)].append(b - s)
    slow = [(k / 10, max(v), sum(1 for x in v if x * 1e3 > a.slow_ms), len(v))
            for k, v in sorted(windows.items()) if max(v) * 1e3 > a.slow_ms]
    print(f"{len(slow)} of {len(windows)} windows of 100 ms had an add slower than "
          f"{a.slow_ms:g} ms:")
    for at, worst, nslow, total in slow:
        print(f"  t={at:5.1f}s  worst {worst * 1e3:6.1f} ms  {nslow:5d} of {total} adds slow")


if __name__ == "__main__":
    main()
