"""Run a real etcd server and N real bookie processes on loopback: behind
``bookie localcluster``, the benchmarks, and (through ``bk.testing``) the tests.

    from bk.localcluster import LocalCluster
    with LocalCluster(num_bookies=3) as cluster:
        client = bk.BookKeeper(cluster.metadata_uri)
        cluster.bookies[0].kill()          # kill -9 the whole bookie (arbiter + shards)
        cluster.bookies[0].start()         # same directories: replays its journals

Every bookie is a ``bookie start`` child process in its own process group, with
its own directory holding its conf file, data and log. Nothing outlives
:meth:`LocalCluster.stop` (also called on ``with`` exit and at interpreter exit),
nor the process that started the cluster: a bookie is started with
``--stop-with <that pid>`` and stops as on SIGTERM (draining, journals synced)
once that process has exited, however it ended (kill -9 included), and etcd dies
with it (``PR_SET_PDEATHSIG``, bk.meta.etcd_server). Bookies started any other way
(``bookie start`` by an operator or systemd) are not affected.

``LocalCluster(secure=True)`` (``bookie localcluster --secure``) makes a CA,
certificates, a token key, tokens and etcd passwords under
``<base_dir>/security``; etcd serves TLS, requires client certificates and has
authentication on, with a user whose role reaches only the cluster's prefix;
bookies require TLS and tokens. :meth:`LocalCluster.client_settings` is what
a client needs (also written to ``<base_dir>/client.conf``).
"""

from __future__ import annotations

import atexit
import os
import secrets
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
from bk.exitcodes import EXIT_BIND
from bk.meta.etcd_server import EtcdServer, colocated_env, enable_auth
from bk.meta.store import MetadataStore
from bk.security import auth, pki
from bk.security.etcd import EtcdCredentials
from bk.security.tokens import create_token
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
        # settings (bookiePort, httpServerPort) whose port free_port() picked: another
        # may be picked if someone else takes it before the bookie binds it
        self.picked_ports: set = set()
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
        # stop with the process holding this BookieProcess, whoever forks the bookie
        self.proc = self._spawn(["start", "--conf", self.conf_file,
                                 "--stop-with", str(os.getpid())])
        _live.add(self)
        if wait:
            self.wait_registered(timeout)
        return self

    def _spawn(self, args: list):
        """``bookie ARGS`` as a child in a session of its own, its output appended to
        the log: its Popen."""
        with open(self.log_file, "ab") as log:
            return subprocess.Popen(
                [*self.command_prefix, sys.executable, "-m", "bk.cli.bookie", *args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env=_child_env())

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

    def repick_ports(self) -> bool:
        """After an exit with EXIT_BIND: new free ports for the picked ports it failed
        to bind, so that the next start may succeed; False if it has none to change.
        The bookie port changes (hence the bookie id) only while the bookie has no
        cookie, which the bookie creates only once it holds its port."""
        why = _tail(self.log_file, 3)
        if "cannot bind httpServerPort" in why and "httpServerPort" in self.picked_ports:
            self.write_conf(httpServerPort=free_port())
            return True
        if ("cannot bind" in why and "bookiePort" in self.picked_ports
                and self.store is not None and self.store.read_cookie(self.bookie_id)[0] is None):
            self.port = free_port()
            self.bookie_id = f"{self.address}:{self.port}"
            self.write_conf()
            return True
        return False

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
        scheme = "https" if self.conf_overrides.get("httpServerTlsEnable") in (True, "true") \
            else "http"
        return f"{scheme}://127.0.0.1:{self.conf_overrides['httpServerPort']}/metrics"

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

    bookie_class = BookieProcess        # what runs each bookie

    def __init__(self, num_bookies: int = 3, base_dir: str | None = None, num_shards: int = 2,
                 base_port: int = 0, etcd_port: int = 0, conf_overrides: dict | None = None,
                 prefix: str = "ledgers", http_port: int | None = None,
                 etcd_quota_bytes: int = ETCD_QUOTA_BYTES, secure: bool = False):
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
        self.secure = secure
        self.security_dir = os.path.join(self.base_dir, "security")
        self._etcd_credentials = None

    @property
    def metadata_uri(self) -> str:
        return self.etcd.uri(self.prefix)

    @property
    def store(self):
        if self._store is None:
            self._store = MetadataStore(self.metadata_uri, credentials=self._etcd_credentials)
        return self._store

    # --- secure mode ---------------------------------------------------------------
    def _sec(self, name: str) -> str:
        return os.path.join(self.security_dir, name)

    def _make_security(self) -> None:
        """The CA, certificates, token key, tokens and etcd passwords (kept, so that a
        restarted cluster finds the same ones)."""
        if os.path.exists(self._sec("ca.pem")):
            return
        ca = pki.make_ca(self.security_dir)
        hosts = self._certificate_hosts()
        ca.issue("etcd", hosts, common_name="etcd")
        ca.issue("bookie", hosts, common_name="bookie")
        ca.issue("client", hosts, common_name="client")
        auth.write_secret_key(self._sec("token.key"), auth.create_secret_key())
        key = auth.read_secret_key(self._sec("token.key"))
        for role in ("bookie", "client", "admin", "reader"):
            _write_secret(self._sec(f"{role}.token"), create_token(key, role))
        for name in ("etcd-root", "etcd-bk", "etcd-reader"):
            _write_secret(self._sec(f"{name}.password"), secrets.token_urlsafe(24))

    def _certificate_hosts(self) -> list:
        """The names etcd's and the bookies' certificates are valid for."""
        return ["127.0.0.1", "localhost"]

    def _security_settings(self, who: str) -> dict:
        """Settings of a bookie (``who="bookie"``) or a client (``client``, ``admin``
        or the read-only ``reader``) in secure mode."""
        cert = "bookie" if who == "bookie" else "client"
        etcd_user = "reader" if who == "reader" else "bk"
        s = {"tlsEnabled": True, "tlsTrustStore": self._sec("ca.pem"),
             "authTokenFile": self._sec(f"{who}.token"),
             "etcdTrustStore": self._sec("ca.pem"),
             "etcdCertificatePath": self._sec(f"{cert}.crt"),
             "etcdKeyStore": self._sec(f"{cert}.key"),
             "etcdUser": etcd_user, "etcdPasswordFile": self._sec(f"etcd-{etcd_user}.password")}
        if who == "bookie":
            s.update(tlsCertificatePath=self._sec("bookie.crt"),
                     tlsKeyStore=self._sec("bookie.key"), authProvider="token",
                     tokenSecretKeyFile=self._sec("token.key"), superUserRoles="bookie,admin",
                     clientRoles="client", readOnlyRoles="reader")
        return s

    def client_settings(self, role: str = "client") -> dict:
        """What a client of this cluster needs besides the URI (secure mode: TLS, the
        token of ``role`` (client, admin or the read-only reader) and etcd credentials,
        all as file paths; otherwise nothing)."""
        return self._security_settings(role) if self.secure else {}

    def client_conf(self) -> str:
        """A client.conf for this cluster."""
        lines = [f"metadataServiceUri={self.metadata_uri}"]
        for k, v in self.client_settings().items():
            lines.append(f"{k}={'true' if v is True else v}")
        return "\n".join(lines) + "\n"

    def start(self) -> "LocalCluster":
        self.start_etcd()
        self.start_bookies()
        return self

    def start_etcd(self) -> None:
        os.makedirs(self.base_dir, exist_ok=True)
        tls = None
        if self.secure:
            self._make_security()
            tls_only = EtcdCredentials.from_conf(_Settings(
                etcdTrustStore=self._sec("ca.pem"), etcdCertificatePath=self._sec("client.crt"),
                etcdKeyStore=self._sec("client.key")))
            tls = {"cert": self._sec("etcd.crt"), "key": self._sec("etcd.key"),
                   "ca": self._sec("ca.pem"), "client_cert_auth": True,
                   "credentials": tls_only}
        self.etcd = self._make_etcd(tls)
        self.etcd.start()
        if self.secure:
            marker = self._sec("etcd-auth-enabled")
            if not os.path.exists(marker):
                with open(self._sec("etcd-root.password")) as f:
                    root = f.read().strip()
                users = {}
                for name in ("bk", "reader"):
                    with open(self._sec(f"etcd-{name}.password")) as f:
                        users[name] = (f.read().strip(), name == "reader")
                enable_auth(self.etcd.endpoint, tls["credentials"], root, users,
                            "/" + self.prefix.strip("/") + "/")
                open(marker, "w").close()
            self._etcd_credentials = EtcdCredentials.from_conf(
                _Settings(**{k: v for k, v in self.client_settings().items()
                             if k.startswith("etcd")}))
            with open(os.path.join(self.base_dir, "client.conf"), "w") as f:
                f.write(self.client_conf())
        if not self.store.is_formatted():    # a restarted cluster keeps its identity
            self.store.format()

    def _make_etcd(self, tls: dict | None) -> EtcdServer:
        return EtcdServer(os.path.join(self.base_dir, "etcd"), client_port=self.etcd_port,
                          extra_args=etcd_flags(self.etcd_quota_bytes), tls=tls,
                          env=colocated_env())

    def start_bookies(self) -> None:
        new = [self._new_bookie() for _ in range(self.num_bookies - len(self.bookies))]
        for b in new:
            b.start(wait=False)
        for b in new:
            self._wait_started(b)

    @staticmethod
    def _wait_started(b: BookieProcess, attempts: int = 3) -> None:
        """Wait until a new bookie registers; started again on other ports while it
        exits because a port free_port() picked for it was taken meanwhile (by any
        process on the machine: a port is free only until someone binds it)."""
        for attempt in range(attempts):
            try:
                return b.wait_registered()
            except BKError:
                if attempt + 1 == attempts or b.last_exit != EXIT_BIND or not b.repick_ports():
                    raise
            b.start(wait=False)

    def _new_bookie(self, **overrides) -> BookieProcess:
        i = self._next
        self._next += 1
        directory = os.path.join(self.base_dir, f"bookie-{i}")
        # A bookie restarted on its old directory keeps its port, hence its id and cookie.
        port = _port_in_conf(os.path.join(directory, "bk_server.conf"))
        picked = set()
        if port is None:
            if self.base_port:
                port = self.base_port + i
            else:
                port = free_port()
                picked.add("bookiePort")
        conf = self._security_settings("bookie") if self.secure else {}
        conf.update(self.conf_overrides)
        if self.http_port is not None:
            http = _port_in_conf(os.path.join(directory, "bk_server.conf"), "httpServerPort")
            if http is None:
                if self.http_port:
                    http = self.http_port + i
                else:
                    http = free_port()
                    picked.add("httpServerPort")
            conf.update(httpServerEnabled=True, httpServerPort=http)
            if self.secure:
                conf.setdefault("httpServerTlsEnable", True)
        conf.update(overrides)
        b = self.bookie_class(self.metadata_uri, directory, port,
                              self.num_shards, conf, store=self.store)
        b.picked_ports = picked - set(overrides)
        self.bookies.append(b)
        return b

    def add_bookie(self, **overrides) -> BookieProcess:
        """Start one more bookie (overrides: configuration keys for it alone)."""
        b = self._new_bookie(**overrides).start(wait=False)
        self._wait_started(b)
        return b

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


def _write_secret(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")


class _Settings(dict):
    """A mapping of some settings, the rest empty (for EtcdCredentials.from_conf)."""

    def __missing__(self, key):
        return ""

    def __getattr__(self, key):
        return self[key]


@atexit.register
def _kill_leftovers() -> None:
    for b in list(_live):
        if b.alive:
            b.kill()
