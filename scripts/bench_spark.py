#!/usr/bin/env python3
"""Benchmark: a Spark batch read of a bk log (``bk.spark``), Arrow batches vs rows.

Starts a local cluster (etcd + 3 bookies, unless --metadata names one), appends
``--mb`` MiB of ``--record-size``-byte records to a log (rolled every
``--segment-mb``), then reads the whole log with Spark (local[2] by default)
forcing every byte through the Python workers (sum of lengths), once with rows
as Arrow record batches and once as plain tuples (each in its own Spark
application, so the workers' setting is clean). Prints MB/s and rows/s.

Then (unless --stream-seconds 0) the streaming end-to-end latency: records
appended at --stream-rate records/s to a log, copied by a Spark streaming query
into another log through the exactly-once sink; latency from the append to
the commit that makes the record visible in the output log; once with a
client per process (bk.spark's way) and once with a client per call.

    .venv/bin/python scripts/bench_spark.py --mb 1024 --record-size 1024
    .venv/bin/python scripts/bench_spark.py --skip-read --stream-seconds 30
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _read_once(uri: str, log: str, master: str, min_partitions: int) -> dict:
    from pyspark.sql import SparkSession
    import bk.spark
    spark = (SparkSession.builder.master(master).appName("bench_spark")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    bk.spark.register(spark)
    df = (spark.read.format("bookkeeper").option("metadataServiceUri", uri).option("log", log)
          .option("minPartitions", min_partitions).load())
    # Warm-up (JVM, Python workers) on a tiny range, not timed.
    spark.read.format("bookkeeper").option("metadataServiceUri", uri).option("log", log) \
        .option("endingPosition", "0:1:0").load().count()
    t = time.perf_counter()
    r = df.selectExpr("count(*) as n", "sum(length(data)) as b").collect()[0]
    dt = time.perf_counter() - t
    spark.stop()
    return {"rows": r.n, "bytes": r.b, "seconds": round(dt, 2),
            "mb_per_sec": round(r.b / dt / 1e6, 1), "rows_per_sec": round(r.n / dt)}


def _stream_latency(uri: str, master: str, rate: int, seconds: float, record_size: int,
                    warmup: float = 15.0) -> dict:
    """Streaming end to end: an application appends ``rate`` records/s (each carrying
    its append time) to a log; a Spark query (micro-batches as fast as they go)
    copies them into another log through the exactly-once sink; a watcher of the
    output log's record notes when each segment (a committed task's staging
    ledger) appears. Latency: that moment minus the record's append time."""
    import struct
    import threading
    from pyspark.sql import SparkSession
    import bk
    import bk.spark
    from bk.log import metadata
    from bk.log.records import decode_record_set
    spark = (SparkSession.builder.master(master).appName("bench_spark stream")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    bk.spark.register(spark)
    tag = int(time.time())
    src, dst = f"bench-stream-in-{tag}", f"bench-stream-out-{tag}"
    cp = tempfile.mkdtemp(prefix="bench-spark-cp-")
    client = bk.BookKeeper(uri)
    client.create_log(src)
    client.create_log(dst)
    q = (spark.readStream.format("bookkeeper").option("metadataServiceUri", uri)
         .option("log", src).load().select("data").writeStream.format("bookkeeper")
         .option("metadataServiceUri", uri).option("log", dst)
         .option("checkpointLocation", cp).start())
    lat, batches, stop, batches_at_start = [], [], threading.Event(), []

    def watch():
        seen = set()
        while not stop.is_set() or got[0] < sent[0]:
            rec, _ = metadata.read(client._store, dst)
            now = time.time()
            for seg in rec["segments"]:
                if seg["ledger_id"] in seen:
                    continue
                seen.add(seg["ledger_id"])
                batches.append(seg["records"])
                h = client.open_ledger_no_recovery(seg["ledger_id"])
                for ent in h.read_entries(0, seg["last_entry_id"]):
                    for r in decode_record_set(ent.data).records:
                        ts = struct.unpack_from(">d", r)[0]
                        got[0] += 1
                        if ts >= measure_from[0]:
                            lat.append(now - ts)
                h.close()
            if stop.is_set() and time.time() > stop_at[0] + 60:
                break
            time.sleep(0.005)

    sent, stop_at, got, measure_from = [0], [0.0], [0], [float("inf")]
    # Warm-up: the first micro-batches start the Python workers.
    with client.open_log_writer(src, logBatchLingerMs=1) as w:
        w.append(struct.pack(">d", time.time()) + bytes(record_size - 8))
        sent[0] = 1
        t_w = time.time()
        while not metadata.read(client._store, dst)[0]["segments"]:
            assert time.time() - t_w < 120, "the query never committed"
            time.sleep(0.05)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        # The first --warmup seconds at the full rate are not measured (every
        # Python worker of the query starts, the backlog of the first batch drains).
        t0 = time.time()
        measure_from[0] = t0 + warmup
        tick = 0.01
        per_tick = max(1, int(rate * tick))
        n = 0
        while time.time() - t0 < warmup + seconds:
            due = t0 + n / rate
            if time.time() < due:
                time.sleep(due - time.time())
            for _ in range(per_tick):
                w.append_async(struct.pack(">d", time.time()) + bytes(record_size - 8))
            n += per_tick
            sent[0] = n + 1
            if not batches_at_start and time.time() >= measure_from[0]:
                batches_at_start.append(len(batches))
    stop_at[0] = time.time()
    stop.set()
    watcher.join(90)
    q.stop()
    spark.stop()
    client.close()
    lat.sort()
    pick = (lambda f: round(lat[min(len(lat) - 1, int(f * len(lat)))] * 1000)) if lat else \
        (lambda f: None)
    return {"records": n - int(rate * warmup), "received": len(lat), "rate": rate,
            "seconds": seconds, "segments": len(batches) - batches_at_start[0],
            "p50_ms": pick(0.5), "p90_ms": pick(0.9),
            "p99_ms": pick(0.99), "max_ms": pick(1.0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--metadata", default=None, help="an existing cluster (else a local one)")
    ap.add_argument("--mb", type=int, default=128, help="MiB of records to append")
    ap.add_argument("--record-size", type=int, default=1024)
    ap.add_argument("--segment-mb", type=int, default=32)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--min-partitions", type=int, default=2)
    ap.add_argument("--stream-rate", type=int, default=1000,
                    help="records/s appended for the streaming latency run")
    ap.add_argument("--stream-seconds", type=float, default=30.0,
                    help="length of the streaming run (0: skip it)")
    ap.add_argument("--skip-read", action="store_true", help="only the streaming run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_stream_child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    if args._stream_child:
        print(json.dumps(_stream_latency(args._stream_child, args.master, args.stream_rate,
                                         args.stream_seconds, args.record_size)))
        return 0
    if args._child:
        print(json.dumps(_read_once(args._child[0], args._child[1], args.master,
                                    args.min_partitions)))
        return 0
    import bk
    cluster = None
    uri = args.metadata
    if uri is None:
        from bk.localcluster import LocalCluster
        cluster = LocalCluster(3, base_dir=tempfile.mkdtemp(prefix="bench-spark-")).start()
        uri = cluster.metadata_uri
    try:
        results = {}
        if args.stream_seconds > 0:
            for mode, env in (("stream_client_per_call", "1"), ("stream", "0")):
                out = subprocess.run(
                    [sys.executable, __file__, "--master", args.master, "--record-size",
                     str(args.record_size), "--stream-rate", str(args.stream_rate),
                     "--stream-seconds", str(args.stream_seconds), "--_stream_child", uri],
                    env={**os.environ, "BK_SPARK_CLIENT_PER_CALL": env},
                    capture_output=True, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"streaming run failed:\n{out.stderr[-3000:]}")
                results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        if args.skip_read:
            _print(args, results)
            return 0
        name = f"bench-spark-{int(time.time())}"
        n = args.mb * 1024 * 1024 // args.record_size
        rec = os.urandom(args.record_size)
        t = time.perf_counter()
        with bk.BookKeeper(uri) as client, client.open_log_writer(
                name, logRollBytes=args.segment_mb * 1024 * 1024) as w:
            fut = None
            for i in range(0, n, 1000):
                fut = w.append_many_async([rec] * min(1000, n - i))
            fut.result()
        append_s = time.perf_counter() - t
        results.update({"records": n, "record_size": args.record_size,
                        "append_seconds": round(append_s, 1)})
        for mode, env in (("arrow", "1"), ("rows", "0")):
            out = subprocess.run([sys.executable, __file__, "--master", args.master,
                                  "--min-partitions", str(args.min_partitions),
                                  "--_child", uri, name],
                                 env={**os.environ, "BK_SPARK_ARROW": env},
                                 capture_output=True, text=True, check=True)
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            assert results[mode]["rows"] == n, results[mode]
        _print(args, results)
    finally:
        if cluster is not None:
            cluster.stop()
    return 0


def _print(args, results: dict) -> None:
    if args.json:
        print(json.dumps(results))
        return
    if "arrow" in results:
        print(f"log of {results['records']} records x {args.record_size} B ({args.mb} MiB), "
              f"appended in {results['append_seconds']}s; read with Spark {args.master}:")
        for mode in ("arrow", "rows"):
            r = results[mode]
            print(f"  {mode:5s}: {r['seconds']}s  {r['mb_per_sec']} MB/s  "
                  f"{r['rows_per_sec']} rows/s")
    for mode in ("stream", "stream_client_per_call"):
        r = results.get(mode)
        if r:
            print(f"streaming {r['rate']} records/s for {r['seconds']}s ({mode}): "
                  f"{r['received']}/{r['records']} records in {r['segments']} segments; "
                  f"append-to-sink latency p50 {r['p50_ms']} ms, p90 {r['p90_ms']} ms, "
                  f"p99 {r['p99_ms']} ms, max {r['max_ms']} ms")


if __name__ == "__main__":
    sys.exit(main())
