#!/usr/bin/env python3
"""etcd's CPU per created+closed ledger by what etcd does (gRPC, raft, WAL, the
txn's puts and compares, watch matching, Go's GC and scheduler) and by Go
function: a cluster as `bench_metadata.py --breakdown` runs it, `perf record -g`
of etcd, names from the stripped binary's own function table.

    scripts/profile_etcd.py                    # 10,000 ledgers, 64 threads
    scripts/profile_etcd.py --ledgers 20000 --folded /tmp/etcd.folded   # for a flame graph
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bk.bench.goprofile import profile_etcd  # noqa: E402
from bk.bench.metadata import THREADS  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ledgers", type=int, default=10_000)
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--freq", type=int, default=999, help="perf samples per second")
    ap.add_argument("--folded", default=None, metavar="FILE",
                    help="also write the stacks, one 'frames count' line each")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    r = profile_etcd(a.ledgers, threads=a.threads, freq=a.freq)
    stacks = r.pop("stacks")
    if a.folded:
        with open(a.folded, "w") as f:
            for stack, n in stacks.items():
                f.write(f"{stack} {n}\n")
    if a.json:
        print(json.dumps(r, indent=1))
        return
    print(f"{r['ledgers']} ledgers from {r['threads']} threads: {r['create_close_per_s']}/s, "
          f"etcd {r['etcd_us_per_ledger']} us of CPU per ledger ({r['samples']} samples)")
    for what, us in r["us_per_ledger"].items():
        print(f"  {us:7.1f} us  {what}")
    print("functions (share of samples with them on the stack):")
    for name, pct in r["top_functions"]:
        print(f"  {pct:5.1f}%  {name}")


if __name__ == "__main__":
    main()
