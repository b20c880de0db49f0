"""The client entry point: :class:`BookKeeper`."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time

from bk.client import digest as _digest
from bk.client.connection import DeadConnection, IOLoop
from bk.client.health import BookieHealth
from bk.client.ledger import _FRAME_OVERHEAD, LedgerHandle, _AddFuture
from bk.client.placement import PlacementPolicy
from bk.client.recovery import check_password, recover_ledger
from bk import log as bklog
from bk.config import Config
from bk.errors import (BKError, ClientClosedError, ClusterIdentityError,
                       ClusterNotFormattedError, LedgerExistsError, MetadataError,
                       NoSuchLedgerError, NotEnoughBookiesError)
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

_CREATE_TRIES = 10      # ledger ids tried by a create whose id was taken (an old cluster)
# When this many ids are left in the last reserved block, the next block is
# reserved on a metadata thread (a block holds 2**ID_BLOCK_BITS ids).
_ID_REFILL_AT = 256


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

    Closing: :meth:`close` may be called from any thread while others use the
    client. Every call pending on its bookies then ends at once with
    :class:`bk.errors.ClientClosedError` (a ``BookieUnavailableError``), not at
    its own timeout: adds (blocking, pipelined or futures), reads, LAC reads
    and long polls (``read_last_add_confirmed_and_entry``, a log reader's
    tail), recovery opens, ledger closes waiting for their adds. Every call
    made afterwards raises it at once, on the client and on its handles and
    log readers. A call whose metadata request meets the store closing with
    the client (an open, a recovery, a read's refresh, a create, a delete, a
    listing, a metadata read) raises it too, not the store's MetadataError. A forked child's copy of a closed
    client is closed too, and a child's close() ends only the child's I/O
    thread.
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
        self._ids_refilling = False   # a block is being reserved ahead (_refill_ids_later)
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
                          batching=conf.frameBatching,
                          slice_us=conf.ioThreadSliceMicros)
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
        """Close the client. When it returns, nothing of it runs any more: every
        call pending on it ended (``ClientClosedError``), its I/O thread has
        ended with every bookie socket closed, its watch of the bookies is
        cancelled, its etcd channel closed, and its metadata threads (ensemble
        changes, ``close_async``) have ended. Called from the client's own I/O
        thread (an add callback) or one of its metadata threads (a
        ``close_async`` callback), it cannot wait for that thread: it ends
        once the callback returns."""
        if self._closed:
            return
        self._closed = True
        # (a forked child's copy too: the loop knows whether its thread is ours)
        self._io.stop()
        if self._cancel_watch is not None and self._view_pid == os.getpid():
            self._cancel_watch()
        # The store first: a metadata thread waiting on etcd then fails at once
        # (its caller gets ClientClosedError) instead of being waited out.
        self._store.close()
        if os.getpid() == self._pid:
            ex = self._executor_obj
            # a task still queued runs (and fails at once: the client is closed),
            # so that whoever waits on it is answered; never cancelled
            ex.shutdown(wait=threading.current_thread() not in getattr(ex, "_threads", ()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<BookKeeper {self.uri}{' closed' if self._closed else ''}>"

    def _check(self):
        if self._closed:
            raise ClientClosedError(f"client of {self.uri} is closed")
        if os.getpid() != self._pid:
            self._after_fork()

    def _closed_error(self, what: str) -> ClientClosedError:
        return ClientClosedError(f"{what}: client of {self.uri} is closed")

    @contextlib.contextmanager
    def _store_call(self, what: str):
        """A call to the metadata store: the MetadataError of a call that close()
        ended under it (the store closes with the client) is ClientClosedError,
        as every other call pending at close ends."""
        try:
            yield
        except MetadataError:
            if self._closed:
                raise self._closed_error(what) from None
            raise

    def _store_iter(self, it, what: str):
        with self._store_call(what):
            yield from it

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
            self._ids_refilling = False
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
        with self._store_call("create ledger"):     # (ids, the bookies' view, the record)
            c = self._new_ledger(ensemble_size, write_quorum_size, ack_quorum_size,
                                 digest_type, password, custom_metadata, ledger_id)
            for _ in range(_CREATE_TRIES if ledger_id is None else 1):
                md = c.metadata()
                try:
                    version = self._store.create_ledger(md)
                    break
                except LedgerExistsError:
                    if ledger_id is not None:
                        raise
                    continue
            else:
                raise MetadataError("create ledger: could not allocate a free ledger id")
        return c.handle(md, version)

    def create_ledger_async(self, ensemble_size: int = 3, write_quorum_size: int = 2,
                            ack_quorum_size: int = 2, digest_type: str = "crc32c",
                            password: bytes = b"", custom_metadata: dict | None = None,
                            ledger_id: int | None = None, callback=None):
        """:meth:`create_ledger` without blocking (BookKeeper's ``asyncCreateLedger``).

        Without ``callback``: returns a ``concurrent.futures.Future`` of the
        LedgerHandle. With ``callback``: calls ``callback(exc_or_None, handle)``
        and returns None. Bad arguments raise ValueError/TypeError at once; every
        other error (NotEnoughBookiesError, LedgerExistsError, MetadataError...)
        comes through the future or callback, as the blocking call raises it. The
        outcome is delivered on the client's metadata thread: keep callbacks short
        and never wait there on another metadata call."""
        done = _AddFuture() if callback is None else callback
        try:
            c = self._new_ledger(ensemble_size, write_quorum_size, ack_quorum_size,
                                 digest_type, password, custom_metadata, ledger_id)
        except BKError as e:
            done(e, None)
            return done if callback is None else None
        c.done = done
        c.start()
        return done if callback is None else None

    def _new_ledger(self, ensemble_size, write_quorum_size, ack_quorum_size, digest_type,
                    password, custom_metadata, ledger_id) -> "_Create":
        """Check the arguments of a create, place its ensemble: a :class:`_Create`."""
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
        for b in ensemble:
            # learn an unknown bookie's shards here, not on the thread that
            # completes an asynchronous create (it would hold up other ledgers)
            if b not in self._shards:
                self._resolve(b)
        pw = bytes(password)
        pw_digest, key = self._password_keys(pw)
        return _Create(self, (ensemble_size, write_quorum_size, ack_quorum_size), ensemble,
                       digest_type, pw, pw_digest, key, custom,
                       None if ledger_id is None else int(ledger_id))

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
            refill = False
            with self._ids_lock:
                while self._ids:
                    block = self._ids[0]
                    if block:
                        self._ids[0] = block[1:]
                        if len(block) == _ID_REFILL_AT and len(self._ids) == 1 \
                                and not self._ids_refilling:
                            self._ids_refilling = refill = True
                        break
                    self._ids.pop(0)
                else:
                    block = None
            if block is not None:
                if refill:
                    self._refill_ids_later()
                return block[0]
            # Several threads may reserve at once: each block is theirs alone, and the
            # ids left over in one are skipped (ids are sparse anyway).
            self._add_ids(self._store.reserve_ledger_ids())

    def _add_ids(self, block: range) -> None:
        with self._ids_lock:
            self._ids.append(block)
            self._ids.sort(key=lambda r: r.start)

    def _refill_ids_later(self) -> None:
        """Reserve the next block of ids on a metadata thread while this one still
        lasts: no create (blocking or not) waits for an idgen write then."""
        def refill():
            try:
                self._add_ids(self._store.reserve_ledger_ids())
            except BKError as e:
                log.info("reserving ledger ids ahead failed (the next create will): %s", e)
            finally:
                self._ids_refilling = False
        try:
            self._executor.submit(refill)
        except RuntimeError:          # the client is closing
            self._ids_refilling = False

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
        try:
            md, version = self._store.read_ledger(ledger_id)
        except MetadataError:
            if self._closed:            # the store closed with the client
                raise self._closed_error(f"open ledger {ledger_id}") from None
            raise
        check_password(md, password, f"open ledger {ledger_id}")
        lac = md.last_entry_id if md.state == LedgerState.CLOSED else -1
        h = LedgerHandle(self, md, version, bytes(password), writable=False, lac=lac)
        if md.state != LedgerState.CLOSED:
            try:
                h.read_last_add_confirmed()
            except (ClientClosedError, NoSuchLedgerError):
                raise           # (the latter: deleted during the open)
            except BKError as e:
                log.info("open ledger %d: LAC unknown for now: %s", ledger_id, e)
        return h

    def delete_ledger(self, ledger_id: int) -> None:
        """Delete the ledger's metadata; bookies garbage-collect its entries."""
        self._check()
        with self._store_call(f"delete ledger {ledger_id}"):
            self._store.delete_ledger(ledger_id)

    def list_ledgers(self, page_size: int = LIST_PAGE):
        """Iterator of the ids of every ledger, ascending; lazy, one metadata range
        request per ``page_size`` ids (never the whole listing in one request)."""
        self._check()
        return self._store_iter(self._store.list_ledgers(page_size=page_size), "list ledgers")

    def ledger_metadata(self, ledger_id: int) -> LedgerMetadata:
        self._check()
        with self._store_call(f"ledger {ledger_id}'s metadata"):
            return self._store.read_ledger(ledger_id)[0]

    def bookies(self, readonly: bool = False) -> list[str]:
        """Ids of the registered writable (or read-only) bookies."""
        self._check()
        with self._store_call("list bookies"):
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


class _Create:
    """One ledger create under way: its checked arguments and ensemble; the ids it
    tries; ``done(exc, handle)`` of an asynchronous create.

    Theory of operation of ``create_ledger_async``: the calling thread checks
    the arguments, places the ensemble, takes an id from the reserved block
    (:meth:`BookKeeper._next_ledger_id`, which reserves the next block ahead on
    a metadata thread) and queues the create's etcd transaction on the store's
    combiner (:meth:`MetadataStore.create_ledger_async`), then returns. The
    combiner's sender thread sends it, shared with other creates and closes,
    and calls :meth:`created`: it builds the handle and completes the future,
    or, if the generated id was taken, queues the create again with a new id
    (as the blocking create retries). No thread waits per ledger."""

    __slots__ = ("client", "shape", "ensemble", "digest_type", "pw", "pw_digest", "key",
                 "custom", "ledger_id", "tries", "done", "md")

    def __init__(self, client, shape, ensemble, digest_type, pw, pw_digest, key, custom,
                 ledger_id):
        self.client = client
        self.shape = shape
        self.ensemble = ensemble
        self.digest_type = digest_type
        self.pw = pw
        self.pw_digest = pw_digest
        self.key = key
        self.custom = custom
        self.ledger_id = ledger_id      # given by the caller, or None: generated
        self.tries = 0
        self.done = None
        self.md = None

    def metadata(self) -> LedgerMetadata:
        """The new ledger's metadata under the next id to try."""
        client = self.client
        lid = client._next_ledger_id() if self.ledger_id is None else self.ledger_id
        e, qw, qa = self.shape
        return LedgerMetadata.new(ledger_id=lid, ensemble_size=e, write_quorum_size=qw,
                                  ack_quorum_size=qa, ensembles=[(0, self.ensemble)],
                                  digest_type=self.digest_type,
                                  password_digest=self.pw_digest, master_key=self.key,
                                  ctime=time.time(), custom_metadata=self.custom)

    def handle(self, md, version) -> LedgerHandle:
        return LedgerHandle(self.client, md, version, self.pw, writable=True,
                            master_key=self.key)

    def start(self) -> None:
        self.tries += 1
        try:
            self.md = self.metadata()
            self.client._store.create_ledger_async(self.md, self.created)
        except BaseException as e:        # e.g. reserving ids failed: the caller's error
            self.done(self._closed(e), None)

    def _closed(self, exc):
        """``exc``, or ClientClosedError if it is the store closing with the client."""
        if isinstance(exc, MetadataError) and self.client._closed:
            return self.client._closed_error("create ledger")
        return exc

    def created(self, exc, version) -> None:
        exc = self._closed(exc)
        if exc is None:
            try:
                h = self.handle(self.md, version)
            except BaseException as e:
                self.done(e, None)
                return
            self.done(None, h)
        elif isinstance(exc, LedgerExistsError) and self.ledger_id is None:
            if self.tries < _CREATE_TRIES:
                self.start()
            else:
                self.done(MetadataError("create ledger: could not allocate a free ledger id"),
                          None)
        else:
            self.done(exc, None)
