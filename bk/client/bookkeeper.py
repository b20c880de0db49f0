"""The client entry point: :class:`BookKeeper`."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time

from bk.client import digest as _digest
from bk.client.connection import DeadConnection, IOLoop
from bk.client.health import BookieHealth
from bk.client.ledger import _FRAME_OVERHEAD, LedgerHandle
from bk.client.placement import PlacementPolicy
from bk.client.recovery import check_password, recover_ledger
from bk import log as bklog
from bk.config import Config
from bk.errors import (BKError, ClusterIdentityError, ClusterNotFormattedError,
                       LedgerExistsError, MetadataError, NotEnoughBookiesError)
from bk.errors import EOK
from bk.log.reader import LogReader
from bk.log.records import check_log_name
from bk.log.writer import CONF_KEYS, SHAPE_KEYS, LogWriter
from bk.meta.ledger import LedgerMetadata, LedgerState
from bk.meta.racks import all_racks
from bk.meta.store import LIST_PAGE, MetadataStore
from bk.exposition import client_registry
from bk.security import ClientSecurity
from bk.security.etcd import EtcdCredentials
from bk import protocol

log = logging.getLogger("bk.client")


def _check_uri(uri) -> str:
    if not isinstance(uri, str) or not uri:
        raise ValueError("a metadata service URI (etcd://host:port/prefix) is required: pass "
                         "it, or set metadataServiceUri / BK_metadataServiceUri")
    if not uri.startswith("etcd://"):
        raise ValueError(f"metadata service URI {uri!r}: unsupported scheme, expected "
                         f"etcd://host:port[,host:port...]/prefix")
    return uri


class BookKeeper:
    """A client of one bk cluster; thread-safe; ``with`` closes it.

    ``BookKeeper("etcd://127.0.0.1:2379/ledgers")``, or ``BookKeeper(conf=Config)``,
    or ``BookKeeper(uri, addEntryTimeoutSec=5, throttle=1000)`` (settings of
    ``bk.config`` by name).
    """

    def __init__(self, uri_or_none=None, conf: Config | None = None, **overrides):
        if isinstance(uri_or_none, Config):
            conf, uri_or_none = uri_or_none, None
        if conf is None:
            conf = Config.load(overrides={k: v for k, v in overrides.items()})
        elif overrides:
            conf = conf.with_overrides(**overrides)
        uri = uri_or_none or conf.metadataServiceUri
        self.uri = _check_uri(uri)
        if conf.metadataServiceUri != uri:
            conf = conf.with_overrides(metadataServiceUri=uri)
        self.conf = conf
        security = ClientSecurity.from_conf(conf)   # bad TLS files or token: fail first
        etcd_credentials = EtcdCredentials.from_conf(conf)
        self._placement = PlacementPolicy.from_conf(conf)
        self._closed = False
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._shards: dict[str, int] = {}
        # Ledger ids reserved in blocks (MetadataStore.reserve_ledger_ids): creating a
        # ledger then costs one etcd transaction. The lock guards only this list; a
        # thread that finds it empty reserves a block with no lock held.
        self._ids_lock = threading.Lock()
        self._ids: list[range] = []
        self._pw_keys: dict[bytes, tuple[bytes, bytes]] = {}   # see _password_keys
        # Writable bookies as the watch of bookies/ last saw them (see _writable_view).
        self._view_lock = threading.Lock()
        self._view: frozenset | None = None
        self._view_pid = 0
        self._cancel_watch = None
        self._store_cls = MetadataStore
        self._store = MetadataStore(uri, timeout=conf.metadataTimeoutMillis / 1000.0,
                                    credentials=etcd_credentials)
        try:
            # Touch etcd now so that an unreachable store fails here, naming the URI,
            # and a prefix with no cluster (a typo) fails before anything is created.
            self._store.cluster()
        except (ClusterNotFormattedError, ClusterIdentityError):
            self._store.close()
            raise
        except BKError as e:
            self._store.close()
            raise MetadataError(f"connect to metadata store {uri}: {e}") from None
        self._io = IOLoop(max_frame_size=conf.nettyMaxFrameSizeBytes,
                          connect_timeout=conf.clientConnectTimeoutMillis / 1000.0,
                          security=security,
                          batching=conf.frameBatching)
        self._health = BookieHealth(conf.bookieQuarantineTimeSeconds)
        self._io.health = self._health
        self._executor_obj = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="bk-meta")

    def bookie_health(self) -> dict:
        """The bookies this client saw fail: ``{bookie id: {"failures": n,
        "quarantined": bool}}`` (quarantined ones are read from last and not picked
        as replacements for ``bookieQuarantineTimeSeconds``)."""
        return self._health.snapshot()

    @property
    def metrics_registry(self):
        """The prometheus_client registry of the client metrics (add/read latency,
        ensemble changes, recoveries, bookie errors), shared by every client of this
        process: expose it with ``prometheus_client.generate_latest`` or
        ``start_http_server(port, registry=...)``."""
        return client_registry()

    @property
    def _executor(self):
        """Worker threads for metadata work off the I/O thread (ensemble changes)."""
        if os.getpid() != self._pid:
            self._after_fork()
        return self._executor_obj

    # --- lifecycle ---------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self._pid:
            self._io.stop()
            self._executor_obj.shutdown(wait=False)
        if self._cancel_watch is not None and self._view_pid == os.getpid():
            self._cancel_watch()
        self._store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<BookKeeper {self.uri}{' closed' if self._closed else ''}>"

    def _check(self):
        if self._closed:
            raise BKError(f"client of {self.uri} is closed")
        if os.getpid() != self._pid:
            self._after_fork()

    def _after_fork(self):
        with self._lock:
            if os.getpid() == self._pid:
                return
            # The store re-creates its gRPC channel itself; the I/O loop resets on
            # first use; the executor's threads do not exist in the child.
            self._executor_obj = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="bk-meta")
            # The parent hands out the ids it reserved: the child reserves its own.
            self._ids_lock = threading.Lock()
            self._ids = []
            self._pid = os.getpid()

    # --- which bookies are writable ---------------------------------------------
    def _on_bookies(self, writable: set, readonly: set) -> None:
        self._view = frozenset(writable)

    def _writable_view(self) -> frozenset:
        """The writable bookies, kept current by a watch of ``bookies/available`` and
        ``bookies/readonly`` (started on first use; its start reads both, so the
        view is never older than the watch). A dead bookie leaves it when its
        lease expires, a new one joins it when it registers."""
        pid = os.getpid()
        if self._view is None or self._view_pid != pid:
            with self._view_lock:
                if self._view is None or self._view_pid != pid:
                    # After a fork the parent's watch thread does not exist here.
                    self._view = None
                    self._cancel_watch = self._store.watch_bookies(self._on_bookies)
                    self._view_pid = pid
        return self._view

    def _place(self, choose, avoid=frozenset()):
        """``choose(writable)`` on the watched view less the bookies to avoid: those
        this client has quarantined (``bk.client.health``) and ``avoid`` (a
        handle's own memory of bookies that failed it). Avoiding is a preference,
        never an exclusion: if too few are left, on the whole view (a bookie that
        failed a while ago beats no ensemble at all); then once more on a fresh
        read (the watch may lag a bookie that registered a moment ago, e.g. right
        after ``bkshell`` or a test added it)."""
        view = self._writable_view()
        bad = self._health.quarantined_set() | set(avoid)
        if bad and view & bad:
            try:
                return choose(view - bad)
            except NotEnoughBookiesError as e:
                log.info("placement: not enough bookies without the quarantined %s (%s); "
                         "using them", sorted(view & bad), e)
        try:
            return choose(view)
        except NotEnoughBookiesError:
            return choose(self._store.list_bookies())

    def _racks(self) -> dict:
        """bookie id -> rack, read from etcd when the placement policy needs them
        (once per placement: an operator's setrack counts from the next one)."""
        return all_racks(self._store) if self._placement.rack_aware else {}

    @property
    def max_entry_size(self) -> int:
        """The largest payload one add takes (nettyMaxFrameSizeBytes less an ADD's
        header fields and digest)."""
        return int(self.conf.nettyMaxFrameSizeBytes) - _FRAME_OVERHEAD

    # --- bookie connections ------------------------------------------------
    def _connection(self, bookie_id: str, ledger_id: int):
        """The connection for ``ledger_id``'s shard on ``bookie_id`` (caller thread)."""
        n = self._shards.get(bookie_id)
        if n is None:
            n = self._resolve(bookie_id)
            if n is None:
                return DeadConnection(self._io, bookie_id, "not registered and not reachable")
        return self._io.conn(bookie_id, protocol.shard_of(ledger_id, n))

    def _resolve(self, bookie_id: str):
        """Learn the address and shard count of a bookie: registration, else HELLO."""
        try:
            info = self._store.bookie_info(bookie_id)
        except BKError as e:
            log.warning("cannot read the registration of bookie %s: %s", bookie_id, e)
            info = None
        if info:
            addr = info.get("address")
            port = info.get("port")
            if addr and port:
                self._io.addresses[bookie_id] = (str(addr), int(port))
            n = info.get("numShards")
            if n:
                self._shards[bookie_id] = int(n)
                return int(n)
        # Not registered (dead?) or no shard count: ask the bookie itself.
        conn = self._io.conn(bookie_id, -1)
        call = self._io.request(conn, protocol.ping, timeout=self.conf.clientConnectTimeoutMillis
                                / 1000.0)
        call.wait(self.conf.clientConnectTimeoutMillis / 1000.0 + 2)
        if call.reply is not None and call.reply[2] == EOK and conn.num_shards:
            self._shards[bookie_id] = int(conn.num_shards)
            return int(conn.num_shards)
        return None

    # --- ledgers -------------------------------------------------------------
    def create_ledger(self, ensemble_size: int = 3, write_quorum_size: int = 2,
                      ack_quorum_size: int = 2, digest_type: str = "crc32c",
                      password: bytes = b"", custom_metadata: dict | None = None,
                      ledger_id: int | None = None) -> LedgerHandle:
        """Create a ledger and return its write handle.

        ``ledger_id`` (BookKeeper's ``createLedgerAdv(ledgerId, ...)``): create the
        ledger under this id, allocated beforehand with :meth:`new_ledger_id` (so that
        the caller can record the id somewhere before the ledger exists);
        LedgerExistsError if it is taken."""
        self._check()
        for name, v in (("ensemble_size", ensemble_size), ("write_quorum_size", write_quorum_size),
                        ("ack_quorum_size", ack_quorum_size)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"create ledger: {name} must be an integer, not {v!r}")
        if not ensemble_size >= write_quorum_size >= ack_quorum_size >= 1:
            raise ValueError(
                f"create ledger: need ensemble_size >= write_quorum_size >= ack_quorum_size >= 1, "
                f"got E={ensemble_size} Qw={write_quorum_size} Qa={ack_quorum_size}")
        _digest.check_digest_type(digest_type)
        if not isinstance(password, (bytes, bytearray)):
            raise TypeError(f"create ledger: password must be bytes, not "
                            f"{type(password).__name__}")
        custom = {}
        for k, v in (custom_metadata or {}).items():
            if not isinstance(k, str):
                raise TypeError(f"create ledger: custom metadata keys must be str, not {k!r}")
            if isinstance(v, str):
                v = v.encode("utf-8")
            if not isinstance(v, (bytes, bytearray)):
                raise TypeError(f"create ledger: custom metadata value of {k!r} must be bytes")
            custom[k] = bytes(v)
        try:
            racks = self._racks()
            ensemble = self._place(lambda writable: self._placement.new_ensemble(
                writable, ensemble_size, write_quorum_size, racks))
        except NotEnoughBookiesError as e:
            raise NotEnoughBookiesError(f"create ledger with ensemble size {ensemble_size}: {e}") \
                from None
        pw = bytes(password)
        pw_digest, key = self._password_keys(pw)
        for _ in range(10 if ledger_id is None else 1):
            lid = self._next_ledger_id() if ledger_id is None else int(ledger_id)
            md = LedgerMetadata.new(ledger_id=lid, ensemble_size=ensemble_size,
                                    write_quorum_size=write_quorum_size,
                                    ack_quorum_size=ack_quorum_size, ensembles=[(0, ensemble)],
                                    digest_type=digest_type,
                                    password_digest=pw_digest, master_key=key,
                                    ctime=time.time(), custom_metadata=custom)
            try:
                version = self._store.create_ledger(md)
                break
            except LedgerExistsError:
                if ledger_id is not None:
                    raise
                continue
        else:
            raise MetadataError("create ledger: could not allocate a free ledger id")
        return LedgerHandle(self, md, version, pw, writable=True, master_key=key)

    def _password_keys(self, pw: bytes) -> tuple[bytes, bytes]:
        """(salted password digest, master key) of ``pw`` for the metadata of the
        ledgers this client creates: hashed once per password, not per ledger (the
        salt is then shared by this client's ledgers of one password, which only
        tells that their passwords are equal)."""
        keys = self._pw_keys.get(pw)
        if keys is None:
            keys = (_digest.password_digest(pw), _digest.master_key(pw))
            if len(self._pw_keys) >= 64:      # many passwords: a bounded cache
                self._pw_keys.clear()
            self._pw_keys[pw] = keys
        return keys

    def _next_ledger_id(self) -> int:
        while True:
            with self._ids_lock:
                while self._ids:
                    block = self._ids[0]
                    if block:
                        self._ids[0] = block[1:]
                        return block[0]
                    self._ids.pop(0)
            # Several threads may reserve at once: each block is theirs alone, and the
            # ids left over in one are skipped (ids are sparse anyway).
            block = self._store.reserve_ledger_ids()
            with self._ids_lock:
                self._ids.append(block)
                self._ids.sort(key=lambda r: r.start)

    def new_ledger_id(self) -> int:
        """A ledger id no ledger has or will be given (for ``create_ledger(ledger_id=)``)."""
        self._check()
        return self._store.new_ledger_id()

    def open_ledger(self, ledger_id: int, password: bytes = b"") -> LedgerHandle:
        """Open with recovery: fence the ledger, recover its tail, close it.

        (Administrators without the password: ``bk.client.recovery.recover_ledger``
        with the metadata's master key.)"""
        self._check()
        if not isinstance(password, (bytes, bytearray)):
            raise TypeError(f"open ledger {ledger_id}: password must be bytes, not "
                            f"{type(password).__name__}")
        md, version = recover_ledger(self, ledger_id, password=password)
        return LedgerHandle(self, md, version, bytes(password), writable=False,
                            lac=md.last_entry_id)

    def open_ledger_no_recovery(self, ledger_id: int, password: bytes = b"") -> LedgerHandle:
        """Open without fencing: readable up to the LAC, which can be refreshed."""
        self._check()
        md, version = self._store.read_ledger(ledger_id)
        check_password(md, password, f"open ledger {ledger_id}")
        lac = md.last_entry_id if md.state == LedgerState.CLOSED else -1
        h = LedgerHandle(self, md, version, bytes(password), writable=False, lac=lac)
        if md.state != LedgerState.CLOSED:
            try:
                h.read_last_add_confirmed()
            except BKError as e:
                log.info("open ledger %d: LAC unknown for now: %s", ledger_id, e)
        return h

    def delete_ledger(self, ledger_id: int) -> None:
        """Delete the ledger's metadata; bookies garbage-collect its entries."""
        self._check()
        self._store.delete_ledger(ledger_id)

    def list_ledgers(self, page_size: int = LIST_PAGE):
        """Iterator of the ids of every ledger, ascending; lazy, one metadata range
        request per ``page_size`` ids (never the whole listing in one request)."""
        self._check()
        return self._store.list_ledgers(page_size=page_size)

    def ledger_metadata(self, ledger_id: int) -> LedgerMetadata:
        self._check()
        return self._store.read_ledger(ledger_id)[0]

    def bookies(self, readonly: bool = False) -> list[str]:
        """Ids of the registered writable (or read-only) bookies."""
        self._check()
        return self._store.list_bookies(readonly=readonly)

    # --- logs (bk.log) ------------------------------------------------------------
    def open_log_writer(self, name: str, **opts):
        """Take ownership of log ``name`` (created if absent) and return its writer.

        ``opts``: ``logRollBytes``, ``logRollEntries``, ``logRollSeconds``,
        ``logBatchBytes``, ``logBatchLingerMs`` (default: this client's conf) and
        ``ensemble_size``, ``write_quorum_size``, ``ack_quorum_size``."""
        self._check()
        check_log_name(name)
        unknown = sorted(set(opts) - set(CONF_KEYS) - set(SHAPE_KEYS))
        if unknown:
            raise TypeError(f"open log writer {name}: unknown option(s) {', '.join(unknown)}")
        conf = self.conf.with_overrides(**{k: v for k, v in opts.items() if k in CONF_KEYS})
        shape = {"ensemble_size": 3, "write_quorum_size": 2, "ack_quorum_size": 2}
        shape.update({k: v for k, v in opts.items() if k in SHAPE_KEYS})
        return LogWriter(self, name, conf, shape)

    def open_log_reader(self, name: str, start="earliest"):
        """A reader of log ``name`` from ``"earliest"``, ``"latest"`` or a Position."""
        self._check()
        return LogReader(self, check_log_name(name), start)

    def create_log(self, name: str) -> bool:
        """Create an empty log (no writer yet); False if it exists."""
        self._check()
        return bklog.create_log(self, name)

    def list_logs(self) -> list[str]:
        """Names of every log, sorted."""
        self._check()
        return bklog.list_logs(self)

    def log_info(self, name: str):
        """A LogInfo: name, segments, first/last position, records, bytes."""
        self._check()
        return bklog.log_info(self, name)

    def truncate_log(self, name: str, before) -> list[int]:
        """Drop the records before Position ``before``: the ledgers that end before it
        are deleted (never the open one). Returns the deleted ledger ids."""
        self._check()
        return bklog.truncate_log(self, name, before)

    def delete_log(self, name: str) -> list[int]:
        """Delete the log and its ledgers. Returns the deleted ledger ids."""
        self._check()
        return bklog.delete_log(self, name)
