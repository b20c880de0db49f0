"""Auto-recovery benchmark (``bkshell bench recovery``): how fast the
replication workers re-replicate a lost bookie, and what that costs writers.

A local cluster of 4 bookies runs auto-recovery in every bookie
(``autoRecoveryDaemonEnabled=true``, ``lostBookieRecoveryDelay=0``) with the
production defaults otherwise. The bench writes ``size`` bytes of
``entry_size`` entries, E3 Qw2 Qa2, over ``ledgers`` ledgers (written
concurrently, then closed). Then ``writers`` background writers add to their
own ledgers at ``writer_rate`` entries/s each; their ledgers' ensembles
avoid the bookie that will be killed, so what they see is the recovery's load
and not their own ensemble change. After ``baseline`` seconds one bookie (not
the auditor) is killed with SIGKILL and the clock runs:

* kill -> first ledger marked under-replicated: the loss being noticed (its
  registration lease must expire: ``registrationTtlSeconds``);
* first mark -> the under-replicated list empty and the bookie in no ensemble
  of the bench's ledgers: the re-replication itself. MB/s is the payload the
  lost bookie held (every entry of a bench ledger whose write set had it)
  over this time.

The writers' add latency is reported before the kill and during the
re-replication. At the end every entry of every ledger must be on every
bookie of its write set (GET_LIST_OF_ENTRIES), and the workers' own counter
(``replication_REREPLICATED_BYTES``, from the bookies' /metrics) is reported
next to what the lost bookie held.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
import time
import urllib.request

from bk import protocol as P
from bk.client.bookkeeper import BookKeeper
from bk.errors import EOK, BKError
from bk.localcluster import LocalCluster
from bk.meta import underreplication as UR
from bk.meta.recipes import Election
from bk.rawclient import BookieConnection

PASSWORD = b"bench-recovery"
AUTORECOVERY = {"autoRecoveryDaemonEnabled": True, "lostBookieRecoveryDelay": 0}


def parse_size(text) -> int:
    """``1G``, ``256M``, ``512K`` or a number of bytes."""
    if isinstance(text, int):
        return text
    text = str(text).strip()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper())
    try:
        return int(float(text[:-1]) * mult) if mult else int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a size (bytes, or a number with K, M or G)") \
            from None


def _percentiles(values) -> dict:
    v = sorted(values)
    if not v:
        return {"count": 0, "p50": None, "p99": None, "p999": None, "max": None}

    def p(q):
        return round(v[min(len(v) - 1, int(q * len(v)))] * 1000, 3)
    return {"count": len(v), "p50": p(0.50), "p99": p(0.99), "p999": p(0.999),
            "max": round(v[-1] * 1000, 3)}


def _metric(port, name: str) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    except OSError:
        return None
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _cpu_seconds(pids) -> float:
    """User + system CPU of these processes and their children (a bookie's arbiter
    and shard workers), 0 for those gone."""
    import psutil
    total = 0.0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            for q in [p] + p.children(recursive=True):
                t = q.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            continue
    return total


def entries_on(store, bookie_id: str, ledger_id: int) -> set:
    """Entry ids of a ledger a bookie holds (GET_LIST_OF_ENTRIES on its shard)."""
    n = store.bookie_info(bookie_id)["numShards"]
    with BookieConnection(bookie_id, shard=P.shard_of(ledger_id, n)) as c:
        r = c.call(P.get_list_of_entries(c.next_rid(), ledger_id))
    return set(P.ranges_to_ids(r[4])) if r[2] == EOK and r[4] else set()


def held_by(md, bookie_id: str) -> int:
    """How many entries of the (closed) ledger have ``bookie_id`` in their write set."""
    return sum(1 for e in range(md.last_entry_id + 1) if bookie_id in md.write_set(e))


def verify(store, mds) -> list[str]:
    """Problems: entries missing from a bookie of their write set."""
    problems = []
    for md in mds:
        have = {}
        for _, ens in md.ensembles:
            for b in ens:
                if b not in have:
                    try:
                        have[b] = entries_on(store, b, md.ledger_id)
                    except (OSError, BKError, TypeError) as e:
                        problems.append(f"ledger {md.ledger_id}: bookie {b}: {e}")
                        have[b] = None
        for e in range(md.last_entry_id + 1):
            for b in md.write_set(e):
                if have[b] is not None and e not in have[b]:
                    problems.append(f"ledger {md.ledger_id} entry {e} missing on {b}")
                    if len(problems) > 20:
                        return problems
    return problems


def _write_bulk(client, count: int, entry_size: int, ledgers: int, progress=None) -> list:
    """``count`` entries over ``ledgers`` ledgers, round-robin, pipelined; closed."""
    handles = [client.create_ledger(3, 2, 2, digest_type="crc32c", password=PASSWORD)
               for _ in range(ledgers)]
    payloads = [os.urandom(entry_size) for _ in range(16)]
    state = {"acked": 0, "error": None}
    lock = threading.Lock()

    def cb(exc, _eid):
        if exc is not None:
            state["error"] = exc
        with lock:
            state["acked"] += 1

    t0 = last = time.monotonic()
    chunk = 500
    sent = 0
    while sent < count:
        for h in handles:
            n = min(chunk, count - sent)
            for i in range(n):
                h.add_entry_async(payloads[(sent + i) & 15], cb)
            sent += n
            if sent >= count:
                break
        if state["error"] is not None:
            raise state["error"]
        now = time.monotonic()
        if progress and now - last >= 2.0:
            last = now
            progress(f"writing: {state['acked']}/{count} entries, "
                     f"{state['acked'] * entry_size / (now - t0) / 1e6:.1f} MB/s")
    deadline = time.monotonic() + 120
    while state["acked"] < count:
        if time.monotonic() > deadline:
            raise BKError(f"only {state['acked']} of {count} adds acknowledged")
        time.sleep(0.01)
    if state["error"] is not None:
        raise state["error"]
    for h in handles:
        h.close()
    return [h.ledger_id for h in handles], time.monotonic() - t0


class _Writer(threading.Thread):
    """Adds to one ledger at a fixed rate; records (submit time, latency)."""

    def __init__(self, handle, rate: float, entry_size: int):
        super().__init__(daemon=True, name=f"bench-writer-{handle.ledger_id}")
        self.h = handle
        self.rate = rate
        self.payload = os.urandom(entry_size)
        self.samples: list[tuple[float, float]] = []
        self.errors = 0
        self.stop = threading.Event()

    def _done(self, t0, exc, _eid):
        if exc is None:
            self.samples.append((t0, time.perf_counter() - t0))
        else:
            self.errors += 1

    def run(self):
        pc = time.perf_counter
        start = pc()
        sent = 0
        while not self.stop.is_set():
            now = pc()
            if sent >= (now - start) * self.rate:
                time.sleep(0.001)
                continue
            try:
                self.h.add_entry_async(self.payload, functools.partial(self._done, pc()))
            except BKError:
                self.errors += 1
                return
            sent += 1


def _writer_ledgers(client, n: int, avoid: str, attempts: int = 200) -> list:
    """``n`` open ledgers (E3 Qw2 Qa2) whose ensembles do not hold ``avoid``."""
    out = []
    for _ in range(attempts):
        if len(out) == n:
            return out
        h = client.create_ledger(3, 2, 2, digest_type="crc32c", password=PASSWORD)
        if avoid in h.metadata.ensembles[0][1]:
            h.close()
            client.delete_ledger(h.ledger_id)
        else:
            out.append(h)
    raise BKError(f"could not place {n} writer ledgers away from {avoid}")


def bench_recovery(size: int = 1 << 30, entry_size: int = 1024, ledgers: int = 16,
                   writers: int = 2, writer_rate: float = 500.0, baseline: float = 3.0,
                   registration_ttl: int | None = None, conf_overrides: dict | None = None,
                   base_dir: str | None = None, timeout: float = 1800.0,
                   progress=None) -> dict:
    """Run the benchmark (module doc); return its numbers."""
    say = progress or (lambda msg: None)
    count = max(ledgers, size // entry_size)
    conf = {**AUTORECOVERY, **(conf_overrides or {})}
    if registration_ttl is not None:
        conf["registrationTtlSeconds"] = registration_ttl
    with tempfile.TemporaryDirectory(prefix="bk-bench-recovery-", dir=base_dir) as d:
        with LocalCluster(num_bookies=4, base_dir=d, conf_overrides=conf,
                          http_port=0) as cluster:
            store = cluster.store
            with BookKeeper(cluster.metadata_uri) as client:
                say(f"writing {count} entries of {entry_size} bytes over {ledgers} ledgers "
                    f"(E3 Qw2 Qa2)...")
                bulk, write_secs = _write_bulk(client, count, entry_size, ledgers, say)
                mds = {lid: client.ledger_metadata(lid) for lid in bulk}
                probe = Election(store, UR.AUDITOR, "bench-probe")
                deadline = time.monotonic() + 60
                while probe.leader() is None:
                    if time.monotonic() > deadline:
                        raise BKError("no auditor elected within 60 s")
                    time.sleep(0.05)
                auditor = probe.leader()
                held = {b.bookie_id: sum(held_by(md, b.bookie_id) for md in mds.values())
                        for b in cluster.bookies}
                victim = max((b for b in cluster.bookies if b.bookie_id != auditor),
                             key=lambda b: held[b.bookie_id])
                vid = victim.bookie_id
                held_entries = held[vid]
                on_victim = sum(len(entries_on(store, vid, lid)) for lid in bulk)
                if on_victim != held_entries:
                    raise BKError(f"the bookie to kill lists {on_victim} entries, its write "
                                  f"sets say {held_entries}")
                affected = sorted(lid for lid, md in mds.items()
                                  if any(vid in ens for _, ens in md.ensembles))
                ports = {b.bookie_id: b.conf_overrides["httpServerPort"]
                         for b in cluster.bookies}
                name = "replication_REREPLICATED_BYTES_total"
                copied0 = {b: _metric(p, name) or 0.0 for b, p in ports.items() if b != vid}

                ws = [_Writer(h, writer_rate, entry_size)
                      for h in _writer_ledgers(client, writers, vid)]
                for w in ws:
                    w.start()
                say(f"{writers} writers at {writer_rate:g} entries/s each; "
                    f"killing {vid} in {baseline:g}s (it holds {held_entries} entries of "
                    f"{len(affected)} ledgers; auditor {auditor})")
                time.sleep(baseline)
                survivors = [b.pid for b in cluster.bookies if b is not victim]
                cpu0 = None
                t_kill = time.perf_counter()
                victim.kill()
                t_mark = t_empty = None
                last = 0.0
                failures = {}
                while True:
                    now = time.perf_counter()
                    if now - t_kill > timeout:
                        raise BKError(f"re-replication not done {timeout:g}s after the kill "
                                      f"(failures: {failures})")
                    marked = list(UR.list_marked(store))
                    if marked and t_mark is None:
                        t_mark = now
                        cpu0 = _cpu_seconds(survivors)
                    failures = {lid: rec["error"] for lid, rec, _ in marked
                                if rec.get("error")}
                    if t_mark is not None and not marked:
                        if all(vid not in ens for lid in affected
                               for _, ens in client.ledger_metadata(lid).ensembles):
                            t_empty = now
                            cpu1 = _cpu_seconds(survivors)
                            break
                    if now - last >= 1.0:
                        last = now
                        done = sum((_metric(p, name) or 0.0) - copied0[b]
                                   for b, p in ports.items() if b != vid)
                        say(f"{now - t_kill:6.1f}s after the kill: {len(marked)} ledgers "
                            f"under-replicated, {done / 2**20:.0f} of "
                            f"{held_entries * entry_size / 2**20:.0f} MiB copied"
                            + (f", {len(failures)} failing" if failures else ""))
                    time.sleep(0.1)     # light: the writers share this process
                for w in ws:
                    w.stop.set()
                for w in ws:
                    w.join(10)
                for w in ws:
                    w.h.close()
                copied = {b: (_metric(p, name) or 0.0) - copied0[b]
                          for b, p in ports.items() if b != vid}
                say("verifying every entry is on every bookie of its write set...")
                final = [client.ledger_metadata(lid) for lid in bulk] + \
                    [client.ledger_metadata(w.h.ledger_id) for w in ws]
                problems = verify(store, final)
                left = len(list(UR.list_marked(store)))

    samples = [s for w in ws for s in w.samples]
    before = [lat for t, lat in samples if t < t_kill]
    during = [lat for t, lat in samples if t_mark <= t < t_empty]
    held_bytes = held_entries * entry_size
    repl = t_empty - t_mark
    return {
        "bookies": 4, "entry_size": entry_size, "ledgers": ledgers, "entries": count,
        "bytes_written": count * entry_size, "write_seconds": round(write_secs, 2),
        "write_mb_per_sec": round(count * entry_size / write_secs / 1e6, 2),
        "killed": vid, "auditor": auditor, "affected_ledgers": len(affected),
        "lost_entries": held_entries, "lost_bytes": held_bytes,
        "rereplicated_bytes_by_workers": int(sum(copied.values())),
        "rereplicated_bytes_per_bookie": {b: int(v) for b, v in copied.items()},
        "seconds_kill_to_marked": round(t_mark - t_kill, 2),
        "seconds_marked_to_empty": round(repl, 2),
        "seconds_kill_to_empty": round(t_empty - t_kill, 2),
        "mb_per_sec": round(held_bytes / repl / 1e6, 2) if repl > 0 else None,
        "mb_per_sec_from_kill": round(held_bytes / (t_empty - t_kill) / 1e6, 2),
        # CPU the surviving bookies (replication workers, shard workers, the writers'
        # adds too) spent from the first mark to the empty list: less noisy than MB/s
        # on a shared machine.
        "bookie_cpu_seconds_during_recovery": round(cpu1 - cpu0, 2),
        "bookie_cpu_us_per_lost_entry": round((cpu1 - cpu0) / held_entries * 1e6, 1)
        if held_entries else None,
        "writers": writers, "writer_rate": writer_rate,
        "writer_latency_ms_before_kill": _percentiles(before),
        "writer_latency_ms_during_recovery": _percentiles(during),
        "writer_errors": sum(w.errors for w in ws),
        "verified": not problems, "problems": problems[:20],
        "under_replicated_at_end": left,
        "machine_cpus": os.cpu_count(),
    }
