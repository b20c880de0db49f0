#!/usr/bin/env python
"""A fresh fork's full cyclic collection, with and without gc.freeze() before the
fork (why a bookie's arbiter freezes its objects for each shard worker it forks).

    python scripts/bench_fork_gc.py                 # 5 forks each way, a bookie's imports
    python scripts/bench_fork_gc.py --extra 100000  # plus 100,000 long-lived dicts

Imports what a bookie imports, then forks: each child times its first and its
second gc.collect() (the first also copies every inherited page it writes a GC
header in) and reports how many objects it tracks."""

import argparse
import gc
import importlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

for _name in ("bk.bookie.arbiter", "bk.bookie.worker"):   # what a bookie's arbiter has loaded
    importlib.import_module(_name)


def one_fork(freeze: bool) -> dict:
    if freeze:
        gc.freeze()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        t = time.perf_counter()
        gc.collect()
        first = time.perf_counter() - t
        t = time.perf_counter()
        gc.collect()
        second = time.perf_counter() - t
        os.write(w, json.dumps({"first_ms": round(first * 1000, 2),
                                "second_ms": round(second * 1000, 2),
                                "tracked": len(gc.get_objects())}).encode())
        os._exit(0)
    if freeze:
        gc.unfreeze()
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return json.loads(f.read())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--forks", type=int, default=5, help="forks each way, alternating")
    p.add_argument("--extra", type=int, default=0, help="long-lived dicts to hold as well")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    keep = [{"i": i, "l": [i]} for i in range(a.extra)]
    out = {"parent_tracked": len(gc.get_objects()), "plain": [], "frozen": []}
    for _ in range(a.forks):
        out["plain"].append(one_fork(False))
        out["frozen"].append(one_fork(True))
    del keep
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"parent tracks {out['parent_tracked']} objects")
    for mode in ("plain", "frozen"):
        firsts = ", ".join(f"{r['first_ms']:.1f}" for r in out[mode])
        seconds = ", ".join(f"{r['second_ms']:.1f}" for r in out[mode])
        print(f"{mode:6s}: child's first gc.collect ms {firsts}; second {seconds}; "
              f"tracked {out[mode][0]['tracked']}")


if __name__ == "__main__":
    main()
