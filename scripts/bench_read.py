#!/usr/bin/env python3
"""Client read cost: one bookie, one ledger of N 1 KiB entries read back with
read_entries in windows of 10,000 (READ_RANGE), best of three passes; prints
the CPU per entry of the client (what the bulk decode saves) and of the shard
worker (``/proc/<pid>/task/*/schedstat``), and the wall rate. Warm: the
entries are in the page cache (the cold catch-up read is
``scripts/bench_scale.py --catchup-only``).

    python scripts/bench_read.py --entries 100000
    PYTHONPATH=/tmp/bk-old python scripts/bench_read.py    # an older checkout's client
"""

import argparse
import os
import sys
import tempfile
import time

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bk  # noqa: E402
from bk.localcluster import LocalCluster  # noqa: E402


def worker_cpu(pid: int) -> float:
    """CPU seconds of a process's threads (here, so that an older checkout's bk
    can be measured too)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:
            pass
    return total / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=100_000)
    a = ap.parse_args()
    n_all = a.entries
    with tempfile.TemporaryDirectory() as d:
        with LocalCluster(num_bookies=1, base_dir=d, num_shards=1) as c:
            with bk.BookKeeper(c.metadata_uri) as cl:
                h = cl.create_ledger(1, 1, 1, password=b"p")
                data = os.urandom(1024)
                for _ in range(0, n_all, 1000):
                    h.add_entries([data] * 1000)
                h.close()
                r = cl.open_ledger(h.ledger_id, password=b"p")
                wpid = c.bookies[0].worker_pids()[0]
                wall = cpu = wcpu = None
                for _ in range(3):
                    t0, c0, w0 = time.perf_counter(), time.process_time(), worker_cpu(wpid)
                    n = 0
                    for e in range(0, n_all, 10_000):
                        got = r.read_entries(e, min(n_all - 1, e + 9_999))
                        assert got[0].entry_id == e and got[-1].data == data
                        n += len(got)
                    dt, dc = time.perf_counter() - t0, time.process_time() - c0
                    dw = worker_cpu(wpid) - w0
                    wall = dt if wall is None else min(wall, dt)
                    cpu = dc if cpu is None else min(cpu, dc)
                    wcpu = dw if wcpu is None else min(wcpu, dw)
    print(f"read {n} x 1 KiB: client CPU {cpu / n * 1e6:.2f} us/entry, worker CPU "
          f"{wcpu / n * 1e6:.2f} us/entry; wall "
          f"{wall / n * 1e6:.2f} us/entry, {n * 1024 / wall / 1e6:.0f} MB/s (best of 3)")


if __name__ == "__main__":
    main()
