"""Drive one bookie with pipelined adds over the raw protocol and measure it.

This measures the bookie alone (no quorum, no metadata): one connection per
shard used, each keeping ``window`` adds in flight. Every add is durable when
acknowledged (with ``journalSyncData=true``). Used by ``bkshell bench bookie``
and ``scripts/bench_bookie.py``.
"""

from __future__ import annotations

import os
import time
from array import array

from bk import protocol as P
from bk.errors import EOK, BKError, error_for_status
from bk.rawclient import BookieConnection

MASTER_KEY = b"bench-bookie-key-000"


def _percentile(sorted_values, q: float) -> float:
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, int(q * len(sorted_values)))
    return sorted_values[i]


def _bookie_counters(bookie_id: str, num_shards: int,
                     security=None) -> tuple[int, int, float]:
    """Journal syncs, synced records and CPU seconds, summed over the shards."""
    syncs = records = 0
    cpu = 0.0
    for shard in range(num_shards):
        with BookieConnection(bookie_id, shard, security=security) as c:
            info = c.call(P.get_bookie_info(c.next_rid()))[3]
        syncs += info.get("syncs", 0)
        records += info.get("synced_records", 0)
        cpu += info.get("cpu_seconds", 0.0)
    return syncs, records, cpu


def bench_bookie(bookie_id: str, entry_size: int = 1024, count: int = 200_000,
                 window: int = 2000, ledger_id: int | None = None, progress=None,
                 batched: bool = True, security=None) -> dict:
    """Send ``count`` adds of ``entry_size`` bytes to one shard of ``bookie_id``.

    ``batched``: as ADD_BATCH frames (what the client sends a bookie that
    announces them), answered by group acknowledgements; else one ADD frame
    per entry. Returns adds/s, MB/s, latency percentiles (ms), adds per journal
    sync and the shard workers' CPU per add. ``security``: a
    :class:`bk.security.ClientSecurity` (TLS, token) for the connections.
    """
    if ledger_id is None:
        ledger_id = (int(time.time() * 1000) << 8) & ((1 << 62) - 1)
    probe = BookieConnection(bookie_id, -1, security=security)
    num_shards = probe.num_shards
    batched = batched and bool(probe.features & P.FEATURE_ADD_BATCH)
    probe.close()
    conn = BookieConnection(bookie_id, P.shard_of(ledger_id, num_shards), security=security)
    sock = conn.sock
    sock.settimeout(60)
    payload = os.urandom(entry_size)
    digest = bytes(16)
    syncs0, recs0, cpu0 = _bookie_counters(bookie_id, num_shards, security)

    sent_at = array("d", bytes(8 * count))
    latencies = array("d")
    fb = P.FrameBuffer(1 << 30)
    next_eid = 0
    acked = 0
    encode = P.encode_frame
    dlen = len(digest)
    plen = len(payload)
    rec = P.add_record_struct(dlen).pack
    wlen = P.REC_HEAD + dlen + plen
    clock = time.perf_counter
    t0 = clock()
    last_report = t0
    while acked < count:
        # Keep the window full: encode a batch and send it with one system call.
        n = min(window - (next_eid - acked), count - next_eid)
        if n > 0 and batched:
            bufs = []
            for b0 in range(next_eid, next_eid + n, 1000):
                b1 = min(next_eid + n, b0 + 1000)
                recs = []
                for eid in range(b0, b1):
                    recs.append(rec(plen, ledger_id, eid, eid - 1, dlen, digest))
                    recs.append(payload)
                bufs.append(P.add_batch_head(b0, MASTER_KEY, 0, b1 - b0, (b1 - b0) * wlen))
                bufs.extend(recs)
            now = clock()
            for eid in range(next_eid, next_eid + n):
                sent_at[eid] = now
            sock.sendall(b"".join(bufs))
            next_eid += n
        elif n > 0:
            frames = [encode([P.ADD, eid, ledger_id, eid, eid - 1, MASTER_KEY, 0, digest,
                              payload]) for eid in range(next_eid, next_eid + n)]
            now = clock()
            for eid in range(next_eid, next_eid + n):
                sent_at[eid] = now
            sock.sendall(b"".join(frames))
            next_eid += n
        data = sock.recv(1 << 20)
        if not data:
            raise BKError(f"bookie {bookie_id} closed the connection")
        fb.feed(data)
        now = clock()
        for resp in fb.frames():
            if resp[0] == P.ADD_BATCH:
                runs, errors = resp[3], resp[4]
                if errors:
                    raise error_for_status(errors[2], f"add entry {errors[1]} to bookie "
                                                      f"{bookie_id}")
                for i in range(0, len(runs), 3):
                    for eid in range(runs[i + 1], runs[i + 2] + 1):
                        latencies.append(now - sent_at[eid])
                    acked += runs[i + 2] - runs[i + 1] + 1
                continue
            if resp[2] != EOK:
                raise error_for_status(resp[2], f"add entry {resp[4]} to bookie {bookie_id}")
            latencies.append(now - sent_at[resp[1]])
            acked += 1
        if progress and now - last_report >= 1.0:
            last_report = now
            progress(acked, count, acked / (now - t0))
    elapsed = clock() - t0
    conn.close()
    syncs1, recs1, cpu1 = _bookie_counters(bookie_id, num_shards, security)
    lat = sorted(latencies)
    syncs = syncs1 - syncs0
    return {
        "bookie": bookie_id,
        "adds": count,
        "entry_size": entry_size,
        "window": window,
        "batched": batched,
        "tls": security is not None and security.context is not None,
        "seconds": round(elapsed, 3),
        "adds_per_sec": round(count / elapsed, 1),
        "mb_per_sec": round(count * entry_size / elapsed / 1e6, 2),
        "latency_ms": {"p50": round(_percentile(lat, 0.50) * 1000, 3),
                       "p99": round(_percentile(lat, 0.99) * 1000, 3),
                       "p999": round(_percentile(lat, 0.999) * 1000, 3)},
        # CPU the bookie's shard workers spent per add: what the bookie costs,
        # whatever else competes for the machine's cores.
        "bookie_cpu_us_per_add": round((cpu1 - cpu0) / count * 1e6, 2),
        "bookie_adds_per_cpu_second": round(count / (cpu1 - cpu0)) if cpu1 > cpu0 else None,
        "journal_syncs": syncs,
        "adds_per_sync": round((recs1 - recs0) / syncs, 1) if syncs else None,
    }
