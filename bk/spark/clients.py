"""Clients of the data source: one per process and metadata URI.

The driver side of a query (planning, offsets, commits) runs in long-lived
Python processes, and Spark reuses its Python workers for task after task: a
client (an etcd channel, a watch of the bookies, bookie connections) made per
call costs more than the call (about 2 ms to connect, and a staging ledger's
create-write-close takes twice as long in a new client as in a warm one), so
each process keeps one per URI, closed at exit. After a fork the child makes
its own (the key has the pid).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading

from bk.client.bookkeeper import BookKeeper
from bk.errors import BKError

log = logging.getLogger("bk.spark")

_clients: dict = {}
_clients_lock = threading.Lock()


# BK_SPARK_CLIENT_PER_CALL=1 in the environment: a new client per call instead
# (closed at exit): only to measure what reuse is worth (scripts/bench_spark.py).
_PER_CALL = os.environ.get("BK_SPARK_CLIENT_PER_CALL", "0") == "1"


def client_for(opts) -> BookKeeper:
    """This process's client of ``opts.uri`` (made on first use)."""
    key = (os.getpid(), opts.uri, opts.security)
    if _PER_CALL:
        with _clients_lock:
            if not _clients:
                atexit.register(close_clients)
            c = _clients[(*key, len(_clients))] = BookKeeper(opts.uri, **dict(opts.security))
        return c
    c = _clients.get(key)
    if c is not None and not c._closed:
        return c
    with _clients_lock:
        c = _clients.get(key)
        if c is None or c._closed:
            if not _clients:
                atexit.register(close_clients)
            c = _clients[key] = BookKeeper(opts.uri, **dict(opts.security))
        return c


def close_clients() -> None:
    """Close this process's clients (at exit, or when a test wants them gone)."""
    with _clients_lock:
        mine = [k for k in _clients if k[0] == os.getpid()]
        for k in mine:
            try:
                _clients.pop(k).close()
            except BKError as e:       # pragma: no cover - best effort at exit
                log.debug("closing the client of %s: %s", k[1], e)
