"""The control channel between the arbiter and one shard worker.

A ``SOCK_SEQPACKET`` Unix socketpair: message boundaries are kept by the
kernel, and a client socket rides along with the message that hands it over
(``SCM_RIGHTS`` through :func:`socket.send_fds`). Messages are small msgpack
lists ``[kind, ...]``; anything large (ledger lists for GC) is sent in chunks
of at most :data:`CHUNK` items.

Arbiter -> worker: ``conn`` (hello body, with one fd), ``readonly`` (flag),
``gc_begin``, ``gc_delete`` (ids, last), ``stop``.
Worker -> arbiter: ``ready`` (stats), ``error`` (message), ``hb`` (with the
shard's metrics snapshot unless ``enableStatistics`` is off, see
:mod:`bk.metrics`), ``gc_ledgers`` (ids, last), ``gc_done`` (stats).
"""

from __future__ import annotations

import socket

import msgpack

CHUNK = 8192
MAX_MESSAGE = 256 * 1024


def pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair: (arbiter end, worker end)."""
    a, w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (a, w):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE * 2)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, MAX_MESSAGE * 2)
    return a, w


def send(sock: socket.socket, *msg, fds=()) -> None:
    data = msgpack.packb(list(msg), use_bin_type=True)
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv(sock: socket.socket):
    """One message as ``(list, fds)``; ``(None, [])`` when the peer is gone."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 4)
    if not data:
        for fd in fds:
            socket.close(fd)
        return None, []
    return msgpack.unpackb(data, raw=False, strict_map_key=False), fds


def send_chunked(sock: socket.socket, kind: str, items) -> None:
    """Send a list as ``[kind, chunk, last]`` messages (always at least one)."""
    items = list(items)
    if not items:
        send(sock, kind, [], True)
        return
    for i in range(0, len(items), CHUNK):
        send(sock, kind, items[i:i + CHUNK], i + CHUNK >= len(items))
