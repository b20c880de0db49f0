#!/usr/bin/env python3
"""Benchmark of one shard's storage: durable 1 KiB adds per second.

Drives ShardStorage the way a shard worker does: a batch of add_entry calls,
then one sync() (group commit), repeated. Prints adds/s for journalSyncData
true and false, plus the cost of add_entry alone (no sync) and of reads.

    python scripts/bench_storage.py [--adds 200000] [--batch 200] [--size 1024] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from bk.bookie.storage import ShardStorage


def run(base: str, sync_data: bool, adds: int, batch: int, size: int, seg_mb: int) -> dict:
    jdir = os.path.join(base, f"journal-{int(sync_data)}")
    idir = os.path.join(base, f"index-{int(sync_data)}")
    st = ShardStorage(jdir, idir, segment_size=seg_mb << 20, sync_data=sync_data)
    payload = os.urandom(size)
    digest = os.urandom(16)
    key = b"k" * 20
    nledgers = 8
    add = st.add_entry
    sync = st.sync
    t_add = 0.0
    clock = time.perf_counter
    t0 = clock()
    e = 0
    while e < adds:
        a0 = clock()
        for i in range(e, min(adds, e + batch)):
            add(i % nledgers, i // nledgers, i // nledgers - 1, key, digest, payload, False)
        t_add += clock() - a0
        sync()
        e += batch
    elapsed = clock() - t0
    r0 = clock()
    nreads = min(adds, 100_000)
    for i in range(nreads):
        st.read_entry(i % nledgers, i // nledgers)
    t_read = clock() - r0
    stats = st.stats()
    c0 = clock()
    st.checkpoint()
    t_ckpt = clock() - c0
    st.close()
    r0 = clock()
    st = ShardStorage(jdir, idir, segment_size=seg_mb << 20, sync_data=sync_data)
    t_open = clock() - r0
    st.close()
    return {
        "sync_data": sync_data,
        "adds_per_s": adds / elapsed,
        "add_entry_us": t_add / adds * 1e6,
        "read_entry_us": t_read / nreads * 1e6,
        "adds_per_sync": stats["synced_records"] / max(1, stats["syncs"]),
        "checkpoint_ms": t_ckpt * 1e3,
        "reopen_ms": t_open * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adds", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=200, help="adds per sync (group commit)")
    ap.add_argument("--size", type=int, default=1024, help="payload bytes")
    ap.add_argument("--segment-mb", type=int, default=64)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under "
                    "the current directory, i.e. on a real disk, not tmpfs)")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench-storage-", dir=args.dir or os.getcwd())
    try:
        print(f"{args.adds} adds of {args.size} B, a sync every {args.batch} adds, "
              f"{args.segment_mb} MiB segments, {os.cpu_count()} CPUs, dir {base}")
        for sync_data in (True, False):
            r = run(base, sync_data, args.adds, args.batch, args.size, args.segment_mb)
            print(f"journalSyncData={str(sync_data).lower():5}  {r['adds_per_s']:>9,.0f} adds/s  "
                  f"add_entry {r['add_entry_us']:.2f} us  read_entry {r['read_entry_us']:.2f} us  "
                  f"adds/sync {r['adds_per_sync']:.0f}  checkpoint {r['checkpoint_ms']:.1f} ms  "
                  f"reopen {r['reopen_ms']:.1f} ms")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
