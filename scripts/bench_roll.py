#!/usr/bin/env python
"""What a journal segment roll costs the shard's loop, with direct writes.

    python scripts/bench_roll.py                       # 20 rolls of 8 MiB segments
    python scripts/bench_roll.py --rolls 40 --segment-mb 16 --group 45

One journal (``journalDirectWrites``) in a temp directory on the disk of /tmp,
1 KiB ADD records, a group commit every ``--group`` records, pipelined as the
shard worker does it: the group's write runs on a second thread (as the sync
thread would) while this thread appends the next group, and a group's write is
begun once the one before completed. Prints the wall time of every roll as the
loop sees it (``Journal._roll``: in an append; ``Journal._roll_ahead``: at a
group's start, where the tree has it) and the loop's cycle (append a group,
wait for the write in flight, begin the next) percentiles. It measures the bk
on PYTHONPATH (it adds no path of its own), so that trees are compared with
this one script, alternating: ``PYTHONPATH=TREE python scripts/bench_roll.py``.
"""

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

from bk.bookie import journal as J     # the tree on PYTHONPATH (no path of its own: see above)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rolls", type=int, default=20)
    p.add_argument("--segment-mb", type=int, default=8)
    p.add_argument("--group", type=int, default=45, help="records per group commit")
    p.add_argument("--dir", default="/tmp", help="where the journal's temp directory goes")
    a = p.parse_args()
    times = {}
    for name in ("_roll", "_roll_ahead"):
        fn = getattr(J.Journal, name, None)
        if fn is None:
            continue
        times[name] = []

        def timed(self, *args, fn=fn, out=times[name]):
            t0 = time.monotonic()
            try:
                return fn(self, *args)
            finally:
                out.append(time.monotonic() - t0)
        setattr(J.Journal, name, timed)
    cycles = []
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="bench-roll-") as d:
        j = J.Journal(d, a.segment_mb << 20, True, J.ROLL_STAGGER, True)
        if not j.direct:
            sys.exit("the filesystem refuses O_DIRECT: nothing to measure")
        list(j.replay())
        payload = os.urandom(1000)
        job, e = None, 0
        while sum(map(len, times.values())) < a.rolls:
            t0 = time.monotonic()
            for _ in range(a.group):
                j.append_add(1, e, e - 1, b"", payload)
                e += 1
            if job is not None:
                job.done.wait()
                j.end_sync(job)
            job = j.begin_sync()
            threading.Thread(target=job.run).start()
            cycles.append(time.monotonic() - t0)
        job.done.wait()
        j.end_sync(job)
        j.close()
    for name, xs in times.items():
        if xs:
            ms = [x * 1000 for x in xs]
            print(f"{name:12} {len(ms):4} rolls, ms on the loop: median {statistics.median(ms):.3f} "
                  f"mean {statistics.mean(ms):.3f} max {max(ms):.3f}")
    cycles.sort()
    q = lambda f: cycles[min(len(cycles) - 1, int(len(cycles) * f))] * 1000
    print(f"group cycle ms: p50 {q(0.5):.3f} p99 {q(0.99):.3f} p99.9 {q(0.999):.3f} "
          f"max {cycles[-1] * 1000:.3f} ({len(cycles)} groups)")


if __name__ == "__main__":
    main()
