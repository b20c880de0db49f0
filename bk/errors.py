"""One exception hierarchy for all of bk.

Every failure a user can see is a :class:`BKError`. Callers catch a category
when they do not care which error of it they got:

* :class:`BookieError`: a bookie answered and refused (it has a status
  ``code``: fenced, no such ledger, bad password, read-only, ...).
* :class:`TransientError`: the same request may succeed later or elsewhere
  (a bookie unreachable or overloaded, a timeout, too few bookies right now);
  :mod:`bk.retry` retries these.
* :class:`MetadataError`: the metadata store (etcd) failed, is unreachable,
  holds no cluster or another one.
* :class:`SecurityError` / :class:`AuthError`: TLS and identities (a
  certificate that does not verify, TLS required or not offered; a token or
  role refused). See ``bk.security``.

A lost compare-and-swap (:class:`MetadataVersionError`) is none of these: it is
the protocol's normal conflict, and the caller re-reads and decides.

Each bookie status code is declared once, by the :func:`_status` decorator on
the class it raises; the name and text tables are derived from those
declarations. Messages say what was asked and why it failed, e.g. ``"add
entry 7 of ledger 12 to 127.0.0.1:3181: ledger is fenced"``.
"""

from __future__ import annotations

import builtins

# Status codes. Values follow BookKeeper's BKException codes where they exist
# (negated there; positive here, EOK = 0).
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
EAUTH = 10          # bk's own: an identity or an op refused (BookKeeper: EUA)
ESECURITY = 11      # bk's own: TLS required by the bookie, or not offered

STATUS_NAMES: dict[int, str] = {EOK: "EOK"}         # filled by _status
STATUS_ERRORS: dict[int, type] = {}                  # filled by _status
_STATUS_TEXT: dict[int, str] = {}                    # filled by _status


def _status(code: int, name: str, text: str):
    """Declare that a bookie's status ``code`` (``name``, described by ``text``)
    raises the decorated class."""
    def register(cls):
        assert code not in STATUS_ERRORS, f"status {name} declared twice"
        cls.code = code
        STATUS_NAMES[code] = name
        STATUS_ERRORS[code] = cls
        _STATUS_TEXT[code] = text
        return cls
    return register


class BKError(Exception):
    """Root of every bk error. ``code`` is the bookie status code, if any."""

    code: int | None = None


# --- categories ------------------------------------------------------------------

class BookieError(BKError):
    """A bookie answered a request with an error status (``code``)."""


class TransientError(BKError):
    """The request may succeed if retried later or against another bookie."""


class MetadataError(BKError):
    """The metadata store (etcd) failed or is unreachable."""


class MetadataSpaceError(MetadataError):
    """etcd raised its NOSPACE alarm (its backend reached the quota): it refuses every
    write until its history is compacted, its db defragmented and the alarm disarmed
    (``bkshell metacompact --defrag --disarm``). Reads and adds to open ledgers go on."""


class MetadataCompactedError(MetadataError):
    """A read or watch asked for a revision etcd has compacted away;
    ``compact_revision`` is the oldest revision still kept."""

    compact_revision: int = 0


class SecurityError(BKError):
    """TLS or authentication failed (a certificate that does not verify, TLS
    required by the bookie or not offered by it, ...)."""


class AuthError(SecurityError):
    """An identity was refused (bad or expired token, a role without the right)."""


class ProtocolError(BKError):
    """A frame could not be decoded, was too large, or had the wrong shape."""


class ConfigError(BKError, ValueError):
    """A setting has an unknown key or a bad value; the message names the key."""


# --- bookie status codes -----------------------------------------------------------

@_status(ENOLEDGER, "ENOLEDGER", "no such ledger")
class NoSuchLedgerError(BookieError):
    """ENOLEDGER: the ledger does not exist (on this bookie or in metadata)."""


@_status(ENOENTRY, "ENOENTRY", "no such entry")
class NoSuchEntryError(BookieError):
    """ENOENTRY: the entry does not exist, or is past the last add confirmed."""


@_status(EBADREQ, "EBADREQ", "bad request")
class BadRequestError(BookieError, ProtocolError):
    """EBADREQ: the bookie did not understand the request."""


@_status(EIO, "EIO", "bookie I/O error")
class BookieIOError(BookieError):
    """EIO: the bookie failed to read or write its disks."""


@_status(EUA, "EUA", "wrong password (master key mismatch)")
class BadPasswordError(BookieError):
    """EUA: the master key (password digest) does not match the ledger's."""


@_status(EBADVERSION, "EBADVERSION", "unsupported protocol version")
class ProtocolVersionError(BookieError, ProtocolError):
    """EBADVERSION: the bookie does not speak this protocol version."""


@_status(EFENCED, "EFENCED", "ledger is fenced")
class LedgerFencedError(BookieError):
    """EFENCED: the ledger was fenced by a recovery open; the writer must stop."""


@_status(EREADONLY, "EREADONLY", "bookie is read-only")
class ReadOnlyBookieError(BookieError):
    """EREADONLY: the bookie is read-only (disk almost full) and refuses adds."""


@_status(ETOOMANYREQUESTS, "ETOOMANYREQUESTS", "bookie is overloaded")
class TooManyRequestsError(BookieError, TransientError):
    """ETOOMANYREQUESTS: the bookie is overloaded; back off and retry."""


@_status(ESECURITY, "ESECURITY", "TLS refused")
class TLSRefusedError(BookieError, SecurityError):
    """ESECURITY: the bookie requires TLS and the client did not ask for it, or the
    client asked and the bookie offers none."""


@_status(EAUTH, "EAUTH", "not authorized")
class NotAuthorizedError(BookieError, AuthError):
    """EAUTH: the bookie refused the identity presented, or the op for its role."""


# --- client-side failures ------------------------------------------------------------

class BookieUnavailableError(TransientError):
    """A bookie could not be reached or its connection broke."""


class ClientClosedError(BookieUnavailableError):
    """The client was closed: a call pending on it when it closed, or made on it
    afterwards, ends with this at once (never at its own deadline). A
    BookieUnavailableError, so code that catches that keeps working; retrying
    it on the same client is pointless."""


class NotEnoughBookiesError(TransientError):
    """Too few writable bookies to form (or repair) an ensemble or quorum."""


class TimeoutError(TransientError, builtins.TimeoutError):
    """An operation did not complete within its timeout."""


class DigestMismatchError(BKError):
    """An entry's digest did not verify: the copy is corrupt or the password wrong."""


class MetadataVersionError(BKError):
    """A compare-and-swap on ledger metadata lost against another writer."""


class LedgerClosedError(BKError):
    """The ledger handle is closed (or the ledger is CLOSED) and takes no adds."""


class LedgerRecoveryError(BKError):
    """Recovery could not determine or re-replicate the ledger's last entry."""


class LockLostError(BKError):
    """A lease-bound lock (or leadership) was lost: its holder must stop acting."""


# --- metadata ---------------------------------------------------------------------------

class MetadataPermissionError(MetadataError, AuthError):
    """etcd refused the request: the etcd user's role does not allow it (a read-only
    identity that creates, recovers or deletes a ledger)."""


class LedgerExistsError(MetadataError):
    """A ledger with this id already exists."""


class ClusterNotFormattedError(MetadataError):
    """No bk cluster under the metadata prefix (``bkshell metaformat`` creates one)."""


class ClusterIdentityError(MetadataError):
    """The metadata store is not the cluster a bookie belongs to (another instanceId,
    its cookie missing), or its layout has a format version this bk cannot read."""


class CookieMismatchError(BKError):
    """A bookie's directories belong to another bookie id, cluster, layout or shard count."""


# --- logs (bk.log) -----------------------------------------------------------------------

class LogFencedError(LedgerFencedError):
    """A log writer was deposed: another writer took the log over (fencing its ledger)."""


class LogTruncatedError(BKError):
    """A log reader's position lies in a range that was truncated away."""


class NoSuchLogError(BKError):
    """The log does not exist in the metadata store."""


def error_for_status(status: int, what: str) -> BKError:
    """Build the exception for a non-EOK status; ``what`` names the request."""
    cls = STATUS_ERRORS.get(status, BookieError)
    err = cls(f"{what}: {_STATUS_TEXT.get(status, f'status {status}')}")
    err.code = status
    return err


def status_name(status: int) -> str:
    return STATUS_NAMES.get(status, str(status))
