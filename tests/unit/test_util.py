import os
import time

from bk import util
from bk.util import free_port


def test_free_port_never_hands_out_a_port_twice():
    # The kernel may return a just-released ephemeral port at once; two bookies of
    # one local cluster given the same port made one fail at start.
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_free_port_picks_below_the_ephemeral_range():
    # where outgoing connections never take their local port: none can take the port
    # between its pick and the bind of the server it is for
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    assert util._pick_range() == (util._PICK_FLOOR, low)
    assert all(util._PICK_FLOOR <= free_port() < low for _ in range(50))


def test_pid_alive_running_zombie_and_gone():
    pid_alive = util.pid_alive
    assert pid_alive(os.getpid())
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)          # exited but not reaped: a zombie is not running
    try:
        assert not pid_alive(pid)
        with open(f"/proc/{pid}/stat") as f:
            assert f.read().split(") ", 1)[1][:1] == "Z"   # (it was the zombie case)
    finally:
        os.waitpid(pid, 0)
    assert not pid_alive(pid)     # reaped: gone
