"""The control channel between the arbiter and one shard worker.

A ``SOCK_SEQPACKET`` Unix socketpair: message boundaries are kept by the
kernel, and a client socket rides along with the message that hands it over
(``SCM_RIGHTS`` through :func:`socket.send_fds`). Messages are small msgpack
lists ``[kind, ...]``; anything large (ledger lists for GC) is sent in chunks
of at most :data:`CHUNK` items.

The vocabulary is declared here once (:data:`TO_WORKER`, :data:`TO_ARBITER`:
each message's name and its arguments); a receiver hands each message to
:func:`dispatch`, which calls its ``handle_<name>`` method and logs a message
it does not know, as gunicorn's arbiter maps signals to ``handle_<signal>``.
"""

from __future__ import annotations

import logging
import socket

import msgpack

log = logging.getLogger("bk.bookie")

# Arbiter -> worker: name -> arguments.
TO_WORKER = {
    "conn": "hello body; the connection's fd rides along",
    "readonly": "flag: refuse adds (disk almost full) or take them again",
    "gc_begin": "start a GC round: send the ledgers you hold",
    "gc_delete": "ids of deleted ledgers, last chunk?, compaction threshold",
    "gc_drop": "ids of over-replicated ledgers to drop now",
    "stop": "drain and exit",
}
# Worker -> arbiter: name -> arguments.
TO_ARBITER = {
    "ready": "stats: the journal is replayed, the shard serves",
    "replay": "done, total: journal replay progress (counts as a heartbeat)",
    "error": "message: why the shard cannot start",
    "hb": "[metrics snapshot unless enableStatistics is off, see bk.metrics]",
    "gc_ledgers": "ids held, last chunk?, those of them settled (dropped, fenced, no entry)",
    "gc_dropped": "count of over-replicated ledgers dropped",
    "gc_done": "stats of the GC round",
}

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


def send_chunked(sock: socket.socket, kind: str, items, extra=None) -> None:
    """Send a list as ``[kind, chunk, last]`` messages (always at least one);
    with ``extra``, ``[kind, chunk, last, extra(chunk)]`` (what the receiver
    must know of the items of that chunk: at most as large as the chunk)."""
    items = list(items)
    for i in range(0, max(len(items), 1), CHUNK):
        chunk = items[i:i + CHUNK]
        last = i + CHUNK >= len(items)
        if extra is None:
            send(sock, kind, chunk, last)
        else:
            send(sock, kind, chunk, last, extra(chunk))


def dispatch(handler, vocabulary: dict, msg: list, *first, fds=()) -> None:
    """Call ``handler.handle_<name>(*first, *args)`` for ``msg`` = ``[name, *args]``
    (with ``fds=`` when file descriptors came with it). An unknown or unhandled
    name is logged and its descriptors closed: a newer peer must not crash an
    older one."""
    name = msg[0] if msg and isinstance(msg[0], str) else None
    fn = getattr(handler, f"handle_{name}", None) if name in vocabulary else None
    if fn is None:
        log.warning("control message %r not understood; ignored", msg[:1])
        for fd in fds:
            socket.close(fd)
        return
    if fds:
        fn(*first, *msg[1:], fds=list(fds))
    else:
        fn(*first, *msg[1:])
