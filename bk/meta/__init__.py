"""Metadata: ledger metadata model, the etcd-backed MetadataStore, and etcd servers.

Names are imported on first use (PEP 562), so ``bk.meta.ledger`` (a plain
record) does not load the etcd binding.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "MetadataStore": "bk.meta.store",
    "BookieRegistration": "bk.meta.store",
    "CookieVersionError": "bk.meta.store",
    "parse_metadata_uri": "bk.meta.store",
    "LedgerMetadata": "bk.meta.ledger",
    "LedgerState": "bk.meta.ledger",
    "EtcdServer": "bk.meta.etcd_server",
    "EtcdCluster": "bk.meta.etcd_server",
    "find_etcd_binary": "bk.meta.etcd_server",
}

__all__ = list(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bk.meta' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
