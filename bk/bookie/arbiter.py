"""The bookie's master process: binds, forks shard workers, hands over connections,
supervises, registers in etcd, watches the disks and drives garbage collection.

Theory of operation
-------------------
``Arbiter.run`` binds the bookie port, checks the cookie (creating it on a new
bookie: only once the port is its own), writes the pid file,
forks one :class:`~bk.bookie.worker.ShardWorker` per shard and waits until each
has replayed its journal; only then does it register the bookie (a key bound to
an etcd lease), so a client never sees a bookie that cannot serve. The cookie
check and the registration both wait for an unreachable etcd (up to
``metadataServiceStartTimeoutSeconds``): a bookie started during an outage
comes up when etcd does.

The main loop is a ``selectors`` loop over the listening socket, connections
that have not yet sent their HELLO, the control channel of each worker and a
wake-up pipe. Signal handlers only enqueue the signal and write to the pipe
(as gunicorn's arbiter does); the loop acts on them:

* SIGCHLD: reap with ``waitpid(WNOHANG)``. A worker that dies after it was
  ready is restarted (it replays its journal); one that dies before it was
  ready stops the bookie with its error, as does a worker crashing
  ``MAX_RESTARTS`` times within ``RESTART_WINDOW`` seconds: no restart loops.
* SIGTERM / SIGINT: stop accepting, deregister, let the metadata thread end
  its task (queued ones are skipped; an over-replicated claim has its shard
  drop what it claimed, the loop still reading the shards' answers, and
  releases its locks while the store is open), tell workers to drain and
  exit, wait for them, close the store, remove the pid file, exit 0.
* SIGUSR1: run a garbage collection now (a full reconcile, see bk.bookie.gc).

With ``stop_with=PID`` (``bookie start --stop-with PID``, passed only by
:mod:`bk.localcluster`: its tests, benches and ``bookie localcluster``) a thread
waits on a pidfd of that process and, once it has exited, sends this process a
SIGTERM: the bookie stops exactly as above (workers drain and sync their
journals), so a killed test or bench leaves no bookie behind. The process is
named rather than taken as the parent: a test's bookies are children of its
launcher (bk.testing), and one already gone when the watch begins (it died while
the bookie was starting) stops the bookie before it binds. A bookie started
without it (an operator's, systemd's) ignores every other process.

Each signal is handled by ``handle_<name>`` (``handle_term``, ...), each
control message of a worker by ``handle_<message>``
(:func:`bk.bookie.control.dispatch`, vocabulary in :mod:`bk.bookie.control`).

Every object the arbiter holds at a fork is *frozen* for the fork
(``gc.freeze()`` just before ``os.fork()``, ``gc.unfreeze()`` in the arbiter
right after): the worker inherits them in Python's permanent generation, where
its cyclic collector never looks at them. Otherwise a worker's first full
collection walks the ~31,000 inherited objects and writes to each one's GC
header, copying every inherited page (on this project's VM a full collection in
a fresh fork took 19-31 ms against 0.5 ms frozen, `docs/performance-log.md`); the
worker's loop would stall that long, and the pages would stop being shared.

A new connection's HELLO frame is read here (exactly that frame, nothing
more), then the socket is passed to the worker of the shard it names with
``send_fds``; the worker answers the HELLO. A worker whose heartbeat is older
than ``workerTimeoutMSec`` is killed and so restarted.

Blocking etcd work (read-only re-registration, the metadata checks of GC)
runs on one background thread so the loop keeps handing over connections.
What GC deletes is decided by :mod:`bk.bookie.gc` (deletions learned by a
watch, full reconciles rarely); the arbiter relays its rounds to the shards. A
full round gathers every shard's list of held ledgers (``gc_ledgers``; a shard
that dies meanwhile is left out) before it queues one check for the bookie.
When the over-replicated scan is due, that check also offers the held ledgers
to it, but those a shard reported *settled* (dropped already and no entry
since, :meth:`bk.bookie.storage.ShardStorage.settled`): the scan's cost
follows the ledgers holding entries, not every ledger this bookie ever dropped.

Metrics: each worker's heartbeat carries its counts; the loop keeps them in
:class:`bk.metrics.BookieMetrics`, which sums them over shards and carries a
dead worker's totals over its restart. With ``httpServerEnabled`` an HTTP
server thread (:mod:`bk.bookie.http`) serves them and the bookie's state; it
binds before the workers are forked (they close it) and never blocks the loop.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import queue
import select
import selectors
import signal
import socket
import struct
import threading
import time

from bk import metrics as M
from bk import protocol as P
from bk.autorecovery.checker import claim_overreplicated
from bk.bookie import control, layout
from bk.bookie.gc import GarbageCollector, ShardDeletions
from bk.config import Config
from bk.bookie.journal import ADD_OVERHEAD, HEADER_SIZE
from bk.bookie.worker import ShardWorker
from bk.errors import (BKError, ClusterIdentityError, ConfigError, CookieMismatchError, EBADREQ,
                       MetadataError, ProtocolError)
from bk.exitcodes import (EXIT_BIND, EXIT_COOKIE, EXIT_CONFIG, EXIT_ERROR, EXIT_METADATA,
                          EXIT_OK, EXIT_WORKER_BOOT)
from bk.meta import etcdversion
from bk.meta.compactor import Compactor
from bk.meta.racks import check_rack, set_rack_if_absent
from bk.meta.store import MetadataStore
from bk.rawclient import BookiePool
from bk.retry import Backoff
from bk.security import ClientSecurity, auth, http_security, tls
from bk.security.etcd import EtcdCredentials
from bk.util import pid_alive

log = logging.getLogger("bk.bookie")

MAX_RESTARTS = 5
RESTART_WINDOW = 60.0
HELLO_TIMEOUT = 10.0
BOOT_TIMEOUT = 300.0
HANDOVER_TIMEOUT = 30.0
# a stop waits this long for the metadata thread's task (a GC check, an
# over-replicated claim) before it stops the shards and closes the store
META_STOP_TIMEOUT = 10.0
# the over-replicated scan claims this many held ledgers at a time (each group reads
# the under-replicated marks once); it looks at the bookie's stop before each candidate
OVERREP_GROUP = 256
# retries of an unreachable metadata store at start (metadataServiceStartTimeoutSeconds)
_START_BACKOFF = Backoff(first=0.25, factor=2.0, cap=2.0, jitter=0.2)


class BookieExit(Exception):
    """Stop the bookie with this exit code and message."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class _Worker:
    def __init__(self, shard: int):
        self.shard = shard
        self.pid = 0
        self.ctrl: socket.socket | None = None
        self.ready = False
        self.last_hb = 0.0
        self.crashes: list[float] = []
        self.waiting: list[tuple[socket.socket, bytes, float]] = []   # hand-overs until ready
        self.gc_ledgers: list[int] = []
        self.gc_settled: list[int] = []   # of those, dropped already (ShardStorage.settled)
        self.replaying = False          # reported replay progress while booting
        self.lock = threading.Lock()   # ctrl sends come from the loop and the meta thread


class _Pending:
    """A connection whose HELLO is being read."""

    __slots__ = ("sock", "buf", "deadline", "peer")

    def __init__(self, sock, peer):
        self.sock = sock
        self.buf = bytearray()
        self.deadline = time.monotonic() + HELLO_TIMEOUT
        self.peer = peer


class Arbiter:
    """``autorecovery``: the class of the auto-recovery this bookie hosts with
    ``autoRecoveryDaemonEnabled`` (:class:`bk.autorecovery.service.AutoRecovery`,
    made as ``autorecovery(conf, bookie_id, metrics)`` and started once the bookie
    is registered); ``views``: the HTTP views it serves with ``httpServerEnabled``
    (the module :mod:`bk.bookie.http`). ``bookie start`` passes them, so that a bookie
    without auto-recovery never loads the client stack it copies with, and one
    without HTTP never loads prometheus_client and http.server."""

    def __init__(self, conf: Config, on_ready=None, autorecovery=None, views=None,
                 stop_with: int | None = None):
        if conf.autoRecoveryDaemonEnabled and autorecovery is None:
            raise ValueError("autoRecoveryDaemonEnabled is set: pass the auto-recovery to host")
        if conf.httpServerEnabled and views is None:
            raise ValueError("httpServerEnabled is set: pass the HTTP views (bk.bookie.http)")
        self.conf = conf
        self._views = views
        self.on_ready = on_ready          # called once the bookie serves (daemon hand-off)
        self.stop_with = stop_with        # stop when this process exits (None: never)
        self._stop_with_fd: int | None = None
        self._make_autorecovery = autorecovery
        self.workers: list[_Worker] = []
        self.num_shards = 0
        self.sel = selectors.DefaultSelector()
        self.signals: list[int] = []
        self.listener: socket.socket | None = None
        self.store = None
        self.registration = None
        self.readonly = False
        self.stopping = False
        self.exit_code = EXIT_OK
        self.exit_message = ""
        self.tasks: queue.Queue = queue.Queue()
        self.gc = None                         # bk.bookie.gc.GarbageCollector, once registered
        self.gc_round = None
        self.compactor = None                  # bk.meta.compactor.Compactor candidate
        self.gc_forced = False                 # a full round asked for (SIGUSR1) meanwhile
        self.gc_running = False
        self.gc_pending: set[int] = set()      # shards whose GC round is not done
        # a full round: the shards yet to report what they hold (None: all reported,
        # the one check of the bookie is under way), and what those that did hold
        self.gc_listing: set[int] | None = None
        self.gc_held: dict[int, list[int]] = {}
        self.gc_settled: dict[int, list[int]] = {}  # shard -> held ids the scan skips
        self.meta_thread: threading.Thread | None = None
        self.handed: ShardDeletions | None = None   # the deletions a shard gets with its fork
        self.gc_results: dict[int, dict] = {}
        self.last_gc: dict = {}
        self.last_overrep: dict[int, dict] = {}      # shard -> what its last scan found
        self.dropped: dict[int, threading.Event] = {}  # shard -> gc_drop answered
        self.drop_counts: dict[int, int] = {}  # shard -> how many its gc_drop answer dropped
        self.metrics: M.BookieMetrics | None = None
        self.http = None
        self.security = None            # ClientSecurity towards other bookies
        self.http_port = 0
        self.autorecovery = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # --- public ------------------------------------------------------------------
    def run(self) -> int:
        """Serve until stopped; return the process exit code."""
        try:
            self._start()
            self._loop()
        except BookieExit as e:
            self.exit_code, self.exit_message = e.code, str(e)
        except BKError as e:
            self.exit_code, self.exit_message = EXIT_ERROR, str(e)
        finally:
            self._shutdown()
        if self.exit_code:
            log.error("bookie %s stopped: %s", self.conf.bookie_id, self.exit_message)
        else:
            log.info("bookie %s stopped", self.conf.bookie_id)
        return self.exit_code

    # --- start -------------------------------------------------------------------
    def _start(self):
        conf = self.conf
        if not conf.metadataServiceUri:
            raise BookieExit(EXIT_CONFIG, "metadataServiceUri is not set (conf file, "
                                          "BK_metadataServiceUri or --metadata)")
        self._check_segment_size()
        self._check_security()
        if self.conf.bookieRack:
            try:
                check_rack(self.conf.bookieRack)
            except ConfigError as e:
                raise BookieExit(EXIT_CONFIG, f"bookieRack: {e}") from None
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGUSR1, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        if self.stop_with is not None:
            self._watch_stop_with(self.stop_with)
        # Bind before the cookie check: a bookie that cannot have its port must leave
        # no cookie behind (on a fresh bookie the check creates it), or the cluster
        # would know a bookie that never ran and audit it as lost.
        self._bind()
        try:
            self.store = MetadataStore(conf.metadataServiceUri,
                                       timeout=conf.metadataTimeoutMillis / 1000.0,
                                       credentials=EtcdCredentials.from_conf(conf))
            self.num_shards = self._check_cookie_waiting()
            self.instance_id = self.store.instance_id
        except CookieMismatchError as e:
            raise BookieExit(EXIT_COOKIE, str(e)) from None
        except ConfigError as e:
            raise BookieExit(EXIT_CONFIG, str(e)) from None
        except ValueError as e:
            raise BookieExit(EXIT_CONFIG, f"metadataServiceUri: {e}") from None
        except MetadataError as e:
            raise BookieExit(EXIT_METADATA, str(e)) from None
        for endpoint, version in self.store.etcd_versions().items():
            warning = etcdversion.advice(version)
            if warning:
                log.warning("metadata store %s: %s", endpoint, warning)
        self._write_pid_file()
        self.metrics = M.BookieMetrics(self.num_shards)
        self._bind_http()
        # the shards forgot the deletions they refused late entries of before this
        # start: each gets its own with its fork (_spawn)
        self.handed = ShardDeletions.remembered(conf, self.instance_id,
                                                os.path.abspath(conf.ledgerDirectories[0]),
                                                self.num_shards)
        self.workers = [_Worker(i) for i in range(self.num_shards)]
        for w in self.workers:
            self._spawn(w)
        self._wait_ready()
        space = layout.disk_space(conf)
        self.readonly = self._over_threshold(space["usage"])
        if self.readonly:
            self._tell_workers("readonly", True)
        if self.http is not None:
            self.http.start()
            log.info("bookie %s: HTTP on port %d (metrics: http://%s:%d/metrics)",
                     conf.bookie_id, self.http_port, conf.advertisedAddress, self.http_port)
        log.info("bookie %s serving on %s:%d with %d shards%s (pid %d)", conf.bookie_id,
                 conf.bind_address, self.port, self.num_shards,
                 " (read-only)" if self.readonly else "", os.getpid())
        # Registering may wait for the lease of a killed predecessor to expire (up to
        # registrationTtlSeconds): the loop serves meanwhile, so clients that know this
        # bookie (their ledgers' ensembles) are served at once after a restart.
        threading.Thread(target=self._register, name="bk-register", daemon=True).start()

    def _watch_stop_with(self, pid: int):
        """SIGTERM this process once process ``pid`` has exited (``--stop-with``)."""
        try:
            self._stop_with_fd = os.pidfd_open(pid)
        except ProcessLookupError:
            log.warning("process %d (--stop-with) is gone: not starting", pid)
            raise BookieExit(EXIT_OK, "stopped") from None
        except (AttributeError, OSError):     # no pidfd (not Linux >= 5.3): poll below
            pass
        fd = self._stop_with_fd

        def watch():
            if fd is not None:
                select.select([fd], [], [])     # readable once the process has exited
            else:
                while pid_alive(pid):
                    time.sleep(0.5)
            log.warning("process %d (--stop-with) exited: stopping", pid)
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=watch, name="bk-stop-with", daemon=True).start()

    def _check_security(self):
        """Load the TLS files, the token key and the roles once before forking, so
        that a mistake stops the bookie with its reason instead of every worker."""
        try:
            tls.server_context(self.conf)
            auth.Authenticator(self.conf)
            if self.conf.httpServerEnabled:
                http_security(self.conf)
            self.security = ClientSecurity.from_conf(self.conf)   # to other bookies
        except ConfigError as e:
            raise BookieExit(EXIT_CONFIG, str(e)) from None
        if self.conf.authProvider != "none" and not self.conf.tlsCertificatePath:
            log.warning("authProvider=%s without TLS: tokens cross the network in "
                        "plaintext (set tlsCertificatePath)", self.conf.authProvider)

    def _register_waiting(self):
        """register_bookie, retried while the metadata store is unreachable for up to
        metadataServiceStartTimeoutSeconds, as the cookie check is: etcd can go
        silent between the two (a partition soak restarted a bookie as it was cut
        from etcd: it said it was serving, then exited 1 on its registration's
        timeout). Any other answer is final at once."""
        conf = self.conf
        schedule = _START_BACKOFF.start(
            time.monotonic() + conf.metadataServiceStartTimeoutSeconds)
        while True:
            try:
                return self.store.register_bookie(
                    conf.bookie_id, self._registration_info(), readonly=self.readonly,
                    ttl=conf.registrationTtlSeconds, member=True)
            except MetadataError as e:
                if type(e) is not MetadataError or self.stopping:
                    raise
                delay = schedule.next_delay()
                if delay is None:
                    raise
                log.warning("metadata store unreachable, registering again in %.1fs: %s",
                            delay, e)
                time.sleep(delay)

    def _register(self):
        conf = self.conf
        try:
            reg = self._register_waiting()
        except BKError as e:
            # (the exit codes of the start's cookie check: an unreachable store is 5)
            self.exit_code = (EXIT_COOKIE if isinstance(e, ClusterIdentityError) else
                              EXIT_METADATA if isinstance(e, MetadataError) else EXIT_ERROR)
            self.exit_message = str(e)
            self.stopping = True
            os.write(self._wake_w, b"r")
            if self.on_ready:
                self.on_ready(str(e))
            return
        self.registration = reg
        if self.stopping:
            reg.close()
            return
        if reg.readonly != self.readonly:     # the disks changed while it registered
            self.tasks.put(("readonly", self.readonly))
        self.gc = GarbageCollector(conf, self.store, self.instance_id,
                                   os.path.abspath(conf.ledgerDirectories[0]),
                                   self.num_shards).start()
        if conf.bookieRack:
            # the bookie's own rack counts only where an operator set none (setrack wins)
            try:
                if set_rack_if_absent(self.store, conf.bookie_id, conf.bookieRack):
                    log.info("bookie %s: rack %s recorded", conf.bookie_id, conf.bookieRack)
            except BKError as e:
                log.warning("bookie %s: could not record bookieRack: %s", conf.bookie_id, e)
        self.meta_thread = threading.Thread(target=self._meta_thread, name="bk-meta",
                                            daemon=True)
        self.meta_thread.start()
        if conf.metadataCompactionIntervalSeconds > 0:
            self.compactor = Compactor(self.store, conf.bookie_id,
                                       conf.metadataCompactionIntervalSeconds,
                                       ttl=conf.registrationTtlSeconds,
                                       metrics=self.metrics).start()
        if conf.autoRecoveryDaemonEnabled:
            self.metrics.autorecovery = M.AutoRecoveryMetrics()
            self.autorecovery = self._make_autorecovery(conf, conf.bookie_id,
                                                        self.metrics.autorecovery).start()
        log.info("bookie %s registered", conf.bookie_id)
        if self.on_ready:
            self.on_ready(None)

    def _check_cookie_waiting(self) -> int:
        """layout.check_cookie, retried while the metadata store is unreachable for up
        to metadataServiceStartTimeoutSeconds: a bookie started with (or just before)
        etcd, or restarted by a supervisor during an etcd outage, waits instead of
        exiting. Any other answer (no cluster, another cookie) is final at once."""
        schedule = _START_BACKOFF.start(
            time.monotonic() + self.conf.metadataServiceStartTimeoutSeconds)
        while True:
            try:
                return layout.check_cookie(self.conf, self.store)
            except MetadataError as e:
                if type(e) is not MetadataError:      # answered: not formatted, refused...
                    raise
                delay = schedule.next_delay()
                if delay is None:
                    raise
                log.warning("metadata store unreachable, retrying in %.1fs: %s", delay, e)
                time.sleep(delay)
                if any(sig in (signal.SIGTERM, signal.SIGINT) for sig in self.signals):
                    log.info("stop requested while waiting for the metadata store")
                    raise BookieExit(EXIT_OK, "stopped") from None

    def _check_segment_size(self):
        """Every entry a frame can carry must fit one journal segment: otherwise such
        an ADD gets EBADREQ, and a client replaces this healthy bookie for it."""
        conf = self.conf
        need = conf.nettyMaxFrameSizeBytes + ADD_OVERHEAD + HEADER_SIZE
        if conf.journalPreAllocSizeMB << 20 < need:
            raise BookieExit(EXIT_CONFIG, (
                f"journalPreAllocSizeMB={conf.journalPreAllocSizeMB} is too small for "
                f"nettyMaxFrameSizeBytes={conf.nettyMaxFrameSizeBytes}: a journal segment must "
                f"hold the largest entry a frame can carry ({need} bytes with the record and "
                f"segment headers). Raise journalPreAllocSizeMB to at least "
                f"{-(-need >> 20)} or lower nettyMaxFrameSizeBytes"))

    def _registration_info(self) -> dict:
        return {"address": self.conf.advertisedAddress, "port": self.port,
                "numShards": self.num_shards, "protocolVersion": P.PROTOCOL_VERSION,
                "pid": os.getpid(), "startTime": time.time(),
                **({"httpPort": self.http_port} if self.http is not None else {})}

    def _bind_http(self):
        if not self.conf.httpServerEnabled:
            return
        try:
            self.http = self._views.server(self)
        except OSError as e:
            raise BookieExit(EXIT_BIND, f"cannot bind httpServerPort {self.conf.bind_address}:"
                                        f"{self.conf.httpServerPort}: {e.strerror}") from None
        self.http_port = self.http.port

    def _bind(self):
        sock = socket.socket(socket.AF_INET6 if ":" in self.conf.bind_address else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.conf.bind_address, self.conf.bookiePort))
        except OSError as e:
            sock.close()
            raise BookieExit(EXIT_BIND, f"cannot bind {self.conf.bind_address}:"
                                        f"{self.conf.bookiePort}: {e.strerror}") from None
        sock.listen(1024)
        sock.setblocking(False)
        self.listener = sock
        self.port = sock.getsockname()[1]
        self.sel.register(sock, selectors.EVENT_READ, "listen")
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")

    def _write_pid_file(self):
        path = self.conf.pid_file
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{os.getpid()}\n")
        os.replace(tmp, path)
        self.pid_file = path

    def _spawn(self, w: _Worker):
        a_end, w_end = control.pair()
        # Under w.lock until the new channel is w.ctrl: a round's deletions for this
        # shard (_gc_send) are then either among those the fork carries or sent on
        # the new channel, ahead of any connection handed over.
        with w.lock:
            self._fork(w, a_end, w_end, self.handed.of(w.shard))
        a_end.setblocking(True)
        a_end.settimeout(5.0)
        self.sel.register(a_end, selectors.EVENT_READ, w)
        log.debug("forked shard %d as pid %d", w.shard, w.pid)

    def _fork(self, w: _Worker, a_end, w_end, deleted):
        gc.freeze()          # the child's collector never walks what it inherits
        try:
            pid = os.fork()
        except BaseException:
            gc.unfreeze()
            raise
        if pid:
            gc.unfreeze()    # the arbiter collects its own as before; the child keeps them
        if pid == 0:   # child: never returns
            try:
                signal.set_wakeup_fd(-1)
                a_end.close()
                self.listener.close()
                if self.http is not None:
                    self.http.close_in_child()
                for other in self.workers:
                    if other.ctrl is not None:
                        other.ctrl.close()
                    for s, _b, _d in other.waiting:
                        s.close()
                os.close(self._wake_r)
                os.close(self._wake_w)
                if self._stop_with_fd is not None:
                    os.close(self._stop_with_fd)
                ShardWorker(self.conf, w.shard, self.num_shards, w_end, deleted=deleted).run()
            finally:
                os._exit(EXIT_ERROR)
        w_end.close()
        w.pid = pid
        w.ctrl = a_end
        w.ready = False
        w.replaying = False
        w.last_hb = time.monotonic()

    def _wait_ready(self):
        # A worker replaying a long journal reports progress ("replay"), which counts
        # as a heartbeat: only one that makes no progress for workerTimeoutMSec (at
        # least BOOT_TIMEOUT before its first report) fails the boot.
        limit = self.conf.workerTimeoutMSec / 1000.0
        start = time.monotonic()
        while not all(w.ready for w in self.workers):
            now = time.monotonic()
            stuck = [w.shard for w in self.workers if not w.ready and now - w.last_hb > limit
                     and (w.replaying or now - start > BOOT_TIMEOUT)]
            if stuck:
                raise BookieExit(EXIT_WORKER_BOOT, f"shard {stuck[0]} made no progress "
                                                   f"booting for {limit:.0f}s")
            self._poll(1.0)
            if self.stopping:
                raise BookieExit(self.exit_code or EXIT_OK, self.exit_message or "stopped")

    # --- loop ----------------------------------------------------------------------
    def _loop(self):
        conf = self.conf
        next_disk = time.monotonic()
        next_gc = time.monotonic() + conf.gcWaitTime / 1000.0
        while not self.stopping:
            self._poll(0.5)
            now = time.monotonic()
            self._check_heartbeats(now)
            self._expire_pending(now)
            if now >= next_disk:
                next_disk = now + conf.diskCheckInterval / 1000.0
                self._check_disk()
            if now >= next_gc:
                next_gc = now + conf.gcWaitTime / 1000.0
                self._start_gc()

    def _poll(self, timeout: float):
        for key, _mask in self.sel.select(timeout):
            data = key.data
            if data == "listen":
                self._accept()
            elif data == "wake":
                self._on_wake()
            elif isinstance(data, _Worker):
                self._on_control(data)
            elif isinstance(data, _Pending):
                self._read_hello(data)

    def _on_signal(self, signum, frame):
        self.signals.append(signum)

    def _on_wake(self):
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        sigs, self.signals = self.signals, []
        for sig in sigs:      # SIGTERM -> handle_term, ...; SIGCHLD and SIGHUP: reap below
            handler = getattr(self, "handle_" + signal.Signals(sig).name[3:].lower(), None)
            if handler is not None:
                handler(sig)
        self._reap()

    # --- signals (queued by _on_signal, acted on by the loop) ---------------------------
    def handle_term(self, sig: int):
        """Drain and stop."""
        if not self.stopping:
            log.info("received %s: stopping", signal.Signals(sig).name)
        self.stopping = True

    handle_int = handle_term

    def handle_usr1(self, sig: int):
        """Run a garbage collection round now, with a full reconcile (bk.bookie.gc)."""
        self._start_gc(full=True)

    def _reap(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            w = next((w for w in self.workers if w.pid == pid), None)
            if w is None:
                continue
            self._worker_died(w, status)

    def _worker_died(self, w: _Worker, status: int):
        how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
               else f"exit code {os.WEXITSTATUS(status)}")
        # Read what the worker said last (its boot error) before closing the channel.
        try:
            w.ctrl.setblocking(False)
            while True:
                msg, fds = control.recv(w.ctrl)
                if msg is None:
                    break
                if msg[0] == "error":
                    w.error = msg[1]
                elif msg[0] == "hb" and len(msg) > 1:   # its last counts
                    self.metrics.update(w.shard, msg[1])
        except OSError:
            pass
        self.metrics.worker_died(w.shard)
        try:
            self.sel.unregister(w.ctrl)
        except (KeyError, ValueError):
            pass
        with w.lock:                    # the metadata thread may be sending on it
            w.ctrl.close()
            w.ctrl = None
        w.pid = 0
        ev = self.dropped.get(w.shard)
        if ev is not None:              # its gc_drop will never be answered
            ev.set()
        if self.stopping:
            return
        if not w.ready:
            msg = getattr(w, "error", None) or f"shard {w.shard} failed to start ({how})"
            self.stopping = True
            self.exit_code, self.exit_message = EXIT_WORKER_BOOT, msg
            return
        now = time.monotonic()
        w.crashes = [t for t in w.crashes if now - t < RESTART_WINDOW] + [now]
        if len(w.crashes) > MAX_RESTARTS:
            self.stopping = True
            self.exit_code = EXIT_ERROR
            self.exit_message = (f"shard {w.shard} died {len(w.crashes)} times within "
                                 f"{RESTART_WINDOW:.0f}s (last: {how}); giving up")
            return
        try:
            layout.verify_local_cookies(self.conf)
        except BKError as e:
            self.stopping = True
            self.exit_code, self.exit_message = EXIT_COOKIE, f"shard {w.shard} died ({how}); {e}"
            return
        log.warning("shard %d died with %s; restarting it", w.shard, how)
        self.metrics.restarted(w.shard)
        self._gc_shard_done(w.shard)
        self._spawn(w)

    def _on_control(self, w: _Worker):
        if w.ctrl is None:
            # reaped earlier in this same batch of events (SIGCHLD came first): its
            # channel is closed and what it said last was read then
            return
        try:
            msg, fds = control.recv(w.ctrl)
        except (BlockingIOError, InterruptedError, socket.timeout):
            return
        except OSError:
            msg, fds = None, []
        for fd in fds:
            os.close(fd)
        if msg is None:
            # The worker is gone; SIGCHLD will reap it. Stop listening to its channel.
            try:
                self.sel.unregister(w.ctrl)
            except (KeyError, ValueError):
                pass
            return
        control.dispatch(self, control.TO_ARBITER, msg, w)

    # --- control messages from a worker (control.TO_ARBITER) ---------------------------
    def handle_hb(self, w: _Worker, snapshot=None):
        w.last_hb = time.monotonic()
        if snapshot is not None:
            self.metrics.update(w.shard, snapshot)

    def handle_replay(self, w: _Worker, done=None, total=None):
        w.last_hb = time.monotonic()
        w.replaying = True

    def handle_ready(self, w: _Worker, stats=None):
        w.ready = True
        w.last_hb = time.monotonic()
        waiting, w.waiting = w.waiting, []
        for sock, body, _deadline in waiting:
            self._hand_over(w, sock, body)

    def handle_error(self, w: _Worker, message: str):
        w.error = message
        log.error("%s", message)

    def handle_gc_ledgers(self, w: _Worker, ids, last, settled=()):
        w.gc_ledgers.extend(ids)
        w.gc_settled.extend(settled)
        if last:
            ids, w.gc_ledgers = w.gc_ledgers, []
            settled, w.gc_settled = w.gc_settled, []
            if self.gc_listing is not None and w.shard in self.gc_listing:
                self.gc_held[w.shard] = ids
                self.gc_settled[w.shard] = settled
                self.gc_listing.discard(w.shard)
                self._gc_check_when_listed()

    def _gc_check_when_listed(self):
        """Every shard of the full round reported (or died): one check for the bookie,
        at a revision taken after all the lists (bk.bookie.gc.GarbageCollector.check)."""
        if self.gc_listing is None or self.gc_listing:
            return
        self.gc_listing = None
        held, self.gc_held = self.gc_held, {}
        settled, self.gc_settled = self.gc_settled, {}
        if held:
            self.tasks.put(("gc_check", held, settled))

    def handle_gc_dropped(self, w: _Worker, count=0):
        self.metrics.overreplicated(dropped=count)
        ev = self.dropped.get(w.shard)
        if ev is not None:
            self.drop_counts[w.shard] = count
            ev.set()

    def handle_gc_done(self, w: _Worker, stats):
        self.gc_results[w.shard] = stats
        self._gc_shard_done(w.shard)

    def _gc_shard_done(self, shard: int):
        """A shard finished (or left: it died) the running GC round."""
        if self.gc_listing is not None and shard in self.gc_listing:
            self.gc_listing.discard(shard)      # died before it listed: the others go on
            self._gc_check_when_listed()
        if shard in self.gc_pending:
            self.gc_pending.discard(shard)
            if not self.gc_pending and self.gc_running:
                self.gc_running = False
                self.last_gc = dict(self.gc_results)
                self.metrics.gc_done(self.last_gc)
                log.debug("gc done: %s", self.last_gc)
                deleted = sum(r.get("ledgers_deleted", 0) for r in self.last_gc.values())
                self.tasks.put(("gc_finish", self.gc_round, set(self.last_gc), deleted))
                if self.gc_forced:
                    self._start_gc(full=True)

    def _check_heartbeats(self, now: float):
        limit = self.conf.workerTimeoutMSec / 1000.0
        for w in self.workers:
            if w.pid and w.ready and now - w.last_hb > limit:
                log.error("shard %d (pid %d) sent no heartbeat for %.0fs; killing it",
                          w.shard, w.pid, now - w.last_hb)
                try:
                    os.kill(w.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                w.last_hb = now

    # --- connections --------------------------------------------------------------
    def _accept(self):
        for _ in range(64):
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    log.error("cannot accept: %s", e.strerror)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            p = _Pending(sock, "%s:%s" % addr[:2])
            self.sel.register(sock, selectors.EVENT_READ, p)

    def _read_hello(self, p: _Pending):
        # Read exactly one frame: the 4-byte length, then exactly that many bytes.
        need = 4 - len(p.buf) if len(p.buf) < 4 else 4 + struct.unpack(">I", p.buf[:4])[0] - len(p.buf)
        try:
            data = p.sock.recv(need)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(p, None)
            return
        p.buf += data
        if len(p.buf) < 4:
            return
        n = struct.unpack(">I", p.buf[:4])[0]
        if n > 65536 or n == 0:
            self._drop(p, f"HELLO frame of {n} bytes")
            return
        if len(p.buf) < 4 + n:
            return
        body = bytes(p.buf[4:])
        self.sel.unregister(p.sock)
        try:
            msg = P.decode_body(body)
            if P.check_request(msg) != P.HELLO:
                raise ProtocolError(f"expected HELLO first, got {P.OP_NAMES[msg[0]]}")
            shard = msg[3]
            if shard == -1:
                shard = 0
            if type(shard) is not int or not 0 <= shard < self.num_shards:
                self._answer_and_close(p.sock, [P.HELLO, msg[1], EBADREQ, P.PROTOCOL_VERSION,
                                                self.num_shards, self.conf.bookie_id])
                log.warning("connection from %s asked for shard %r of %d", p.peer, shard,
                            self.num_shards)
                return
        except ProtocolError as e:
            log.warning("closing connection from %s: %s", p.peer, e)
            p.sock.close()
            return
        w = self.workers[shard]
        if w.ready and w.ctrl is not None:
            self._hand_over(w, p.sock, body)
        else:
            w.waiting.append((p.sock, body, time.monotonic() + HANDOVER_TIMEOUT))

    def _hand_over(self, w: _Worker, sock: socket.socket, body: bytes):
        try:
            with w.lock:
                control.send(w.ctrl, "conn", body, fds=[sock.fileno()])
            self.metrics.accepted += 1
        except OSError as e:
            log.warning("could not hand a connection to shard %d: %s", w.shard, e)
        sock.close()

    def _answer_and_close(self, sock, body):
        try:
            sock.setblocking(True)
            sock.settimeout(1.0)
            sock.sendall(P.encode_frame(body))
        except OSError:
            pass
        sock.close()

    def _drop(self, p: _Pending, reason):
        if reason:
            log.warning("closing connection from %s: %s", p.peer, reason)
        try:
            self.sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass
        p.sock.close()

    def _expire_pending(self, now: float):
        for key in list(self.sel.get_map().values()):
            if isinstance(key.data, _Pending) and now > key.data.deadline:
                self._drop(key.data, "no HELLO in time")
        for w in self.workers:
            if w.waiting:
                keep = []
                for sock, body, deadline in w.waiting:
                    if now > deadline:
                        sock.close()
                    else:
                        keep.append((sock, body, deadline))
                w.waiting = keep

    # --- disks, read-only mode ------------------------------------------------------
    def _over_threshold(self, usage: float) -> bool:
        if self.readonly:
            return usage >= self.conf.diskUsageLwmThreshold
        return usage >= self.conf.diskUsageThreshold

    def _check_disk(self):
        try:
            layout.verify_local_cookies(self.conf)
        except BKError as e:
            self.stopping = True
            self.exit_code, self.exit_message = EXIT_COOKIE, str(e)
            return
        usage = layout.disk_space(self.conf)["usage"]
        ro = self._over_threshold(usage)
        if ro == self.readonly:
            return
        if ro and not self.conf.readOnlyModeEnabled:
            self.stopping = True
            self.exit_code = EXIT_ERROR
            self.exit_message = (f"disk usage {usage:.1%} reached diskUsageThreshold "
                                 f"{self.conf.diskUsageThreshold:.1%} and readOnlyModeEnabled"
                                 f" is false: shutting down")
            return
        self.readonly = ro
        log.warning("disk usage %.1f%%: bookie turns %s", usage * 100,
                    "read-only" if ro else "writable")
        self._tell_workers("readonly", ro)
        self.tasks.put(("readonly", ro))

    def _tell_workers(self, *msg):
        for w in self.workers:
            if w.ctrl is not None:
                try:
                    with w.lock:
                        control.send(w.ctrl, *msg)
                except OSError as e:
                    log.warning("shard %d: cannot send %s: %s", w.shard, msg[0], e)

    # --- garbage collection ------------------------------------------------------------
    def _start_gc(self, full: bool = False):
        """Begin a GC round (bk.bookie.gc decides what it is): a full one asks each
        shard for its ledgers (gc_begin), an incremental one goes straight to the
        metadata thread with the deletions the watch reported."""
        if self.gc is None or self.stopping:
            return
        if self.gc_running:
            self.gc_forced = self.gc_forced or full
            return
        ready = [w for w in self.workers if w.ready and w.ctrl is not None]
        if not ready:
            return
        self.gc_forced = False
        rnd = self.gc_round = self.gc.begin([w.shard for w in ready], force_full=full)
        self.gc_running = True
        self.gc_results = {}
        self.gc_pending = {w.shard for w in ready}
        if not rnd.full:
            self.tasks.put(("gc_incremental", rnd))
            return
        self.gc_held = {}
        self.gc_settled = {}
        for w in ready:
            w.gc_ledgers = []
            w.gc_settled = []
            try:
                with w.lock:
                    control.send(w.ctrl, "gc_begin")
            except OSError:
                self.gc_pending.discard(w.shard)
        self.gc_listing = set(self.gc_pending)
        if not self.gc_pending:
            self.gc_running = False
            self.gc_listing = None

    def _meta_thread(self):
        """Blocking metadata work, off the loop: GC checks and read-only re-registration."""
        while True:
            task = self.tasks.get()
            if task is None:
                return
            if self.stopping and task[0] != "gc_finish":
                # deregistered, and a round not begun decides nothing: skipping it
                # is safe, and the stop (which waits for this thread) is not held
                # up by a reconcile or a scan
                continue
            try:
                if task[0] == "readonly":
                    self.registration.set_readonly(task[1])
                elif task[0] == "gc_check":
                    self._gc_check(task[1], task[2])
                elif task[0] == "gc_incremental":
                    dead = self.gc.incremental(task[1])
                    for shard in task[1].shards:
                        self._gc_send(shard, dead.get(shard, []))
                elif task[0] == "gc_finish":
                    self.gc.finish(task[1], task[2], task[3])
            except Exception as e:   # keep the thread alive: the next cycle retries
                log.warning("metadata task %s failed (retried): %s", task[0], e)
                if task[0] == "gc_check":
                    self.gc_round.failed = True
                    for shard in task[1]:
                        self._gc_send(shard, [])
                elif task[0] == "gc_incremental":
                    task[1].failed = True
                    for shard in task[1].shards:
                        self._gc_send(shard, [])

    def _gc_check(self, held: dict[int, list[int]], settled: dict[int, list[int]]):
        # A full round: every shard reported its ledgers before the check, so one it
        # holds that has no metadata at the checked revision was deleted (ids are
        # never reused); bk.bookie.gc checks only this bookie's cluster. The
        # over-replicated scan skips the settled ones (dropped already, no entry
        # since): claiming them again would cost a lock, metadata reads and a
        # GET_LIST_OF_ENTRIES on every bookie of their write sets, for nothing.
        dead = self.gc.check(self.gc_round, held)
        for shard, local_ids in sorted(held.items()):
            mine = dead.get(shard, [])
            if self.gc_round.overreplicated and not self.gc_round.failed:
                skip = set(mine).union(settled.get(shard, ()))
                self._gc_overreplicated(shard, [lid for lid in local_ids if lid not in skip],
                                        len(settled.get(shard, ())))
            self._gc_send(shard, mine)

    def _gc_overreplicated(self, shard: int, ledger_ids: list[int], settled: int = 0):
        """Drop the entries of ledgers this bookie holds but was replaced in (it was
        away while they were re-replicated), once every bookie of their write
        sets holds them; at the first full GC round and then at the first after each
        gcOverreplicatedLedgerWaitTime (reading the metadata of these ledgers only). The
        under-replication locks of those ledgers are held until the worker has
        dropped them (see bk.autorecovery.checker.claim_overreplicated).

        The ledgers are claimed :data:`OVERREP_GROUP` at a time and the bookie's
        stop is looked at before each candidate: a stop then drops what is
        claimed (the shard still serves: :meth:`_shutdown` waits for this thread
        before it stops the shards and closes the store) and releases every
        lock. ``bookie_gc_OVERREPLICATED_CLAIMS`` counts the claims,
        ``bookie_gc_OVERREPLICATED_DROPPED`` the ledgers whose entries the shard
        dropped (its ``gc_dropped`` answer)."""
        pool = BookiePool(self.store, timeout=10.0, security=self.security)
        stats = {"at": time.time(), "ledgers": len(ledger_ids), "settled": settled,
                 "candidates": 0, "claimed": 0}
        claimed = []
        try:
            for i in range(0, len(ledger_ids), OVERREP_GROUP):
                if self.stopping:
                    stats["stopped"] = True
                    break
                group = {}
                try:
                    claimed += claim_overreplicated(
                        self.store, pool, self.conf.bookie_id, ledger_ids[i:i + OVERREP_GROUP],
                        ttl=max(2, int(self.conf.registrationTtlSeconds)), stats=group,
                        stop=lambda: self.stopping)
                finally:
                    stats["candidates"] += group.get("candidates", 0)
                    stats["claimed"] = len(claimed)
                    if group.get("stopped"):
                        stats["stopped"] = True
        except BaseException:
            for _, lock in claimed:       # not dropped: nobody waits for these
                lock.release()
            raise
        finally:
            pool.close()
            self.last_overrep[shard] = stats
        if not claimed:
            return
        self.metrics.overreplicated(claims=len(claimed))
        # Each lock asked again just before the drop: one whose lease expired since
        # the claim may have let a replication worker copy the ledger back to this
        # bookie and put it in the ensemble again (soak19); its copy is kept.
        confirmed = []
        for lid, lock in claimed:
            try:
                ok = lock.confirm()
            except MetadataError:
                ok = False
            if ok:
                confirmed.append((lid, lock))
            else:
                log.warning("over-replicated ledger %d: its lock was lost since the claim; "
                            "its copy is kept", lid)
                lock.release()
        if not confirmed:
            return
        claimed = confirmed
        w = self.workers[shard]
        self.drop_counts.pop(shard, None)
        ev = self.dropped[shard] = threading.Event()
        try:
            with w.lock:
                control.send(w.ctrl, "gc_drop", [lid for lid, _ in claimed])
            if not ev.wait(60.0):
                log.warning("shard %d did not confirm dropping %d claimed over-replicated "
                            "ledgers", shard, len(claimed))
            elif shard not in self.drop_counts:     # set by the worker's death instead
                log.warning("shard %d died before confirming the drop of %d claimed "
                            "over-replicated ledgers", shard, len(claimed))
            else:
                log.info("shard %d: claimed %d over-replicated ledgers (e.g. %d), dropped "
                         "the entries of %d", shard, len(claimed), claimed[0][0],
                         self.drop_counts.pop(shard))
        except (OSError, AttributeError) as e:
            log.warning("shard %d: cannot send gc_drop: %s", shard, e)
        finally:
            self.dropped.pop(shard, None)
            for _, lock in claimed:
                lock.release()

    def _gc_send(self, shard: int, dead: list[int]):
        w = self.workers[shard]
        threshold = self.conf.compactionThreshold
        try:
            with w.lock:
                # first: a shard forked from now on (respawned) gets them with its fork
                self.handed.add(shard, dead)
                if w.ctrl is None:
                    return
                if not dead:
                    control.send(w.ctrl, "gc_delete", [], True, threshold)
                for i in range(0, len(dead), control.CHUNK):
                    chunk = dead[i:i + control.CHUNK]
                    control.send(w.ctrl, "gc_delete", chunk, i + control.CHUNK >= len(dead),
                                 threshold)
        except OSError as e:
            log.warning("shard %d: cannot send gc results: %s", shard, e)

    # --- stop -------------------------------------------------------------------------
    def _wait_meta_thread(self):
        """Let the metadata thread end its task before the shards stop and the store
        closes: an over-replicated claim holds under-replication locks (leases of
        this store) until its shard confirms the drop, so the loop goes on
        reading the shards' answers (``gc_dropped``) meanwhile. Queued tasks are
        skipped (:meth:`_meta_thread`), a scan stops at its next group of
        ledgers; a task stuck longer than :data:`META_STOP_TIMEOUT` (etcd or a
        bookie not answering) is left behind as before, to fail with the store."""
        t = self.meta_thread
        if t is None or t is threading.current_thread():
            return
        deadline = time.monotonic() + META_STOP_TIMEOUT
        while t.is_alive() and time.monotonic() < deadline:
            self._poll(0.05)
        if t.is_alive():
            log.warning("metadata task still running after %.0fs; stopping anyway",
                        META_STOP_TIMEOUT)

    def _shutdown(self):
        self.stopping = True
        if self.autorecovery is not None:
            try:
                self.autorecovery.stop()
            except Exception as e:
                log.warning("could not stop auto-recovery: %s", e)
        if self.http is not None:
            try:
                self.http.stop()
            except Exception as e:
                log.warning("could not stop the HTTP server: %s", e)
        if self.listener is not None:
            try:
                self.sel.unregister(self.listener)
            except (KeyError, ValueError):
                pass
            self.listener.close()
            self.listener = None
        if self.registration is not None:
            try:
                self.registration.close()
            except Exception as e:
                log.warning("could not deregister: %s", e)
        self.tasks.put(None)
        if self.gc is not None:
            self.gc.stop()
        self._wait_meta_thread()
        if self.compactor is not None:
            self.compactor.stop()
        for w in self.workers:
            if w.pid:
                try:
                    os.kill(w.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        # The signal alone would be seen only when the worker's select times out (up to
        # a heartbeat interval: select resumes after a handler): the message wakes it.
        self._tell_workers("stop")
        deadline = time.monotonic() + 30.0
        while any(w.pid for w in self.workers) and time.monotonic() < deadline:
            self._reap()
            if any(w.pid for w in self.workers):
                time.sleep(0.02)
        for w in self.workers:
            if w.pid:
                log.error("shard %d (pid %d) did not stop; killing it", w.shard, w.pid)
                try:
                    os.kill(w.pid, signal.SIGKILL)
                    os.waitpid(w.pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
            if w.ctrl is not None:
                w.ctrl.close()
                w.ctrl = None
        if self.store is not None:
            try:
                self.store.close()
            except Exception:
                pass
        pid_file = getattr(self, "pid_file", None)
        if pid_file:
            try:
                with open(pid_file) as f:
                    mine = f.read().strip() == str(os.getpid())
                if mine:
                    os.unlink(pid_file)
            except OSError:
                pass
