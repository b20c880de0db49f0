#!/usr/bin/env python3
"""Storage at scale: one bookie (one shard) filled in steps, measured after each.

Prints, per step: entries held, the worker's RSS and peak RSS, the last
flush's bytes and seconds, add latency p50/p99/p99.9 at a fixed rate, restart
after kill -9 until the last entry is served, cold-cache random read p99 and
cold-cache catch-up read MB/s of 1 KiB-entry ledgers written interleaved with
99 others (the page cache is dropped when run as root). See bk/bench/scale.py.

    python scripts/bench_scale.py --steps 1M,10M,100M                 # 100 B entries
    python scripts/bench_scale.py --steps 1M,10M --entry-size 1024    # the 1 KiB variant
    python scripts/bench_scale.py --steps 1M,10M --bk-path /tmp/bk-old # an older bk's bookie

The catch-up read alone (quick, repeatable): 100 ledgers of --catchup-entries
1 KiB entries written interleaved, then --read-ledgers of them read cold
through the client; prints MB/s, CPU us per entry of the client and of the
shard worker, and the MB the worker read from disk:

    python scripts/bench_scale.py --catchup-only                      # 10 x 10,000 entries read
    python scripts/bench_scale.py --catchup-only --compare /tmp/bk-old --pairs 3

--compare runs it alternately against another checkout's bk and this one and
prints each run and the new/old ratio of each pair. The order of a pair
alternates (--order abba, the default: old new, new old, old new, ...): a
machine whose speed drifts during the runs (another job starting or ending,
the page cache, the disk's own caches) favoured the side always run second
(main against main gave catch-up MB/s new/old 0.72-0.99 with --order ab, the
old order: old new, old new, ...).

--bk-path runs the same benchmark (this checkout's bk/bench/scale.py) against
the bk package of another checkout, e.g. `git worktree add --detach
/tmp/bk-old <commit>`: old vs new, one after the other, on the same machine.
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _bk_path() -> str:
    if "--bk-path" in sys.argv:
        return os.path.abspath(sys.argv[sys.argv.index("--bk-path") + 1])
    return HERE


# The benchmark module of this checkout, run against the bk on sys.path first
# (and in the bookie processes it starts, through PYTHONPATH).
sys.path.insert(0, _bk_path())
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_bk_path()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
_spec = importlib.util.spec_from_file_location("bk_bench_scale",
                                               os.path.join(HERE, "bk", "bench", "scale.py"))
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)
bench_scale, parse_count = scale.bench_scale, scale.parse_count


def _compare(a, conf_args) -> None:
    """--catchup-only runs alternating between --compare's checkout and this one."""
    rows = {"old": [], "new": []}
    sides = (("old", a.compare), ("new", HERE))
    for k in range(a.pairs):
        for side, path in (sides[::-1] if a.order == "abba" and k % 2 else sides):
            cmd = [sys.executable, os.path.abspath(__file__), "--catchup-only", "--json",
                   "--bk-path", path, "--catchup-entries", str(a.catchup_entries),
                   "--read-ledgers", str(a.read_ledgers), *conf_args]
            if a.chunk:
                cmd += ["--chunk", str(a.chunk)]
            if a.drop_all:
                cmd.append("--drop-all")
            if a.dir:
                cmd += ["--dir", a.dir]
            env = dict(os.environ, PYTHONPATH="")
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            r = json.loads(out.stdout)
            rows[side].append(r)
            print(f"pair {k + 1} {side}: {scale.format_catchup(r)}", flush=True)
    print(f"order: {a.order}")
    for key in ("mb_per_sec", "client_us_per_entry", "worker_us_per_entry", "disk_mb"):
        old = [r[key] for r in rows["old"]]
        new = [r[key] for r in rows["new"]]
        ratios = [n / o for o, n in zip(old, new) if o]
        print(f"{key}: old median {statistics.median(old):.4g}, new median "
              f"{statistics.median(new):.4g}, new/old per pair "
              f"{', '.join(f'{x:.2f}' for x in ratios)}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", default="1M,10M,100M", help="entries held after each step")
    p.add_argument("--entry-size", type=int, default=100)
    p.add_argument("--ledgers", type=int, default=1000)
    p.add_argument("--rate", type=int, default=30_000, help="adds/s of the latency measurement")
    p.add_argument("--rate-seconds", type=float, default=5.0)
    p.add_argument("--random-reads", type=int, default=2000)
    p.add_argument("--catchup-entries", type=int, default=10_000,
                   help="1 KiB entries per ledger of the 100 catch-up ledgers (0: skip)")
    p.add_argument("--catchup-only", action="store_true",
                   help="measure only the cold catch-up read (see above)")
    p.add_argument("--read-ledgers", type=int, default=10,
                   help="--catchup-only: ledgers read back, each cold")
    p.add_argument("--chunk", type=int, default=None,
                   help="--catchup-only: entries per read_entries call (default: a "
                   "ledger in one call)")
    p.add_argument("--drop-all", action="store_true",
                   help="--catchup-only: drop the whole page cache (root) instead of "
                   "evicting the bookie's files only")
    p.add_argument("--compare", metavar="CHECKOUT", default=None,
                   help="--catchup-only: alternate runs of CHECKOUT's bk and this one")
    p.add_argument("--pairs", type=int, default=3, help="--compare: old/new pairs")
    p.add_argument("--order", choices=("abba", "ab"), default="abba",
                   help="--compare: abba alternates which side of a pair runs first "
                   "(old new, new old, ...); ab always runs old first")
    p.add_argument("--dir", default=None, help="where the bookie's data goes (default: TMPDIR)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="bookie configuration override; repeatable")
    p.add_argument("--bk-path", default=HERE, help="checkout whose bk package is benchmarked "
                   "(default: this one)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    conf = dict(kv.split("=", 1) for kv in a.set)
    if a.catchup_only and a.compare:
        _compare(a, [x for kv in a.set for x in ("--set", kv)])
        return
    if a.catchup_only:
        r = scale.bench_catchup(a.catchup_entries, a.read_ledgers, chunk=a.chunk,
                                drop_all=a.drop_all,
                                base_dir=a.dir, conf=conf,
                                report=lambda line: print(line, file=sys.stderr, flush=True))
        print(json.dumps(r) if a.json else scale.format_catchup(r))
        return
    rows = bench_scale([parse_count(s) for s in a.steps.split(",")], entry_size=a.entry_size,
                       ledgers=a.ledgers, rate=a.rate, rate_seconds=a.rate_seconds,
                       random_reads=a.random_reads, catchup_entries=a.catchup_entries,
                       base_dir=a.dir, conf=conf,
                       report=(lambda line: print(line, file=sys.stderr, flush=True))
                       if a.json else (lambda line: print(line, flush=True)))
    if a.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
