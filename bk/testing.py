"""Pytest-facing helpers on top of :mod:`bk.localcluster` and :mod:`bk.rawclient`:
a local cluster tuned for quick tests, for bk's own tests and users' tests.

    from bk.testing import LocalCluster
    with LocalCluster(num_bookies=3) as cluster:
        client = bk.BookKeeper(cluster.metadata_uri)
        cluster.bookies[0].kill()          # kill -9 the whole bookie (arbiter + shards)
        cluster.bookies[0].start()         # same directories: replays its journals

Production code never imports this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
from click.testing import CliRunner

from bk import localcluster
from bk import protocol as P
from bk.config import SETTINGS
from bk.cli.shell import cli as _shell_cli
from bk.client.bookkeeper import BookKeeper
from bk.errors import EOK, BKError
from bk.localcluster import BookieProcess  # noqa: F401  (re-exported for tests)
from bk.rawclient import BookieConnection  # noqa: F401  (re-exported for tests)

# Settings that keep tests quick; every one is an ordinary configuration key.
TEST_DEFAULTS = {
    "registrationTtlSeconds": 3,
    "journalPreAllocSizeMB": 8,
    "diskCheckInterval": 1000,
    "journalMaxGroupWaitMSec": 1,
}


# etcd flags of test clusters. No fsync: a test kills processes, never the machine, and
# the page cache outlives a killed etcd, so nothing a test checks rests on etcd's
# fsyncs, which on a shared disk cost milliseconds each (tens at the 90th percentile).
# Short raft ticks: the one member elects itself in ~0.2 s instead of 0.3-1 s (it has
# no peer to miss a heartbeat of).
TEST_ETCD_ARGS = ["--unsafe-no-fsync", "--heartbeat-interval", "10", "--election-timeout", "100"]


def env_settings(env=None) -> dict:
    """Settings every test cluster's bookies get from ``BK_TEST_SETTINGS``
    (``key=value,key=value``), under each test's own ``conf_overrides``: the
    suite run with a setting a release is about to change (``BK_<key>``
    variables do not reach test bookies, see bk.localcluster). An unknown key
    fails at once, with its name."""
    raw = (os.environ if env is None else env).get("BK_TEST_SETTINGS", "")
    out = {}
    for item in filter(None, (x.strip() for x in raw.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in SETTINGS:
            raise BKError(f"BK_TEST_SETTINGS: {item!r} is not key=value of a known setting")
        out[key] = value
    return out


def production_settings() -> dict:
    """The registry defaults of the keys TEST_DEFAULTS changes (for tests that
    want one bookie to run as a deployed one does)."""
    return {k: SETTINGS[k].default for k in TEST_DEFAULTS}


# --- bookies forked from a warm process -------------------------------------------
#
# A bookie start is mostly Python importing bk's bookie modules, gRPC and the etcd
# client (~0.25 CPU-s), and the suite starts some 400 bookies. So a test process
# starts one helper, the launcher, which imports those modules once (it starts no
# thread and opens no connection) and forks each bookie from itself: the child
# makes a session of its own, points stdout and stderr at the bookie's log, takes
# the caller's environment and directory and runs ``bookie ARGS`` as
# ``python -m bk.cli.bookie ARGS`` would (one launcher for each environment bookies
# are started with). The bookie is a child of the launcher,
# which reports each child's exit status: :class:`_LaunchedProcess` offers the
# Popen calls BookieProcess makes (pid, poll, wait, send_signal, returncode).

_LAUNCHER = r"""
import json, os, selectors, signal, sys, traceback
import bk.cli.bookie, bk.bookie.arbiter, bk.bookie.worker, bk.bookie.http
import bk.autorecovery.service
replies = os.dup(1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *a: None)
def say(msg):
    os.write(replies, (json.dumps(msg) + "\n").encode())
def run(req):
    os.setsid()
    # the signal handling a fresh interpreter has (SIGPIPE stays ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    sel.close()
    log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for fd in (log, replies, wake_r, wake_w):
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    sys.argv = ["bookie", *req["args"]]
    code = 1
    try:
        bk.cli.bookie.main(args=req["args"], prog_name="bookie")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
sel = selectors.DefaultSelector()
sel.register(0, selectors.EVENT_READ)
sel.register(wake_r, selectors.EVENT_READ)
pending = b""
while True:
    for key, _ in sel.select():
        if key.fd == wake_r:
            os.read(wake_r, 4096)
            continue
        data = os.read(0, 65536)
        if not data:
            sys.exit(0)
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                run(json.loads(line))
            say({"spawned": pid})
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
"""


class _LaunchedProcess:
    """A bookie forked by the launcher: the Popen calls BookieProcess makes."""

    def __init__(self, launcher: "_Launcher", pid: int):
        self._launcher = launcher
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._launcher.cond:
            if not self._launcher.cond.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(f"bookie pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# how long a spawn waits for the launcher (a starved machine: see _Launcher.spawn)
LAUNCHER_ANSWER_TIMEOUT = 180.0


class _Launcher:
    """A launcher process of this test process, started on first use for each
    environment a bookie is started with: what the interpreter does at its start
    (PYTHONPATH, sitecustomize: a test's hook) and what modules read when they are
    imported is the launcher's, so it is the bookie's environment too. Launchers
    are kept: one that exits leaves the exit statuses of its children unknown."""

    MAX = 4                         # environments; beyond, bookies are started anew
    _launchers: dict = {}
    _launchers_lock = threading.Lock()

    @classmethod
    def get(cls, env: dict) -> "_Launcher | None":
        key = tuple(sorted(env.items()))
        with cls._launchers_lock:
            launcher = cls._launchers.get(key)
            if launcher is None or launcher.proc.poll() is not None:
                if launcher is None and len(cls._launchers) >= cls.MAX:
                    return None
                launcher = cls._launchers[key] = cls(env)
            return launcher

    def __init__(self, env: dict):
        self.env = env
        self.proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.cond = threading.Condition()
        self._children: dict[int, _LaunchedProcess] = {}
        self._spawned: list[_LaunchedProcess] = []
        self._lock = threading.Lock()             # one spawn request at a time
        threading.Thread(target=self._read, name="bk-test-launcher", daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.cond:
                if "spawned" in msg:
                    child = _LaunchedProcess(self, msg["spawned"])
                    self._children[child.pid] = child
                    self._spawned.append(child)
                else:
                    child = self._children.pop(msg["exited"], None)
                    if child is not None:
                        child.returncode = msg["code"]
                self.cond.notify_all()
        with self.cond:                 # the launcher is gone: so are its reports
            for child in self._children.values():
                if child.returncode is None:
                    child.returncode = -signal.SIGKILL
            self._children.clear()
            self.cond.notify_all()

    def spawn(self, args: list, log_file: str) -> _LaunchedProcess:
        req = {"args": args, "log": log_file, "cwd": os.getcwd(), "env": self.env}
        with self._lock:
            with self.cond:
                self._spawned.clear()
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            with self.cond:
                # The first answer waits for the launcher's imports: on a machine other
                # jobs keep busy (a niced soak beside CPU burners) that took over 30 s.
                # A launcher that exited answers nothing: no need to wait for it then.
                if not self.cond.wait_for(
                        lambda: self._spawned or self.proc.poll() is not None,
                        LAUNCHER_ANSWER_TIMEOUT) or not self._spawned:
                    raise BKError(f"the bookie launcher did not answer (exit status "
                                  f"{self.proc.poll()})")
                return self._spawned.pop()


class _ForkedBookie(localcluster.BookieProcess):
    """A bookie forked from the launcher (one run in a network namespace, with a
    command prefix, is started as its own process)."""

    def _spawn(self, args: list):
        launcher = None if self.command_prefix else _Launcher.get(localcluster._child_env())
        if launcher is None:
            return super()._spawn(args)
        return launcher.spawn(args, self.log_file)


class LocalCluster(localcluster.LocalCluster):
    """:class:`bk.localcluster.LocalCluster` with :data:`TEST_DEFAULTS` and
    :func:`env_settings` under the caller's ``conf_overrides``, etcd run with
    :data:`TEST_ETCD_ARGS`, and bookies forked from a process that imported
    their modules already."""

    bookie_class = _ForkedBookie

    def __init__(self, *args, conf_overrides: dict | None = None, **kw):
        super().__init__(*args, conf_overrides={**TEST_DEFAULTS, **env_settings(),
                                                **(conf_overrides or {})}, **kw)

    def _make_etcd(self, tls):
        etcd = super()._make_etcd(tls)
        etcd.extra_args += TEST_ETCD_ARGS
        return etcd

    def client(self, timeout: float = 3.0, **settings) -> BookKeeper:
        """A client of this cluster whose adds and reads time out after ``timeout``
        seconds (so a test about a dead bookie does not wait out the defaults)."""
        settings.setdefault("addEntryTimeoutSec", timeout)
        settings.setdefault("readEntryTimeoutSec", timeout)
        return BookKeeper(self.metadata_uri, **settings)

    def entries_on(self, bookie_id: str, ledger_id: int) -> set[int]:
        """The entry ids of ``ledger_id`` that ``bookie_id`` holds."""
        return entries_held(self.store, bookie_id, ledger_id)


@contextlib.contextmanager
def bookie_lost(bookie, how: str = "stop"):
    """Inside the block ``bookie`` (a BookieProcess) is lost: killed -9 with its
    shard workers (``how="kill"``) or SIGSTOPped, arbiter and workers, so it hangs
    with its sockets open (``"stop"``: the block starts once every thread of
    each is stopped, :func:`sigstop`). A stopped bookie is continued after the
    block, whatever happened in it."""
    if how not in ("kill", "stop"):
        raise ValueError(f"how must be 'kill' or 'stop', not {how!r}")
    pids = [bookie.pid] + bookie.worker_pids()
    if how == "kill":
        bookie.kill(signal.SIGKILL)
    else:
        sigstop(*pids)
    try:
        yield
    finally:
        if how == "stop":
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass


@contextlib.contextmanager
def site_hook(directory, source: str, env: dict | None = None):
    """Inside the block, every Python process started (bookies, their workers)
    runs ``source`` at start-up, as a ``sitecustomize`` module put first on
    PYTHONPATH (the kill tests' way of stopping a process at an exact line), with
    ``env``'s items as environment variables for it to read. After the block
    PYTHONPATH and those variables are as before: a restarted process runs
    without the hook."""
    hook_dir = os.path.join(str(directory), "hook")
    os.makedirs(hook_dir, exist_ok=True)
    with open(os.path.join(hook_dir, "sitecustomize.py"), "w") as f:
        f.write(source)
    changes = {key: str(value) for key, value in (env or {}).items()}
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    changes["PYTHONPATH"] = os.pathsep.join([hook_dir] + rest)
    before = {key: os.environ.get(key) for key in changes}
    os.environ.update(changes)
    try:
        yield hook_dir
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def wait_until(pred, timeout: float = 30.0, what: str = "condition", step: float = 0.05):
    """Poll ``pred()`` until it is true: a test waits for a condition with a
    deadline, never a bare sleep. AssertionError naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def process_state(pid: int) -> str:
    """Process ``pid``'s state letter from /proc (R, S, D, T: stopped, Z: zombie),
    or "gone" once it is reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def process_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state T in /proc/PID/task/*/stat).

    SIGSTOP stops a process as a group: one thread takes the signal (when it is
    next scheduled) and asks the others to stop, and each does when it next
    leaves the kernel or is scheduled. Until the first one took it, every
    thread runs on: etcd on a loaded machine answered 22 of 100 writes sent
    right after ``kill()`` returned (none of 600 once its main thread was seen
    stopped). /proc/PID/stat is the main thread's state alone: the others
    stopped up to ~5 ms after it, finishing the system call they were in.
    This waits for all of them, the exact condition."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        raise AssertionError(f"process {pid} is gone, it cannot be stopped") from None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue                        # a thread that ended meanwhile
        if state not in ("T", "t"):
            return False
    return True


def sigstop(*pids: int, timeout: float = 10.0) -> None:
    """SIGSTOP each of ``pids`` and wait until every thread of each is stopped
    (:func:`process_stopped`): from then on none of them runs a line of its own
    code until SIGCONT."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    wait_stopped(*pids, timeout=timeout)


def wait_stopped(*pids: int, timeout: float = 10.0, what: str = "") -> None:
    """Wait until every thread of each of ``pids`` is stopped (a SIGSTOP sent
    by someone else, e.g. a process stopping itself at a :func:`site_hook`)."""
    wait_until(lambda: all(process_stopped(p) for p in pids), timeout=timeout,
               what=what or f"every thread of {', '.join(map(str, pids))} stopped", step=0.002)


def stop_bookie(bookie, timeout: float = 10.0) -> list[int]:
    """SIGSTOP the whole bookie (arbiter and shard workers, its process group)
    and wait until every thread of each is stopped; their pids."""
    pids = [bookie.pid] + bookie.worker_pids()
    bookie.kill(signal.SIGSTOP)
    wait_stopped(*pids, timeout=timeout)
    return pids


# --- the kill tests' hooks ------------------------------------------------------------
# A kill test's site_hook source runs in the bookie's processes; it learns where it
# is to stop (its settings) and where to report from the environment the test gave
# it (hook_env), and reports and stops with stop_here.

HOOK_PREFIX = "BK_TEST_HOOK_"


# A bookie of the direct-write kill tests: one 1 MiB journal segment after another
# and a 2 MiB write cache, so that rolls and flushes come every few hundred adds of
# 1 KiB; no GC round and no timed flush in the way.
KILL_TEST_CONF = {"journalDirectWrites": True, "journalPreAllocSizeMB": 1,
                  "nettyMaxFrameSizeBytes": 512 << 10, "dbStorage_writeCacheMaxSizeMb": 2,
                  "flushIntervalBytes": 1 << 20, "flushInterval": 3_600_000,
                  "gcWaitTime": 3_600_000}


def hook_env(out, **settings) -> dict:
    """The environment a test gives its :func:`site_hook`: the path its hook reports
    to (``out``) and its ``settings`` (site, at, how, ...), which the hook reads
    with :func:`hook_setting`."""
    env = {HOOK_PREFIX + "OUT": out}
    env.update({HOOK_PREFIX + name.upper(): value for name, value in settings.items()})
    return env


def hook_setting(name: str, default: str = "") -> str:
    """In a hook: the setting ``name`` its test gave in :func:`hook_env`."""
    return os.environ.get(HOOK_PREFIX + name.upper(), default)


def hook_report(report: dict) -> None:
    """In a hook: write ``report`` and this process's pid as JSON to the path the
    test gave, atomically (written aside, then renamed over it: the test polls
    for the path and must never read half a report)."""
    out = os.environ[HOOK_PREFIX + "OUT"]
    report["pid"] = os.getpid()
    with open(out + ".tmp", "w") as f:
        json.dump(report, f)
    os.rename(out + ".tmp", out)


def stop_here(report: dict, how: str | None = None) -> None:
    """In a hook: :func:`hook_report`, then stop this process (SIGSTOP, every
    thread; ``how`` "stop", the default) or kill it -9 (any other ``how``);
    ``how`` defaults to the test's ``how`` setting."""
    hook_report(report)
    how = how or hook_setting("how", "stop")
    os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)


def hooked_stop(out, how: str = "stop", what: str = "the worker reaching the hooked line",
                timeout: float = 120.0) -> dict:
    """Wait for the report a :func:`site_hook` writes to ``out`` (JSON with at least
    the ``pid`` of the worker it stops at its line), then until that worker is
    stopped (``how == "stop"``: SIGSTOPped there) or dead (any other ``how``: it
    killed itself -9); the report."""
    wait_until(out.exists, timeout=timeout, what=what)
    stopped = json.loads(out.read_text())
    if how == "stop":
        wait_stopped(stopped["pid"], what="every thread of the worker stopped")
    else:
        wait_until(lambda: process_state(stopped["pid"]) in ("gone", "Z"), timeout=10,
                   what="the worker killed")
    return stopped



def kill_at_hook(bookie, out, writers, what: str, how: str = "stop") -> dict:
    """Run each ``writer(stop)`` on its own thread until the worker a
    :func:`site_hook` stops at its line has stopped there (``how`` "stop"), or
    killed itself there (any other ``how``) (:func:`hooked_stop`), then kill -9
    the bookie; the writers end (``stop`` is set, and a connection broken after
    it ends them). The hook's report."""
    stop = threading.Event()
    threads = [threading.Thread(target=w, args=(stop,)) for w in writers]
    for t in threads:
        t.start()
    try:
        stopped = hooked_stop(out, how, what=what)
        stop.set()
        bookie.kill()                       # SIGKILL while the worker is stopped there
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads), "a writer did not end after the kill"
    return stopped

def start_elsewhere(job, log: list) -> None:
    """Unit tests of direct journal writes: mark a group's write ``job`` as
    submitted elsewhere (as through Linux AIO: the journal cannot run it itself);
    waiting for it appends the job to ``log``, then does the write (``pwritev``
    with RWF_DSYNC) unless it is done already."""
    def waiter(jb, timeout=None):
        log.append(jb)
        if not jb.done.is_set():
            views = [v for _, v in jb.parts]
            os.pwritev(jb.fd, views, jb.offset, os.RWF_DSYNC)
            jb.done.set()
    job.started(waiter)


def acknowledged_entries(answers) -> list[list[int]]:
    """The ``[ledger, entry]`` pairs that a shard worker's answers (``(conn, frame)``
    pairs, as its ``_answer`` takes them) acknowledge: a group acknowledgement is
    ``[rid, runs, errors]`` with runs as (ledger, first, last) triples; other
    frames acknowledge nothing here. For the kill tests' hooks, which report what
    was acknowledged just before the moment they stop the worker at."""
    out = []
    for _conn, frame in answers:
        if type(frame) is list:
            runs = frame[1]
            for i in range(0, len(runs), 3):
                out += [[runs[i], e] for e in range(runs[i + 1], runs[i + 2] + 1)]
    return out


def pump_add_batches(conn: BookieConnection, next_batch, stop: threading.Event, acked: list,
                     key: bytes, window: int = 4) -> None:
    """The kill tests' writer: send ADD_BATCH frames of ``next_batch()`` (each call
    the next list of ``(ledger, entry, lac, digest, payload)``) on ``conn``, at most
    ``window`` unanswered, until ``stop`` and every frame is answered; each
    acknowledged ``(ledger, entry)`` goes to ``acked``. A refusal fails it; a
    connection broken once ``stop`` is set (the kill it waits for) ends it."""
    outstanding = 0
    try:
        while not stop.is_set() or outstanding:
            while outstanding < window and not stop.is_set():
                conn.send_raw(P.encode_add_batch(conn.next_rid(), key, 0, next_batch()))
                outstanding += 1
            r = conn.recv()
            assert r[0] == P.ADD_BATCH and r[2] == EOK and r[4] == [], r[:3]
            runs = r[3]
            for i in range(0, len(runs), 3):
                acked += [(runs[i], e) for e in range(runs[i + 1], runs[i + 2] + 1)]
            outstanding -= 1
    except (OSError, BKError):
        if not stop.is_set():
            raise


def pump_ledger_until_hooked(b, ledger_id: int, stop: threading.Event, acked: list,
                             hooked, key: bytes, payload: bytes, batch: int = 16,
                             window: int = 8) -> None:
    """A kill test's writer thread: batches of ``ledger_id``'s next entries (``lac``
    the entry before, no digest, ``payload`` each) into bookie ``b``'s shard of it
    (:func:`pump_add_batches`), until ``stop``. The connection may break only once
    the hook that stops or kills the bookie has reported (``hooked``, a path, exists)."""
    nxt = [0]

    def next_batch():
        eid = nxt[0]
        nxt[0] = eid + batch
        return [(ledger_id, e, e - 1, b"", payload) for e in range(eid, eid + batch)]
    try:
        with BookieConnection(b.bookie_id, shard=P.shard_of(ledger_id, b.num_shards)) as c:
            pump_add_batches(c, next_batch, stop, acked, key, window=window)
    except (OSError, BKError):
        if not os.path.exists(hooked):
            raise


def kill_while_writing(b, ledger_ids, out, key: bytes, payload: bytes, batch: int = 16,
                       how: str = "stop", what: str = "the worker at the hook"):
    """Write each of ``ledger_ids`` (:func:`pump_ledger_until_hooked`, a thread a
    ledger) into bookie ``b`` until the worker its :func:`site_hook` stops (or
    kills, ``how``) at its line reports to ``out``, then kill -9 the bookie
    (:func:`kill_at_hook`). Returns the hook's report and, per ledger, the
    ``(ledger, entry)`` pairs acknowledged before the kill."""
    acked: list[list] = [[] for _ in ledger_ids]
    writers = [lambda stop, lid=lid, a=a: pump_ledger_until_hooked(b, lid, stop, a, out, key,
                                                                   payload, batch)
               for lid, a in zip(ledger_ids, acked)]
    return kill_at_hook(b, out, writers, what, how=how), acked


def served_after_restart(b, ledger_ids, acked, key: bytes, payload: bytes) -> None:
    """A kill test's check once the bookie is back: every acknowledged entry of each
    ledger (``acked``: one list of ``(ledger, entry)`` a ledger) is served, each with
    ``payload``, with no hole before the last served; and each ledger takes its
    next add."""
    def intact(entry, digest, got):
        assert got == payload, f"entry {entry} served with a bad payload"
    for lid, per in zip(ledger_ids, acked):
        with BookieConnection(b.bookie_id, shard=P.shard_of(lid, b.num_shards)) as conn:
            served = entries_read_back(conn, lid, intact)
        want = {e for _l, e in per}
        assert want <= set(served), sorted(want - set(served))[:10]
        assert served == list(range(len(served))), "a hole in what the bookie serves"
    for lid in ledger_ids:
        with BookieConnection(b.bookie_id, shard=P.shard_of(lid, b.num_shards)) as conn:
            nxt = len(entries_read_back(conn, lid))
            r = conn.call(P.add(conn.next_rid(), lid, nxt, nxt - 1, key, b"", payload))
            assert r[2] == EOK, r


def entries_read_back(conn: BookieConnection, ledger_id: int, check=None) -> list[int]:
    """Every entry id a bookie returns for ``ledger_id`` (READ_RANGE pages, in
    order); ``check(entry, digest, payload)`` asserts on each if given."""
    got: list[int] = []
    first = 0
    while True:
        r = conn.call(P.read_range(conn.next_rid(), ledger_id, first, first + 100_000, 4 << 20))
        assert r[2] == EOK, r[:3]
        flat = r[5]
        if check is not None:
            for i in range(0, len(flat), 4):
                check(flat[i], flat[i + 2], flat[i + 3])
        got += flat[0::4]
        if not flat:
            return got
        first = r[4]

def entries_held(store, bookie_id: str, ledger_id: int, num_shards: int | None = None) -> set[int]:
    """The entry ids of ``ledger_id`` that ``bookie_id`` holds (GET_LIST_OF_ENTRIES on
    the shard that owns the ledger); empty if it has none. ``num_shards`` asks the
    bookie directly, without its registration (which it may not have)."""
    n = num_shards or store.bookie_info(bookie_id)["numShards"]
    with BookieConnection(bookie_id, shard=P.shard_of(ledger_id, n)) as c:
        r = c.call(P.get_list_of_entries(c.next_rid(), ledger_id))
    return set(P.ranges_to_ids(r[4])) if r[2] == EOK and r[4] else set()


def closed_ledger(client: BookKeeper, entries, ensemble: int = 3, write_quorum: int = 2,
                  ack_quorum: int = 2, password: bytes = b"") -> int:
    """Create a ledger, add ``entries`` (a list of bytes) and close it: its id."""
    lh = client.create_ledger(ensemble, write_quorum, ack_quorum, password=password)
    lh.add_entries(entries)
    lh.close()
    return lh.ledger_id


# Variables a developer's shell may set that would point bkshell elsewhere.
_SHELL_ENV = {"BK_METADATA_URI": None, "BK_metadataServiceUri": None, "BK_LEDGER_PASSWORD": None}


def shell(*args, env: dict | None = None):
    """``bkshell ARGS`` run in this process (click's runner): its result, with
    ``exit_code``, ``stdout``, ``stderr`` and ``output``."""
    return CliRunner().invoke(_shell_cli, [str(a) for a in args], env={**_SHELL_ENV, **(env or {})},
                              catch_exceptions=False)


def shell_ok(*args, env: dict | None = None):
    """:func:`shell` that must exit 0."""
    r = shell(*args, env=env)
    assert r.exit_code == 0, f"bkshell {args}: exit {r.exit_code}\n{r.stdout}\n{r.stderr}"
    return r


def shell_json(*args, env: dict | None = None):
    """:func:`shell_ok` of a ``--json`` command: its output, parsed (quick enough to
    poll in a wait, where :func:`bkshell_ok` would start a Python process a try)."""
    return json.loads(shell_ok(*args, env=env).stdout)


def shell_err(*args, code: int | None = None, env: dict | None = None) -> str:
    """:func:`shell` that must fail (with exit ``code`` if given) without a traceback:
    its stderr."""
    r = shell(*args, env=env)
    if code is None:
        assert r.exit_code != 0, f"bkshell {args} should fail:\n{r.stdout}"
    else:
        assert r.exit_code == code, f"bkshell {args}: exit {r.exit_code}\n{r.stdout}\n{r.stderr}"
    assert "Traceback" not in r.stderr
    return r.stderr


def bkshell(uri: str, *args, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run ``bkshell --metadata uri ARGS`` as a process, as an operator would."""
    return subprocess.run([sys.executable, "-m", "bk.cli.shell", "--metadata", uri, *args],
                          capture_output=True, text=True, timeout=timeout)


def bkshell_ok(uri: str, *args, timeout: float = 120.0):
    """``bkshell`` that must succeed: its output, parsed when ``--json`` is among ``args``."""
    r = bkshell(uri, *args, timeout=timeout)
    assert r.returncode == 0, f"bkshell {' '.join(args)} failed ({r.returncode}): {r.stderr}"
    return json.loads(r.stdout) if "--json" in args else r.stdout


def http_get(port: int, path: str, method: str = "GET", host: str = "127.0.0.1",
             timeout: float = 10.0):
    """``(status, body text, content type)`` of one HTTP request; ``(None, "", None)``
    when nothing answers on the port."""
    req = urllib.request.Request(f"http://{host}:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(), r.headers.get("Content-Type")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers.get("Content-Type")
    except OSError:
        return None, "", None



@contextlib.contextmanager
def bookie_localcluster(directory: str, bookies: int = 2):
    """Run ``bookie localcluster`` (one shard a bookie, free ports, HTTP, no smoke
    test) as a process until it says it is up: yields ``(process, lines printed)``.
    Ctrl-C (SIGINT, a KeyboardInterrupt there even where the caller ignores it)
    stops it; on exit it is sent one if it still runs, and killed if that is not enough."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BK_")}
    # `python -m bk.cli.bookie`, with Ctrl-C raising KeyboardInterrupt even when this
    # process ignores SIGINT (a background job does; the child would inherit that).
    # Set in the child's Python, not by a preexec_fn: forking a process with threads
    # (gRPC's, xdist's) and running Python code before exec is not safe.
    run = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "sys.argv[0] = 'bookie'; runpy.run_module('bk.cli.bookie', run_name='__main__')")
    p = subprocess.Popen([sys.executable, "-c", run, "localcluster", "--dir", directory,
                          "--bookies", str(bookies), "--shards", "1", "--no-smoke",
                          "--base-port", "0", "--http-port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out: list[str] = []
    try:
        for line in p.stdout:
            out.append(line)
            if "Press Ctrl-C" in line:
                break
        yield p, out
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(30)
        p.stdout.close()


def require_java() -> None:
    """Fail (not skip) when Spark cannot start: Java 17 is part of the test machine,
    and a suite that silently skips Spark would pass with Spark broken."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise RuntimeError("the Spark tests need Java 17: put java on PATH or set JAVA_HOME")


# JVM options for the short-lived Spark JVMs of tests: the quick (C1) compiler only
# and one GC thread. A JVM started for a few small jobs spends much of its CPU in
# the optimising compiler and parallel GC; with these it used about 40% less CPU
# (26 -> 15 s for a session and a few jobs, measured on a 2-core machine). And no
# bytecode verification of the classes loaded from jars (Spark's own, trusted):
# a session and two small jobs went from ~17.5 to ~15 CPU-s (2 alternating pairs).
SPARK_TEST_JAVA_OPTIONS = ("-XX:TieredStopAtLevel=1 -XX:+UseSerialGC "
                           "-XX:+UnlockDiagnosticVMOptions -XX:-BytecodeVerificationRemote")


def local_spark(app_name: str, **conf):
    """A ``local[2]`` SparkSession for tests (the caller registers the ``bookkeeper``
    source with ``bk.spark.register``: bk.spark imports pyspark, which bk.testing
    does not need).

    The driver binds to loopback: a JVM that ran a namespace-host test earlier in
    the same process keeps that test's (deleted) address as the driver's default.
    Python workers get 120 s (not 15) to connect back, for a loaded machine; the
    JVM runs with :data:`SPARK_TEST_JAVA_OPTIONS`."""
    require_java()
    from pyspark.sql import SparkSession      # optional dependency (the spark extra)
    # Python workers are children of this process: they must import this bk too.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    b = (SparkSession.builder.master("local[2]").appName(app_name)
         .config("spark.driver.host", "127.0.0.1")
         .config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "2")
         .config("spark.python.authenticate.socketTimeout", "120s")
         .config("spark.driver.extraJavaOptions", SPARK_TEST_JAVA_OPTIONS))
    for k, v in conf.items():
        b = b.config(k, v)
    return b.getOrCreate()


def spark_driver_jvm() -> psutil.Process | None:
    """This process's Spark JVM (PySpark's gateway, a child running SparkSubmit),
    or None before its first session. It outlives stopped sessions: the next one
    reuses it. Tests check with it that it was started before their clusters (the
    ``_local_spark`` fixture, tests/integration/conftest.py, says why)."""
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if "org.apache.spark.deploy.SparkSubmit" in child.cmdline():
                return child
    return None


def resident_pages(path: str, lo: int = 0, hi: int | None = None) -> int:
    """How many pages of the file ``path`` in [lo, hi) (hi: its end) are in the
    page cache: ``mincore`` on a mapping made for the question (mapping a file
    touches none of its pages), as util-linux's ``fincore`` does, for a range."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        hi = os.fstat(fd).st_size if hi is None else hi
        lo -= lo % page
        n = (hi - lo + page - 1) // page
        if n <= 0:
            return 0
        addr = libc.mmap(None, n * page, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vec = ctypes.create_string_buffer(n)
            if libc.mincore(addr, n * page, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, n * page)
    finally:
        os.close(fd)
