"""Metadata: ledger metadata model, the etcd-backed MetadataStore, and etcd servers."""

from bk.meta.etcd_server import EtcdCluster, EtcdServer, find_etcd_binary
from bk.meta.ledger import LedgerMetadata, LedgerState
from bk.meta.store import (BookieRegistration, CookieVersionError, MetadataStore,
                           parse_metadata_uri)

__all__ = [
    "MetadataStore", "BookieRegistration", "CookieVersionError", "parse_metadata_uri",
    "LedgerMetadata", "LedgerState", "EtcdServer", "EtcdCluster", "find_etcd_binary",
]
