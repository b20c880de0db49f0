#!/usr/bin/env python
"""Write throughput/latency benchmark (like BookKeeper's BenchThroughputLatency).

    python scripts/bench_writes.py                      # starts a 3-bookie LocalCluster
    python scripts/bench_writes.py --uri etcd://127.0.0.1:2379/ledgers
    python scripts/bench_writes.py --rate 15000         # latency at a fixed load
    python scripts/bench_writes.py --profile out.prof   # cProfile the client
    python scripts/bench_writes.py --tls                # plaintext vs TLS, same cluster, same run
    python scripts/bench_writes.py --gc default         # no full collection before each run
    python scripts/bench_writes.py --set journalDirectWrites=true   # a bookie setting
"""

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bk.bench.writes import bench_writes  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--uri", help="metadata service URI; default: start a LocalCluster")
    p.add_argument("--bookies", type=int, default=3)
    p.add_argument("--shards", type=int, default=2, help="numShards of the local bookies")
    p.add_argument("--ensemble", type=int, default=3)
    p.add_argument("--write-quorum", type=int, default=3)
    p.add_argument("--ack-quorum", type=int, default=2)
    p.add_argument("--entry-size", type=int, default=1024)
    p.add_argument("--duration", type=float, default=10.0, help="seconds")
    p.add_argument("--window", type=int, default=1000, help="most adds outstanding")
    p.add_argument("--ledgers", type=int, default=1)
    p.add_argument("--rate", type=float, default=None, help="entries/s (default: as fast as possible)")
    p.add_argument("--profile", metavar="FILE", help="write a cProfile of the run to FILE")
    p.add_argument("--compare", action="store_true",
                   help="single-entry path (frameBatching=false), then batched, same cluster")
    p.add_argument("--tls", action="store_true",
                   help="local bookies offer TLS (not required): plaintext, then TLS, "
                        "alternating --rounds times, and the ratio")
    p.add_argument("--rounds", type=int, default=2, help="pairs of runs with --tls")
    p.add_argument("--proc", action="store_true",
                   help="CPU us, context switches and file read/write syscalls per entry of "
                        "every process and thread (client, bookie arbiters and shard "
                        "workers, etcd)")
    p.add_argument("--sched", action="store_true",
                   help="each thread's scheduling delay per wake-up (runnable, waiting for a "
                        "core), as percentiles: perf sched over the measured time (needs "
                        "perf and root)")
    p.add_argument("--gc", choices=("default", "collect", "freeze"), default="collect",
                   help="the bench process's GC once each run's client is up: a full "
                        "collection before the warm-up (default: the debt of building "
                        "that client is not paid inside the measured time, as a "
                        "long-running application pays it once), nothing ('default': "
                        "each measured run then held one full collection, 18-125 ms), "
                        "or a collection and gc.freeze() for the run; the library "
                        "never changes a process's GC")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a bookie setting of the local cluster (e.g. journalDirectWrites=true); "
                        "repeat for more")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    bad = [kv for kv in a.set if "=" not in kv]
    if bad:
        p.error(f"--set takes KEY=VALUE, not {bad[0]!r}")
    if a.set and a.uri:
        p.error("--set configures the local cluster this bench starts: no --uri")
    settings = dict(kv.split("=", 1) for kv in a.set)
    gc_mode = a.gc
    tls_conf, tls_client = {}, {}
    if a.tls:
        if a.uri:
            p.error("--tls starts its own cluster (with a throwaway CA): no --uri")
        from bk.security import pki
        ca = pki.throwaway_ca("bk-bench-ca-")
        crt, key = ca.issue("bookie", ["127.0.0.1"])
        tls_conf = {"tlsCertificatePath": crt, "tlsKeyStore": key, "tlsRequired": False}
        tls_client = {"tlsEnabled": True, "tlsTrustStore": ca.cert_path}

    def run(uri):
        if a.tls:
            kw = dict(ensemble=a.ensemble, write_quorum=a.write_quorum,
                      ack_quorum=a.ack_quorum, entry_size=a.entry_size, duration=a.duration,
                      window=a.window, ledgers=a.ledgers, rate=a.rate, proc=a.proc,
                      sched=a.sched, gc_mode=gc_mode)
            runs = [bench_writes(uri, **kw, **extra) for _ in range(a.rounds)
                    for extra in ({}, tls_client)]
            return {"plaintext": runs[0::2], "tls": runs[1::2],
                    "ratio": round(sum(r["entries_per_sec"] for r in runs[1::2]) /
                                   sum(r["entries_per_sec"] for r in runs[0::2]), 2)}
        if a.compare:
            from bk.bench.writes import compare_writes
            return compare_writes(uri, ensemble=a.ensemble, write_quorum=a.write_quorum,
                                  ack_quorum=a.ack_quorum, entry_size=a.entry_size,
                                  duration=a.duration, window=a.window, ledgers=a.ledgers,
                                  rate=a.rate)
        kw = dict(ensemble=a.ensemble, write_quorum=a.write_quorum, ack_quorum=a.ack_quorum,
                  entry_size=a.entry_size, duration=a.duration, window=a.window,
                  ledgers=a.ledgers, rate=a.rate, proc=a.proc, sched=a.sched, gc_mode=gc_mode)
        if a.profile:
            import cProfile
            import threading
            prof = cProfile.Profile()
            threading.setprofile(lambda *args: (sys.setprofile(None), prof.enable()))
            prof.enable()
            try:
                return bench_writes(uri, **kw)
            finally:
                prof.disable()
                threading.setprofile(None)
                prof.dump_stats(a.profile)
        return bench_writes(uri, **kw)

    if a.uri:
        res = run(a.uri)
    else:
        from bk.localcluster import LocalCluster
        with tempfile.TemporaryDirectory(prefix="bk-bench-") as d:
            with LocalCluster(num_bookies=a.bookies, base_dir=d, num_shards=a.shards,
                              conf_overrides={**settings, **tls_conf}) as c:
                res = run(c.metadata_uri)
    if a.json:
        print(json.dumps(res))
    elif a.tls:
        for plain, tls_ in zip(res["plaintext"], res["tls"]):
            print("plaintext:")
            show(plain)
            print("TLS:")
            show(tls_)
        print(f"TLS / plaintext: {res['ratio']}x entries/s (sum of {a.rounds} runs each, "
              f"alternating)")
    elif a.compare:
        for name in ("single", "batched"):
            print(name + ":")
            show(res[name])
        q = res["ratio"]
        print(f"batched / single: {q['entries_per_sec']}x entries/s, "
              f"{q['client_cpu_us_per_entry']}x client CPU per entry, {q['p99']}x p99")
    else:
        show(res)


def show(res):
    if True:
        lat = res["latency_ms"]
        print(f"E={res['ensemble']} Qw={res['write_quorum']} Qa={res['ack_quorum']} "
              f"entry={res['entry_size']}B window={res['window']} ledgers={res['ledgers']} "
              f"rate={res['rate'] or 'max'}")
        print(f"{res['entries']} entries in {res['seconds']}s: {res['entries_per_sec']:.0f} entries/s, "
              f"{res['mb_per_sec']:.2f} MB/s, errors={res['errors']}, "
              f"client CPU {res['client_cpu_us_per_entry']} us/entry")
        print(f"latency ms: p50={lat['p50']} p95={lat['p95']} p99={lat['p99']} "
              f"p99.9={lat['p99.9']} max={res['latency_max_ms']}"
              + (f"; the generator fell {res['generator_lag_max_ms']} ms behind its "
                 f"schedule at worst" if res.get("generator_lag_max_ms") is not None else ""))
        if "gc" in res:
            print(f"  client cyclic GC ({res['gc_mode']}): " + ", ".join(
                f"gen{g} {v['per_sec']}/s (pause ms p50 {v['p50_ms']} p99 {v['p99_ms']} "
                f"max {v['max_ms']})" for g, v in enumerate(res["gc"].values())))
        if "proc" in res:
            pr = res["proc"]
            print(f"  CPU {pr['cpu_us_total']} us/entry in all, run-queue wait "
                  f"{pr['wait_us_total']} us/entry, machine busy {pr['machine_busy']:.0%} (other "
                  f"processes {pr.get('others_busy', 0):.0%}); "
                  f"per entry: cpu us, run-queue wait us, voluntary/involuntary context "
                  f"switches, read/write(pwrite) syscalls:")
            for k, v in pr["per_entry"].items():
                if v["cpu_us"] >= 0.5 or v["vcs"] + v["ics"] >= 0.01:
                    print(f"    {k:<22} {v['cpu_us']:7.1f} {v['wait_us']:7.1f}  "
                          f"{v['vcs']:.3f}/{v['ics']:.3f}  {v['rd']:.3f}/{v['wr']:.3f}")
        if "sched_delay_ms" in res:
            n = max(1, res["entries"])
            print("  scheduling delay after a wake-up, ms: wake-ups per entry, p50 / p90 / "
                  "p99 / p99.9 / max")
            for k, v in res["sched_delay_ms"].items():
                if v["n"] >= 100:
                    print(f"    {k[:22]:<22} {v['n'] / n:6.3f}  {v['p50']:.3f} / {v['p90']:.3f} / "
                          f"{v['p99']:.3f} / {v['p999']:.3f} / {v['max']:.3f}")


if __name__ == "__main__":
    main()
