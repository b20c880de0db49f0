"""Hosts made of Linux network namespaces, and the network faults between them:
the test harness behind the partition tests and ``scripts/soak.py --hosts``.

    from bk.netns import Network, HostCluster
    with Network() as net:
        hosts = [net.add_host(f"b{i}") for i in range(4)]
        meta = net.add_host("meta")
        with HostCluster(net, base_dir, hosts, meta) as cluster:
            client = net.add_host("client").python()     # a Python process on that host
            client.exec(f"import bk; c = bk.BookKeeper({cluster.metadata_uri!r})")
            net.partition(client_host, hosts[0])          # packets vanish both ways
            net.heal()

Theory of operation
-------------------
A :class:`Network` is a Linux bridge in the root namespace with one address of
a private /24 (10.77.X.0/24, X picked from the pid and skipped while a route
already covers it), so the process that made it (the test, "the observer")
reaches every host. A :class:`Host` is a network namespace joined to the
bridge by a veth pair, with address 10.77.X.<n>; its processes are started
through ``ip netns exec``, which execs the command, so the pid we get is the
process's own and it can be signalled like any child. Each namespace has its
own port space, so every bookie listens on 3181 and etcd on 2379.

Faults are routes and link states, never process signals:

* ``partition(a, b)`` (silent): in each of the two namespaces the other's
  address is routed into an ``ifb`` device, which drops every packet it is
  given (an ifb forwards only what a tc redirect hands it). Nothing answers,
  no RST, no ICMP, no local error: connects and established connections time
  out, as in a real partition. (A ``blackhole`` route would not do: the sender
  gets EINVAL at once. ``tc netem loss 100%`` would, but not every kernel has
  netem.)
* ``partition(a, b, reject=True)``: an ``unreachable`` route, so connects
  fail at once with EHOSTUNREACH (a firewall that rejects).
* ``partition(a, b, oneway=True)``: only a's packets to b vanish.
* ``isolate(h)``: the host's bridge port goes down: it vanishes from every
  other host (and the observer) without a FIN, as a machine whose link died.
* ``heal()`` removes every fault (or ``heal(a, b)`` / ``heal(h)`` one of them).

Everything is removed by :meth:`Network.close` (also on ``with`` exit, at
interpreter exit, and for networks of dead processes by :func:`sweep_stale`):
the processes started in its hosts are killed, the namespaces and the bridge
deleted. Names carry the creating pid (``bkh-<pid>-...``), so parallel runs
never clash.

Needs root and iproute2; :func:`unavailable` says why when they are missing.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref

import psutil

from bk.errors import BKError
from bk.localcluster import BookieProcess, LocalCluster, _child_env
from bk.meta.etcd_server import EtcdCluster, EtcdServer, find_etcd_binary

NS_PREFIX = "bkh-"
BOOKIE_PORT = 3181
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380

_networks: "weakref.WeakSet[Network]" = weakref.WeakSet()
_counter = 0
_counter_lock = threading.Lock()
_unavailable: str | None = None
_checked = False


class NetnsError(BKError):
    """A namespace, link or route of the harness could not be made or removed."""


class RemoteError(BKError):
    """Code run by :class:`RemotePython` raised; ``type`` is the remote exception's
    class name, the message its text."""

    def __init__(self, type_name: str, message: str):
        super().__init__(f"{type_name}: {message}")
        self.type = type_name


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


def unavailable() -> str | None:
    """Why hosts cannot be made here (not root, no ``ip``, no namespaces), or None."""
    global _unavailable, _checked
    if _checked:
        return _unavailable
    _checked = True
    if os.geteuid() != 0:
        _unavailable = "network namespaces need root"
    elif shutil.which("ip") is None:
        _unavailable = "iproute2 (the ip command) is not installed"
    else:
        probe = f"{NS_PREFIX}{os.getpid()}-probe"
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            _unavailable = f"cannot create a network namespace: {r.stderr.strip()}"
        else:
            r = _ip("-n", probe, "link", "add", "drop0", "type", "ifb", check=False)
            if r.returncode != 0:
                _unavailable = f"the kernel has no ifb devices: {r.stderr.strip()}"
            _ip("netns", "del", probe, check=False)
    return _unavailable


def sweep_stale() -> list[str]:
    """Delete the namespaces and bridges of networks whose creating process is gone
    (a test run killed before it could clean up). Returns what was deleted."""
    gone = []
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(NS_PREFIX):
            continue
        pid = name[len(NS_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            _kill_ns_pids(name)
            _ip("netns", "del", name, check=False)
            gone.append(name)
    r = _ip("-o", "link", "show", check=False)
    for line in r.stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        if name.startswith("bkh") and "n" in name[3:] and "v" not in name[3:]:
            # a network's bridge (bkh<pid>n<k>) or its observer's drop device (...d)
            pid = name[3:].split("n", 1)[0]
            if pid.isdigit() and not psutil.pid_exists(int(pid)):
                _ip("link", "del", name, check=False)
                gone.append(name)
    return gone


def _kill_ns_pids(ns: str) -> None:
    """SIGKILL what runs in namespace ``ns`` (ours: every process in it was started
    by this harness), so that deleting it leaves nothing behind."""
    r = _ip("netns", "pids", ns, check=False)
    for p in r.stdout.split():
        try:
            os.kill(int(p), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _pick_subnet(seed: int) -> ipaddress.IPv4Network:
    used = _ip("-4", "route", "show", "table", "all", check=False).stdout
    for i in range(250):
        x = (seed + i * 37) % 250 + 1
        net = ipaddress.IPv4Network(f"10.77.{x}.0/24")
        if f"10.77.{x}." not in used:
            return net
    raise NetnsError("no free 10.77.X.0/24 subnet for test hosts")


class Host:
    """One network namespace on the bridge: ``name``, ``ns``, ``address``.
    (``Network.observer`` is the root namespace's end of the bridge: ``ns`` None.)"""

    def __init__(self, net: "Network", name: str, index: int, observer: bool = False):
        self.net = net
        self.name = name
        self.index = index
        self.ns = None if observer else f"{net.ns_prefix}{name}"
        self.address = str(net.subnet.network_address + index)
        self.port_link = f"{net.link_prefix}v{index}"    # the root side of its veth
        self.drop_link = f"{net.link_prefix}d" if observer else "drop0"
        self.procs: list[subprocess.Popen] = []

    def ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """``ip`` run in this host's namespace."""
        return _ip(*args, check=check) if self.ns is None else \
            _ip("-n", self.ns, *args, check=check)

    @property
    def exec_prefix(self) -> list[str]:
        """argv prefix that runs a command in this host's namespace."""
        return ["ip", "netns", "exec", self.ns]

    def _create(self) -> None:
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.port_link, "type", "veth", "peer", "name", "eth0",
            "netns", self.ns)
        _ip("link", "set", self.port_link, "master", self.net.bridge, "up")
        _ip("-n", self.ns, "addr", "add", f"{self.address}/{self.net.subnet.prefixlen}",
            "dev", "eth0")
        _ip("-n", self.ns, "link", "set", "lo", "up")
        _ip("-n", self.ns, "link", "set", "eth0", "up")
        # the device silent partitions route into: an ifb without a redirect
        # drops everything it is given
        _ip("-n", self.ns, "link", "add", "drop0", "type", "ifb")
        _ip("-n", self.ns, "link", "set", "drop0", "up")

    def popen(self, args, **kw) -> subprocess.Popen:
        """Start ``args`` in this host (own session; killed by Network.close)."""
        kw.setdefault("start_new_session", True)
        kw.setdefault("env", _child_env())
        p = subprocess.Popen([*self.exec_prefix, *args], **kw)
        self.procs.append(p)
        return p

    def run(self, args, timeout: float = 60.0, **kw) -> subprocess.CompletedProcess:
        """Run ``args`` in this host to completion (output captured as text)."""
        kw.setdefault("env", _child_env())
        return subprocess.run([*self.exec_prefix, *args], capture_output=True, text=True,
                              timeout=timeout, **kw)

    def python(self) -> "RemotePython":
        """A Python process in this host that runs the code it is sent (a client
        "on another machine"); closed with the network."""
        return RemotePython(self)

    def __repr__(self):
        return f"<Host {self.name} {self.address}>"


class Network:
    """A bridge and the hosts on it, with faults between them (see the module doc)."""

    def __init__(self):
        global _counter
        reason = unavailable()
        if reason:
            raise NetnsError(f"cannot make test hosts: {reason}")
        sweep_stale()
        with _counter_lock:
            _counter += 1
            k = _counter
        pid = os.getpid()
        self.ns_prefix = f"{NS_PREFIX}{pid}-{k}-"
        self.link_prefix = f"bkh{pid}n{k}"
        if len(self.link_prefix) + 3 > 15:            # IFNAMSIZ
            self.link_prefix = f"bkh{pid % 10 ** 6}n{k % 10}"
        self.bridge = self.link_prefix
        self.subnet = _pick_subnet(pid + k)
        self.observer_address = str(self.subnet.network_address + 254)
        # this process's end of the bridge, as a host faults can name
        self.observer = Host(self, "observer", 254, observer=True)
        self.hosts: dict[str, Host] = {"observer": self.observer}
        self._faults: dict[tuple, str] = {}     # (kind, a, b) -> what was done
        self._lock = threading.Lock()
        self._closed = False
        self._pythons: list[RemotePython] = []
        _networks.add(self)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.observer_address}/{self.subnet.prefixlen}", "dev",
                self.bridge)
            _ip("link", "set", self.bridge, "up")
            _ip("link", "add", self.observer.drop_link, "type", "ifb")
            _ip("link", "set", self.observer.drop_link, "up")
        except NetnsError:
            self.close()
            raise

    def add_host(self, name: str) -> Host:
        """A new host (namespace) on the bridge, with the next address."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        index = len(self.hosts)
        if index >= 254:
            raise NetnsError("a network holds at most 253 hosts")
        h = Host(self, name, index)
        self.hosts[name] = h
        h._create()
        return h

    def host(self, name_or_host) -> Host:
        return name_or_host if isinstance(name_or_host, Host) else self.hosts[name_or_host]

    # --- faults ----------------------------------------------------------------
    def _route(self, a: Host, b: Host, kind: str) -> None:
        if kind == "silent":
            a.ip("route", "replace", f"{b.address}/32", "dev", a.drop_link)
        else:
            a.ip("route", "replace", "unreachable", f"{b.address}/32")
        self._faults[("route", a.name, b.name)] = kind

    def partition(self, a, b, reject: bool = False, oneway: bool = False) -> None:
        """Cut ``a`` from ``b``: silently (packets vanish), or with ``reject`` (connects
        fail at once with EHOSTUNREACH); both ways unless ``oneway`` (only a -> b)."""
        a, b = self.host(a), self.host(b)
        kind = "reject" if reject else "silent"
        with self._lock:
            self._route(a, b, kind)
            if not oneway:
                self._route(b, a, kind)

    def split(self, side_a, side_b, reject: bool = False) -> None:
        """Partition every host of ``side_a`` from every host of ``side_b``."""
        for a in side_a:
            for b in side_b:
                self.partition(a, b, reject=reject)

    def isolate(self, h) -> None:
        """Take the host's bridge port down: it vanishes for everyone, without a FIN."""
        h = self.host(h)
        if h.ns is None:
            raise ValueError("the observer cannot be isolated (partition it instead)")
        with self._lock:
            _ip("link", "set", h.port_link, "down")
            self._faults[("isolate", h.name, None)] = "down"

    def heal(self, a=None, b=None) -> None:
        """Remove faults: all (no argument), those of host ``a``, or between a and b."""
        names = {self.host(x).name for x in (a, b) if x is not None}
        with self._lock:
            for key in list(self._faults):
                kind, x, y = key
                if a is not None and b is not None and {x, y} != names:
                    continue
                if a is not None and b is None and not names & {x, y}:
                    continue
                if kind == "route":
                    self.hosts[x].ip("route", "del", f"{self.hosts[y].address}/32", check=False)
                else:
                    _ip("link", "set", self.hosts[x].port_link, "up", check=False)
                del self._faults[key]

    def dropped(self, h) -> int:
        """Packets host ``h`` has sent into its silent partitions so far (each connect
        attempt across one costs a SYN and its retransmissions): what a test counts
        to see how often a client knocked on a host it cannot reach."""
        h = self.host(h)
        r = h.ip("-j", "-s", "link", "show", h.drop_link)
        stats = json.loads(r.stdout)[0]
        return int(stats.get("stats64", stats.get("stats", {}))["rx"]["packets"])

    @property
    def faults(self) -> list[tuple]:
        """The faults in place: ``(kind, host, other_host_or_None)``."""
        with self._lock:
            return [(v if k[0] == "route" else "isolate", k[1], k[2])
                    for k, v in self._faults.items()]

    # --- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        """Kill every process started in its hosts, delete namespaces and bridge."""
        if self._closed:
            return
        self._closed = True
        for p in self._pythons:
            p.close()
        self.heal()
        for h in self.hosts.values():
            if h.ns is None:
                continue
            for proc in h.procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    try:
                        proc.wait(10)
                    except subprocess.TimeoutExpired:
                        pass
            _kill_ns_pids(h.ns)
            _ip("netns", "del", h.ns, check=False)
            _ip("link", "del", h.port_link, check=False)
        _ip("link", "del", self.observer.drop_link, check=False)
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self):
        return f"<Network {self.bridge} {self.subnet} hosts={list(self.hosts)}>"


@atexit.register
def _close_all() -> None:
    for n in list(_networks):
        try:
            n.close()
        except Exception:
            pass


# --- a Python process on a host ---------------------------------------------------------
class RemotePython:
    """A Python interpreter running in a host, fed code over a pipe.

    ``exec(code)`` runs statements in its one global namespace; ``eval(expr)``
    returns the value (JSON-encoded there, so plain data: numbers, strings, lists,
    dicts). An exception there raises :class:`RemoteError` here. ``timeout``
    bounds each call; a call that exceeds it raises ``TimeoutError`` and the
    process is killed (its state is unknown)."""

    def __init__(self, host: Host):
        self.host = host
        self._proc = host.popen([sys.executable, "-u", "-m", "bk.netns", "agent"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=None)
        self._replies: queue.Queue = queue.Queue()
        self._seq = 0
        self._lock = threading.Lock()
        host.net._pythons.append(self)
        threading.Thread(target=self._read, daemon=True, name=f"bkh-{host.name}").start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _read(self):
        for line in self._proc.stdout:
            try:
                self._replies.put(json.loads(line))
            except ValueError:
                continue
        self._replies.put(None)

    def _call(self, mode: str, code: str, timeout: float):
        with self._lock:
            self._seq += 1
            seq = self._seq
            try:
                self._proc.stdin.write((json.dumps({"id": seq, "mode": mode, "code": code})
                                        + "\n").encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                raise RemoteError("ProcessExited", f"python on {self.host.name} is gone") \
                    from None
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                try:
                    msg = self._replies.get(timeout=max(0.0, left))
                except queue.Empty:
                    self.close()
                    raise TimeoutError(f"python on {self.host.name}: no answer within "
                                       f"{timeout:g}s to {code[:200]!r}") from None
                if msg is None:
                    raise RemoteError("ProcessExited",
                                      f"python on {self.host.name} exited "
                                      f"({self._proc.wait()}) running {code[:200]!r}")
                if msg.get("id") != seq:
                    continue
                if "error" in msg:
                    raise RemoteError(msg["error"], msg.get("message", ""))
                return msg.get("value")

    def exec(self, code: str, timeout: float = 120.0) -> None:
        self._call("exec", code, timeout)

    def eval(self, expr: str, timeout: float = 120.0):
        return self._call("eval", expr, timeout)

    def kill(self) -> None:
        """SIGKILL the process (a client host that crashes)."""
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait(10)

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self._proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._proc.wait(10)


def _agent() -> None:
    """The other end of RemotePython (``python -m bk.netns agent``)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout = sys.stderr          # what the code prints must not corrupt replies
    scope: dict = {"__name__": "__bkh__"}
    for line in sys.stdin:
        try:
            req = json.loads(line)
        except ValueError:
            continue
        reply = {"id": req.get("id")}
        try:
            if req.get("mode") == "eval":
                reply["value"] = eval(req["code"], scope)
                json.dumps(reply["value"])
            else:
                exec(req["code"], scope)
        except BaseException as e:          # report everything, even SystemExit
            reply.pop("value", None)
            reply["error"] = type(e).__name__
            reply["message"] = f"{e}\n{traceback.format_exc(limit=8)}"
        out.write(json.dumps(reply, default=repr) + "\n")


# --- a cluster on hosts ----------------------------------------------------------------
class _HostEtcd(EtcdServer):
    """An etcd member run in a host's namespace."""

    def __init__(self, host: Host, data_dir: str, **kw):
        super().__init__(data_dir, client_port=ETCD_CLIENT_PORT, peer_port=ETCD_PEER_PORT,
                         host=host.address, name=f"bk-etcd-{host.name}", **kw)
        self.net_host = host

    def _command(self) -> list[str]:
        return [*self.net_host.exec_prefix, *super()._command()]


class HostEtcdCluster(EtcdCluster):
    """One etcd member on each of ``hosts`` (a Raft cluster across hosts)."""

    def __init__(self, hosts, base_dir: str):   # members of its own, not EtcdCluster's
        self.hosts = list(hosts)
        self.base_dir = os.path.abspath(base_dir)
        self.host = None
        initial = ",".join(f"bk-etcd-{h.name}=http://{h.address}:{ETCD_PEER_PORT}"
                           for h in self.hosts)
        token = f"bk-etcd-{os.getpid()}-{self.hosts[0].address}"
        self.members = [_HostEtcd(h, os.path.join(base_dir, f"etcd-{h.name}"),
                                  initial_cluster=initial, cluster_token=token)
                        for h in self.hosts]

    def leader(self) -> Host | None:
        """The host of the member that is the Raft leader now (None if no leader)."""
        ctl = os.path.join(os.path.dirname(find_etcd_binary()), "etcdctl")
        r = subprocess.run([ctl, "--endpoints", ",".join(m.endpoint for m in self.members),
                            "--dial-timeout", "1s", "--command-timeout", "2s",
                            "endpoint", "status", "-w", "json"],
                           capture_output=True, text=True, timeout=30)
        try:
            rows = json.loads(r.stdout or "[]")
        except ValueError:
            return None
        for row in rows:
            st = row.get("Status", {})
            if st.get("leader") and st.get("leader") == st.get("header", {}).get("member_id"):
                host = row.get("Endpoint", "").rpartition(":")[0]
                return next((h for h in self.hosts if h.address == host), None)
        return None


class HostCluster(LocalCluster):
    """etcd on one host and one bookie on each of ``bookie_hosts`` (port 3181, bound to
    and advertising the host's address), reachable from the observer: a
    :class:`bk.localcluster.LocalCluster` whose processes run in hosts.

    ``etcd_host``: one host, or a list of hosts for an etcd cluster of one member
    on each. ``racks``: ``{host name: "/region/rack"}`` written as each bookie's
    ``bookieRack``. Bookies run with the registry defaults plus ``conf_overrides``.
    ``secure``: as LocalCluster's (one etcd host; certificates name the hosts)."""

    def __init__(self, net: Network, base_dir: str, bookie_hosts, etcd_host,
                 conf_overrides: dict | None = None, num_shards: int = 1,
                 prefix: str = "ledgers", racks: dict | None = None, secure: bool = False):
        hosts = [net.host(h) for h in bookie_hosts]
        super().__init__(num_bookies=len(hosts), base_dir=base_dir, num_shards=num_shards,
                         conf_overrides=conf_overrides, prefix=prefix, secure=secure)
        self.net = net
        self.bookie_hosts = hosts
        if isinstance(etcd_host, (list, tuple)):
            self.etcd_hosts = [net.host(h) for h in etcd_host]
        else:
            self.etcd_hosts = [net.host(etcd_host)]
        self.etcd_host = self.etcd_hosts[0]
        self.racks = dict(racks or {})

    def _make_etcd(self, tls):
        if len(self.etcd_hosts) > 1:
            if tls:
                raise NetnsError("secure mode runs one etcd host (no TLS between members)")
            return HostEtcdCluster(self.etcd_hosts, self.base_dir)
        return _HostEtcd(self.etcd_host, os.path.join(self.base_dir, "etcd"), tls=tls)

    def _certificate_hosts(self) -> list:
        # the hosts' addresses, which bookies advertise and clients connect to
        return super()._certificate_hosts() + [
            h.address for h in self.bookie_hosts + self.etcd_hosts]

    def _new_bookie(self, **overrides) -> BookieProcess:
        h = self.bookie_hosts[self._next]
        self._next += 1
        conf = self._security_settings("bookie") if self.secure else {}
        conf.update(self.conf_overrides)
        if h.name in self.racks:
            conf["bookieRack"] = self.racks[h.name]
        conf.update(overrides)
        b = BookieProcess(self.metadata_uri, os.path.join(self.base_dir, f"bookie-{h.name}"),
                          BOOKIE_PORT, self.num_shards, conf, store=self.store,
                          address=h.address, command_prefix=h.exec_prefix)
        b.host = h
        self.bookies.append(b)
        return b

    def bookie_on(self, h) -> BookieProcess:
        """The bookie running on host ``h``."""
        name = self.net.host(h).name
        for b in self.bookies:
            if b.host.name == name:
                return b
        raise KeyError(name)

    def __enter__(self) -> "HostCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise


__all__ = ["Network", "Host", "HostCluster", "RemotePython", "RemoteError", "NetnsError",
           "unavailable", "sweep_stale"]

if __name__ == "__main__":
    if sys.argv[1:] == ["agent"]:
        _agent()
    elif sys.argv[1:] == ["sweep"]:
        print("\n".join(sweep_stale()))
    else:
        sys.exit("usage: python -m bk.netns agent|sweep")
