"""Run a real etcd server and N real bookie processes on loopback: behind
``bookie localcluster``, the benchmarks, and (through ``bk.testing``) the tests.

    from bk.localcluster import LocalCluster
    with LocalCluster(num_bookies=3) as cluster:
        client = bk.BookKeeper(cluster.metadata_uri)
        cluster.bookies[0].kill()          # kill -9 the whole bookie (arbiter + shards)
        cluster.bookies[0].start()         # same directories: replays its journals

Every bookie is a ``bookie start`` child process in its own process group, with
its own directory holding its conf file, data and log. Nothing outlives
:meth:`LocalCluster.stop` (also called on ``with`` exit and at interpreter exit).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref

from bk.config import SETTINGS
from bk.errors import BKError
from bk.meta.etcd_server import EtcdServer
from bk.meta.store import MetadataStore
from bk.util import free_port

_live: "weakref.WeakSet[BookieProcess]" = weakref.WeakSet()


def _child_env() -> dict:
    # BK_<key> variables override conf files; a developer's shell must not leak into tests.
    return {k: v for k, v in os.environ.items() if not (k.startswith("BK_") and k[3:] in SETTINGS)}


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


class BookieProcess:
    """One bookie run as a child process (``bookie start --conf <dir>/bk_server.conf``).

    ``address``: the address it binds and advertises; ``command_prefix``: argv put
    before the command (``bk.netns`` runs it in a host's network namespace)."""

    def __init__(self, metadata_uri: str, directory: str, port: int, num_shards: int = 2,
                 conf_overrides: dict | None = None, store=None, address: str = "127.0.0.1",
                 command_prefix=()):
        self.metadata_uri = metadata_uri
        self.dir = os.path.abspath(directory)
        self.port = port
        self.address = address
        self.command_prefix = list(command_prefix)
        self.bookie_id = f"{address}:{port}"
        self.num_shards = num_shards
        self.conf_overrides = dict(conf_overrides or {})
        self.conf_file = os.path.join(self.dir, "bk_server.conf")
        self.log_file = os.path.join(self.dir, "bookie.log")
        self.store = store
        self.proc: subprocess.Popen | None = None
        self.last_exit: int | None = None
        os.makedirs(self.dir, exist_ok=True)
        self.write_conf()

    def write_conf(self, **extra) -> None:
        """(Re)write the conf file; ``extra`` settings are kept for later starts."""
        self.conf_overrides.update(extra)
        values = {
            "bookiePort": self.port, "advertisedAddress": self.address,
            "metadataServiceUri": self.metadata_uri, "numShards": self.num_shards,
            "journalDirectories": os.path.join(self.dir, "journal"),
            "ledgerDirectories": os.path.join(self.dir, "ledgers"),
            "pidFile": os.path.join(self.dir, "bookie.pid"),
        }
        values.update(self.conf_overrides)
        with open(self.conf_file, "w") as f:
            for k, v in values.items():
                if isinstance(v, (list, tuple)):
                    v = ",".join(map(str, v))
                elif isinstance(v, bool):
                    v = "true" if v else "false"
                f.write(f"{k}={v}\n")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 60.0, wait: bool = True) -> "BookieProcess":
        if self.alive:
            raise BKError(f"bookie {self.bookie_id} is already running")
        log = open(self.log_file, "ab")
        self.proc = subprocess.Popen(
            [*self.command_prefix, sys.executable, "-m", "bk.cli.bookie", "start",
             "--conf", self.conf_file],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=_child_env())
        log.close()
        _live.add(self)
        if wait:
            self.wait_registered(timeout)
        return self

    def wait_registered(self, timeout: float = 60.0) -> None:
        """Block until this bookie is registered in etcd (it then serves)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                self.last_exit = self.proc.returncode
                raise BKError(f"bookie {self.bookie_id} exited with code {self.last_exit} "
                              f"while starting:\n{_tail(self.log_file)}")
            info = self.store.bookie_info(self.bookie_id) if self.store else None
            if info is not None and info.get("pid") == self.pid:
                return
            time.sleep(0.05)
        raise BKError(f"bookie {self.bookie_id} did not register within {timeout}s:\n"
                      f"{_tail(self.log_file)}")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful drain) and wait; returns the exit code."""
        if not self.alive:
            return self.last_exit
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.last_exit = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        return self.last_exit

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole bookie (arbiter and shard workers), like a machine crash."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            self.last_exit = self.proc.wait(30)
            _wait_group_gone(self.proc.pid)

    def restart(self, timeout: float = 60.0) -> "BookieProcess":
        self.stop()
        return self.start(timeout)

    def worker_pids(self) -> list[int]:
        """Pids of the shard workers (children of the arbiter)."""
        if not self.alive:
            return []
        import psutil
        try:
            return sorted(c.pid for c in psutil.Process(self.proc.pid).children())
        except psutil.NoSuchProcess:
            return []

    @property
    def metrics_url(self) -> str | None:
        """http://.../metrics of this bookie when it serves HTTP (httpServerEnabled)."""
        v = self.conf_overrides.get("httpServerEnabled")
        if v not in (True, "true") or not self.conf_overrides.get("httpServerPort"):
            return None
        return f"http://127.0.0.1:{self.conf_overrides['httpServerPort']}/metrics"

    def __repr__(self):
        return f"BookieProcess({self.bookie_id}, pid={self.pid}, alive={self.alive})"


def _wait_group_gone(pgid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)


def _port_in_conf(path: str, key: str = "bookiePort") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + "="):
                    return int(line.split("=", 1)[1])
    except (OSError, ValueError):
        pass
    return None


ETCD_QUOTA_BYTES = 2 << 30        # etcd's own default backend quota, made explicit


def etcd_flags(quota_bytes: int = ETCD_QUOTA_BYTES) -> list[str]:
    """etcd flags for a cluster bk runs: a backend quota (etcd raises NOSPACE there
    instead of filling the disk), periodic auto-compaction keeping an hour of
    history as a backstop to bk's own compactor (metadataCompactionIntervalSeconds),
    and watch progress notifications every minute, so a bookie's GC can remember
    how far it has seen deletions although none happened."""
    return ["--quota-backend-bytes", str(int(quota_bytes)),
            "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1h",
            "--experimental-watch-progress-notify-interval", "1m"]


class LocalCluster:
    """An etcd server plus N bookie processes on loopback, each in its own directory.

    Bookies run with the registry's (production) defaults plus ``conf_overrides``;
    ``bk.testing.LocalCluster`` adds settings that keep tests quick."""

    def __init__(self, num_bookies: int = 3, base_dir: str | None = None, num_shards: int = 2,
                 base_port: int = 0, etcd_port: int = 0, conf_overrides: dict | None = None,
                 prefix: str = "ledgers", http_port: int | None = None,
                 etcd_quota_bytes: int = ETCD_QUOTA_BYTES):
        self._own_dir = base_dir is None
        self.base_dir = os.path.abspath(base_dir or tempfile.mkdtemp(prefix="bk-cluster-"))
        self.num_bookies = num_bookies
        self.num_shards = num_shards
        self.base_port = base_port
        self.etcd_port = etcd_port
        self.etcd_quota_bytes = int(etcd_quota_bytes)
        self.conf_overrides = dict(conf_overrides or {})
        self.prefix = prefix
        # None: no HTTP; else bookie i serves HTTP on http_port + i (0: free ports).
        self.http_port = http_port
        self.etcd: EtcdServer | None = None
        self.bookies: list[BookieProcess] = []
        self._store = None
        self._next = 0

    @property
    def metadata_uri(self) -> str:
        return self.etcd.uri(self.prefix)

    @property
    def store(self):
        if self._store is None:
            self._store = MetadataStore(self.metadata_uri)
        return self._store

    def start(self) -> "LocalCluster":
        self.start_etcd()
        self.start_bookies()
        return self

    def start_etcd(self) -> None:
        os.makedirs(self.base_dir, exist_ok=True)
        self.etcd = EtcdServer(os.path.join(self.base_dir, "etcd"), client_port=self.etcd_port,
                               extra_args=etcd_flags(self.etcd_quota_bytes))
        self.etcd.start()
        if not self.store.is_formatted():    # a restarted cluster keeps its identity
            self.store.format()

    def start_bookies(self) -> None:
        new = [self._new_bookie() for _ in range(self.num_bookies - len(self.bookies))]
        for b in new:
            b.start(wait=False)
        for b in new:
            b.wait_registered()

    def _new_bookie(self, **overrides) -> BookieProcess:
        i = self._next
        self._next += 1
        directory = os.path.join(self.base_dir, f"bookie-{i}")
        # A bookie restarted on its old directory keeps its port, hence its id and cookie.
        port = _port_in_conf(os.path.join(directory, "bk_server.conf"))
        if port is None:
            port = self.base_port + i if self.base_port else free_port()
        conf = dict(self.conf_overrides)
        if self.http_port is not None:
            http = _port_in_conf(os.path.join(directory, "bk_server.conf"), "httpServerPort")
            if http is None:
                http = self.http_port + i if self.http_port else free_port()
            conf.update(httpServerEnabled=True, httpServerPort=http)
        conf.update(overrides)
        b = BookieProcess(self.metadata_uri, directory, port,
                          self.num_shards, conf, store=self.store)
        self.bookies.append(b)
        return b

    def add_bookie(self, **overrides) -> BookieProcess:
        """Start one more bookie (overrides: configuration keys for it alone)."""
        return self._new_bookie(**overrides).start()

    def bookie(self, bookie_id: str) -> BookieProcess:
        for b in self.bookies:
            if b.bookie_id == bookie_id:
                return b
        raise KeyError(bookie_id)

    def stop(self) -> None:
        threads = [threading.Thread(target=b.stop) for b in self.bookies if b.alive]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for b in self.bookies:
            b.kill()
        if self._store is not None:
            try:
                self._store.close()
            except Exception:
                pass
            self._store = None
        if self.etcd is not None:
            self.etcd.stop()
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@atexit.register
def _kill_leftovers() -> None:
    for b in list(_live):
        if b.alive:
            b.kill()
