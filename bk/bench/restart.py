"""Restart after kill -9: how long until a bookie that took a lot of writes at
full speed serves its last entry again (``scripts/bench_restart.py``).

One bookie (production defaults, one shard so the whole journal is one shard's
replay) takes ``size`` bytes of ``entry_size`` entries through pipelined adds
(``bk.bench.bookie``); then the whole bookie is killed with SIGKILL and started
again, and the clock runs from the start until a READ of the last entry
succeeds. What a restart costs is the replay of the journal written since the
last checkpoint, so ``flushIntervalBytes`` decides it; ``compare=True`` runs the
same with checkpoints under load effectively off (the behaviour before they
were forced) for a ratio in one run.
"""

from __future__ import annotations

import os
import tempfile
import time

from bk import protocol as P
from bk.bench.bookie import bench_bookie
from bk.errors import EOK, BKError
from bk.localcluster import LocalCluster
from bk.rawclient import BookieConnection

NEVER = 1 << 50           # flushIntervalBytes that no run reaches


def _read_last(bookie_id: str, ledger_id: int, entry_id: int) -> bool:
    try:
        with BookieConnection(bookie_id, P.shard_of(ledger_id, 1), timeout=2.0) as c:
            r = c.call(P.read(c.next_rid(), ledger_id, entry_id))
            return r[2] == EOK
    except (OSError, BKError):
        return False


def restart_once(size: int, entry_size: int = 1024, flush_bytes: int | None = None,
                 base_dir: str | None = None, progress=None) -> dict:
    """Write ``size`` bytes to a fresh one-bookie cluster, kill -9 it, restart it;
    return the write rate and the restart timings (seconds)."""
    conf = {"numShards": 1}
    if flush_bytes is not None:
        conf["flushIntervalBytes"] = flush_bytes
    count = max(1, size // entry_size)
    ledger_id = (1 << 48) + 1
    with tempfile.TemporaryDirectory(prefix="bk-bench-restart-", dir=base_dir) as d:
        with LocalCluster(num_bookies=1, base_dir=d, num_shards=1,
                          conf_overrides=conf) as cluster:
            b = cluster.bookies[0]
            w = bench_bookie(b.bookie_id, entry_size=entry_size, count=count,
                             ledger_id=ledger_id, progress=progress)
            with BookieConnection(b.bookie_id, 0) as c:
                info = c.call(P.get_bookie_info(c.next_rid()))[3]
            b.kill()
            t0 = time.monotonic()
            b.start(wait=False)
            while not _read_last(b.bookie_id, ledger_id, count - 1):
                if not b.alive:
                    raise BKError(f"bookie exited with {b.proc.returncode} on restart")
                if time.monotonic() - t0 > 600:
                    raise BKError("the restarted bookie did not serve within 600 s")
                time.sleep(0.01)
            serving = time.monotonic() - t0
            b.wait_registered(600)
            registered = time.monotonic() - t0
            with BookieConnection(b.bookie_id, 0) as c:
                after = c.call(P.get_bookie_info(c.next_rid()))[3]
                r = c.call(P.read(c.next_rid(), ledger_id, count - 1))
                assert r[2] == EOK and len(r[7]) == entry_size
    return {
        "bytes_written": count * entry_size,
        "entries": count,
        "write_mb_per_sec": w["mb_per_sec"],
        "flushIntervalBytes": flush_bytes,
        "checkpoints_during_writes": info.get("checkpoints"),
        "replayed_records": after.get("replayed_records"),
        "seconds_to_serve_last_entry": round(serving, 2),
        "seconds_to_register": round(registered, 2),
    }


def bench_restart(size: int = 1 << 30, entry_size: int = 1024, compare: bool = False,
                  base_dir: str | None = None, progress=None) -> dict:
    """The restart benchmark; with ``compare``, also without forced checkpoints."""
    out = {"with_forced_checkpoints": restart_once(size, entry_size, None, base_dir, progress)}
    if compare:
        out["without_forced_checkpoints"] = restart_once(size, entry_size, NEVER, base_dir,
                                                         progress)
        a = out["with_forced_checkpoints"]["seconds_to_serve_last_entry"]
        b = out["without_forced_checkpoints"]["seconds_to_serve_last_entry"]
        out["speedup"] = round(b / a, 2) if a else None
    out["machine_cpus"] = os.cpu_count()
    return out
