#!/usr/bin/env python3
"""Benchmark metadata at scale: a local cluster of 3 bookies takes ledgers created
and closed (one 100-byte entry each) in steps up to --ledgers, then a churn
phase deletes and creates; after each step it prints the create+close rate, the
time to list every ledger id, etcd's db size (and after compaction +
defragmentation), etcd's RSS, and the CPU etcd and the bookies burn idle.

    scripts/bench_metadata.py                         # steps up to 1,000,000 ledgers
    scripts/bench_metadata.py --ledgers 100000 --json
    scripts/bench_metadata.py --steps 30000,100000 --set gcWaitTime=5000
    scripts/bench_metadata.py --listing-only --ledgers 300000   # listing alone
    scripts/bench_metadata.py --reconcile 100000,300000   # one GC full reconcile, old vs new
    scripts/bench_metadata.py --reconcile-cluster 100000 --old-tree /tmp/main  # real bookie
    scripts/bench_metadata.py --reconcile-cluster 100000 --share 20 --old-tree /tmp/main
                                        # ... holding one ledger in 20, scattered
    scripts/bench_metadata.py --breakdown 10000   # where one ledger's CPU goes
    scripts/bench_metadata.py --compare-threads 32,64 --rounds 4   # rate by thread count
    scripts/bench_metadata.py --compare-threads 64,a256   # 64 threads vs async, 256 in flight
    scripts/bench_metadata.py --async-inflight 256 --breakdown 6000
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bk.bench.metadata import (INFLIGHT, THREADS, bench_breakdown, bench_listing,  # noqa: E402
                               bench_metadata, bench_reconcile, bench_reconcile_cluster,
                               bench_threads, format_row, mode_name)
from bk.meta.store import LIST_PAGE  # noqa: E402


def format_reconcile(row: dict) -> str:
    parts = [f"{row['held']:,} of {row['ledgers']:,} held:"]
    for name in ("old", "new"):
        x = row[name]
        parts.append(f"{name} etcd {x['etcd_cpu_s']}s CPU, bookie {x['bookie_cpu_s']}s CPU, "
                     f"{x['requests']:.0f} requests, {x['wall_s']}s wall;")
    parts.append("new/old: etcd CPU {ratio_etcd_cpu_s}x, bookie CPU {ratio_bookie_cpu_s}x, "
                 "requests {ratio_requests}x, wall {ratio_wall_s}x".format(**row))
    return " ".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ledgers", type=int, default=1_000_000)
    ap.add_argument("--steps", default=None, help="comma-separated ledger counts")
    # default: the asynchronous API, INFLIGHT ledgers in flight (docs/performance-log.md,
    # "Asynchronous create and close"; --compare-threads 64,a256)
    ap.add_argument("--threads", type=int, default=None,
                    help=f"create and close from this many blocking client threads instead "
                         f"of the asynchronous API (the bench's mode before; {THREADS} was "
                         f"its default)")
    ap.add_argument("--async-inflight", type=int, default=INFLIGHT, metavar="N",
                    help=f"create+close with the asynchronous API (create_ledger_async, "
                         f"add_entry_async, close_async chained by callbacks) keeping N "
                         f"ledgers in flight (default {INFLIGHT})")
    ap.add_argument("--churn", type=int, default=None)
    ap.add_argument("--idle-seconds", type=float, default=20.0)
    ap.add_argument("--no-compare", action="store_true",
                    help="skip the replaced paths (id write per ledger, sorted pages)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="bookie setting; repeatable")
    ap.add_argument("--dir", default=None, help="where the cluster keeps its data")
    ap.add_argument("--listing-only", action="store_true",
                    help="only time listing --ledgers ids (an etcd alone, keys put directly): "
                         "by id windows of 1,000 and of 10,000 ids, and by plain pages")
    ap.add_argument("--reconcile", default=None, metavar="N,M,...",
                    help="only: one bookie's GC full reconcile (its 2 shards' ids checked at a "
                         "pinned revision) at each of these ledger counts, on an etcd "
                         "alone with ledger keys put directly: each shard alone (old) and "
                         "the shards together by windows (new) alternating --rounds times; etcd CPU, bookie CPU, requests, "
                         "wall time")
    ap.add_argument("--reconcile-cluster", type=int, default=0, metavar="N",
                    help="only: a real bookie's full reconcile (SIGUSR1) on a local cluster of "
                         "3 holding N ledgers: etcd CPU, bookie CPU, requests, seconds; with "
                         "--old-tree the bookie alternates between that tree's code and this "
                         "one's, --rounds times")
    ap.add_argument("--share", type=int, default=0, metavar="K",
                    help="with --reconcile or --reconcile-cluster: the bookie holds one ledger "
                         "in K of the cluster's, scattered at random (a bookie among 3K with "
                         "E3), instead of all of them (--reconcile) or ~2/3 (--reconcile-cluster)")
    ap.add_argument("--old-tree", default=None, metavar="DIR",
                    help="with --reconcile-cluster: a checkout of the code to compare with")
    ap.add_argument("--breakdown", type=int, default=0, metavar="N",
                    help="only: CPU per ledger by process and thread, the client's GC and "
                         "etcd's counters, over N ledgers created and closed")
    ap.add_argument("--compare-threads", default=None, metavar="N,M,...",
                    help="only: create+close runs of --round-ledgers ledgers from each of "
                         "these thread counts (aN: the asynchronous API with N in flight), "
                         "alternating, in one client process")
    ap.add_argument("--rounds", type=int, default=4,
                    help="with --compare-threads (and --reconcile: best of these)")
    ap.add_argument("--round-ledgers", type=int, default=3000, help="with --compare-threads")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    inflight = 0 if a.threads else a.async_inflight
    threads = a.threads or THREADS
    if a.compare_threads:
        counts = [x if x.startswith("a") else int(x) for x in a.compare_threads.split(",")]
        r = bench_threads(counts, rounds=a.rounds, ledgers=a.round_ledgers, base_dir=a.dir,
                          progress=None if a.json else lambda n, row: print(
                              f"{mode_name(n)}: {row['create_close_per_s']}/s, client "
                              f"{row['client_us_per_ledger']} us and "
                              f"{row['client_switches_per_ledger']} context switches per ledger",
                              flush=True))
        if a.json:
            print(json.dumps(r, indent=1))
            return
        for n in counts:
            rows = r["runs"][str(n)]
            mean = {k: sum(x[k] for x in rows) / len(rows) for k in rows[0]}
            print(f"{mode_name(n)}, mean of {len(rows)}: {mean['create_close_per_s']:.0f}/s, "
                  f"client {mean['client_us_per_ledger']:.0f} us and "
                  f"{mean['client_switches_per_ledger']:.2f} switches per ledger")
        return
    if a.reconcile:
        r = bench_reconcile([int(x) for x in a.reconcile.split(",")], rounds=a.rounds,
                            share=max(1, a.share), base_dir=a.dir, progress=(lambda row: None) if a.json else
                            (lambda row: print(format_reconcile(row), flush=True)))
        if a.json:
            print(json.dumps(r, indent=1))
        return
    if a.reconcile_cluster:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        trees = {"old": os.path.abspath(a.old_tree), "new": here} if a.old_tree else None
        r = bench_reconcile_cluster(a.reconcile_cluster, rounds=a.rounds, trees=trees,
                                    share=a.share, base_dir=a.dir, progress=(lambda n, row: None) if a.json
                                    else lambda n, row: print(f"{n}: {row}", flush=True))
        r.pop("held_ids", None)         # one id per ledger held: for tests, not the report
        if a.json:
            print(json.dumps(r, indent=1))
        return
    if a.breakdown:
        r = bench_breakdown(a.breakdown, threads=threads, inflight=inflight, base_dir=a.dir)
        if a.json:
            print(json.dumps(r, indent=1))
            return
        print(f"{r['ledgers']} ledgers, {mode_name(r['mode'])}: "
              f"{r['create_close_per_s']}/s")
        for k, v in sorted(r["cpu_us_per_ledger"].items(), key=lambda kv: -kv[1]):
            print(f"  CPU per ledger {k}: {v} us")
        print(f"  client cyclic GC collections per ledger: {r['gc_collections_per_ledger']}")
        for k, v in r["switches_per_ledger"].items():
            print(f"  context switches per ledger {k}: {v}")
        for k, v in r["etcd_per_ledger"].items():
            print(f"  etcd per ledger {k}: {v}")
        return
    if a.listing_only:
        r = bench_listing(a.ledgers, base_dir=a.dir, progress=lambda r: None)
        p = LIST_PAGE
        print(json.dumps(r) if a.json else
              f"{r['ledgers']} ids listed by id windows (best of 3), pages of {p:,}: "
              f"{r[f'windows_{p}_s']}s, client CPU {r[f'client_cpu_{p}_s']}s, etcd CPU "
              f"{r[f'etcd_cpu_{p}_s']}s; pages of 1,000: {r['windows_1000_s']}s, client CPU "
              f"{r['client_cpu_1000_s']}s, etcd CPU {r['etcd_cpu_1000_s']}s"
              + (f"; plain pages {r['pages_s']}s ({r['ratio']}x)" if "pages_s" in r else ""))
        return
    conf = dict(kv.split("=", 1) for kv in a.set)
    steps = [int(x) for x in a.steps.split(",")] if a.steps else None
    r = bench_metadata(a.ledgers, steps=steps, threads=threads, inflight=inflight, churn=a.churn,
                       idle_seconds=a.idle_seconds, compare=not a.no_compare, conf=conf,
                       base_dir=a.dir,
                       progress=(lambda row: None) if a.json else
                       (lambda row: print(format_row(row), flush=True)))
    if a.json:
        print(json.dumps(r, indent=1))
    else:
        for name, x in r["compare"].items():
            print(f"compare {name}: {x}")


if __name__ == "__main__":
    main()
