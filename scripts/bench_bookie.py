#!/usr/bin/env python3
"""Benchmark one bookie: pipelined durable adds from one client.

    scripts/bench_bookie.py                      # starts etcd + 1 bookie in a temp dir
    scripts/bench_bookie.py --bookie 127.0.0.1:3181 --count 500000
    scripts/bench_bookie.py --sync false         # journalSyncData=false, for comparison
    scripts/bench_bookie.py --stats false        # enableStatistics=false: the metrics' cost
    scripts/bench_bookie.py --compare            # single ADDs vs ADD_BATCH, same bookie, same run
    scripts/bench_bookie.py --tls                # plaintext vs TLS, same bookie, same run

Prints adds/s, MB/s, p50/p99/p99.9 latency and adds per journal sync.
"""

import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bookie", help="bookie id host:port; default: start a local bookie")
    ap.add_argument("--entry-size", type=int, default=1024)
    ap.add_argument("--count", type=int, default=300_000)
    ap.add_argument("--window", type=int, default=2000)
    ap.add_argument("--shards", type=int, default=1, help="shards of the local bookie")
    ap.add_argument("--sync", default="true", help="journalSyncData of the local bookie")
    ap.add_argument("--group-wait", default="0", help="journalMaxGroupWaitMSec of the local bookie")
    ap.add_argument("--stats", default="true", help="enableStatistics of the local bookie "
                    "(false: to measure what the metrics cost)")
    ap.add_argument("--single", action="store_true", help="single ADD frames (the old path)")
    ap.add_argument("--compare", action="store_true",
                    help="run single ADDs, then ADD_BATCH, and print the ratios")
    ap.add_argument("--tls", action="store_true",
                    help="the local bookie offers TLS (not required): plaintext, then TLS, "
                         "alternating --rounds times, and the ratio")
    ap.add_argument("--rounds", type=int, default=2, help="pairs of runs with --tls")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from bk.bench.bookie import bench_bookie

    cluster = None
    bookie = a.bookie
    tls_conf, tls_client = {}, None
    if a.tls:
        if bookie is not None:
            ap.error("--tls starts its own bookie (with a throwaway CA): no --bookie")
        from bk.security import ClientSecurity, pki, tls
        from bk.config import Config
        ca = pki.throwaway_ca("bk-bench-ca-")
        crt, key = ca.issue("bookie", ["127.0.0.1"])
        tls_conf = {"tlsCertificatePath": crt, "tlsKeyStore": key, "tlsRequired": False}
        tls_client = ClientSecurity(tls.client_context(Config.load(overrides={
            "tlsEnabled": True, "tlsTrustStore": ca.cert_path}, env={})))
    if bookie is None:
        from bk.localcluster import LocalCluster
        cluster = LocalCluster(num_bookies=1, num_shards=a.shards, conf_overrides={
            "journalSyncData": a.sync, "journalMaxGroupWaitMSec": a.group_wait,
            "journalPreAllocSizeMB": 256, "enableStatistics": a.stats, **tls_conf})
        cluster.start()
        bookie = cluster.bookies[0].bookie_id
    try:
        def progress(done, total, rate):
            print(f"  {done}/{total} adds, {rate:,.0f} adds/s", file=sys.stderr)
        if a.tls:
            runs = [bench_bookie(bookie, a.entry_size, a.count, a.window, progress=progress,
                                 batched=not a.single, security=s)
                    for _ in range(a.rounds) for s in (None, tls_client)]
        elif a.compare:
            runs = [bench_bookie(bookie, a.entry_size, a.count, a.window, progress=progress,
                                 batched=b) for b in (False, True)]
        else:
            runs = [bench_bookie(bookie, a.entry_size, a.count, a.window, progress=progress,
                                 batched=not a.single)]
    finally:
        if cluster:
            cluster.stop()
    if a.json:
        print(json.dumps(runs if a.compare or a.tls else runs[0], indent=1))
        return
    for r in runs:
        _show(r)
    if a.tls:
        plain = sum(r["adds_per_sec"] for r in runs[0::2])
        tls_ = sum(r["adds_per_sec"] for r in runs[1::2])
        print(f"TLS / plaintext: {tls_ / plain:.2f}x adds/s (sum of {a.rounds} runs each, "
              f"alternating)")
    if a.compare:
        s, b = runs
        print(f"batched / single: {b['adds_per_sec'] / s['adds_per_sec']:.2f}x adds/s, "
              f"worker CPU per add {b['bookie_cpu_us_per_add'] / s['bookie_cpu_us_per_add']:.2f}x")


def _show(r):
    print(f"bookie {r['bookie']}: {r['adds']} adds of {r['entry_size']} B, window {r['window']}, "
          f"{'ADD_BATCH' if r['batched'] else 'single ADD'}{', TLS' if r.get('tls') else ''}")
    print(f"  throughput  {r['adds_per_sec']:,.0f} adds/s  {r['mb_per_sec']:.1f} MB/s")
    lat = r["latency_ms"]
    print(f"  latency     p50 {lat['p50']:.2f} ms  p99 {lat['p99']:.2f} ms  p99.9 {lat['p999']:.2f} ms")
    print(f"  journal     {r['journal_syncs']} syncs, {r['adds_per_sync']} adds per sync")
    print(f"  bookie CPU  {r['bookie_cpu_us_per_add']} us per add "
          f"(= {r['bookie_adds_per_cpu_second']:,} adds per CPU-second of a shard worker)")


if __name__ == "__main__":
    main()
