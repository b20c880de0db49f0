"""Small helpers shared by the server, the client, the CLI and the tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for tests and local clusters)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
