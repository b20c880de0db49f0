#!/usr/bin/env python3
"""Benchmark a restart after kill -9: a bookie that took --size bytes of 1 KiB
entries at full speed is killed with SIGKILL and started again; prints how long
until it serves its last entry (and until it is registered).

    scripts/bench_restart.py                    # 1 GiB, production defaults
    scripts/bench_restart.py --size 256M --compare   # also without forced checkpoints
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bk.bench.restart import bench_restart  # noqa: E402


def size_arg(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper())
    return int(float(text[:-1]) * mult) if mult else int(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=size_arg, default=1 << 30, help="bytes to write (1G, 256M)")
    ap.add_argument("--entry-size", type=int, default=1024)
    ap.add_argument("--compare", action="store_true",
                    help="also run with checkpoints under load off, for a ratio")
    ap.add_argument("--dir", help="where the bookie's data goes (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    def progress(done, total, rate):
        print(f"  {done}/{total} adds, {rate:,.0f} adds/s", file=sys.stderr, flush=True)

    r = bench_restart(a.size, a.entry_size, a.compare, a.dir, progress)
    if a.json:
        print(json.dumps(r, indent=1))
        return
    for name in ("with_forced_checkpoints", "without_forced_checkpoints"):
        x = r.get(name)
        if x:
            print(f"{name}: wrote {x['bytes_written'] / 2**20:.0f} MiB at "
                  f"{x['write_mb_per_sec']} MB/s ({x['checkpoints_during_writes']} checkpoints); "
                  f"after kill -9: replayed {x['replayed_records']} records, last entry "
                  f"served in {x['seconds_to_serve_last_entry']} s, registered in "
                  f"{x['seconds_to_register']} s")
    if r.get("speedup"):
        print(f"restart {r['speedup']}x faster with forced checkpoints")


if __name__ == "__main__":
    main()
