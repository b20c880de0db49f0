"""The distributed check of every ledger's replicas (``check_ledgers``, ``bkshell
checkledgers``): the driver lists the ledgers, partitions check them in
parallel, each asking every bookie of each write set which entries it holds
(GET_LIST_OF_ENTRIES) and reporting what is missing."""

from __future__ import annotations

import dataclasses

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from bk import protocol as P
from bk.config import Config
from bk.errors import EOK, BKError, NoSuchLedgerError
from bk.meta.store import MetadataStore
from bk.rawclient import BookiePool
from bk.security import ClientSecurity
from bk.security.etcd import EtcdCredentials
from bk.spark.options import PROBLEM_SCHEMA, SECURITY_OPTIONS


@dataclasses.dataclass
class _LedgerIds(InputPartition):
    uri: str
    ids: list
    security: tuple = ()       # (key, value) client security settings (bk.security)


def _store(uri: str, security: tuple) -> tuple:
    """A metadata store and the bookies' security, from the check's settings."""
    conf = Config.load(overrides=dict(security))
    return (MetadataStore(uri, credentials=EtcdCredentials.from_conf(conf)),
            ClientSecurity.from_conf(conf))


def _check_one(store, pool, lid: int) -> list:
    try:
        md = store.read_ledger(lid)[0]
    except NoSuchLedgerError:
        return []           # deleted since it was listed
    bookies = sorted({b for _, ens in md.ensembles for b in ens})
    held, out = {}, []
    for b in bookies:
        try:
            r = pool.call(b, lid, P.get_list_of_entries, lid)
        except BKError as e:
            out.append((lid, -1, b, f"bookie unreachable: {e}"))
            continue
        held[b] = set(P.ranges_to_ids(r[4])) if r[2] == EOK and r[4] else set()
    if md.is_closed:
        last = md.last_entry_id
    else:
        # An open ledger is checked to its LAC: what the highest stored entry
        # says was confirmed before it (its writer may still be adding).
        top = max((max(s) for s in held.values() if s), default=-1)
        last = -1
        if top >= 0:
            for b in md.write_set(top):
                try:
                    r = pool.call(b, lid, P.read, lid, top)
                except BKError:
                    continue
                if r[2] == EOK:
                    last = max(last, int(r[5]))
    for i in range(len(md.ensembles)):
        lo, hi = md.fragment_bounds(i, last)
        for e in range(lo, hi + 1):
            for b in md.write_set(e):
                if b in held and e not in held[b]:
                    out.append((lid, e, b, "missing"))
    return out


def _check_partition(p: _LedgerIds):
    store, security = _store(p.uri, p.security)
    pool = BookiePool(store, security=security)
    try:
        for lid in p.ids:
            yield from _check_one(store, pool, lid)
    finally:
        pool.close()
        store.close()


class _CheckReader(DataSourceReader):
    def __init__(self, uri: str, parts: int, security: tuple = ()):
        self.uri, self.parts, self.security = uri, parts, security

    def partitions(self):
        store, _ = _store(self.uri, self.security)
        try:
            ids = list(store.list_ledgers())
        finally:
            store.close()
        n = max(1, min(self.parts, len(ids)))
        return [_LedgerIds(self.uri, ids[i::n], self.security) for i in range(n)]

    def read(self, partition):
        return _check_partition(partition)


class _CheckSource(DataSource):
    @classmethod
    def name(cls):
        return "bookkeeper_check"

    def schema(self):
        return PROBLEM_SCHEMA

    def reader(self, schema):
        uri = self.options.get("metadataServiceUri")
        given = {k.lower(): v for k, v in self.options.items()}
        security = tuple((k, given[k.lower()]) for k in SECURITY_OPTIONS if k.lower() in given)
        return _CheckReader(uri, int(self.options.get("partitions", "8")), security)


def check_ledgers(spark, uri: str, partitions: int | None = None,
                  security: dict | None = None):
    """A DataFrame of problems (ledger_id, entry_id, bookie, problem): every entry of
    every ledger (closed ones to their last entry, open ones to their LAC) that a
    bookie of its write set does not hold; entry_id -1 for a bookie unreachable.
    ``security``: the client's security settings (file paths and flags, see
    docs/security.md)."""
    if not isinstance(uri, str) or not uri.startswith("etcd://"):
        raise ValueError(f"check ledgers: {uri!r} is not a metadata service URI "
                         f"(etcd://host:port/prefix)")
    spark.dataSource.register(_CheckSource)
    n = partitions or max(2, spark.sparkContext.defaultParallelism * 2)
    reader = (spark.read.format("bookkeeper_check").option("metadataServiceUri", uri)
              .option("partitions", str(n)))
    for k, v in (security or {}).items():
        if k in SECURITY_OPTIONS and v not in ("", None):
            reader = reader.option(k, "true" if v is True else "false" if v is False else str(v))
    return reader.load()
