"""bk: Apache BookKeeper's replicated-ledger storage, rebuilt in Python.

``bk.BookKeeper`` is the client; ``bk.errors`` holds the one exception
hierarchy; ``bk.LedgerMetadata`` / ``bk.LedgerState`` describe ledgers;
``bk.Position`` / ``bk.LogRecord`` name and carry the records of logs
(``bk.log``).

Every name is imported on first use (PEP 562): ``import bk.protocol`` (the
sans-IO codec) or a bookie's shard worker loads nothing of the client or of
the etcd binding.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "BookKeeper": "bk.client.bookkeeper",
    "LedgerHandle": "bk.client.ledger",
    "LedgerEntry": "bk.client.ledger",
    "LedgerMetadata": "bk.meta.ledger",
    "LedgerState": "bk.meta.ledger",
    "Position": "bk.log.records",
    "LogRecord": "bk.log.records",
}

__all__ = [*_LAZY, "errors", "__version__"]


def __getattr__(name):
    if name == "errors":
        return importlib.import_module("bk.errors")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bk' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value          # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
