"""One exception hierarchy for all of bk.

Every failure a user can see is a :class:`BKError`. Bookie status codes
(``bk.protocol.Status``) map to exactly one subclass through
:data:`STATUS_ERRORS`; client-side failures (quorum lost, digest mismatch,
metadata conflicts, ...) have their own subclasses. Messages say what was
asked and why it failed, e.g. ``"add entry 7 of ledger 12 to 127.0.0.1:3181:
ledger is fenced"``.
"""

from __future__ import annotations

import builtins


class BKError(Exception):
    """Root of every bk error. ``code`` is the bookie status code, if any."""

    code: int | None = None


class ProtocolError(BKError):
    """A frame could not be decoded, was too large, or had the wrong shape."""


class ConfigError(BKError, ValueError):
    """A setting has an unknown key or a bad value; the message names the key."""


# --- bookie status codes ---------------------------------------------------

class NoSuchLedgerError(BKError):
    """ENOLEDGER: the ledger does not exist (on this bookie or in metadata)."""


class NoSuchEntryError(BKError):
    """ENOENTRY: the entry does not exist, or is past the last add confirmed."""


class LedgerFencedError(BKError):
    """EFENCED: the ledger was fenced by a recovery open; the writer must stop."""


class BadPasswordError(BKError):
    """EUA: the master key (password digest) does not match the ledger's."""


class BadRequestError(ProtocolError):
    """EBADREQ: the bookie did not understand the request."""


class ReadOnlyBookieError(BKError):
    """EREADONLY: the bookie is read-only (disk almost full) and refuses adds."""


class TooManyRequestsError(BKError):
    """ETOOMANYREQUESTS: the bookie is overloaded; back off and retry."""


class BookieIOError(BKError):
    """EIO: the bookie failed to read or write its disks."""


# --- client-side failures ----------------------------------------------------

class BookieUnavailableError(BKError):
    """A bookie could not be reached or its connection broke."""


class NotEnoughBookiesError(BKError):
    """Too few writable bookies to form (or repair) an ensemble or quorum."""


class DigestMismatchError(BKError):
    """An entry's digest did not verify: the copy is corrupt or the password wrong."""


class MetadataVersionError(BKError):
    """A compare-and-swap on ledger metadata lost against another writer."""


class MetadataError(BKError):
    """The metadata store (etcd) failed or is unreachable."""


class LedgerExistsError(MetadataError):
    """A ledger with this id already exists."""


class LedgerClosedError(BKError):
    """The ledger handle is closed (or the ledger is CLOSED) and takes no adds."""


class LedgerRecoveryError(BKError):
    """Recovery could not determine or re-replicate the ledger's last entry."""


class TimeoutError(BKError, builtins.TimeoutError):
    """An operation did not complete within its timeout."""


# --- logs (bk.log) -------------------------------------------------------------

class LogFencedError(LedgerFencedError):
    """A log writer was deposed: another writer took the log over (fencing its ledger)."""


class LogTruncatedError(BKError):
    """A log reader's position lies in a range that was truncated away."""


class NoSuchLogError(BKError):
    """The log does not exist in the metadata store."""


class CookieMismatchError(BKError):
    """A bookie's directories belong to another bookie id, cluster, layout or shard count."""


class LockLostError(BKError):
    """A lease-bound lock (or leadership) was lost: its holder must stop acting."""


class ClusterNotFormattedError(MetadataError):
    """No bk cluster under the metadata prefix (``bkshell metaformat`` creates one)."""


class ClusterIdentityError(MetadataError):
    """The metadata store is not the cluster a bookie belongs to (another instanceId,
    its cookie missing), or its layout has a format version this bk cannot read."""


# Status codes, in one place. Values follow BookKeeper's BKException codes
# where they exist (negated there; positive here, EOK = 0).
EOK = 0
ENOLEDGER = 1
ENOENTRY = 2
EBADREQ = 3
EIO = 4
EUA = 5
EBADVERSION = 6
EFENCED = 7
EREADONLY = 8
ETOOMANYREQUESTS = 9

STATUS_NAMES = {
    EOK: "EOK", ENOLEDGER: "ENOLEDGER", ENOENTRY: "ENOENTRY", EBADREQ: "EBADREQ",
    EIO: "EIO", EUA: "EUA", EBADVERSION: "EBADVERSION", EFENCED: "EFENCED",
    EREADONLY: "EREADONLY", ETOOMANYREQUESTS: "ETOOMANYREQUESTS",
}

STATUS_ERRORS: dict[int, type[BKError]] = {
    ENOLEDGER: NoSuchLedgerError,
    ENOENTRY: NoSuchEntryError,
    EBADREQ: BadRequestError,
    EIO: BookieIOError,
    EUA: BadPasswordError,
    EBADVERSION: ProtocolError,
    EFENCED: LedgerFencedError,
    EREADONLY: ReadOnlyBookieError,
    ETOOMANYREQUESTS: TooManyRequestsError,
}

_STATUS_TEXT = {
    ENOLEDGER: "no such ledger",
    ENOENTRY: "no such entry",
    EBADREQ: "bad request",
    EIO: "bookie I/O error",
    EUA: "wrong password (master key mismatch)",
    EBADVERSION: "unsupported protocol version",
    EFENCED: "ledger is fenced",
    EREADONLY: "bookie is read-only",
    ETOOMANYREQUESTS: "bookie is overloaded",
}


def error_for_status(status: int, what: str) -> BKError:
    """Build the exception for a non-EOK status; ``what`` names the request."""
    cls = STATUS_ERRORS.get(status, BKError)
    text = _STATUS_TEXT.get(status, f"status {status}")
    err = cls(f"{what}: {text}")
    err.code = status
    return err


def status_name(status: int) -> str:
    return STATUS_NAMES.get(status, str(status))


# --- metadata at scale (issue 22; the lead may move these into the categories) ---

class MetadataSpaceError(MetadataError):
    """etcd raised its NOSPACE alarm (its backend reached the quota): it refuses every
    write until its history is compacted, its db defragmented and the alarm disarmed
    (``bkshell metacompact --defrag --disarm``). Reads and adds to open ledgers go on."""


class MetadataCompactedError(MetadataError):
    """A read or watch asked for a revision etcd has compacted away;
    ``compact_revision`` is the oldest revision still kept."""

    compact_revision: int = 0
