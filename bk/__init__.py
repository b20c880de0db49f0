"""bk: Apache BookKeeper's replicated-ledger storage, rebuilt in Python.

``bk.BookKeeper`` is the client (imported lazily, so that bookie processes do
not load the client and its etcd binding); ``bk.errors`` holds the one
exception hierarchy; ``bk.LedgerMetadata`` / ``bk.LedgerState`` describe ledgers;
``bk.Position`` / ``bk.LogRecord`` name and carry the records of logs (``bk.log``).
"""

from bk import errors
from bk.meta.ledger import LedgerMetadata, LedgerState

__version__ = "0.1.0"

__all__ = ["BookKeeper", "LedgerHandle", "LedgerEntry", "errors", "LedgerMetadata",
           "LedgerState", "Position", "LogRecord", "__version__"]


def __getattr__(name):
    if name == "BookKeeper":
        from bk.client.bookkeeper import BookKeeper
        return BookKeeper
    if name in ("LedgerHandle", "LedgerEntry"):
        from bk.client import ledger
        return getattr(ledger, name)
    if name in ("Position", "LogRecord"):
        from bk.log import records
        return getattr(records, name)
    raise AttributeError(f"module 'bk' has no attribute {name!r}")
