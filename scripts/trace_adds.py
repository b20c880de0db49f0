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

Stalls: every pass of each shard worker's loop and of the client's I/O thread
(select returned -> next select) is timed; a pass of ``BK_TRACE_STALL_MS`` (2)
or more is kept with what it was made of: the thread's own CPU, its run-queue
wait (``/proc/thread-self/schedstat``: runnable, no core free), the rest
(waiting for the GIL, or blocked in a syscall), the CPU of the process's other
threads meanwhile (a flusher or sync thread), and the wall time of each step
it ran (reads, the journal's ``pwrite``, ``io_submit``, the heartbeat,
``maintain``, flushes begun and taken back, segment rolls, cyclic collections,
...). A select whose wake-up waited that long for a core, or overslept its
timeout, is a late wake-up. The report gives, per mode, stalls per loop-second
and their make-up, every step that once took that long (calls, mean wall, mean
CPU, max), and for the slowest 1% of adds the share with a stall of the client's
I/O thread (from submit to the acknowledgement read) or of the worker of their
2nd acknowledgement (from the earlier of the client's ``sent`` and that
worker's select that returned with the add, to its ``released``) on their path, and the
steps those stalls were in; and the flushes each shard swapped, how many of them
began while another bookie's flush ran, and the share of the slowest adds sent
while flushes ran on one bookie and on two or more (the ack quorum, 2 of 3,
rides out a stall of one). Only the measured time of each run counts (not the
client's start or the warm-up).

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


STALL = float(os.environ.get("BK_TRACE_STALL_MS", "2")) / 1000
_thread_time, _process_time = time.thread_time, time.process_time
PROBES = []          # this process's loop probes
GCS = []             # its cyclic collections: (start, seconds, generation, thread name)
FLUSHES = []         # a shard's flushes: (swapped, taken back)


class Probe:
    """The passes of one thread's loop, from each select's return to the next
    select's call: a pass of ``STALL`` or more (a *stall*: the loop read nothing
    meanwhile) is kept with its CPU (this thread's), its run-queue wait
    (``/proc/thread-self/schedstat``: runnable, no core), the CPU of the process's
    other threads meanwhile (a flusher or sync thread, which may hold the GIL)
    and the time spent in each wrapped step (``parts``; inclusive, so nested
    steps count twice). A select that returned ``STALL`` after it was due (its
    run-queue wait, or a timeout overslept) is a late wake-up. Made on the
    loop's own thread (the schedstat file is that thread's)."""

    def __init__(self, kind):
        self.kind, self.pid = kind, os.getpid()
        self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        self.stalls, self.wakes, self.parts = [], [], {}
        self.totals = {}         # step -> [calls, seconds, longest] over the whole run
        self.t_ret = self.t_call = self.cpu0 = self.pcpu0 = 0.0
        self.rq0 = self.rq_call = 0
        self.passes, self.busy = 0, 0.0
        PROBES.append(self)

    def rq(self):
        return int(os.pread(self.fd, 80, 0).split()[1])

    def before(self):
        t = mono()
        rq = self.rq()
        if self.t_ret:
            wall = t - self.t_ret
            self.passes += 1
            self.busy += wall
            if wall >= STALL:
                cpu = _thread_time() - self.cpu0
                self.stalls.append((self.t_ret, wall, cpu, (rq - self.rq0) / 1e9,
                                    _process_time() - self.pcpu0 - cpu, self.parts))
        self.t_call, self.rq_call = t, rq
        self.cpu0, self.pcpu0 = _thread_time(), _process_time()

    def after(self, timeout, n):
        t = mono()
        rq = self.rq()
        wait = (rq - self.rq_call) / 1e9
        late = t - self.t_call - timeout if timeout is not None and not n else 0.0
        cpu = _thread_time() - self.cpu0
        other = _process_time() - self.pcpu0 - cpu
        # other threads' CPU while this one slept: one of them may have held the GIL
        # when the select returned (a wait that no run queue shows)
        if wait >= STALL or late >= STALL or (n and other >= STALL):
            self.wakes.append((self.t_call, t - self.t_call, wait, max(0.0, late), other))
        self.t_ret, self.rq0, self.parts = t, rq, {}
        self.cpu0, self.pcpu0 = _thread_time(), _process_time()

    def dump(self):
        return {"kind": self.kind, "pid": self.pid, "passes": self.passes, "busy": self.busy,
                "stalls": self.stalls, "wakes": self.wakes, "totals": self.totals}


def timed(probe_of, cls, name, label=None):
    """Wrap ``cls.name`` to add its time to the running pass's parts."""
    fn = getattr(cls, name)
    label = label or name

    def wrapper(self, *a, **k):
        t0, c0 = mono(), _thread_time()
        try:
            return fn(self, *a, **k)
        finally:
            p = probe_of(self)
            if p is not None:
                dt = mono() - t0
                p.parts[label] = p.parts.get(label, 0.0) + dt
                tot = p.totals.get(label)
                if tot is None:
                    tot = p.totals[label] = [0, 0.0, 0.0, 0.0]
                tot[0] += 1
                tot[1] += dt
                tot[3] += _thread_time() - c0
                if dt > tot[2]:
                    tot[2] = dt
    setattr(cls, name, wrapper)


def gc_hook():
    import gc
    import threading
    t0 = [0.0]

    def cb(phase, info):
        if phase == "start":
            t0[0] = mono()
        else:
            dt = mono() - t0[0]
            GCS.append((t0[0], dt, info["generation"], threading.current_thread().name))
            for p in PROBES:            # the pass it fell in, on whichever thread
                p.parts["gc%d" % info["generation"]] = \
                    p.parts.get("gc%d" % info["generation"], 0.0) + dt
    gc.callbacks.append(cb)


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
            t0, c0 = mono(), _thread_time()
            job = begin()
            self._tr_begin.append((t0, mono() - t0, self._tr_done == self._tr_sel,
                                   _thread_time() - c0, job.bytes if job is not None else 0))
            return job
        self.storage.begin_sync = begin_sync
        worker = self

        class Sel:                # the poller has __slots__: wrap it, not its method
            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                return getattr(self.inner, name)

            def select(self, timeout=None):
                probe.before()
                r = self.inner.select(timeout)
                worker._tr_sel = mono()
                probe.after(timeout, len(r))
                return r
        probe = self._tr_probe = Probe("worker")
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
                json.dump({"bookie": self.bookie_id, "pid": os.getpid(),
                           "probes": [p.dump() for p in PROBES], "gcs": GCS,
                           "flushes": FLUSHES, "syncs": self._tr_syncs,
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
    # what each pass did, for the stalls (see Probe); by name, where they exist
    st, jr = sys.modules["bk.bookie.storage"], sys.modules["bk.bookie.journal"]
    of_worker = lambda w: getattr(w, "_tr_probe", None)
    of_loop = lambda _: PROBES[0] if PROBES else None
    for name in ("_on_readable", "_on_readable_tls", "_start_sync", "_release", "_send_hb",
                 "_on_control", "_on_aio_done", "_on_sync_done", "_compaction_step",
                 "_wake_waiters", "_expire_unready"):
        if hasattr(W, name):
            timed(of_worker, W, name)
    S = st.ShardStorage
    for name in ("maintain", "_start_flush", "_finish", "_trim_index", "begin_sync", "sync"):
        if hasattr(S, name):
            timed(of_loop, S, name, "storage." + name)
    # the whole roll on the loop (older journals: _room, which rolls and, rarely,
    # only checks; their segment was created there, now it is prepared off the loop)
    timed(of_loop, jr.Journal, "_roll" if hasattr(jr.Journal, "_roll") else "_room",
          "journal roll")
    if hasattr(jr.Journal, "_roll_ahead"):     # a roll at a group's start (direct writes)
        timed(of_loop, jr.Journal, "_roll_ahead", "journal roll ahead")
    if hasattr(jr.Journal, "_write_out"):
        timed(of_loop, jr.Journal, "_write_out", "journal pwrite")
    aio = sys.modules.get("bk.bookie.aiosync")
    if aio is not None and hasattr(aio, "AioSync"):
        timed(of_loop, aio.AioSync, "submit", "io_submit")
    start_flush, finish = S._start_flush, S._finish

    def _start_flush(self):
        FLUSHES.append([mono(), None])
        return start_flush(self)

    def _finish(self, job):
        r = finish(self, job)
        if FLUSHES and FLUSHES[-1][1] is None:
            FLUSHES[-1][1] = mono()
        return r
    S._start_flush, S._finish = _start_flush, _finish
    gc_hook()


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
    # the I/O thread's passes, for the stalls (see Probe)
    IO = cm.IOLoop
    run = IO._run

    class Sel:
        def __init__(self, inner, probe):
            self.inner, self.probe = inner, probe

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def select(self, timeout=None):
            self.probe.before()
            r = self.inner.select(timeout)
            self.probe.after(timeout, len(r))
            return r

        def poll(self, timeout=-1):     # the loop's own epoll (bk.client.connection._Poller)
            self.probe.before()
            r = self.inner.poll(timeout)
            self.probe.after(None if timeout is None or timeout < 0 else timeout, len(r))
            return r

    def _run(self):
        self.sel = Sel(self.sel, Probe("client I/O"))
        return run(self)
    IO._run = _run
    of_io = lambda _: next((p for p in reversed(PROBES) if p.kind == "client I/O"), None)
    for cls, names in ((C, ("_on_readable", "_write")), (L, ("_io_flush",)),
                       (IO, ("_tick", "_run_timers"))):
        for name in names:
            timed(of_io, cls, name)
    gc_hook()
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
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a bookie setting for the cluster (e.g. journalSyncThroughAio=false)")
    p.add_argument("--show", type=int, default=5,
                   help="list the stalls on the path of the N slowest adds of each mode "
                        "(one per 20 ms: those of a moment share their stalls)")
    a = p.parse_args()
    overrides = dict(kv.split("=", 1) for kv in a.set)
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
    windows, measured = [], []
    with LocalCluster(num_bookies=3, base_dir=os.path.join(d, "cluster"), num_shards=2,
                      conf_overrides={"tlsCertificatePath": crt, "tlsKeyStore": key,
                                      "tlsRequired": False, **overrides}) as c:
        for _ in range(a.rounds):
            for name, extra in modes:
                t0 = time.monotonic()
                r = bench_writes(c.metadata_uri, duration=a.duration, rate=a.rate, **extra)
                windows.append((t0, time.monotonic(), name))
                # the stalls: the measured time only (not the client's start, its
                # deliberate full collection, the warm-up or the drain)
                measured.append(tuple(r["window_monotonic"] or (t0, t0)) + (name,))
                lat = r["latency_ms"]
                print(f"{name:9s} {r['entries_per_sec']:8.0f}/s  p50 {lat['p50']} p99 {lat['p99']} "
                      f"p99.9 {lat['p99.9']} ms", flush=True)
    # the cluster stopped: the bookies wrote their traces
    workers = {}
    probes = [p.dump() for p in ns["PROBES"]]
    gcs = [tuple(g) + (os.getpid(),) for g in ns["GCS"]]
    flushes = []
    syncs = collections.defaultdict(list)
    idle = collections.defaultdict(list)
    answer = collections.defaultdict(list)
    begin = collections.defaultdict(list)
    begin_cpu = collections.defaultdict(list)
    for fn in os.listdir(d):
        if fn.startswith("w-"):
            with open(os.path.join(d, fn)) as f:
                w = json.load(f)
            for lid, eid, v in w["adds"]:
                v["pid"] = w.get("pid")
                workers[(w["bookie"], lid, eid)] = v
            probes.extend(w.get("probes", ()))
            gcs.extend(tuple(g) + (w.get("pid"),) for g in w.get("gcs", ()))
            flushes.extend([f[0], f[1], w.get("pid")] for f in w.get("flushes", ()))
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
            for t0, dt, _, cpu, nbytes in w.get("begin", ()):
                for s, e, name in windows:
                    if s <= t0 <= e:
                        begin[name].append(dt)
                        begin_cpu[name].append((cpu, nbytes))
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
                whole[mode].append((total, parts, add_path(t, w["pid"])))
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
            c = begin_cpu[name]
            kib = sum(n for _, n in c) / 1024
            print(f"  {'  its CPU':40s} {pct([x for x, _ in c], .5):7.3f} "
                  f"{pct([x for x, _ in c], .9):7.3f} {pct([x for x, _ in c], .99):7.3f}"
                  f"   ({sum(x for x, _ in c) * 1e6 / max(kib, 1e-9):.1f} us per KiB written)")
        x = answer[name]
        if x:
            print(f"  {'a synced group answered, the next begun':40s} {pct(x, .5):7.3f} "
                  f"{pct(x, .9):7.3f} {pct(x, .99):7.3f}")
        slow_table(name, whole[name])
        stall_report(name, [(s, e) for s, e, n in measured if n == name], probes, gcs,
                     flushes, whole[name], a.show)


def _flushing(flushes, t, but=None):
    """How many bookies (other than pid ``but``) had a flush running at ``t``."""
    return len({f[2] for f in flushes if f[2] != but and f[0] <= t <= (f[1] or 1e18)})


def _within(t, wins):
    return any(s <= t <= e for s, e in wins)


def add_path(t, pid):
    """The moments of one add's path that the stall report looks at, from its
    hops ``t`` through the worker ``pid`` of its 2nd acknowledgement: the client's
    part from submit to the acknowledgement read; the worker's from the earlier
    of the client's ``sent`` and the worker's select that returned with the add,
    to its ``released``. Not ``sent`` alone: it is read after the write returned,
    and a client thread held up there (the GIL, no core) reads it late, once the
    worker may have answered already (on a loaded machine: 47 ms after the
    worker's select, 3 ms after its answer), which left no pass of the worker on
    the path of an add slow for the client's sake."""
    return {"sub": t["sub"], "end": t["c_read"], "sent": t["sent"], "released": t["released"],
            "at_worker": min(t["sent"], t["w_select"]), "pid": pid}


def stall_report(name, wins, probes, gcs, flushes, adds, show=5):
    """The loops' stalls (passes of STALL or more, see Probe) and late wake-ups in
    this mode's runs, what they were made of, and how many of the slowest 1% of
    adds had one on their path."""
    stall = float(os.environ.get("BK_TRACE_STALL_MS", "2"))
    secs = sum(e - s for s, e in wins)
    print(f"\n{name}: loop passes of {stall:g} ms or more (stalls) and wake-ups {stall:g} ms "
          f"late, over {secs:.0f} s")
    by_kind = collections.defaultdict(list)
    for p in probes:
        by_kind[p["kind"]].append(p)
    for kind, ps in sorted(by_kind.items()):
        st = [x for p in ps for x in p["stalls"] if _within(x[0], wins)]
        wk = [x for p in ps for x in p["wakes"] if _within(x[0], wins)]
        loops = len({p["pid"] for p in ps}) if kind == "worker" else 1
        walls = [x[1] for x in st]
        tot = sum(walls) or 1e-9
        cpu, rq = sum(x[2] for x in st), sum(x[3] for x in st)
        other = sum(x[4] for x in st)
        n = sum(p["passes"] for p in ps)
        print(f"  {kind} ({loops} loops, {n} passes in all runs): "
              f"{len(st) / max(secs * loops, 1e-9):.1f} stalls per "
              f"loop-second, ms p50 / p99 / max {pct(walls, .5):.1f} / {pct(walls, .99):.1f} / "
              f"{max(walls, default=0) * 1000:.1f}; of their time: own CPU {cpu / tot:.0%}, "
              f"run-queue wait {rq / tot:.0%}, neither (GIL, blocked) "
              f"{max(0.0, tot - cpu - rq) / tot:.0%}; other threads' CPU meanwhile "
              f"{other / tot:.0%}")
        parts = collections.Counter()
        for x in st:
            parts.update(x[5])
        if parts:
            print("    in them (inclusive, share of their time): " + ", ".join(
                f"{k} {v / tot:.0%}" for k, v in parts.most_common(8)))
        tots = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
        for p in ps:
            for k, (c, t, mx, cpu) in p.get("totals", {}).items():
                tots[k][0] += c
                tots[k][1] += t
                tots[k][2] = max(tots[k][2], mx)
                tots[k][3] += cpu
        big = sorted(((v[2], k, v) for k, v in tots.items() if v[2] * 1000 >= stall),
                     reverse=True)
        if big:
            print("    steps that took that long at least once (all runs): calls, ms mean wall "
                  "/ mean CPU / max wall")
            for _, k, v in big:
                print(f"      {k:24s} {v[0]:7d} {v[1] / v[0] * 1000:8.3f} "
                      f"{v[3] / v[0] * 1000:8.3f} {v[2] * 1000:8.1f}")
        # rare steps: do the bookies take them at the same moment? (with E = Qw an
        # add waits for the 2nd bookie: one stalled bookie is hidden, two are not)
        rare = collections.defaultdict(list)
        for p in ps:
            for x in p["stalls"]:
                if _within(x[0], wins):
                    for k in ("journal roll", "storage._start_flush", "storage._finish"):
                        if k in x[5]:
                            rare[k].append((x[0], p["pid"], x[1]))
        t0 = min(s for s, _ in wins) if wins else 0.0
        for k, xs in sorted(rare.items()):
            print(f"    stalls holding {k} (s into the runs, pid, ms): " + ", ".join(
                f"{t - t0:.2f} {pid} {w * 1000:.1f}" for t, pid, w in sorted(xs)[:12]))
        if wk:
            print(f"    late wake-ups: {len(wk) / max(secs * loops, 1e-9):.1f} per loop-second, "
                  f"run-queue wait ms p50 / max {pct([x[2] for x in wk], .5):.1f} / "
                  f"{max(x[2] for x in wk) * 1000:.1f}, timeouts overslept "
                  f"{sum(1 for x in wk if x[3] > 0)}, woken while other threads ran "
                  f"{stall:g} ms or more {sum(1 for x in wk if x[4] * 1000 >= stall)}")
    g = [x for x in gcs if _within(x[0], wins) and x[1] * 1000 >= stall / 2]
    if g:
        print(f"  cyclic collections of {stall / 2:g} ms or more: " + ", ".join(
            f"gen{x[2]} {x[1] * 1000:.1f} ms ({x[3]}, pid {x[4]})" for x in g[:12]))
    fl = [f for f in flushes if _within(f[0], wins)]
    if fl:
        print(f"  flushes swapped: {len(fl)}, each {pct([(f[1] or f[0]) - f[0] for f in fl], .5):.0f}"
              f" ms until taken back (median); swapped while another bookie's flush ran: "
              f"{sum(_flushing(flushes, f[0], f[2]) > 0 for f in fl)}")
    if len(adds) < 100:
        return
    slow = sorted(adds, key=lambda a: a[0])[-max(1, int(len(adds) * SLOW)):]
    client = [x for p in by_kind.get("client I/O", ()) for x in p["stalls"] + [
        (w[0], w[1], 0, w[2], w[4], {"(late wake-up)": w[1]}) for w in p["wakes"]]]
    per_pid = collections.defaultdict(list)
    for p in by_kind.get("worker", ()):
        per_pid[p["pid"]].extend(p["stalls"])
        per_pid[p["pid"]].extend((w[0], w[1], 0, w[2], w[4], {"(late wake-up)": w[1]})
                                 for w in p["wakes"])

    def overlap(xs, a, b):
        return [(x, min(b, x[0] + x[1]) - max(a, x[0])) for x in xs
                if x[0] < b and x[0] + x[1] > a]
    n_c = n_w = n_none = 0
    ov_c = ov_w = 0.0
    in_flush = in_two = rolled = 0
    why = collections.Counter()
    for total, _, m in slow:
        oc = overlap(client, m["sub"], m["end"])
        ow = overlap(per_pid.get(m["pid"], ()), m["at_worker"], m["released"])
        n_c += bool(oc)
        n_w += bool(ow)
        n_none += not oc and not ow
        ov_c += sum(o for _, o in oc) / total
        ov_w += sum(o for _, o in ow) / total
        in_flush += any(f[0] <= m["sent"] <= (f[1] or 1e18) for f in flushes)
        in_two += _flushing(flushes, m["sent"]) >= 2
        rolled += any("journal roll" in x[5] for x, _ in ow)
        for x, o in oc + ow:
            k = max(x[5], key=x[5].get) if x[5] else "?"
            why[k] += o
    k = len(slow)
    print(f"  the slowest {SLOW:.0%} ({k} adds): a client I/O stall on the path of "
          f"{n_c / k:.0%} (covering {ov_c / k:.0%} of their latency), a stall of the worker "
          f"of the 2nd acknowledgement on {n_w / k:.0%} ({ov_w / k:.0%}), neither "
          f"{n_none / k:.0%}; sent while a flush ran {in_flush / k:.0%} (on two bookies or "
          f"more {in_two / k:.0%}); behind that "
          f"worker's journal segment roll {rolled / k:.0%}")
    s = sum(why.values()) or 1e-9
    if why:
        print("    the largest step of those stalls, by their time: " + ", ".join(
            f"{a} {b / s:.0%}" for a, b in why.most_common(8)))
    shown = []
    for total, hops, m in slow[::-1]:
        if len(shown) >= show:
            break
        if any(abs(m["sub"] - t) < 0.02 for t in shown):
            continue                # the same moment as one listed already
        shown.append(m["sub"])
        big = max(hops, key=hops.get)
        print(f"  an add of {total * 1000:.1f} ms (largest hop {big.strip()} "
              f"{hops[big] * 1000:.1f} ms), stalls on its path (ms after it was submitted: "
              f"loop, wall, own CPU, run-queue wait, other threads' CPU; steps):")
        for who, xs, a, b in (("client I/O", client, m["sub"], m["end"]),
                              (f"worker {m['pid']}", per_pid.get(m["pid"], ()),
                               m["at_worker"], m["released"])):
            for x, _ in sorted(overlap(xs, a, b), key=lambda xo: xo[0][0])[:6]:
                steps = ", ".join(f"{k} {v * 1000:.1f}" for k, v in
                                  sorted(x[5].items(), key=lambda kv: -kv[1])[:4])
                print(f"    +{(x[0] - m['sub']) * 1000:6.1f} {who:14s} {x[1] * 1000:6.1f} "
                      f"{x[2] * 1000:5.1f} {x[3] * 1000:5.1f} {x[4] * 1000:5.1f}  {steps}")


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
                              for _, p, _ in slow)

    def mean(rows, k):
        xs = [p[k] for _, p, _ in rows if k in p]
        return sum(xs) / len(xs) * 1000 if xs else float("nan")
    for k in keys:
        print(f"  {k:40s} {mean(adds, k):7.3f} {mean(slow, k):7.3f}   "
              f"{top.get(k, 0) / len(slow):.2f}")


if __name__ == "__main__":
    main()
