#!/usr/bin/env python
"""Where an add's time goes, hop by hop: plaintext and TLS alternating.

    python scripts/trace_adds.py                          # 30,000/s, 2 pairs of 6 s
    python scripts/trace_adds.py --rate 20000 --rounds 3 --duration 8
    python scripts/trace_adds.py --no-tls                 # plaintext only

Starts a LocalCluster (3 bookies offering TLS, not requiring it) and runs
``bench_writes`` at a fixed rate, plaintext then TLS, ``--rounds`` times. Every
``--sample``-th entry is followed through the client and the bookies and timed
with the machine's monotonic clock, which the processes share:

    sub       the application's add_entry_async returned
    pick      the client's I/O thread took it (LedgerHandle._io_flush)
    write0    that connection's write began (others' encryption comes before)
    sent      its sendmsg returned
    w_select  the shard worker's select returned for the pass that read it
    dispatched  the worker journaled it
    sync0     the group commit that covers it began (it may wait for one in flight)
    released  its acknowledgement was sent (after that sync)
    c_read    the client's I/O thread read the acknowledgement

and each group commit's ``fdatasync`` on its own, and the disk's idle time
between one group's sync and the next (while the loop answers the synced group
and begins the next). Then percentiles per hop.

A diagnostic: it wraps private methods of the worker and the client by name (in
this process, and in the bookies through a ``sitecustomize`` module put first
on their PYTHONPATH), so it follows the code it measures only as long as those
names stay. The wrappers cost a little per call; compare modes within a run.
"""

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# The hooks, as a module: the bookies import it as sitecustomize (they are other
# processes), this process imports it by path for the client's side.
HOOK = r'''
import json, os, sys, time
mono = time.monotonic
OUT = os.environ.get("BK_TRACE_DIR")
SAMPLE = int(os.environ.get("BK_TRACE_SAMPLE", "20"))


def patch_worker(m):
    W = m.ShardWorker
    boot, add_batch, start_sync = W._boot, W._add_batch, W._start_sync
    release, drain, sync_done = W._release, W._drain, W._on_sync_done
    aio_done = getattr(W, "_aio_done", None)
    aio_sync_done = getattr(W, "_on_aio_done", None)

    def _boot(self):
        boot(self)
        self._tr, self._tr_pend, self._tr_groups, self._tr_syncs = {}, [], [], []
        self._tr_answer, self._tr_begin, self._tr_jobs = [], [], {}
        self._tr_sel = self._tr_done = 0.0
        begin = self.storage.begin_sync

        def begin_sync():
            t0 = mono()
            job = begin()
            self._tr_begin.append((t0, mono() - t0, self._tr_done == self._tr_sel))
            return job
        self.storage.begin_sync = begin_sync
        worker = self

        class Sel:                # the poller has __slots__: wrap it, not its method
            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                return getattr(self.inner, name)

            def select(self, timeout=None):
                r = self.inner.select(timeout)
                worker._tr_sel = mono()
                return r
        self.sel = Sel(self.sel)

    def _add_batch(self, conn, msg):
        add_batch(self, conn, msg)
        t = mono()
        for lid, eid, *_ in m.P.split_add_batch(msg[5], msg[4]):
            if eid % SAMPLE == 0:
                self._tr[(lid, eid)] = {"w_select": self._tr_sel, "dispatched": t,
                                        "in_flight": self.sync_job is not None,
                                        "after_done": self._tr_done == self._tr_sel}
                self._tr_pend.append((lid, eid))

    def _start_sync(self, *done):
        t = mono()
        group, self._tr_pend = self._tr_pend, []
        for k in group:
            self._tr[k]["sync0"] = t
        self._tr_groups.append(group)
        return start_sync(self, *done)

    def _release(self, held):
        r = release(self, held)
        t = mono()
        if self._tr_groups:
            for k in self._tr_groups.pop(0):
                self._tr[k]["released"] = t
        return r

    def _run_sync(self, job, keep=None):
        t0 = mono()
        job.run(keep) if keep is not None else job.run()
        t1 = mono()
        self._tr_syncs.append((t0, t1 - t0, job.bytes))
        self._tr_jobs[id(job)] = (t0, t1)
        os.write(self._sync_w, b"s")

    def _aio_done(self, res):         # a sync through Linux AIO, timed from submit to reap
        # (so its end is after the loop woke for it: s_end -> l_sel is 0 or less)
        aio_done(self, res)
        job, t1 = self.sync_job, mono()
        self._tr_syncs.append((self._sync_t0, t1 - self._sync_t0, job.bytes))
        self._tr_jobs[id(job)] = (self._sync_t0, t1)

    def _sync_thread(self):          # a worker of before _run_sync (to compare with it)
        while True:
            job = self._sync_q.get()
            if job is None:
                return
            _run_sync(self, job)

    def _on_sync_done(self):
        self._tr_done = self._tr_sel
        t0 = mono()
        job = self.sync_job
        ts = self._tr_jobs.pop(id(job), None) if job is not None else None
        if ts is not None and self._tr_groups:
            for k in self._tr_groups[0]:
                self._tr[k].update(s_run0=ts[0], s_end=ts[1], l_sel=self._tr_sel, l_done=t0)
        r = sync_done(self)
        self._tr_answer.append((t0, mono() - t0))
        return r

    def _on_aio_done(self):        # the same, the job's times taken when it is reaped
        job = self.sync_job
        group = self._tr_groups[0] if self._tr_groups else ()
        sel, t0 = self._tr_sel, mono()
        r = aio_sync_done(self)
        ts = self._tr_jobs.pop(id(job), None) if job is not None else None
        if ts is not None:
            self._tr_done = sel
            for k in group:
                self._tr[k].update(s_run0=ts[0], s_end=ts[1], l_sel=sel, l_done=t0)
            self._tr_answer.append((t0, mono() - t0))
        return r

    def _drain(self):
        try:
            with open(os.path.join(OUT, "w-%d.json" % os.getpid()), "w") as f:
                json.dump({"bookie": self.bookie_id, "syncs": self._tr_syncs,
                           "answer": self._tr_answer, "begin": self._tr_begin,
                           "adds": [[k[0], k[1], v] for k, v in self._tr.items()]}, f)
        except Exception as e:
            print("trace_adds: could not write the trace: %r" % (e,), file=sys.stderr)
        return drain(self)
    W._boot, W._add_batch, W._start_sync, W._release = _boot, _add_batch, _start_sync, _release
    W._drain, W._on_sync_done = _drain, _on_sync_done
    if aio_done is not None:
        W._aio_done, W._on_aio_done = _aio_done, _on_aio_done
    if hasattr(W, "_run_sync"):
        W._run_sync = _run_sync
    else:
        W._sync_thread = _sync_thread


def patch_client(cm, lm):
    """Wrap the client's classes; returns the dict the samples go into."""
    C, L = cm.Connection, lm.LedgerHandle
    ev = {}
    submit, io_flush = L._submit_one, L._io_flush
    write, readable, add_ack = C._write, C._on_readable, C._on_add_ack
    state = {"read": 0.0}

    def _submit_one(self, data, cb):
        r = submit(self, data, cb)
        eid = self._next_entry - 1
        if eid % SAMPLE == 0:
            ev[(self._lid, eid)] = {"sub": mono(), "write0": {}, "sent": {}, "c_read": {}}
        return r

    def _io_flush(self):
        t = mono()
        for op in list(self._outbox):
            d = ev.get((self._lid, op.entry_id))
            if d is not None:
                d["pick"] = t
        return io_flush(self)

    def _write(self):
        keys = [(ops[0].handle._lid, op.entry_id) for ops, _ in self.addq for op in ops
                if op.entry_id % SAMPLE == 0]
        t0 = mono()
        r = write(self)
        t1 = mono()
        for k in keys:
            d = ev.get(k)
            if d is not None:
                d["write0"][self.bookie_id] = t0
                d["sent"][self.bookie_id] = t1
                d["tls"] = self.tls is not None
        return r

    def _on_readable(self):
        state["read"] = mono()
        return readable(self)

    def _on_add_ack(self, msg):
        acked = msg[3]
        for i in range(0, len(acked), 3):
            lid, a, b = acked[i], acked[i + 1], acked[i + 2]
            for e in range(a + (-a) % SAMPLE, b + 1, SAMPLE):
                d = ev.get((lid, e))
                if d is not None:
                    d["c_read"][self.bookie_id] = state["read"]
        return add_ack(self, msg)
    L._submit_one, L._io_flush = _submit_one, _io_flush
    C._write, C._on_readable, C._on_add_ack = _write, _on_readable, _on_add_ack
    return ev


if OUT and __name__ == "sitecustomize":
    import importlib.abc
    import importlib.machinery

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "bk.bookie.worker":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            exec_module = spec.loader.exec_module

            def run(module):
                exec_module(module)
                patch_worker(module)
            spec.loader.exec_module = run
            return spec
    sys.meta_path.insert(0, _Finder())
'''

IDLE_GAP = 0.05    # s: syncs further apart than this had nothing to wait for
HOPS = [("sub", "pick"), ("pick", "write0"), ("write0", "sent"), ("sent", "w_select"),
        ("w_select", "dispatched"), ("dispatched", "sync0"), ("sync0", "released"),
        ("released", "c_read")]
# sync0 -> released in detail (groups committed through the sync thread): the
# pwrite and the hand-off to the sync thread; its fdatasync; its wake-up of the
# loop through the pipe (until the loop's select returned); the rest of that pass
# before it got to the pipe; beginning the next group and answering this one.
SYNC_HOPS = [("sync0", "s_run0"), ("s_run0", "s_end"), ("s_end", "l_sel"),
             ("l_sel", "l_done"), ("l_done", "released")]
SLOW = 0.01        # the slowest 1% of adds, hop by hop


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))] * 1000 if xs else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rate", type=float, default=30000)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sample", type=int, default=20, help="follow every N-th entry")
    p.add_argument("--no-tls", action="store_true", help="plaintext runs only")
    a = p.parse_args()
    d = tempfile.mkdtemp(prefix="bk-trace-")
    hook_dir = os.path.join(d, "hook")
    os.makedirs(hook_dir)
    with open(os.path.join(hook_dir, "sitecustomize.py"), "w") as f:
        f.write(HOOK)
    os.environ["BK_TRACE_DIR"] = d
    os.environ["BK_TRACE_SAMPLE"] = str(a.sample)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [hook_dir] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])
    ns = {"__name__": "bk_trace_hook"}
    exec(compile(HOOK, "bk_trace_hook", "exec"), ns)

    from bk.bench.writes import bench_writes
    from bk.client import connection, ledger
    from bk.localcluster import LocalCluster
    from bk.security import pki
    ev = ns["patch_client"](connection, ledger)
    ca = pki.make_ca(os.path.join(d, "ca"))
    crt, key = ca.issue("bookie", ["127.0.0.1"])
    modes = [("plaintext", {})] if a.no_tls else [
        ("plaintext", {}), ("TLS", {"tlsEnabled": True, "tlsTrustStore": ca.cert_path})]
    windows = []
    with LocalCluster(num_bookies=3, base_dir=os.path.join(d, "cluster"), num_shards=2,
                      conf_overrides={"tlsCertificatePath": crt, "tlsKeyStore": key,
                                      "tlsRequired": False}) as c:
        for _ in range(a.rounds):
            for name, extra in modes:
                t0 = time.monotonic()
                r = bench_writes(c.metadata_uri, duration=a.duration, rate=a.rate, **extra)
                windows.append((t0, time.monotonic(), name))
                lat = r["latency_ms"]
                print(f"{name:9s} {r['entries_per_sec']:8.0f}/s  p50 {lat['p50']} p99 {lat['p99']} "
                      f"p99.9 {lat['p99.9']} ms", flush=True)
    # the cluster stopped: the bookies wrote their traces
    workers = {}
    syncs = collections.defaultdict(list)
    idle = collections.defaultdict(list)
    answer = collections.defaultdict(list)
    begin = collections.defaultdict(list)
    for fn in os.listdir(d):
        if fn.startswith("w-"):
            with open(os.path.join(d, fn)) as f:
                w = json.load(f)
            for lid, eid, v in w["adds"]:
                workers[(w["bookie"], lid, eid)] = v
            end = None
            for t0, dt, nbytes in sorted(w["syncs"]):
                for s, e, name in windows:
                    if s <= t0 <= e:
                        syncs[name].append((dt, nbytes))
                        # the disk idle between a group's sync and the next one's, when
                        # they follow closely (a longer gap: no adds were held)
                        if end is not None and t0 - end < IDLE_GAP:
                            idle[name].append(t0 - end)
                end = t0 + dt
            for t0, dt, _ in w.get("begin", ()):
                for s, e, name in windows:
                    if s <= t0 <= e:
                        begin[name].append(dt)
            for t0, dt in w["answer"]:
                for s, e, name in windows:
                    if s <= t0 <= e:
                        answer[name].append(dt)
    hops = collections.defaultdict(lambda: collections.defaultdict(list))
    # per mode: (latency, {hop: seconds}) of each add through the bookie whose
    # acknowledgement completed it (the 2nd), for the slowest-1% table
    whole = collections.defaultdict(list)
    for (lid, eid), c in ev.items():
        if "pick" not in c or len(c["c_read"]) < 2:
            continue
        mode = "TLS" if c.get("tls") else "plaintext"
        h = hops[mode]
        second = sorted(c["c_read"].items(), key=lambda kv: kv[1])[1][0]
        total = c["c_read"][second] - c["sub"]
        h["the add (to its 2nd acknowledgement)"].append(total)
        h["sub -> pick"].append(c["pick"] - c["sub"])
        for b in c["sent"]:
            w = workers.get((b, lid, eid))
            if not w or "released" not in w or b not in c["c_read"]:
                continue
            t = dict(w, sub=c["sub"], pick=c["pick"], write0=c["write0"][b], sent=c["sent"][b],
                     c_read=c["c_read"][b])
            for x, y in HOPS[1:]:
                h[f"{x} -> {y}"].append(t[y] - t[x])
            if "s_end" in t:
                for x, y in SYNC_HOPS:
                    h[f"  {x} -> {y}"].append(t[y] - t[x])
            h["a sync was in flight at dispatch (share)"].append(float(w["in_flight"]))
            h["read in the pass that saw a sync end, after it (share)"].append(
                float(w["after_done"]))
            if b == second:
                parts = {f"{x} -> {y}": t[y] - t[x] for x, y in HOPS}
                if "s_end" in t:
                    parts.update({f"  {x} -> {y}": t[y] - t[x] for x, y in SYNC_HOPS})
                whole[mode].append((total, parts))
    shutil.rmtree(d, ignore_errors=True)     # the bookies' data: hundreds of MB a run
    for name, _ in modes:
        h = hops[name]
        print(f"\n{name}: {len(h['sub -> pick'])} entries followed; ms p50 / p90 / p99")
        for k, xs in h.items():
            if k.endswith("(share)"):
                print(f"  {k:56s} {sum(xs) / max(1, len(xs)):.2f}")
            else:
                print(f"  {k:40s} {pct(xs, .5):7.3f} {pct(xs, .9):7.3f} {pct(xs, .99):7.3f}")
        s = syncs[name]
        if s:
            print(f"  {'fdatasync of a group commit':40s} {pct([x for x, _ in s], .5):7.3f} "
                  f"{pct([x for x, _ in s], .9):7.3f} {pct([x for x, _ in s], .99):7.3f}"
                  f"   ({sorted(n for _, n in s)[len(s) // 2] / 1024:.0f} KiB per group, median)")
        x = idle[name]
        if x:
            print(f"  {'the disk idle between syncs':40s} {pct(x, .5):7.3f} "
                  f"{pct(x, .9):7.3f} {pct(x, .99):7.3f}")
        x = begin[name]
        if x:
            print(f"  {'a sync begun (its pwrite)':40s} {pct(x, .5):7.3f} "
                  f"{pct(x, .9):7.3f} {pct(x, .99):7.3f}")
        x = answer[name]
        if x:
            print(f"  {'a synced group answered, the next begun':40s} {pct(x, .5):7.3f} "
                  f"{pct(x, .9):7.3f} {pct(x, .99):7.3f}")
        slow_table(name, whole[name])


def slow_table(name, adds):
    """Mean ms per hop of the slowest 1% of adds beside all of them, and how often
    each hop was the largest of a slow add."""
    if len(adds) < 100:
        return
    adds.sort(key=lambda a: a[0])
    slow = adds[-max(1, int(len(adds) * SLOW)):]
    print(f"\n{name}: the slowest {SLOW:.0%} ({len(slow)} adds, from "
          f"{slow[0][0] * 1000:.2f} ms), through the bookie of the 2nd acknowledgement; "
          f"ms mean (all adds) / mean (slowest) / largest hop of a slow add (share)")
    keys = [f"{x} -> {y}" for x, y in HOPS] + [f"  {x} -> {y}" for x, y in SYNC_HOPS]
    top = collections.Counter(max((k for k in p if not k.startswith(" ")), key=p.get)
                              for _, p in slow)

    def mean(rows, k):
        xs = [p[k] for _, p in rows if k in p]
        return sum(xs) / len(xs) * 1000 if xs else float("nan")
    for k in keys:
        print(f"  {k:40s} {mean(adds, k):7.3f} {mean(slow, k):7.3f}   "
              f"{top.get(k, 0) / len(slow):.2f}")


if __name__ == "__main__":
    main()
