"""A small HTTP server for the observability endpoints of bk's daemons.

Theory of operation
-------------------
A ``ThreadingHTTPServer`` runs on a daemon thread of its process (a bookie's
arbiter, or ``bookie autorecovery``). What it serves is a route table,
``{path: view}``, that the daemon builds (:mod:`bk.bookie.http` for a bookie,
:mod:`bk.autorecovery.http` for the standalone auto-recovery); a view is a
callable returning :class:`Reply`. Views read their daemon's state and never
touch a shard worker's loop, so a slow scrape cannot delay an add. GET only
(anything else: 405); an unknown path: 404 naming the paths there are; a view
that raises: 500 with the error, and the server goes on.

The server binds at construction, so a taken port fails the daemon's start
with a clear error instead of a silent thread failure.

With a TLS context it serves HTTPS: the listening socket is wrapped without
handshaking at accept, and each request's thread runs its own handshake, so
a stalled client never holds up the accept loop. A ``guard``
(:class:`bk.security.auth.HttpGuard`) decides per path who may see a view:
401 without a valid identity, 403 for a role that may not.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger("bk.http")

TEXT = "text/plain; charset=utf-8"


@dataclass
class Reply:
    """What a view answers: status code, body, content type, extra headers."""

    code: int
    body: bytes
    ctype: str = TEXT
    headers: dict = field(default_factory=dict)


def json_reply(obj, code: int = 200) -> Reply:
    return Reply(code, json.dumps(obj, indent=1, sort_keys=True).encode() + b"\n",
                 "application/json")


def heartbeat() -> Reply:
    """``/heartbeat``: 200 ``OK`` while the process serves."""
    return Reply(200, b"OK")


def metrics_view(registry, refresh: Callable[[], None] | None = None) -> Callable[[], Reply]:
    """``/metrics`` of a prometheus_client registry (``refresh`` runs first)."""
    def view() -> Reply:
        if refresh is not None:
            refresh()
        return Reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
    return view


class _Handler(BaseHTTPRequestHandler):
    server_version = "bk"
    protocol_version = "HTTP/1.1"
    timeout = 30           # an idle or stalled client's thread does not linger

    def log_message(self, fmt, *args):   # access logs would flood the daemon's log
        pass

    def _send(self, r: Reply):
        self.send_response(r.code)
        self.send_header("Content-Type", r.ctype)
        self.send_header("Content-Length", str(len(r.body)))
        for k, v in r.headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(r.body)

    def setup(self):
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()     # under the handler's timeout

    def _refused(self, path: str):
        guard = self.server.guard
        if guard is None:
            return None
        peer = None
        if isinstance(self.connection, ssl.SSLSocket):
            cert = self.connection.getpeercert() or {}
            peer = next((v for rdn in cert.get("subject", ()) for k, v in rdn
                         if k == "commonName"), None)
        refused = guard.check(path, self.headers.get("Authorization"), peer)
        if refused is None:
            return None
        code, reason = refused
        log.warning("http %s refused (%d) for %s: %s", path, code, self.client_address[0],
                    reason)
        return Reply(code, json.dumps({"error": reason}).encode() + b"\n", "application/json",
                     {"WWW-Authenticate": "Bearer"} if code == 401 else {})

    def do_GET(self):
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        routes = self.server.routes
        try:
            refused = self._refused(path)
            view = routes.get(path)
            if refused is not None:
                self._send(refused)
            elif view is None:
                self._send(json_reply({"error": f"no such path: {path}",
                                       "paths": list(routes)}, 404))
            else:
                self._send(view())
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:    # a failing view answers 500 and the server goes on
            log.warning("http %s failed: %s", path, e)
            try:
                self._send(json_reply({"error": str(e)}, 500))
            except OSError:
                pass

    def _not_allowed(self):
        self._send(Reply(405, f"method {self.command} not allowed; use GET\n".encode(),
                         headers={"Allow": "GET"}))

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # a failed TLS handshake or a client gone: one line, not a traceback on stderr
        log.info("http request from %s failed", client_address[0])


class HttpServer:
    """Serves ``routes`` (``{path: view}``) on ``host:port`` (0: a free port, then
    :attr:`port`). Binds at construction (``OSError`` if it cannot), serves
    after :meth:`start`, until :meth:`stop`."""

    def __init__(self, routes: dict[str, Callable[[], Reply]], host: str, port: int,
                 tls_context: ssl.SSLContext | None = None, guard=None):
        self.server = _Server((host, port), _Handler)
        self.server.daemon_threads = True
        self.server.routes = dict(routes)
        self.server.guard = guard
        if tls_context is not None:
            self.server.socket = tls_context.wrap_socket(
                self.server.socket, server_side=True, do_handshake_on_connect=False)
        self.port = self.server.server_address[1]
        self.thread: threading.Thread | None = None

    def start(self) -> "HttpServer":
        self.thread = threading.Thread(target=self.server.serve_forever, name="bk-http",
                                       kwargs={"poll_interval": 0.5}, daemon=True)
        self.thread.start()
        return self

    def close_in_child(self) -> None:
        """In a forked child: drop the listening socket, nothing else."""
        self.server.socket.close()

    def stop(self) -> None:
        if self.thread is not None:
            self.server.shutdown()
        self.server.server_close()
