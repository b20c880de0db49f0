#!/usr/bin/env python3
"""An end-to-end data pipeline on bk and Spark (``bk.spark``).

1. An application appends JSON events ({"ts", "user", "amount"}) to the log
   ``events``, one minute of event time per round.
2. A Spark streaming job reads ``events`` (format ``bookkeeper``), parses the
   JSON, sums the amount per user and one-minute window (a watermark closes a
   window once a later minute's events arrived), and appends each closed
   window's totals as JSON to the log ``totals`` (exactly-once, checkpointed;
   the sink is append-only, hence the watermark).
3. A log reader prints ``totals``; they are checked against the events.

Start a cluster first (``bookie localcluster``) and pass the URI it prints:

    python scripts/pipeline_demo.py --metadata etcd://127.0.0.1:2379/ledgers

The job runs with ``trigger(availableNow=True)`` after each round, on the same
checkpoint: each event is counted once; the last minute stays open (no later
event has closed it yet).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile



T0 = 1_700_000_000 - 1_700_000_000 % 60      # a minute boundary


def append_events(client, n: int, minute: int) -> list:
    rnd = random.Random(minute)
    events = [{"ts": T0 + 60 * minute + rnd.randint(0, 59), "user": rnd.choice(["ana", "bo", "cy"]),
               "amount": rnd.randint(1, 100)} for _ in range(n)]
    with client.open_log_writer("events") as w:
        w.append_many([json.dumps(e).encode() for e in events])
    print(f"appended {n} events of minute {minute} to log 'events'")
    return events


def run_job(spark, uri: str, checkpoint: str) -> None:
    from pyspark.sql import functions as F
    events = (spark.readStream.format("bookkeeper").option("metadataServiceUri", uri)
              .option("log", "events").option("maxRecordsPerTrigger", 500).load())
    parsed = (events.select(F.from_json(F.col("data").cast("string"),
                                        "ts long, user string, amount long").alias("e"))
              .select(F.col("e.ts").cast("timestamp").alias("ts"), "e.user", "e.amount"))
    totals = (parsed.withWatermark("ts", "0 seconds")
              .groupBy(F.window("ts", "1 minute"), "user")
              .agg(F.sum("amount").alias("amount"), F.count("*").alias("events")))
    out = totals.select(F.to_json(F.struct(
        F.unix_timestamp("window.start").alias("minute_start"), "user", "amount", "events"))
        .cast("binary").alias("data"))
    q = (out.writeStream.format("bookkeeper").option("metadataServiceUri", uri)
         .option("log", "totals").option("checkpointLocation", checkpoint)
         .outputMode("append").trigger(availableNow=True).start())
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
                k = (t["minute_start"], t["user"])
                assert k not in sums, f"window {k} written twice"
                sums[k] = t["amount"]
    return sums


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--metadata", default=os.environ.get("BK_METADATA_URI"),
                    help="etcd://host:port/ledgers (default $BK_METADATA_URI)")
    ap.add_argument("--events", type=int, default=1000, help="events per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--checkpoint", default=None, help="default: a new temp dir")
    args = ap.parse_args(argv)
    if not args.metadata:
        ap.error("pass --metadata etcd://host:port/ledgers (from 'bookie localcluster')")
    from pyspark.sql import SparkSession
    import bk.spark
    # Spark's Python workers are children of this process: give them this bk.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master("local[2]").appName("bk pipeline demo")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    bk.spark.register(spark)
    checkpoint = args.checkpoint or tempfile.mkdtemp(prefix="bk-demo-cp-")
    with bk.BookKeeper(args.metadata) as client:
        for name in ("events", "totals"):
            if name in client.list_logs():
                client.delete_log(name)
        expected: dict = {}
        for minute in range(args.rounds):
            for e in append_events(client, args.events, minute):
                k = (e["ts"] - e["ts"] % 60, e["user"])
                expected[k] = expected.get(k, 0) + e["amount"]
            run_job(spark, args.metadata, checkpoint)
        print("closed windows, from log 'totals':")
        sums = print_totals(client)
    spark.stop()
    # Every window but the last minute's is closed, and each total is exact.
    closed = {k: v for k, v in expected.items() if k[0] < T0 + 60 * (args.rounds - 1)}
    ok = sums == closed
    print("each event counted exactly once:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
