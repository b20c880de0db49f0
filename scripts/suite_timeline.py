#!/usr/bin/env python3
"""Each xdist worker's test modules in time, from a BK_TEST_TIMELINE file
(tests/conftest.py): when each module started and ended (seconds after the
first test began), its CPU (the worker's and its reaped children's), and when
each worker ran out of work. The worker that ends last holds the critical path.

    BK_TEST_TIMELINE=/tmp/tl.jsonl scripts/test.sh
    scripts/suite_timeline.py /tmp/tl.jsonl
"""

import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    with open(path) as f:
        tests = [json.loads(line) for line in f if line.strip()]
    t0 = min(t["start"] for t in tests)
    modules = defaultdict(lambda: {"start": float("inf"), "end": 0.0, "cpu": 0.0, "n": 0})
    for t in tests:
        m = modules[(t["worker"], t["test"].split("::", 1)[0])]
        m["start"] = min(m["start"], t["start"] - t0)
        m["end"] = max(m["end"], t["end"] - t0)
        m["cpu"] += t["cpu"] + t["children_cpu"]
        m["n"] += 1
    workers = sorted({w for w, _ in modules})
    for w in workers:
        rows = sorted(((k[1], v) for k, v in modules.items() if k[0] == w),
                      key=lambda r: r[1]["start"])
        print(f"{w}: ends at {max(v['end'] for _, v in rows):.0f} s, "
              f"busy {sum(v['end'] - v['start'] for _, v in rows):.0f} s, "
              f"CPU {sum(v['cpu'] for _, v in rows):.0f} s")
        for name, v in rows:
            print(f"  {v['start']:6.0f} {v['end']:6.0f} {v['end'] - v['start']:5.0f} s "
                  f"cpu {v['cpu']:5.0f} s {v['n']:4d} tests  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
