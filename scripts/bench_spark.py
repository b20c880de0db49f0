#!/usr/bin/env python3
"""Benchmark: a Spark batch read of a bk log (``bk.spark``), Arrow batches vs rows.

Starts a local cluster (etcd + 3 bookies, unless --metadata names one), appends
``--mb`` MiB of ``--record-size``-byte records to a log (rolled every
``--segment-mb``), then reads the whole log with Spark (local[2] by default)
forcing every byte through the Python workers (sum of lengths), once with rows
as Arrow record batches and once as plain tuples (each in its own Spark
application, so the workers' setting is clean). Prints MB/s and rows/s.

    .venv/bin/python scripts/bench_spark.py --mb 256 --record-size 1024
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--metadata", default=None, help="an existing cluster (else a local one)")
    ap.add_argument("--mb", type=int, default=128, help="MiB of records to append")
    ap.add_argument("--record-size", type=int, default=1024)
    ap.add_argument("--segment-mb", type=int, default=32)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--min-partitions", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    os.environ["PYSPARK_PYTHON"] = sys.executable
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
        results = {"records": n, "record_size": args.record_size,
                   "append_seconds": round(append_s, 1)}
        for mode, env in (("arrow", "1"), ("rows", "0")):
            out = subprocess.run([sys.executable, __file__, "--master", args.master,
                                  "--min-partitions", str(args.min_partitions),
                                  "--_child", uri, name],
                                 env={**os.environ, "BK_SPARK_ARROW": env},
                                 capture_output=True, text=True, check=True)
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            assert results[mode]["rows"] == n, results[mode]
        if args.json:
            print(json.dumps(results))
        else:
            print(f"log of {n} records x {args.record_size} B ({args.mb} MiB), "
                  f"appended in {append_s:.1f}s; read with Spark {args.master}:")
            for mode in ("arrow", "rows"):
                r = results[mode]
                print(f"  {mode:5s}: {r['seconds']}s  {r['mb_per_sec']} MB/s  "
                      f"{r['rows_per_sec']} rows/s")
    finally:
        if cluster is not None:
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
