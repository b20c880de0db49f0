"""Storage at scale: one bookie filled in steps, measured after each step
(``scripts/bench_scale.py``, ``bkshell bench scale``).

One bookie with one shard (so one worker holds everything) is filled through
the raw protocol with entries over ``ledgers`` ledgers, interleaved (each
ADD_BATCH carries one entry of many ledgers), at full speed. After each step
it measures and prints:

* entries held; the worker's RSS, measured at the same point of every step
  (after that step's reads, when its caches are warm), split into anonymous
  memory, file-backed pages and, of those, the LMDB index's mapped pages,
  and its peak RSS (VmHWM), from /proc;
* bytes and seconds of the last flush (what a flush costs at this size);
* add latency p50/p99/p99.9 at a fixed ``rate`` adds/s for ``rate_seconds``;
* restart after kill -9: seconds until the last entry is served;
* cold-cache random reads: p50/p99 of single READs of random entries;
* cold-cache catch-up read: MB/s of reading whole ledgers of 1 KiB entries
  through the client (``bk.BookKeeper``), ledgers written at the start
  interleaved with 99 others (different ones at each step): 10 ledgers one
  after another, each cold, each with one ``read_entries``; the aggregate
  (opening each ledger included) and each ledger's rate.

"Cold" means the page cache was dropped (``/proc/sys/vm/drop_caches``, as
root, as CI runs); without root the figures are marked warm.

:func:`bench_catchup` is the catch-up read alone, quick enough to repeat
(``scripts/bench_scale.py --catchup-only``): 100 interleaved ledgers of 1 KiB
entries are written through the client and pushed into entry logs, then some
of them are read back cold, one at a time (100 MB in all by default, so that
a scheduling hiccup cannot move a sample by a fifth), reporting the aggregate
and per-ledger MB/s, CPU per entry of the client and of the shard worker
(``/proc/<pid>/task/*/schedstat``) and the bytes the worker read from disk
(``/proc/<pid>/io``). By default "cold" evicts only the
bookie's own files from the page cache (``posix_fadvise(DONTNEED)``), leaving
other processes' caches alone.
"""

from __future__ import annotations

import os
import random
import tempfile
import time

from bk import protocol as P
from bk.client.bookkeeper import BookKeeper
from bk.errors import EOK, BKError, error_for_status
from bk.localcluster import LocalCluster
from bk.meta.ledger import LedgerMetadata
from bk.rawclient import BookieConnection

KEY = b"bench-scale-key-0000"
CATCHUP_LEDGERS = 100


def parse_count(text: str) -> int:
    """``"1M"``, ``"500k"``, ``"2G"`` or digits -> an entry count."""
    mult = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}
    t = text.strip().lower()
    return int(float(t[:-1]) * mult[t[-1]]) if t and t[-1] in mult else int(t)


def _pct(sorted_values, q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def proc_memory(pid: int) -> dict:
    """RSS, peak RSS (VmHWM) and anonymous RSS of a process, in MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = round(int(rest.split()[0]) / 1024, 1)
    return out


def mapped_file_mib(pid: int, suffix: str) -> float:
    """Resident MiB of a process's mappings of files whose path ends with ``suffix``
    (``/proc/<pid>/smaps``): e.g. the shard's LMDB index, ``/data.mdb``."""
    total = 0
    cur = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if line.startswith("Rss:"):
                if cur:
                    total += int(line.split()[1])
                cur = False
            elif "-" in line.split(None, 1)[0] and not line.startswith(("Rss", "Pss")):
                cur = line.rstrip("\n").endswith(suffix)
    return round(total / 1024, 1)


def drop_caches() -> bool:
    """Drop the page cache (root only); False if not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict_files(root: str) -> int:
    """Evict the files under ``root`` from the page cache (each synced, then
    ``POSIX_FADV_DONTNEED``); pages a process has mapped stay, as with
    drop_caches. Returns the files evicted."""
    n = 0
    for d, _, names in os.walk(root):
        for name in names:
            try:
                fd = os.open(os.path.join(d, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            except OSError:
                pass
            finally:
                os.close(fd)
    return n


def proc_cpu(pid: int) -> float:
    """CPU seconds a process's threads have run (``/proc/<pid>/task/*/schedstat``,
    nanoseconds; ``/proc/<pid>/stat``'s ticks are 10 ms, too coarse here). Threads
    that ended are not counted: measure across spans where they all live."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1e9


def proc_read_bytes(pid: int) -> int:
    """Bytes a process made the kernel read from storage (``/proc/<pid>/io``)."""
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


class _Filler:
    """Adds over the raw protocol: round-robin over ledgers, ADD_BATCH frames."""

    def __init__(self, bookie_id: str, ledgers: list[int], entry_size: int):
        self.conn = BookieConnection(bookie_id, 0, timeout=120)
        self.ledgers = ledgers
        self.payload = os.urandom(entry_size)
        self.digest = bytes(8)
        self.rec = P.add_record_struct(len(self.digest)).pack
        self.wlen = P.REC_HEAD + len(self.digest) + entry_size
        self.next = 0                   # entries added so far (round-robin position)
        self.fb = P.FrameBuffer(1 << 30)

    def _batch(self, start: int, n: int) -> list:
        rec, payload, digest, plen = self.rec, self.payload, self.digest, len(self.payload)
        dlen = len(digest)
        ids = self.ledgers
        L = len(ids)
        parts = [P.add_batch_head(start, KEY, 0, n, n * self.wlen)]
        for i in range(start, start + n):
            e = i // L
            parts.append(rec(plen, ids[i % L], e, e - 1, dlen, digest))
            parts.append(payload)
        return parts

    def _acks(self, block: bool) -> list:
        """Acknowledged (first request id, count, receive time) of the frames read."""
        sock = self.conn.sock
        sock.setblocking(block)
        try:
            data = sock.recv(1 << 20)
        except BlockingIOError:
            return []
        finally:
            sock.setblocking(True)
        if not data:
            raise BKError("the bookie closed the connection")
        self.fb.feed(data)
        now = time.perf_counter()
        out = []
        for resp in self.fb.frames():
            runs, errors = resp[3], resp[4]
            if errors:
                raise error_for_status(errors[2], f"add entry {errors[1]}")
            out.append((resp[1], sum(runs[i + 2] - runs[i + 1] + 1
                                      for i in range(0, len(runs), 3)), now))
        return out

    def fill(self, target: int, window: int = 20_000, progress=None) -> float:
        """Add entries until ``target`` are held, as fast as the bookie takes them."""
        t0 = time.perf_counter()
        sent = acked = self.next
        last = t0
        while acked < target:
            while sent - acked < window and sent < target:
                n = min(1000, target - sent)
                self.conn.sock.sendall(b"".join(self._batch(sent, n)))
                sent += n
            for _rid, k, now in self._acks(True):
                acked += k
            if progress and time.perf_counter() - last >= 5:
                last = time.perf_counter()
                progress(f"  {acked:,} entries, {(acked - self.next) / (last - t0):,.0f}/s")
        self.next = acked
        return time.perf_counter() - t0

    def paced(self, rate: int, seconds: float) -> dict:
        """Adds at a fixed rate (a batch every 5 ms); latency of each from the
        moment it was due."""
        tick = 0.005
        per = max(1, int(rate * tick))
        due: dict[int, float] = {}
        lat = []
        t0 = time.perf_counter()
        k = 0
        sent = self.next
        outstanding = 0
        while True:
            now = time.perf_counter()
            t_due = t0 + k * tick
            if t_due - t0 >= seconds and not outstanding:
                break
            if now >= t_due and t_due - t0 < seconds:
                self.conn.sock.sendall(b"".join(self._batch(sent, per)))
                due[sent] = t_due
                sent += per
                outstanding += per
                k += 1
                continue
            for rid, n, at in self._acks(False):
                lat += [at - due.pop(rid)] * n
                outstanding -= n
            if outstanding and time.perf_counter() < t0 + k * tick:
                for rid, n, at in self._acks(True):
                    lat += [at - due.pop(rid)] * n
                    outstanding -= n
        self.next = sent
        lat.sort()
        return {"rate": rate, "adds": len(lat),
                "p50_ms": round(_pct(lat, 0.5) * 1000, 2),
                "p99_ms": round(_pct(lat, 0.99) * 1000, 2),
                "p999_ms": round(_pct(lat, 0.999) * 1000, 2)}

    def close(self):
        self.conn.close()


def _shard_info(bookie_id: str) -> dict:
    with BookieConnection(bookie_id, 0) as c:
        return c.call(P.get_bookie_info(c.next_rid()))[3]


def _restart(b, ledger: int, entry: int) -> float:
    b.kill()
    t0 = time.monotonic()
    b.start(wait=False)
    while True:
        try:
            with BookieConnection(b.bookie_id, 0, timeout=2.0) as c:
                if c.call(P.read(c.next_rid(), ledger, entry))[2] == EOK:
                    break
        except (OSError, BKError):
            pass
        if not b.alive:
            raise BKError(f"bookie exited with {b.proc.returncode} on restart")
        if time.monotonic() - t0 > 900:
            raise BKError("the restarted bookie did not serve within 900 s")
        time.sleep(0.01)
    took = time.monotonic() - t0
    b.wait_registered(600)
    return took


def _random_reads(bookie_id: str, held: int, ledgers: list[int], n: int) -> dict:
    rng = random.Random(held)
    lat = []
    L = len(ledgers)
    with BookieConnection(bookie_id, 0) as c:
        for _ in range(n):
            i = rng.randrange(held)
            t0 = time.perf_counter()
            r = c.call(P.read(c.next_rid(), ledgers[i % L], i // L))
            lat.append(time.perf_counter() - t0)
            if r[2] != EOK:
                raise BKError(f"random read of entry {i // ledgers}: status {r[2]}")
    lat.sort()
    return {"reads": n, "p50_ms": round(_pct(lat, 0.5) * 1000, 3),
            "p99_ms": round(_pct(lat, 0.99) * 1000, 3)}


def _write_catchup_set(client, entries: int) -> list[int]:
    """100 ledgers of 1 KiB entries written interleaved (round-robin, 100 at a time)."""
    hs = [client.create_ledger(1, 1, 1, password=b"scale") for _ in range(CATCHUP_LEDGERS)]
    data = [os.urandom(1024) for _ in range(100)]
    for first in range(0, entries, 100):
        futs = [h.add_entry_async(x) for h in hs for x in data[: min(100, entries - first)]]
        for f in futs:
            f.result()
    ids = [h.ledger_id for h in hs]
    for h in hs:
        h.close()
    return ids


def _read_ledger(client, lid: int, chunk: int | None) -> tuple[int, int, float, float]:
    """Open ``lid`` and read it whole (``read_entries`` of ``chunk`` entries,
    None: the whole ledger in one call, which the client windows and pipelines
    itself); ``(entries, bytes, open seconds, seconds in all)``."""
    t0 = time.perf_counter()
    h = client.open_ledger(lid, password=b"scale")
    t_open = time.perf_counter() - t0
    last = h.last_add_confirmed
    n = nbytes = 0
    e = 0
    while e <= last:
        end = last if chunk is None else min(last, e + chunk - 1)
        for ent in h.read_entries(e, end):
            nbytes += len(ent.data)
            n += 1
        e = end + 1
    h.close()
    return n, nbytes, t_open, time.perf_counter() - t0


def _catchup(client, ledger_ids: list[int], evict=None, chunk: int | None = None) -> dict:
    """Read ``ledger_ids`` one after another, each cold (``evict()`` before it):
    the aggregate MB/s (opening included) and each ledger's."""
    nbytes = n = 0
    wall = opens = evict_cpu = 0.0
    per = []
    for lid in ledger_ids:
        if evict is not None:
            c0 = time.process_time()
            evict()
            evict_cpu += time.process_time() - c0
        k, b, t_open, dt = _read_ledger(client, lid, chunk)
        n += k
        nbytes += b
        wall += dt
        opens += t_open
        per.append(round(b / 1e6 / dt, 1))
    return {"ledgers": len(ledger_ids), "entries": n, "mb": round(nbytes / 1e6, 1),
            "mb_per_sec": round(nbytes / 1e6 / wall, 1), "seconds": round(wall, 3),
            "open_ms_per_ledger": round(opens / max(1, len(ledger_ids)) * 1e3, 2),
            "per_ledger_mb_per_sec": per, "evict_cpu_seconds": evict_cpu}


def bench_catchup(entries: int = 10_000, read_ledgers: int = 10, chunk: int | None = None,
                  drop_all: bool = False, base_dir: str | None = None, conf=None,
                  report=print) -> dict:
    """The cold catch-up read alone: 100 ledgers of ``entries`` 1 KiB entries
    written interleaved, flushed to entry logs, then ``read_ledgers`` of them
    read whole through ``bk.BookKeeper`` one after another, each after evicting
    the bookie's files from the page cache (``drop_all``: the whole page cache,
    as root), each with one ``read_entries`` (or of ``chunk`` entries). One
    sample reads ``read_ledgers`` x ``entries`` KiB (100 MB by default), so
    that a scheduling hiccup of tens of ms moves it by a few percent, not by a
    fifth. Returns the aggregate MB/s (opening each ledger included), each
    ledger's MB/s, CPU µs per entry of the client and of the shard worker, and
    disk MB the worker read."""
    conf = dict(conf or {})
    with tempfile.TemporaryDirectory(prefix="bk-bench-catchup-", dir=base_dir) as d:
        with LocalCluster(num_bookies=1, base_dir=d, num_shards=1,
                          conf_overrides=conf) as cluster:
            b = cluster.bookies[0]
            with BookKeeper(cluster.metadata_uri) as client:
                t0 = time.perf_counter()
                ids = _write_catchup_set(client, entries)
                # Push the set out of the write cache (the journal's tail) into
                # entry logs: more than the write cache of another ledger after it.
                wc = int(conf.get("dbStorage_writeCacheMaxSizeMb", 64)) << 20
                h = client.create_ledger(1, 1, 1, password=b"scale")
                blob = os.urandom(1024)
                for _ in range(0, wc + (8 << 20), 1000 << 10):
                    h.add_entries([blob] * 1000)
                h.close()
                report(f"  wrote {len(ids)} x {entries} x 1 KiB interleaved in "
                       f"{time.perf_counter() - t0:.1f}s")
            wpid = b.worker_pids()[0]

            def evict():
                if not (drop_all and drop_caches()):
                    evict_files(b.dir)

            with BookKeeper(cluster.metadata_uri) as client:
                pick = ids[:: max(1, len(ids) // read_ledgers)][:read_ledgers]
                # CPU over the whole sample; the eviction is the bench's own work
                # (in this process), not the client's
                r0, w0 = proc_read_bytes(wpid), proc_cpu(wpid)
                c0 = time.process_time()
                r = _catchup(client, pick, evict, chunk)
                ccpu = time.process_time() - c0 - r["evict_cpu_seconds"]
                wcpu = proc_cpu(wpid) - w0
                disk = proc_read_bytes(wpid) - r0
            n = r["entries"]
            return dict(r, client_us_per_entry=round(ccpu / n * 1e6, 2),
                        worker_us_per_entry=round(wcpu / n * 1e6, 2),
                        disk_mb=round(disk / 1e6, 1))


def format_catchup(r: dict) -> str:
    per = r.get("per_ledger_mb_per_sec")
    return (f"cold catch-up: {r['mb_per_sec']} MB/s ({r['entries']:,} x 1 KiB from "
            f"{r['ledgers']} ledgers in {r['seconds']}s"
            + (f"; opening {r['open_ms_per_ledger']} ms a ledger; per ledger "
               f"{min(per)}-{max(per)} MB/s" if per else "")
            + f") | CPU per entry: client {r['client_us_per_entry']} us, worker "
            f"{r['worker_us_per_entry']} us | worker read {r['disk_mb']} MB from disk")


def bench_scale(steps: list[int], entry_size: int = 100, ledgers: int = 1000,
                rate: int = 30_000, rate_seconds: float = 5.0, random_reads: int = 2000,
                catchup_entries: int = 10_000, base_dir: str | None = None, conf=None,
                report=print) -> list[dict]:
    """Fill one bookie to each of ``steps`` entries and measure (see the module
    docstring); ``report`` gets a line per step and progress lines."""
    conf = dict(conf or {})
    conf.setdefault("numShards", 1)
    results = []
    with tempfile.TemporaryDirectory(prefix="bk-bench-scale-", dir=base_dir) as d:
        with LocalCluster(num_bookies=1, base_dir=d, num_shards=1,
                          conf_overrides=conf) as cluster:
            b = cluster.bookies[0]
            client = BookKeeper(cluster.metadata_uri)
            try:
                # The filled ledgers exist in the metadata, or garbage collection
                # would (rightly) delete them during a long fill.
                ids = []
                for _ in range(ledgers):
                    ids.append(cluster.store.new_ledger_id())
                    cluster.store.create_ledger(LedgerMetadata(
                        ids[-1], 1, 1, 1, [(0, [b.bookie_id])]))
                catchup_ids = _write_catchup_set(client, catchup_entries) \
                    if catchup_entries else []
                filler = _Filler(b.bookie_id, ids, entry_size)
                for k, target in enumerate(steps):
                    fill_s = filler.fill(target, progress=report)
                    filled_rate = (target - (steps[k - 1] if k else 0)) / fill_s
                    latency = filler.paced(rate, rate_seconds)
                    info = _shard_info(b.bookie_id)
                    mem_running = proc_memory(b.worker_pids()[0])
                    filler.close()
                    last_i = filler.next - 1
                    restart = _restart(b, ids[last_i % ledgers], last_i // ledgers)
                    mem_after = proc_memory(b.worker_pids()[0])
                    cold = drop_caches()
                    reads = _random_reads(b.bookie_id, filler.next, ids, random_reads)
                    catch = {}
                    if catchup_ids:
                        pick = catchup_ids[(k * 10) % len(catchup_ids):][:10]
                        client.close()
                        client = BookKeeper(cluster.metadata_uri)
                        catch = _catchup(client, pick, drop_caches)
                    # Memory after the step's reads (caches warm), the same point every step.
                    pid = b.worker_pids()[0]
                    mem = proc_memory(pid)
                    index_mib = mapped_file_mib(pid, "/data.mdb")
                    filler = _Filler(b.bookie_id, ids, entry_size)
                    filler.next = last_i + 1
                    row = {
                        "entries": info.get("entries"), "entry_size": entry_size,
                        "fill_adds_per_sec": round(filled_rate),
                        "worker_rss_mib": mem.get("VmRSS"), "worker_hwm_mib": mem.get("VmHWM"),
                        "worker_anon_mib": mem.get("RssAnon"),
                        "worker_file_mib": mem.get("RssFile"),
                        "worker_index_mapped_mib": index_mib,
                        "running_rss_mib": mem_running.get("VmRSS"),
                        "running_hwm_mib": mem_running.get("VmHWM"),
                        "rss_after_restart_mib": mem_after.get("VmRSS"),
                        "last_flush_bytes": info.get("last_flush_bytes"),
                        "last_flush_seconds": info.get("last_flush_seconds"),
                        "add_latency": latency, "restart_seconds": round(restart, 2),
                        "cold": cold, "random_read": reads, "catchup_read": catch,
                        "index_mib": round(info.get("index_bytes", 0) / 2**20, 1),
                        "entry_log_gib": round(info.get("entry_log_bytes", 0) / 2**30, 2),
                    }
                    results.append(row)
                    report(format_row(row))
                filler.close()
            finally:
                client.close()
    return results


def format_row(r: dict) -> str:
    lat, rr, cu = r["add_latency"], r["random_read"], r["catchup_read"]
    temp = "cold" if r["cold"] else "warm"
    return (f"{r['entries']:>12,} entries | RSS after reads {r['worker_rss_mib']} MiB (anon "
            f"{r['worker_anon_mib']}, file {r['worker_file_mib']} of which index "
            f"{r['worker_index_mapped_mib']}; peak before restart "
            f"{r['running_hwm_mib']}) | last flush "
            f"{(r['last_flush_bytes'] or 0) / 2**20:.1f} MiB in "
            f"{r['last_flush_seconds'] or 0:.2f}s | adds at "
            f"{lat['rate']}/s p50/p99/p99.9 {lat['p50_ms']}/{lat['p99_ms']}/{lat['p999_ms']} ms | "
            f"restart {r['restart_seconds']}s | {temp} random read p99 {rr['p99_ms']} ms | "
            f"{temp} catch-up {cu.get('mb_per_sec', '-')} MB/s | fill "
            f"{r['fill_adds_per_sec']:,}/s | index {r['index_mib']} MiB")
