"""Small helpers shared by the server, the client, the CLI and the tests."""

from __future__ import annotations

import errno
import os
import random
import socket


_handed_out: set[int] = set()

# Ports below the kernel's ephemeral range (ip_local_port_range), where free_port
# picks: a port picked there cannot be taken by an outgoing connection's local
# port (of any process on the machine) before the server it is for binds it.
_PICK_FLOOR = 10000


def _pick_range() -> tuple[int, int] | None:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (_PICK_FLOOR, low) if low - _PICK_FLOOR >= 1000 else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for tests and local clusters).

    Picked at random below the ephemeral range where the kernel tells it (a port
    the kernel picked is one it may give an outgoing connection next, before the
    server binds it: seen as a bookie failing to bind on a loaded machine), else
    by the kernel. Never the same port twice in one process: a just-closed port
    may be handed out again at once, and two bookies of one local cluster given
    the same port made one of them fail at start (seen in a full test run)."""
    span = _pick_range()
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, random.randrange(*span) if span else 0))
            except OSError as e:
                if e.errno not in (errno.EADDRINUSE, errno.EACCES):
                    raise
                continue               # in use (or lingering): pick another
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError(f"no free TCP port on {host} that this process has not handed out")


def parse_host_port(text: str, default_port: int | None = None) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; ValueError naming the text otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep:
        if default_port is None:
            raise ValueError(f"expected host:port, got {text!r}")
        return text, default_port
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ValueError(f"bad port in {text!r}") from None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` is running: it exists (or exists but is not ours
    to signal) and is not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:        # no /proc (not Linux), or it went meanwhile: signalled fine
        return True
