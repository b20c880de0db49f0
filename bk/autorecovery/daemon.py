"""``bookie autorecovery``: auto-recovery as a process of its own.

The same shape as the bookie's arbiter: it checks that the metadata store
holds a cluster, binds its HTTP port (``httpServerEnabled``) before anything
starts, runs an :class:`~bk.autorecovery.service.AutoRecovery` (auditor candidate and
replication worker), and then only waits: signal handlers just record the
signal, the loop stops on SIGTERM or SIGINT. Exit codes are the bookie's
(:mod:`bk.exitcodes`).

HTTP (``httpServerPort``; 0: a free port, logged): ``/heartbeat``,
``/metrics`` (this process's auditor and replication metrics) and
``/api/v1/autorecovery/status``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading

from bk.autorecovery.service import AutoRecovery
from bk.autorecovery.status import status as autorecovery_status
from bk.errors import BKError
from bk.exitcodes import EXIT_BIND, EXIT_CONFIG, EXIT_METADATA, EXIT_OK
from bk.exposition import registry_of
from bk.http import HttpServer, heartbeat, json_reply, metrics_view
from bk.meta.store import MetadataStore
from bk.metrics import AutoRecoveryMetrics
from bk.security import http_security
from bk.security.etcd import EtcdCredentials

log = logging.getLogger("bk.autorecovery")


class DaemonExit(Exception):
    """Stop ``bookie autorecovery`` with this exit code and message."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class AutoRecoveryDaemon:
    """Runs auto-recovery (and its HTTP endpoint) until SIGTERM / SIGINT or :meth:`stop`."""

    def __init__(self, conf, identifier: str | None = None):
        self.conf = conf
        self.identifier = identifier or f"autorecovery-{socket.gethostname()}-{os.getpid()}"
        self.metrics = AutoRecoveryMetrics()
        self.store: MetadataStore | None = None
        self.http: HttpServer | None = None
        self.autorecovery: AutoRecovery | None = None
        self._stop = threading.Event()

    def routes(self) -> dict:
        return {"/heartbeat": heartbeat,
                "/metrics": metrics_view(registry_of(self.metrics)),
                "/api/v1/autorecovery/status": lambda: json_reply(
                    autorecovery_status(self.store, self.autorecovery is not None))}

    def run(self) -> int:
        """Serve until stopped; return the exit code (raises :class:`DaemonExit` when
        it cannot start)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *a: self._stop.set())
        try:
            self._start()
            while not self._stop.wait(0.5):
                pass
        finally:
            self._shutdown()
        return EXIT_OK

    def stop(self) -> None:
        self._stop.set()

    def _start(self):
        conf = self.conf
        if not conf.metadataServiceUri:
            raise DaemonExit(EXIT_CONFIG, "metadataServiceUri is not set (in the conf file, "
                                          "BK_metadataServiceUri or --metadata)")
        try:
            self.store = MetadataStore(conf.metadataServiceUri,
                                       timeout=conf.metadataTimeoutMillis / 1000.0,
                                       credentials=EtcdCredentials.from_conf(conf))
            self.store.cluster()              # no cluster under the prefix: say so
        except ValueError as e:
            raise DaemonExit(EXIT_CONFIG, f"metadataServiceUri: {e}") from None
        except BKError as e:
            raise DaemonExit(EXIT_METADATA, str(e)) from None
        if conf.httpServerEnabled:
            try:
                self.http = HttpServer(self.routes(), conf.bind_address, conf.httpServerPort,
                                       **http_security(conf))
            except OSError as e:
                raise DaemonExit(EXIT_BIND, f"cannot bind httpServerPort {conf.bind_address}:"
                                            f"{conf.httpServerPort}: {e.strerror}") from None
        self.autorecovery = AutoRecovery(conf, self.identifier, self.metrics).start()
        if self.http is not None:
            self.http.start()
            log.info("auto-recovery %s: HTTP on port %d (http://%s:%d/api/v1/autorecovery/"
                     "status)", self.identifier, self.http.port, conf.advertisedAddress,
                     self.http.port)

    def _shutdown(self):
        stops = [("auto-recovery", self.autorecovery and self.autorecovery.stop),
                 ("HTTP server", self.http and self.http.stop),
                 ("metadata store", self.store and self.store.close)]
        for what, stop in stops:
            if stop:
                try:
                    stop()
                except Exception as e:
                    log.warning("could not stop the %s: %s", what, e)
