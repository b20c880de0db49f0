#!/usr/bin/env python3
"""An end-to-end data pipeline on bk and Spark (``bk.spark``).

1. An application appends JSON events ({"user", "action", "amount"}) to the log
   ``events``.
2. A Spark streaming job reads ``events`` (format ``bookkeeper``), parses the
   JSON, sums the amount per user and action in each micro-batch, and writes the
   results as JSON to the log ``totals`` (exactly-once, checkpointed).
3. A log reader prints ``totals``.

Start a cluster first (``bookie localcluster``) and pass the URI it prints:

    python scripts/pipeline_demo.py --metadata etcd://127.0.0.1:2379/ledgers

The job runs with ``trigger(availableNow=True)`` twice on the same checkpoint,
with more events appended between the runs: each event is counted once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile

import bk


def append_events(client, n: int, seed: int) -> None:
    rnd = random.Random(seed)
    with client.open_log_writer("events") as w:
        w.append_many([json.dumps({"user": rnd.choice(["ana", "bo", "cy"]),
                                   "action": rnd.choice(["buy", "refund"]),
                                   "amount": rnd.randint(1, 100)}).encode() for _ in range(n)])
    print(f"appended {n} events to log 'events'")


def run_job(spark, uri: str, checkpoint: str) -> None:
    from pyspark.sql import functions as F
    events = (spark.readStream.format("bookkeeper").option("metadataServiceUri", uri)
              .option("log", "events").option("maxRecordsPerTrigger", 500).load())
    parsed = events.select(F.from_json(F.col("data").cast("string"),
                                       "user string, action string, amount long").alias("e"),
                           "position").select("e.*", "position")
    totals = (parsed.groupBy("user", "action")
              .agg(F.sum("amount").alias("amount"), F.count("*").alias("events"),
                   F.max("position").alias("upto")))
    # Per micro-batch totals (no state across batches), one JSON record each.
    out = totals.select(F.to_json(F.struct("user", "action", "amount", "events", "upto"))
                        .cast("binary").alias("data"))
    q = (out.writeStream.format("bookkeeper").option("metadataServiceUri", uri)
         .option("log", "totals").option("checkpointLocation", checkpoint)
         .outputMode("update").trigger(availableNow=True).start())
    q.awaitTermination()
    if q.exception():
        raise q.exception()


def print_totals(client) -> dict:
    info = client.log_info("totals")
    sums: dict = {}
    with client.open_log_reader("totals") as r:
        got = 0
        while got < info.records:
            for rec in r.read_batch(1000, timeout=5):
                got += 1
                t = json.loads(rec.data)
                print(f"  {rec.position}  {t}")
                k = (t["user"], t["action"])
                sums[k] = sums.get(k, 0) + t["amount"]
    return sums


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--metadata", default=os.environ.get("BK_METADATA_URI"),
                    help="etcd://host:port/ledgers (default $BK_METADATA_URI)")
    ap.add_argument("--events", type=int, default=1000)
    ap.add_argument("--checkpoint", default=None, help="default: a new temp dir")
    args = ap.parse_args(argv)
    if not args.metadata:
        ap.error("pass --metadata etcd://host:port/ledgers (from 'bookie localcluster')")
    from pyspark.sql import SparkSession
    import bk.spark
    # Spark's Python workers are children of this process: give them this bk.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    spark = (SparkSession.builder.master("local[2]").appName("bk pipeline demo")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    bk.spark.register(spark)
    checkpoint = args.checkpoint or tempfile.mkdtemp(prefix="bk-demo-cp-")
    with bk.BookKeeper(args.metadata) as client:
        for name in ("events", "totals"):
            if name in client.list_logs():
                client.delete_log(name)
        expected: dict = {}
        for run in range(2):
            append_events(client, args.events, seed=run)
            run_job(spark, args.metadata, checkpoint)
        df = spark.read.format("bookkeeper").option("metadataServiceUri", args.metadata) \
            .option("log", "events").load()
        for row in df.selectExpr("cast(data as string) as j").collect():
            e = json.loads(row.j)
            expected[(e["user"], e["action"])] = expected.get((e["user"], e["action"]), 0) \
                + e["amount"]
        print("totals per micro-batch, from log 'totals':")
        sums = print_totals(client)
    spark.stop()
    print("sum over batches:", dict(sorted(sums.items())))
    ok = sums == expected
    print("each event counted exactly once:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
