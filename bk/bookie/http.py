"""The bookie's HTTP endpoint (``httpServerEnabled``), served by the arbiter.

Theory of operation
-------------------
A ``ThreadingHTTPServer`` runs on a daemon thread of the arbiter; its handlers
read the arbiter's state and :class:`bk.metrics.BookieMetrics` (under that
object's lock) and never touch a shard worker's loop, so a slow scrape cannot
delay an add. GET only (anything else: 405); an unknown path: 404.

``/heartbeat``                   200 ``OK`` while the arbiter serves
``/metrics``                     Prometheus text format, summed over shard workers
``/api/v1/bookie/info``          JSON: identity, ports, shards, storage, disk
``/api/v1/bookie/state``         JSON: running / readOnly / shuttingDown
``/api/v1/autorecovery/status``  JSON read from the metadata store (blocking: etcd)
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger("bk.bookie")

PATHS = ("/heartbeat", "/metrics", "/api/v1/bookie/info", "/api/v1/bookie/state",
         "/api/v1/autorecovery/status")


class _Handler(BaseHTTPRequestHandler):
    server_version = "bk-bookie"
    protocol_version = "HTTP/1.1"
    timeout = 30           # an idle or stalled client's thread does not linger

    def log_message(self, fmt, *args):   # access logs would flood the bookie's log
        pass

    def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8",
               headers: dict | None = None):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj, code: int = 200):
        self._reply(code, json.dumps(obj, indent=1, sort_keys=True).encode() + b"\n",
                    "application/json")

    def do_GET(self):
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        app = self.server.app
        try:
            if path == "/heartbeat":
                self._reply(200, b"OK")
            elif path == "/metrics":
                app.refresh_metrics()
                self._reply(200, generate_latest(app.registry), CONTENT_TYPE_LATEST)
            elif path == "/api/v1/bookie/info":
                self._json(app.http_info())
            elif path == "/api/v1/bookie/state":
                self._json(app.http_state())
            elif path == "/api/v1/autorecovery/status":
                self._json(app.http_autorecovery())
            else:
                self._json({"error": f"no such path: {path}", "paths": list(PATHS)}, 404)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:    # a failing endpoint answers 500 and the server goes on
            log.warning("http %s failed: %s", path, e)
            try:
                self._json({"error": str(e)}, 500)
            except OSError:
                pass

    def _not_allowed(self):
        self._reply(405, f"method {self.command} not allowed; use GET\n".encode(),
                    headers={"Allow": "GET"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed


class HttpServer:
    """Binds at construction (so a bad port fails the boot), serves after :meth:`start`."""

    def __init__(self, app, host: str, port: int):
        self.server = ThreadingHTTPServer((host, port), _Handler)
        self.server.daemon_threads = True
        self.server.app = app
        self.port = self.server.server_address[1]
        self.thread: threading.Thread | None = None

    def fileno(self) -> int:
        return self.server.socket.fileno()

    def start(self) -> None:
        self.thread = threading.Thread(target=self.server.serve_forever, name="bk-http",
                                       kwargs={"poll_interval": 0.5}, daemon=True)
        self.thread.start()

    def close_in_child(self) -> None:
        """In a forked worker: drop the listening socket, nothing else."""
        self.server.socket.close()

    def stop(self) -> None:
        if self.thread is not None:
            self.server.shutdown()
        self.server.server_close()
