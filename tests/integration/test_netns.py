"""The host harness itself (bk.netns): hosts reach each other, a silent cut makes
connects time out, a reject fails them at once, isolation silences a host, heal
restores, and nothing is left behind."""

import inspect
import subprocess

import psutil
import pytest

from bk import netns
from bk.testing import wait_until

pytestmark = pytest.mark.skipif(netns.unavailable() is not None,
                                reason=f"needs test hosts: {netns.unavailable()}")

SERVE = """
import socket, threading
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(({addr!r}, 7000)); srv.listen(16)
def _accept():
    while True:
        c, _ = srv.accept()
        threading.Thread(target=lambda c=c: [c.sendall(d) for d in iter(lambda: c.recv(1024), b"")],
                         daemon=True).start()
threading.Thread(target=_accept, daemon=True).start()
"""

def probe(addr, timeout):
    """("ok" | "timeout" | errno name, seconds) of a connect + echo to addr:7000."""
    import errno
    import socket
    import time
    t = time.monotonic()
    s = socket.socket()
    s.settimeout(timeout)
    try:
        s.connect((addr, 7000))
        s.sendall(b"x")
        s.recv(1)
        return ["ok", time.monotonic() - t]
    except socket.timeout:
        return ["timeout", time.monotonic() - t]
    except OSError as e:
        return [errno.errorcode.get(e.errno, str(e)), time.monotonic() - t]
    finally:
        s.close()


PROBE = inspect.getsource(probe)


@pytest.fixture
def net():
    with netns.Network() as n:
        yield n


def test_hosts_faults_and_heal(net):
    a, b, c = net.add_host("a"), net.add_host("b"), net.add_host("c")
    assert len({a.address, b.address, c.address}) == 3
    server = b.python()
    server.exec(SERVE.format(addr=b.address))
    pa, pc = a.python(), c.python()
    for p in (pa, pc):
        p.exec(PROBE)
    to_b = f"probe({b.address!r}, 1.0)"
    assert pa.eval(to_b)[0] == "ok"

    # silent: the connect times out (nothing answers, no local error)
    net.partition(a, b)
    assert pa.eval(to_b)[0] == "timeout"
    assert pc.eval(to_b)[0] == "ok"            # c is not cut
    net.heal(a, b)
    assert pa.eval(to_b)[0] == "ok"

    # reject: fails at once with EHOSTUNREACH
    net.partition(a, b, reject=True)
    assert pa.eval(to_b)[0] == "EHOSTUNREACH"    # a local error, not a timeout
    net.heal()
    assert net.faults == []

    # an established connection goes silent too (no RST, no FIN): a read times out
    pa.exec(f"import socket; s = socket.create_connection(({b.address!r}, 7000), 1.0)")
    assert pa.eval("s.sendall(b'y') or s.recv(1).decode()") == "y"
    net.partition(a, b)
    with pytest.raises(netns.RemoteError) as ei:
        pa.exec("s.settimeout(0.5); s.sendall(b'w'); s.recv(1)")
    assert ei.value.type == "TimeoutError"
    net.heal()

    # the observer (this process) can be cut from a host like any other
    assert probe(b.address, 1.0)[0] == "ok"
    net.partition(net.observer, b)
    assert probe(b.address, 0.5)[0] == "timeout"
    assert pa.eval(f"probe({b.address!r}, 1.0)")[0] == "ok"
    net.heal(net.observer, b)
    assert probe(b.address, 1.0)[0] == "ok"

    # isolation: b vanishes for everyone, the observer included
    net.isolate(b)
    assert pa.eval(to_b)[0] == "timeout"
    assert pc.eval(to_b)[0] == "timeout"
    net.heal(b)
    # its link comes back up asynchronously (the kernel applies a carrier change
    # within about a second, later under load): reachable again, with a deadline
    wait_until(lambda: pc.eval(to_b)[0] == "ok", timeout=30, what="b reachable after the heal")


def test_one_way_cut(net):
    a, b = net.add_host("a"), net.add_host("b")
    b.python().exec(SERVE.format(addr=b.address))
    a.python().exec(SERVE.format(addr=a.address))
    pa, pb = a.python(), b.python()
    pa.exec(PROBE)
    pb.exec(PROBE)
    net.partition(a, b, oneway=True)
    # a's packets to b vanish: a's connect times out, and so does b's (its SYN
    # arrives, a's SYN-ACK does not)
    assert pa.eval(f"probe({b.address!r}, 0.5)")[0] == "timeout"
    assert pb.eval(f"probe({a.address!r}, 0.5)")[0] == "timeout"
    net.heal()
    assert pb.eval(f"probe({a.address!r}, 0.5)")[0] == "ok"


def test_remote_errors_and_cleanup():
    with netns.Network() as n:
        h = n.add_host("x")
        p = h.python()
        assert p.eval("1 + 1") == 2
        with pytest.raises(netns.RemoteError) as ei:
            p.exec("raise ValueError('boom')")
        assert ei.value.type == "ValueError" and "boom" in str(ei.value)
        pid = p.pid
        ns = h.ns
        bridge = n.bridge
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert ns not in names
    links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    assert bridge not in links
    wait_until(lambda: not psutil.pid_exists(pid), timeout=10,
               what=f"python {pid} of a closed network to be gone")


def test_cluster_on_hosts(net, tmp_path):
    """etcd and bookies on their own hosts, bound to and advertising the host's
    address (not 127.0.0.1); a client on a fourth host writes and reads."""
    from bk.testing import TEST_DEFAULTS
    hosts = [net.add_host(f"b{i}") for i in range(3)]
    meta, ch = net.add_host("meta"), net.add_host("client")
    with netns.HostCluster(net, str(tmp_path / "c"), hosts, meta, TEST_DEFAULTS) as cluster:
        assert sorted(cluster.store.list_bookies()) == sorted(f"{h.address}:3181" for h in hosts)
        info = cluster.store.bookie_info(f"{hosts[0].address}:3181")
        assert info["address"] == hosts[0].address
        py = ch.python()
        py.exec(f"import bk; c = bk.BookKeeper({cluster.metadata_uri!r})\n"
                "lh = c.create_ledger(3, 3, 2)\n"
                "ids = [lh.add_entry(b'e%d' % i) for i in range(20)]\n"
                "lh.close()")
        lid = py.eval("lh.ledger_id")
        assert set(py.eval("lh.metadata.last_ensemble")) == {f"{h.address}:3181" for h in hosts}
        assert py.eval(f"[e.data.decode() for e in c.open_ledger({lid}).read_entries(0, 19)]") \
            == [f"e{i}" for i in range(20)]
