"""Small helpers shared by the server, the client, the CLI and the tests."""

from __future__ import annotations

import socket


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for tests and local clusters).

    Never the same port twice in one process: the kernel may hand a just-closed
    ephemeral port out again at once, and two bookies of one local cluster given
    the same port made one of them fail at start (seen in a full test run)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
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
