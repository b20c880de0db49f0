"""Metadata at scale (``scripts/bench_metadata.py``, ``bkshell bench metadata``).

A local cluster (etcd + ``bookies`` bookies with production defaults and
auto-recovery on, as ``bookie localcluster`` runs them, unless ``conf`` says otherwise) takes ledgers created and closed in steps (E3 Qw2 Qa2, one
100-byte entry each, from ``threads`` threads of one client) up to ``ledgers``.
After each step it measures what a large cluster costs: the create+close rate
of the step, the time to list every ledger id, etcd's db size (as it is, then
after a compaction to the current revision and a defragmentation), etcd's RSS,
and the CPU etcd and the bookies burn while nobody uses the cluster. A churn
phase then deletes and creates ``churn`` ledgers and reports the same.

``compare=True`` also measures, in the same run and on the same cluster, the
paths this replaced: a fresh id write per ledger (two etcd round trips per
create instead of one), one etcd transaction per ledger write instead of
concurrent writes sharing them (:mod:`bk.meta.combiner`), a combiner whose
leader sends at once instead of lingering for company under load (rate, and
client and etcd CPU per ledger) and listings by plain pages (each page visits
every remaining key on etcd 3.5), with or without asking etcd to sort them.

:func:`bench_breakdown` says where the CPU of one created and closed ledger
goes: the client by thread and its cyclic GC, each bookie process by thread
(a shard worker's loop is its main thread), etcd, and etcd's own counters of
what it was asked (its ``/metrics``).
"""

from __future__ import annotations

import gc
import json
import os
import random
import re
import resource
import signal
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil

from bk import protocol as P
from bk.client.bookkeeper import BookKeeper
from bk.config import SETTINGS
from bk.errors import BKError
from bk.localcluster import LocalCluster, etcd_flags
from bk.meta.etcd_server import EtcdServer
from bk.meta import underreplication as UR
from bk.meta.store import (ID_BLOCK_BITS, LIST_PAGE, RANGE_WASTE, MetadataStore, id_windows,
                           ledger_key_name)

PAYLOAD = b"x" * 100
# client threads creating and closing ledgers: 64 carried 1.46x the ledgers of 32
# (docs/performance-log.md, "Hand-offs per ledger and the number of threads")
THREADS = 64
# ledgers in flight when creating and closing with the asynchronous API, the
# default mode: 256 carried 1.2x the ledgers of 64 at the same client CPU, and
# the mode 1.56x the ledgers of 64 blocking threads at 0.57x the client CPU per
# ledger (docs/performance-log.md, "Asynchronous create and close")
INFLIGHT = 256


def _tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p] + p.children(recursive=True)
    except psutil.Error:
        return []


def _cpu_seconds(procs) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def idle_cpu(cluster: LocalCluster, seconds: float) -> dict:
    """Share of one core etcd and the bookies (arbiters and shards) use over
    ``seconds`` while no client does anything."""
    etcd = _tree(cluster.etcd.pid)
    bookies = [p for b in cluster.bookies if b.alive for p in _tree(b.pid)]
    e0, b0, t0 = _cpu_seconds(etcd), _cpu_seconds(bookies), time.monotonic()
    time.sleep(seconds)
    dt = time.monotonic() - t0
    return {"etcd": round((_cpu_seconds(etcd) - e0) / dt, 4),
            "bookies": round((_cpu_seconds(bookies) - b0) / dt, 4)}


def wait_first_audit(cluster: LocalCluster, conf: dict, timeout: float = 120.0) -> None:
    """Wait for a fresh cluster's one-time work: the auditor's first periodic ledger
    check, which runs at once on a cluster with no record of one. Without this wait
    a fast first step ends before it starts, and the check of the step's ledgers
    (~1 s of CPU per 3,000) lands in that step's idle measurement."""
    interval = int(conf.get("auditorPeriodicCheckInterval",
                            SETTINGS["auditorPeriodicCheckInterval"].default))
    if str(conf.get("autoRecoveryDaemonEnabled", "")).lower() not in ("true", "1") \
            or interval <= 0:
        return
    deadline = time.monotonic() + timeout
    while "ledgers" not in UR.checks(cluster.store):
        if time.monotonic() > deadline:
            raise BKError(f"the auditor made no first ledger check within {timeout:g}s")
        time.sleep(0.1)


def create_close(client: BookKeeper, count: int, threads: int, fresh_ids: bool = False,
                 out: list | None = None) -> float:
    """Create, write one entry to and close ``count`` ledgers; ledgers/s.
    ``fresh_ids``: the old path, one id write per ledger before its create."""
    left = [count]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run():
        while True:
            with lock:
                if left[0] <= 0 or errors:
                    return
                left[0] -= 1
            try:
                lid = client.new_ledger_id() if fresh_ids else None
                h = client.create_ledger(3, 2, 2, password=b"bench", ledger_id=lid)
                h.add_entry(PAYLOAD)
                h.close()
                if out is not None:
                    out.append(h.ledger_id)
            except BaseException as e:      # report the first failure after the step
                errors.append(e)
                return
    t0 = time.monotonic()
    ts = [threading.Thread(target=run, daemon=True) for _ in range(threads)]   # Ctrl-C ends it
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return count / (time.monotonic() - t0)


def create_close_async(client: BookKeeper, count: int, inflight: int,
                       out: list | None = None) -> float:
    """:func:`create_close` with the asynchronous API from no thread of its own:
    ``inflight`` chains of create_ledger_async -> add_entry_async -> close_async,
    each link started by the previous one's callback (on the client's metadata
    and I/O threads), each chain starting the next ledger when one closes; ledgers/s."""
    left = [count]
    chains = [min(inflight, count)]
    lock = threading.Lock()
    errors: list[BaseException] = []
    finished = threading.Event()

    def fail(e):
        errors.append(e)
        end_chain()

    def end_chain():
        with lock:
            chains[0] -= 1
            last = chains[0] == 0
        if last:
            finished.set()

    def next_ledger():
        with lock:
            go = left[0] > 0 and not errors
            left[0] -= 1
        if not go:
            end_chain()
            return
        try:
            client.create_ledger_async(3, 2, 2, password=b"bench", callback=step(created))
        except BaseException as e:
            fail(e)

    def step(then):
        """A link's callback: an error ends the chain, else ``then(value)`` runs
        (and an error it raises ends the chain too)."""
        def callback(exc, value):
            if exc is not None:
                fail(exc)
                return
            try:
                then(value)
            except BaseException as e:
                fail(e)
        return callback

    def created(h):
        h.add_entry_async(PAYLOAD, callback=step(lambda _eid: added(h)))

    def added(h):
        h.close_async(callback=step(lambda _: closed(h)))

    def closed(h):
        if out is not None:
            out.append(h.ledger_id)
        next_ledger()

    t0 = time.monotonic()
    if not chains[0]:
        return 0.0
    for _ in range(chains[0]):
        next_ledger()
    finished.wait()
    if errors:
        raise errors[0]
    return count / (time.monotonic() - t0)


def run_create_close(client: BookKeeper, count: int, mode, out: list | None = None) -> float:
    """create+close of ``count`` ledgers by ``mode``: an int (that many blocking
    threads) or ``"aN"`` (the asynchronous API, N ledgers in flight); ledgers/s."""
    if isinstance(mode, str) and mode.startswith("a"):
        return create_close_async(client, count, int(mode[1:]), out=out)
    return create_close(client, count, int(mode), out=out)


def mode_name(mode) -> str:
    if isinstance(mode, str) and mode.startswith("a"):
        return f"async, {mode[1:]} in flight"
    return f"{mode} threads"


def list_seconds(client: BookKeeper, mode: str = "windows",
                 page_size: int = LIST_PAGE) -> tuple[float, int]:
    """(seconds, ids) to list every ledger id. ``windows``: the client's listing
    (requests over id windows that hold about a page); ``pages``: plain pages
    from the last key to the end of the prefix (etcd 3.5 visits every remaining
    key for each page); ``sorted``: the same, asking etcd to sort each page."""
    t0 = time.monotonic()
    if mode == "windows":
        n = sum(1 for _ in client.list_ledgers(page_size=page_size))
        return time.monotonic() - t0, n
    store = client._store
    start = store._key("ledgers/")
    end = start[:-1] + bytes([start[-1] + 1])
    sort = {"sort_order": "ascend", "sort_target": "key"} if mode == "sorted" else {}
    n = 0
    while True:
        resp = store._call("list (pages)", "range", lambda c: c.get_range_response(
            start, end, limit=1000, keys_only=True, **sort), idempotent=True)
        n += len(resp.kvs)
        if not resp.more or not resp.kvs:
            break
        start = resp.kvs[-1].key + b"\0"
    return time.monotonic() - t0, n


def etcd_sizes(cluster: LocalCluster, defrag: bool) -> dict:
    # a physical compaction and a defragmentation of a large db take minutes
    store = MetadataStore(cluster.metadata_uri, timeout=600)
    out = {"db_mb": round(store.db_size() / 1e6, 1)}
    try:
        rss = psutil.Process(cluster.etcd.pid).memory_info().rss
        out["etcd_rss_mb"] = round(rss / 1e6, 1)
    except psutil.Error:
        pass
    if defrag:
        store.compact(store.revision(), physical=True)   # done before the defrag starts
        store.defragment()
        out["db_mb_compacted"] = round(store.db_size() / 1e6, 1)
    store.close()
    return out


def _after_bk_compaction(cluster: LocalCluster, conf: dict) -> dict:
    """The db once bk's own compactor has compacted past now (two intervals at
    most), then defragmented: what an operator's occasional defrag gets back."""
    interval = float(conf.get("metadataCompactionIntervalSeconds", 300))
    if interval <= 0 or interval > 120:
        return {}
    store = MetadataStore(cluster.metadata_uri, timeout=600)
    target = store.revision()
    deadline = time.monotonic() + 3 * interval + 10
    while store.compact_revision() < target and time.monotonic() < deadline:
        time.sleep(1.0)
    out = {"bk_compacted": store.compact_revision() >= target}
    store.defragment()
    out["db_mb_bk_compacted_defrag"] = round(store.db_size() / 1e6, 1)
    store.close()
    return out


def _steps(total: int) -> list[int]:
    marks = [m for m in (10_000, 30_000, 100_000, 300_000, 1_000_000, 3_000_000) if m < total]
    return marks + [total]


def bench_metadata(ledgers: int = 1_000_000, steps: list[int] | None = None,
                   threads: int = THREADS, inflight: int = INFLIGHT,
                   bookies: int = 3, shards: int = 2, churn: int | None = None,
                   idle_seconds: float = 20.0, compare: bool = True, conf: dict | None = None,
                   base_dir: str | None = None, progress=print) -> dict:
    """Run the benchmark; returns ``{"steps": [...], "churn": {...}, "compare": {...}}``
    and calls ``progress(row)`` after each step. Ledgers are created and closed
    with the asynchronous API, ``inflight`` at a time, or (``inflight=0``) from
    ``threads`` blocking threads; the compared old paths and the churn's deletes
    use the blocking threads."""
    steps = sorted(steps or _steps(ledgers))
    mode = f"a{inflight}" if inflight else threads
    nthreads = threads
    churn = min(steps[-1], 100_000) if churn is None else churn
    out: dict = {"steps": [], "compare": {}, "churn": None}
    with tempfile.TemporaryDirectory(prefix="bk-bench-meta-", dir=base_dir) as d:
        # as 'bookie localcluster' runs them: auto-recovery on in every bookie
        conf = {"autoRecoveryDaemonEnabled": True, **(conf or {})}
        with LocalCluster(num_bookies=bookies, base_dir=d, num_shards=shards,
                          conf_overrides=conf) as cluster:
            client = BookKeeper(cluster.metadata_uri)
            try:
                wait_first_audit(cluster, conf)
                held = 0
                created: list[int] = []
                etcd = _tree(cluster.etcd.pid)
                for target in steps:
                    bookies = [p for b in cluster.bookies if b.alive for p in _tree(b.pid)]
                    c0, e0, b0 = _own_cpu(), _cpu_seconds(etcd), _cpu_seconds(bookies)
                    rate = run_create_close(client, target - held, mode, out=created)
                    per = 1e6 / (target - held)
                    row = {"ledgers": target, "create_close_per_s": round(rate),
                           "client_cpu_us": round((_own_cpu() - c0) * per),
                           "etcd_cpu_us": round((_cpu_seconds(etcd) - e0) * per),
                           "bookies_cpu_us": round((_cpu_seconds(bookies) - b0) * per)}
                    held = target
                    if compare and not out["compare"]:
                        n = min(2000, max(200, held // 10))
                        old = create_close(client, n, nthreads, fresh_ids=True, out=created)
                        new = create_close(client, n, nthreads, out=created)
                        held += 2 * n
                        out["compare"]["create_close_per_s"] = {
                            "fresh_id_per_ledger": round(old), "id_blocks": round(new),
                            "ratio": round(new / old, 2)}
                        # one etcd txn per write vs concurrent writes sharing txns,
                        # alternated three times (the best of each: a noisy machine)
                        combiner = client._store._combiner
                        alone = shared = 0.0
                        for _ in range(3):
                            combiner.enabled = False
                            alone = max(alone, create_close(client, n, nthreads, out=created))
                            combiner.enabled = True
                            shared = max(shared, create_close(client, n, nthreads, out=created))
                            held += 2 * n
                        out["compare"]["create_close_per_s"].update(
                            one_txn_per_write=round(alone), shared_txns=round(shared),
                            shared_ratio=round(shared / alone, 2))
                        # a leader sending at once vs waiting combiner.linger for
                        # company under load: rate (best) and CPU per ledger (least)
                        linger, best = combiner.linger, {}
                        for _ in range(3):
                            for name, value in (("no_linger", 0.0), ("linger", linger)):
                                combiner.linger = value
                                c0, e0 = _own_cpu(), _cpu_seconds(etcd)
                                r = create_close(client, n, nthreads, out=created)
                                cpu = ((_own_cpu() - c0) * 1e6 / n,
                                       (_cpu_seconds(etcd) - e0) * 1e6 / n)
                                b = best.setdefault(name, [0.0, cpu[0], cpu[1]])
                                best[name] = [max(b[0], r), min(b[1], cpu[0]),
                                              min(b[2], cpu[1])]
                            held += 2 * n
                        out["compare"]["linger"] = {
                            f"{name}_{k}": round(v) for name, b in best.items()
                            for k, v in zip(("per_s", "client_us", "etcd_us"), b)}
                    row["list_s"], n_listed = list_seconds(client)
                    row["list_s"] = round(row["list_s"], 2)
                    row["listed"] = n_listed
                    if compare and held <= 300_000:     # the old ways grow quadratically
                        paged_s, _ = list_seconds(client, "pages")
                        row["list_pages_s"] = round(paged_s, 2)
                    if compare and held <= 100_000:
                        sorted_s, _ = list_seconds(client, "sorted")
                        row["list_sorted_s"] = round(sorted_s, 2)
                    row["idle_cpu"] = idle_cpu(cluster, idle_seconds)
                    row.update(etcd_sizes(cluster, defrag=True))
                    out["steps"].append(row)
                    progress(row)
                if churn:
                    t0 = time.monotonic()
                    victims, created = created[:churn], created[churn:]
                    with ThreadPoolExecutor(nthreads) as ex:
                        list(ex.map(client.delete_ledger, victims))
                    fresh: list[int] = []
                    rate = run_create_close(client, len(victims), mode, out=fresh)
                    row = {"churned": len(victims), "create_close_per_s": round(rate),
                           "seconds": round(time.monotonic() - t0, 1)}
                    row.update(etcd_sizes(cluster, defrag=False))
                    row["idle_cpu"] = idle_cpu(cluster, idle_seconds)
                    row.update(_after_bk_compaction(cluster, conf))
                    out["churn"] = row
                    progress(row)
            finally:
                client.close()
    return out


def format_row(row: dict) -> str:
    """One line of a step's (or the churn's) numbers."""
    cpu = row.get("idle_cpu", {})
    head = (f"{row['ledgers']:>9} ledgers" if "ledgers" in row
            else f"churn {row['churned']} deleted+created")
    parts = [head, f"create+close {row['create_close_per_s']}/s"]
    if "client_cpu_us" in row:
        parts.append(f"CPU per ledger: client {row['client_cpu_us']} us, "
                     f"etcd {row['etcd_cpu_us']} us, bookies {row.get('bookies_cpu_us', '?')} us")
    if "list_s" in row:
        old = [f"{k} {row[f'list_{k}_s']}s" for k in ("pages", "sorted")
               if f"list_{k}_s" in row]
        parts.append(f"list {row['list_s']}s" + (f" (plain {', '.join(old)})" if old else ""))
    parts.append(f"db {row.get('db_mb')} MB" + (f" ({row['db_mb_compacted']} MB compacted)"
                                                if "db_mb_compacted" in row else ""))
    if "db_mb_bk_compacted_defrag" in row:
        parts.append(f"db {row['db_mb_bk_compacted_defrag']} MB after bk's compaction "
                     f"and a defrag")
    parts.append(f"etcd RSS {row.get('etcd_rss_mb')} MB")
    parts.append(f"idle CPU etcd {cpu.get('etcd', 0):.1%} bookies {cpu.get('bookies', 0):.1%}")
    return ", ".join(parts)


# a closed ledger's metadata as a client writes it (~455 bytes of JSON): etcd reads
# the value of every key a range visits, keys only or not
VALUE = (b'{"ctime":1764200000000,"customMetadata":{},"digestType":"CRC32C","ensembles":'
         b'[[0,["127.0.0.1:3181","127.0.0.1:3182","127.0.0.1:3183"]]],"ensembleSize":3,'
         b'"formatVersion":3,"lastEntryId":0,"length":100,"password":"","state":"CLOSED",'
         b'"writeQuorumSize":2,"ackQuorumSize":2,"creatorToken":"bench-0000000000000000"}')


def _fill(store: MetadataStore, ledgers: int, blocks: list, value: bytes = VALUE) -> list[int]:
    """Put ``ledgers`` ledger keys directly, ids as clients hand them out: from
    ``len(blocks)`` writers' blocks of 1024 (updated in place), 13 of each per
    transaction, interleaved. Returns the ids put."""
    c = store._client()
    made: list[int] = []
    while len(made) < ledgers:
        ops, ids = [], []
        for i, b in enumerate(blocks):
            take, blocks[i] = b[:13], b[13:]
            ids += take
            if not blocks[i]:
                blocks[i] = store.reserve_ledger_ids()
        ids = ids[:ledgers - len(made)]
        ops = [c.transactions.put(store._key(ledger_key_name(lid)), value) for lid in ids]
        store._txn_full("fill", [], ops)
        made += ids
    return made


def bench_listing(ledgers: int, base_dir: str | None = None, progress=print) -> dict:
    """Listing alone, on an etcd with nothing but ``ledgers`` ledger keys (ids as
    clients hand them out: blocks of 1024 from 8 writers, interleaved): seconds,
    client CPU and etcd CPU to list them by id windows (the client's listing) of
    1,000 and of LIST_PAGE ids, and (up to 300,000) seconds by plain pages."""
    with tempfile.TemporaryDirectory(prefix="bk-bench-list-", dir=base_dir) as d, \
            EtcdServer(d, extra_args=etcd_flags()) as etcd:
        store = MetadataStore(etcd.uri("ledgers"), timeout=60)
        store.format()
        made = len(_fill(store, ledgers, [store.reserve_ledger_ids() for _ in range(8)],
                         b'{"state":"CLOSED"}'))
        store.compact(store.revision(), physical=True)

        class _Client:               # what list_seconds needs of a client
            _store = store

            def list_ledgers(self, page_size):
                return store.list_ledgers(page_size=page_size)
        out = {"ledgers": made}
        # id windows of LIST_PAGE ids and of 1,000 (the page before), alternated
        # three times (best wall time, least CPU: a noisy machine)
        etcd_procs = _tree(etcd.pid)
        for _ in range(3):
            for page in (1000, LIST_PAGE):
                c0, e0 = _own_cpu(), _cpu_seconds(etcd_procs)
                secs, n = list_seconds(_Client(), "windows", page)
                assert n == made, (page, n, made)
                for k, v in ((f"windows_{page}_s", secs),
                             (f"client_cpu_{page}_s", _own_cpu() - c0),
                             (f"etcd_cpu_{page}_s", _cpu_seconds(etcd_procs) - e0)):
                    out[k] = round(min(out.get(k, v), v), 2)
        out["windows_s"] = out[f"windows_{LIST_PAGE}_s"]
        if made <= 300_000:           # plain pages grow quadratically: minutes at 1M
            secs, n = list_seconds(_Client(), "pages")
            out["pages_s"] = round(secs, 2)
            assert n == made, ("pages", n, made)
            out["ratio"] = round(out["pages_s"] / max(out["windows_s"], 1e-6), 1)
        progress(out)
        store.close()
        return out


def bench_reconcile(steps: list[int], rounds: int = 2, shards: int = 2,
                    writers: int = 1, share: int = 1, base_dir: str | None = None,
                    progress=print) -> dict:
    """One bookie's full GC reconcile of what it holds, as its arbiter runs it
    (:meth:`bk.bookie.gc.GarbageCollector.check`), on an etcd holding only ledger
    keys, at each of ``steps`` ledgers in the cluster, ids as ``writers`` clients
    hand them out (one: each block of 1024 is reserved when the last is used up,
    ~80 revisions later, so blocks are dense runs far apart, as from the bench's
    one client). The bookie holds one in ``share`` of them, picked at random (1:
    every one, a bookie of 3 with E3; 20: a bookie among 60 with E3), in
    ``shards`` shards. Old (the code before: each shard's ids checked alone,
    ranges over their dense runs, point reads elsewhere) and new (the shards' ids
    together, :meth:`~bk.meta.store.MetadataStore.existing_ledgers`: windows of
    the prefix read whole where the held ids are one in 64 of the keys or more)
    alternate ``rounds`` times in one process against the same etcd, at one
    pinned revision; each reports etcd CPU, this process's CPU (the bookie's
    side), the Range requests it sent (the store's own count, ``requests``) and
    wall seconds of the whole reconcile (best of the rounds), and the two must
    find the same ledgers (a few deleted first, after the revision). Each row
    also says what the layout implies: ``blocks``, the id blocks holding a
    held id, and ``old_windows``, the windows the old way cuts each shard's
    ids into (a request each)."""
    out: dict = {"steps": [], "share": share}
    pick = random.Random(share)
    with tempfile.TemporaryDirectory(prefix="bk-bench-reconcile-", dir=base_dir) as d, \
            EtcdServer(d, extra_args=etcd_flags()) as etcd:
        store = MetadataStore(etcd.uri("ledgers"), timeout=60)
        store.format()
        etcd_procs = _tree(etcd.pid)
        blocks = [store.reserve_ledger_ids() for _ in range(writers)]
        ids: list[int] = []
        held: list[int] = []
        for n in steps:
            made = _fill(store, n - len(ids), blocks)
            ids += made
            held += [lid for lid in made if share <= 1 or pick.randrange(share) == 0]
            store.compact(store.revision(), physical=True)
            rev = store.revision()
            gone = held[:: max(1, len(held) // 50)]     # deleted after the pinned revision
            for lid in gone:
                store.delete_json(ledger_key_name(lid))
            per_shard: dict[int, list[int]] = {}
            for lid in held:
                per_shard.setdefault(P.shard_of(lid, shards), []).append(lid)
            row: dict = {"ledgers": len(ids), "held": len(held),
                         "blocks": len({lid >> ID_BLOCK_BITS for lid in held}),
                         "old_windows": sum(len(id_windows(sorted(part), RANGE_WASTE))
                                            for part in per_shard.values())}
            for r in range(rounds):
                for name in ("old", "new") if r % 2 == 0 else ("new", "old"):   # A B B A
                    gc.collect()
                    e0, c0 = store.rpc_counts["ledger ranges"], _own_cpu()
                    ecpu0, t0 = _cpu_seconds(etcd_procs), time.monotonic()
                    if name == "old":
                        live = set()
                        for part in per_shard.values():
                            live.update(store._ledger_id_of(kv.key) for kv in store._ledger_kvs(
                                "check ledgers", part, True, rev, waste=RANGE_WASTE))
                    else:
                        live = store.existing_ledgers(held, revision=rev)
                    wall = time.monotonic() - t0
                    res = {"wall_s": wall, "bookie_cpu_s": _own_cpu() - c0,
                           "etcd_cpu_s": _cpu_seconds(etcd_procs) - ecpu0,
                           "requests": store.rpc_counts["ledger ranges"] - e0}
                    if live != set(held):
                        raise BKError(f"{name}: {len(set(held) - live)} ledgers missed, "
                                      f"{len(live - set(held))} extra")
                    best = row.setdefault(name, {})
                    for k, v in res.items():
                        best[k] = round(min(best.get(k, v), v), 3)
            for k in ("wall_s", "bookie_cpu_s", "etcd_cpu_s", "requests"):
                row[f"ratio_{k}"] = round(row["new"][k] / max(row["old"][k], 1e-9), 3)
            progress(row)
            out["steps"].append(row)
            for lid in gone:                            # back, for the next step
                store.put_json(ledger_key_name(lid), {"id": lid})
        store.close()
    return out


def _gc_state(cluster: LocalCluster, b) -> dict:
    port = cluster.store.bookie_info(b.bookie_id)["httpPort"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/bookie/info",
                                timeout=10) as r:
        return json.loads(r.read())["gc"] or {}


def _wait(pred, what: str, timeout: float = 1800.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise BKError(f"no {what} within {timeout:g}s")
        time.sleep(0.2)


def _scattered(cluster: LocalCluster, client: BookKeeper, ledgers: int, share: int
               ) -> list[int]:
    """``ledgers`` ledger ids from the cluster's blocks, one in ``share`` (at random)
    a real ledger on every bookie (E3 Qw3 Qa2, one entry, closed), the others
    empty closed ledgers put directly (no bookie holds an entry of them): what a
    bookie among ``3 * share`` holds of a cluster of E3 ledgers. Returns the
    real ones' ids."""
    pick = random.Random(share)
    store = cluster.store
    bookies = sorted(store.list_bookies())
    empty = json.dumps({
        "ctime": 1764200000000, "customMetadata": {}, "digestType": "CRC32C",
        "ensembles": [[0, bookies[:3]]], "ensembleSize": 3, "formatVersion": 3,
        "lastEntryId": -1, "length": 0, "password": "", "state": "CLOSED",
        "writeQuorumSize": 3, "ackQuorumSize": 2,
        "creatorToken": "bench-0000000000000000"}).encode()
    real: list[int] = []
    c = store._client()
    made = 0
    while made < ledgers:
        block = list(store.reserve_ledger_ids())[:ledgers - made]
        made += len(block)
        mine = [lid for lid in block if pick.randrange(share) == 0]
        real += mine
        others = sorted(set(block) - set(mine))
        for i in range(0, len(others), 100):
            store._txn_full("fill", [], [c.transactions.put(
                store._key(ledger_key_name(lid)), empty) for lid in others[i:i + 100]])

    def make(lid):
        h = client.create_ledger(3, 3, 2, password=b"bench", ledger_id=lid)
        h.add_entry(PAYLOAD)
        h.close()
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(make, real))
    return real


def _held_by(store: MetadataStore, bookie_id: str) -> list[int]:
    """The ledgers of which ``bookie_id`` holds an entry, by their metadata (the
    write set of each entry up to the last)."""
    held = []
    for md, _ in store.list_ledger_metadata():
        last = md.last_entry_id if md.last_entry_id is not None else -1
        if any(bookie_id in md.write_set(e) for e in range(last + 1)):
            held.append(md.ledger_id)
    return held


def bench_reconcile_cluster(ledgers: int, rounds: int = 2, trees: dict | None = None,
                            share: int = 0, base_dir: str | None = None,
                            progress=print) -> dict:
    """One real bookie's full reconcile (SIGUSR1) on a local cluster of 3 (2 shards
    each) holding ``ledgers`` ledgers: created and closed by the asynchronous API
    (E3 Qw2 Qa2, one entry: a bookie holds about two thirds of them), or with
    ``share`` > 1 scattered (:func:`_scattered`: the bookie holds one in ``share``
    of the ids, at random). ``trees``
    (name -> a source tree, e.g. ``{"old": "/tmp/main", "new": "."}``): the first
    bookie is restarted on each tree's code in turn (``PYTHONPATH``), on the same
    data, alternating (A B B A ...), ``rounds`` times; none: this code only. Per
    reconcile: etcd CPU, the bookie's CPU (arbiter and shards), the Range
    requests the reconcile sent (``requests``, the bookie's own count from its
    GC state; None from a tree that does not report it) and etcd's count of
    Range calls meanwhile (``etcd_requests``: the other bookies' and the
    bookie's other reads too), the ledgers the reconcile checked and found
    deleted, the round's seconds. ``held_ids``: the ledgers the bookie holds
    (the real ones of ``share``; else from their metadata: those with an entry
    whose write set names it)."""
    trees = trees or {"this": ""}
    out: dict = {"ledgers": ledgers, "share": share, "runs": {}}
    conf = {"httpServerEnabled": True, "httpServerPort": 0, "gcWaitTime": 5000}
    with tempfile.TemporaryDirectory(prefix="bk-bench-reconcile-", dir=base_dir) as d, \
            LocalCluster(num_bookies=3, base_dir=d, num_shards=2,
                         conf_overrides=conf) as cluster:
        with BookKeeper(cluster.metadata_uri) as client:
            if share > 1:
                out["held_ids"] = _scattered(cluster, client, ledgers, share)
            else:
                out["create_close_per_s"] = round(run_create_close(client, ledgers,
                                                                   f"a{INFLIGHT}"))
        b = cluster.bookies[0]
        if share <= 1:
            out["held_ids"] = _held_by(cluster.store, b.bookie_id)
        out["held"] = len(out["held_ids"])
        etcd = _tree(cluster.etcd.pid)
        names = list(trees)
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                b.stop()
                b.command_prefix = ["env", f"PYTHONPATH={trees[name]}"] if trees[name] else []
                b.start()
                _wait(lambda: (_gc_state(cluster, b).get("lastRound") or {}).get("complete"),
                      "first GC round after the restart")
                before = _gc_state(cluster, b).get("lastReconcile")
                procs = _tree(b.pid)
                e0, b0 = _cpu_seconds(etcd), _cpu_seconds(procs)
                m0 = _etcd_counters(cluster.etcd.client_url)
                os.kill(b.pid, signal.SIGUSR1)

                def reconciled():
                    last = _gc_state(cluster, b).get("lastReconcile")
                    return last is not None and last != before and last["complete"]
                _wait(reconciled, "full reconcile")
                m1 = _etcd_counters(cluster.etcd.client_url)
                last = _gc_state(cluster, b)["lastReconcile"]
                row = {"etcd_cpu_s": round(_cpu_seconds(etcd) - e0, 2),
                       "bookie_cpu_s": round(_cpu_seconds(procs) - b0, 2),
                       "requests": last.get("requests"),
                       "etcd_requests": round(m1.get("Range calls", 0)
                                              - m0.get("Range calls", 0)),
                       "checked": last["checked"], "dead": last["dead"],
                       "seconds": last["seconds"]}
                out["runs"].setdefault(name, []).append(row)
                progress(name, row)
    return out


_HZ = os.sysconf("SC_CLK_TCK")
_ETCD_COUNTERS = re.compile(
    r'^(grpc_server_handled_total)\{[^}]*grpc_method="(\w+)"[^}]*\} (\S+)$|'
    r'^(etcd_network_client_grpc_received_bytes_total|etcd_network_client_grpc_sent_bytes_total|'
    r'etcd_mvcc_put_total|etcd_mvcc_range_total|etcd_disk_wal_fsync_duration_seconds_count)'
    r'(?:\{[^}]*\})? (\S+)$')


def _threads_cpu(pid: int) -> dict:
    """{thread id: (name, CPU seconds)} of one process."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
        except OSError:
            continue
        rest = tail.split()
        out[int(tid)] = (head.split("(", 1)[1], (int(rest[11]) + int(rest[12])) / _HZ)
    return out


def _switches(pid: int) -> int:
    """Context switches (voluntary and not) of the live threads of one process."""
    n = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return n
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if "ctxt_switches:" in line:
                        n += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return n


def _own_switches() -> int:
    # all of this process's threads, those that ended included
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_nvcsw + r.ru_nivcsw


def _etcd_counters(url: str) -> dict:
    out: dict = {}
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            m = _ETCD_COUNTERS.match(line)
            if m is None:
                continue
            key, value = ((f"{m.group(2)} calls", m.group(3)) if m.group(1)
                          else (m.group(4), m.group(5)))
            out[key] = out.get(key, 0.0) + float(value)
    return out


def bench_threads(counts: list[int], rounds: int = 4, ledgers: int = 3_000,
                  bookies: int = 3, shards: int = 2, base_dir: str | None = None,
                  progress=None) -> dict:
    """Create+close rate, client CPU and context switches per ledger for each
    thread count of ``counts``, alternating them ``rounds`` times (every other
    round in reverse order) in one client process against one cluster (so the
    VM's drifts hit every count alike).
    ``progress(count, row)`` after each run."""
    runs: dict = {str(n): [] for n in counts}
    with tempfile.TemporaryDirectory(prefix="bk-bench-meta-", dir=base_dir) as d:
        with LocalCluster(num_bookies=bookies, base_dir=d, num_shards=shards,
                          conf_overrides={"autoRecoveryDaemonEnabled": True}) as cluster:
            client = BookKeeper(cluster.metadata_uri)
            try:
                wait_first_audit(cluster, {"autoRecoveryDaemonEnabled": True})
                for n in counts:                                 # warm-up
                    run_create_close(client, 500, n)
                for i in range(rounds):
                    # every other round in reverse (ABBA): a run's place in the round
                    # (what ran just before it) favours no count
                    for n in (counts if i % 2 == 0 else counts[::-1]):
                        c0, s0 = _own_cpu(), _own_switches()
                        rate = run_create_close(client, ledgers, n)
                        row = {"create_close_per_s": round(rate),
                               "client_us_per_ledger": round((_own_cpu() - c0) * 1e6 / ledgers, 1),
                               "client_switches_per_ledger":
                                   round((_own_switches() - s0) / ledgers, 2)}
                        runs[str(n)].append(row)
                        if progress is not None:
                            progress(n, row)
            finally:
                client.close()
    return {"ledgers_per_run": ledgers, "rounds": rounds,
            "runs": runs}


def bench_breakdown(ledgers: int = 10_000, threads: int = THREADS, bookies: int = 3,
                    shards: int = 2, warmup: int = 1_000, base_dir: str | None = None,
                    inflight: int = INFLIGHT) -> dict:
    """CPU per created and closed ledger by process and thread, the client's cyclic
    GC (collections and their CPU, from ``gc.callbacks``: observed, not tuned) and
    etcd's counters per ledger, over ``ledgers`` after ``warmup``; asynchronous
    (``inflight`` at a time) or, with ``inflight=0``, from ``threads`` threads."""
    mode = f"a{inflight}" if inflight else threads
    collections_ = [0, 0.0]
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.thread_time()
        else:
            collections_[0] += 1
            collections_[1] += time.thread_time() - started[0]
    with tempfile.TemporaryDirectory(prefix="bk-bench-meta-", dir=base_dir) as d:
        with LocalCluster(num_bookies=bookies, base_dir=d, num_shards=shards,
                          conf_overrides={"autoRecoveryDaemonEnabled": True}) as cluster:
            client = BookKeeper(cluster.metadata_uri)
            try:
                wait_first_audit(cluster, {"autoRecoveryDaemonEnabled": True})
                run_create_close(client, warmup, mode)
                roles = {os.getpid(): "client"}
                for p in _tree(cluster.etcd.pid):
                    roles[p.pid] = "etcd"
                for b in cluster.bookies:
                    for p in _tree(b.pid):
                        roles[p.pid] = "arbiter" if p.pid == b.pid else "shard worker"
                before = {pid: _threads_cpu(pid) for pid in roles}
                sw0 = {pid: _switches(pid) for pid in roles if pid != os.getpid()}
                sw0[os.getpid()] = _own_switches()
                url = cluster.etcd.client_url
                e0, c0 = _etcd_counters(url), _own_cpu()
                gc.callbacks.append(on_gc)
                try:
                    rate = run_create_close(client, ledgers, mode)
                finally:
                    gc.callbacks.remove(on_gc)
                client_cpu = _own_cpu() - c0
                after = {pid: _threads_cpu(pid) for pid in roles}
                switches: dict = {}
                for pid, role in roles.items():
                    n = (_own_switches() if pid == os.getpid() else _switches(pid)) - sw0[pid]
                    switches[role] = switches.get(role, 0) + n
                e1 = _etcd_counters(url)
                names = {t.native_id: t.name for t in threading.enumerate()}
            finally:
                client.close()
    per = 1e6 / ledgers
    us: dict = {"client": client_cpu * per,
                "client: the calling threads (gone)": client_cpu * per}
    for pid, role in roles.items():
        for tid, (comm, cpu) in after[pid].items():
            spent = (cpu - before[pid].get(tid, ("", 0.0))[1]) * per
            if role == "client":
                us["client: the calling threads (gone)"] -= spent
                key = f"client thread {names.get(tid, comm)}"
            elif role == "shard worker":
                key = "shard workers: " + ("loop" if tid == pid else "other threads")
            else:
                key = role
            if role != "client" or spent >= 1:
                us[key] = us.get(key, 0.0) + spent
    us["client: cyclic GC"] = collections_[1] * per
    return {"ledgers": ledgers, "mode": mode, "create_close_per_s": round(rate),
            "cpu_us_per_ledger": {k: round(v, 1) for k, v in us.items()},
            "gc_collections_per_ledger": round(collections_[0] / ledgers, 4),
            "switches_per_ledger": {k: round(v / ledgers, 2) for k, v in switches.items()},
            "etcd_per_ledger": {k: round((e1[k] - e0.get(k, 0.0)) / ledgers, 3)
                                for k in sorted(e1) if e1[k] != e0.get(k, 0.0)}}
