"""CPU, context switches and machine load of a benchmark's processes, per entry.

A diagnostic for ``scripts/bench_writes.py --proc``: :func:`snapshot` reads
``/proc`` for this process and every descendant (etcd, bookie arbiters and their
shard workers), per thread; :func:`per_entry` turns two snapshots into CPU
microseconds, voluntary / involuntary context switches and file read / write
syscalls per entry for each kind of process and thread, and the machine's CPU
utilisation in between. The syscalls are the kernel's ``syscr``/``syscw``:
``read``/``pread``/``write``/``pwrite`` (a shard worker's journal ``pwrite`` per
group commit and its sync pipe), not the sockets' ``recv*``/``sendmsg`` (use
``strace -c`` for those). Linux only.

A benchmark takes its snapshots through :class:`Snapshots`, in a helper
process, so that reading /proc (25-35 ms of CPU for ~80 threads) neither holds
the client's GIL nor pauses its load generator inside the measured time.

The run-queue wait is schedstat's: time a thread was runnable without a core
(a mean per entry); :class:`SchedRecord` gives its distribution per wake-up
(``perf sched``), which is what an add's tail is made of on a busy machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import psutil

_TICK = os.sysconf("SC_CLK_TCK")


def _counters(path: str, names: tuple) -> list:
    """The values of ``name: value`` lines of a /proc file, in the order of
    ``names`` (0 for a name it lacks)."""
    found = {}
    with open(path) as f:
        for line in f:
            name, _, value = line.partition(":")
            found[name] = value
    return [int(found[n].split()[0]) if n in found else 0 for n in names]


def _threads(pid: int) -> dict:
    """tid -> [cpu seconds, voluntary, involuntary, read syscalls, write syscalls,
    run-queue wait seconds] of one process's threads (read/pread, write/pwrite:
    /proc/PID/task/TID/io; the wait: schedstat's second field, the time it was
    runnable but not running; 0 where it cannot be read)."""
    out = {}
    base = f"/proc/{pid}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{base}/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            vol, inv = _counters(f"{base}/{tid}/status",
                                 ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))
        except OSError:
            continue
        try:
            rd, wr = _counters(f"{base}/{tid}/io", ("syscr", "syscw"))
        except OSError:
            rd = wr = 0
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                wait = int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            wait = 0.0
        out[int(tid)] = [(int(fields[11]) + int(fields[12])) / _TICK, vol, inv, rd, wr, wait]
    return out


def _kind(p: psutil.Process, me: int) -> str:
    """client (this process), etcd, arbiter (a bookie's master) or worker (a shard
    worker: forked by its arbiter, so it has the same command line)."""
    if p.pid == me:
        return "client"
    try:
        cmd = p.cmdline()
        parent = p.parent()
        pcmd = parent.cmdline() if parent is not None else []
    except psutil.Error:
        return "other"
    if cmd and os.path.basename(cmd[0]).startswith("etcd"):
        return "etcd"
    if "bk.cli.bookie" in cmd:
        return "worker" if pcmd == cmd else "arbiter"
    return "other"


def snapshot(root: int | None = None, names: dict | None = None) -> dict:
    """Per-thread counters of process ``root`` (default: this one, the "client")
    and its descendants, and /proc/stat. ``names``: the client's thread names by
    native id (default: this process's threads, when it is the root)."""
    me = os.getpid()
    root = me if root is None else root
    if names is None:
        names = {t.native_id: t.name for t in threading.enumerate()} if root == me else {}
    procs = {}
    top = psutil.Process(root)
    for p in [top] + top.children(recursive=True):
        if p.pid == me and root != me:
            continue                    # the snapshot's own process (Snapshots)
        kind = _kind(p, root)
        for tid, v in _threads(p.pid).items():
            label = names.get(tid, "other") if kind == "client" else (
                "main" if tid == p.pid else "thread")
            procs[(p.pid, tid)] = (kind, label, v)
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    return {"threads": procs, "busy": sum(cpu) - cpu[3] - cpu[4], "total": sum(cpu)}


def per_entry(before: dict, after: dict, entries: int) -> dict:
    """CPU us, context switches (voluntary, involuntary), file read / write
    syscalls and run-queue wait us (runnable, no core free) per entry by
    ``kind/thread``, and the machine's busy share of its CPUs between the two:
    in all, and by processes other than these (other work: the run was not
    quiet)."""
    rows = {}
    for key, (kind, label, v) in after["threads"].items():
        old = before["threads"].get(key, (kind, label, [0.0, 0, 0, 0, 0, 0.0]))[2]
        r = rows.setdefault(f"{kind}/{label}", [0.0, 0, 0, 0, 0, 0.0])
        for i in range(6):
            r[i] += v[i] - old[i]
    n = max(1, entries)
    res = {k: {"cpu_us": round(c * 1e6 / n, 1), "vcs": round(vc / n, 3),
               "ics": round(ic / n, 3), "rd": round(rd / n, 3), "wr": round(wr / n, 3),
               "wait_us": round(w * 1e6 / n, 1)}
           for k, (c, vc, ic, rd, wr, w) in sorted(rows.items())}
    total = after["total"] - before["total"]
    busy = after["busy"] - before["busy"]
    # what processes outside the benchmark used: whether the run was quiet, measured
    # (/proc/stat counts all CPUs, in ticks; ours is the threads' CPU in seconds)
    ours = sum(r[0] for r in rows.values()) * _TICK
    return {"per_entry": res,
            "cpu_us_total": round(sum(r[0] for r in rows.values()) * 1e6 / n, 1),
            "wait_us_total": round(sum(r[5] for r in rows.values()) * 1e6 / n, 1),
            "machine_busy": round(busy / max(1, total), 3),
            "others_busy": round(max(0.0, busy - ours) / max(1, total), 3)}


class Snapshots:
    """:func:`snapshot` of this process's tree taken by a helper process, on request.

    A snapshot reads four /proc files per thread (some 80 threads for a client,
    etcd and three bookies: 25-35 ms of CPU). Taken in the benchmark's own process
    it held the GIL against the client's I/O thread and paused the load generator
    at the start of the measured time, whose adds then left in one burst. Here
    :meth:`request` only writes a line to the helper and returns; :meth:`result`
    waits for the snapshots in the order requested, each with the
    ``time.monotonic()`` instants it began and ended (``"t"``)."""

    def __init__(self):
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bk.bench.procstats", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def request(self) -> None:
        self._proc.stdin.write("snap\n")

    def result(self) -> dict:
        """The next snapshot requested (RuntimeError if the helper failed)."""
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the procstats helper exited without a snapshot")
        d = json.loads(line)
        names = {t.native_id: t.name for t in threading.enumerate()}
        threads = {}
        for pid, tid, kind, label, v in d["threads"]:
            if kind == "client":
                label = names.get(tid, "other")
            threads[(pid, tid)] = (kind, label, v)
        return {"threads": threads, "busy": d["busy"], "total": d["total"], "t": d["t"]}

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _serve(root: int) -> None:
    """The helper of :class:`Snapshots`: a snapshot of ``root``'s tree per line read."""
    for _ in sys.stdin:
        t0 = time.monotonic()
        snap = snapshot(root, names={})
        out = {"threads": [[pid, tid, kind, label, v]
                           for (pid, tid), (kind, label, v) in snap["threads"].items()],
               "busy": snap["busy"], "total": snap["total"], "t": [t0, time.monotonic()]}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


class SchedRecord:
    """``perf sched record -a`` over a measured interval, then each thread kind's
    *scheduling delay* after a wake-up (how long it was runnable before it got a
    core), as percentiles: the tail that :func:`per_entry`'s mean wait hides.
    Needs ``perf`` and the right to trace the scheduler (root); :meth:`start`
    returns False without them. Threads are labelled as in :func:`snapshot`
    (kind/label of the snapshot taken at :meth:`stop`), others are left out."""

    def __init__(self):
        self._dir = None
        self._proc = None

    def start(self) -> bool:
        perf = shutil.which("perf")
        if perf is None:
            return False
        self._dir = tempfile.mkdtemp(prefix="bk-sched-")
        # the monotonic clock: its timestamps compare with time.monotonic()
        self._proc = subprocess.Popen(
            [perf, "sched", "record", "-a", "-k", "CLOCK_MONOTONIC",
             "-o", os.path.join(self._dir, "perf.data")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.2)
        return self._proc.poll() is None

    def cancel(self) -> None:
        """Stop recording and throw the recording away."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            shutil.rmtree(self._dir, ignore_errors=True)

    def stop(self, snap: dict, t0: float = 0.0, t1: float = float("inf")) -> dict | None:
        """Stop recording; ``{kind/label: {"n", "p50", "p90", "p99", "p999", "max"}}``
        (delays in ms, ``n`` switch-ins between the ``time.monotonic()`` instants
        ``t0`` and ``t1``) for the threads of ``snap``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        try:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
            out = subprocess.run(["perf", "sched", "timehist", "-i",
                                  os.path.join(self._dir, "perf.data")],
                                 capture_output=True, text=True, timeout=300).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
        names = {tid: f"{kind}/{label}" for (_, tid), (kind, label, _) in snap["threads"].items()}
        delays = {}
        # time  cpu  task[tid/pid]  wait  sch-delay  run
        for line in out.splitlines():
            f = line.split()
            if len(f) < 6 or not f[2].endswith("]") or "[" not in f[2]:
                continue
            try:
                t = float(f[0])
                tid = int(f[2].rsplit("[", 1)[1][:-1].split("/")[0])
                delay = float(f[4])
            except ValueError:
                continue
            if not t0 <= t <= t1:
                continue
            name = names.get(tid)
            if name is not None:
                delays.setdefault(name, []).append(delay)
        res = {}
        for name, xs in sorted(delays.items()):
            xs.sort()
            n = len(xs)
            res[name] = {"n": n, "p50": xs[n // 2], "p90": xs[int(n * 0.9)],
                         "p99": xs[int(n * 0.99)], "p999": xs[int(n * 0.999)], "max": xs[-1]}
        return res


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
