"""Ledger metadata: what a ledger is, as stored (JSON) under ``ledgers/<id>`` in etcd.

The stored form is human-readable so that ``etcdctl get`` is useful. Binary
fields (password digest, custom metadata values) are base64. ``FORMAT_VERSION``
is bumped whenever the layout changes; a reader refuses a newer version.
"""

from __future__ import annotations

import base64
import bisect
import enum
import json
import time
from dataclasses import dataclass, field, fields

FORMAT_VERSION = 1
DIGEST_TYPES = ("crc32", "crc32c", "mac", "dummy")
# one encoder for every ledger: json.dumps with options builds one per call (~30%
# of to_json's time, twice per ledger created and closed)
_ENCODER = json.JSONEncoder(separators=(",", ":"))
_b64 = base64.b64encode


class LedgerState(str, enum.Enum):
    OPEN = "OPEN"
    IN_RECOVERY = "IN_RECOVERY"
    CLOSED = "CLOSED"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class LedgerMetadata:
    """Immutable snapshot of one ledger's metadata; change it with :meth:`replace`.

    ``ensembles`` is a list of ``(first_entry_id, [bookie ids])`` sorted by first
    entry id; the ensemble of entry ``e`` is the last one whose first entry id
    is <= e. ``last_entry_id`` and ``length`` are meaningful when CLOSED
    (-1 and 0 otherwise).
    """

    ledger_id: int
    ensemble_size: int
    write_quorum_size: int
    ack_quorum_size: int
    ensembles: list
    digest_type: str = "crc32c"
    password_digest: bytes = b""
    state: LedgerState = LedgerState.OPEN
    last_entry_id: int = -1
    length: int = 0
    ctime: float = field(default_factory=time.time)
    custom_metadata: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    # The key bookies hold for this ledger (bk.client.digest.master_key of the password, not the
    # password): lets an admin re-replicate entries (recovery adds) without the password,
    # as BookKeeper's recoverBookieData does with the password kept in its metadata.
    master_key: bytes = b""

    # --- quorum arithmetic -------------------------------------------------
    def ensemble_index(self, entry_id: int) -> int:
        """Index in ``ensembles`` of the fragment that holds ``entry_id``."""
        firsts = [first for first, _ in self.ensembles]
        return max(0, bisect.bisect_right(firsts, entry_id) - 1)

    def ensemble_for(self, entry_id: int) -> list[str]:
        return self.ensembles[self.ensemble_index(entry_id)][1]

    def write_set(self, entry_id: int) -> list[str]:
        """The Qw bookies that store ``entry_id``: round-robin from ``entry_id % E``."""
        ens = self.ensemble_for(entry_id)
        e = len(ens)
        return [ens[(entry_id + i) % e] for i in range(self.write_quorum_size)]

    @property
    def last_ensemble(self) -> list[str]:
        return self.ensembles[-1][1]

    @property
    def is_closed(self) -> bool:
        return self.state == LedgerState.CLOSED

    def fragment_bounds(self, index: int, last: int | None = None) -> tuple[int, int | None]:
        """``(first, last)`` entry ids of fragment ``index``; ``last`` may be below
        ``first`` (an empty fragment). The last fragment ends at the last entry of a
        CLOSED ledger; of an open one at ``last`` (its LAC, when the caller knows
        it; None otherwise)."""
        first = self.ensembles[index][0]
        if index + 1 < len(self.ensembles):
            return first, self.ensembles[index + 1][0] - 1
        return first, (self.last_entry_id if self.is_closed else last)

    def replace(self, **changes) -> "LedgerMetadata":
        # a copy of the fields, as dataclasses.replace makes it through __init__
        # (which has nothing to check) at a third of the cost: a close makes one
        unknown = changes.keys() - _FIELDS
        if unknown:
            raise TypeError(f"LedgerMetadata has no field {', '.join(sorted(unknown))}")
        new = object.__new__(type(self))
        d = new.__dict__
        d.update(self.__dict__)
        d.update(changes)
        return new

    # --- (de)serialisation -------------------------------------------------
    def to_dict(self) -> dict:
        # keys (and custom metadata) in sorted order, the order to_json writes
        d = {
            "ackQuorumSize": self.ack_quorum_size,
            "ctime": self.ctime,
            "customMetadata": {k: _b64(v).decode("ascii")
                               for k, v in sorted(self.custom_metadata.items())},
            "digestType": self.digest_type,
            "ensembleSize": self.ensemble_size,
            "ensembles": [[first, list(bookies)] for first, bookies in self.ensembles],
            "formatVersion": self.format_version,
            "lastEntryId": self.last_entry_id,
            "ledgerId": self.ledger_id,
            "length": self.length,
        }
        if self.master_key:
            d["masterKey"] = _b64(self.master_key).decode("ascii")
        d["passwordDigest"] = _b64(self.password_digest).decode("ascii")
        d["state"] = self.state.value
        d["writeQuorumSize"] = self.write_quorum_size
        return d

    def to_json(self) -> bytes:
        # Compact: json's C encoder (indent= falls back to the pure-Python one, ~150 us
        # a ledger) and ~30% fewer bytes per ledger in etcd; still one readable line.
        # to_dict's keys are already sorted (sort_keys made the encoder sort them
        # again, once per ledger create and close).
        return _ENCODER.encode(self.to_dict()).encode("utf-8")

    @classmethod
    def from_dict(cls, d: dict) -> "LedgerMetadata":
        version = d.get("formatVersion", 1)
        if version > FORMAT_VERSION:
            raise ValueError(f"ledger metadata format {version} is newer than this bk "
                             f"understands ({FORMAT_VERSION})")
        return cls(
            ledger_id=int(d["ledgerId"]),
            ensemble_size=int(d["ensembleSize"]),
            write_quorum_size=int(d["writeQuorumSize"]),
            ack_quorum_size=int(d["ackQuorumSize"]),
            ensembles=[(int(first), list(bookies)) for first, bookies in d["ensembles"]],
            digest_type=d.get("digestType", "crc32c"),
            password_digest=base64.b64decode(d.get("passwordDigest", "")),
            state=LedgerState(d.get("state", "OPEN")),
            last_entry_id=int(d.get("lastEntryId", -1)),
            length=int(d.get("length", 0)),
            ctime=float(d.get("ctime", 0.0)),
            custom_metadata={k: base64.b64decode(v)
                             for k, v in d.get("customMetadata", {}).items()},
            format_version=version,
            master_key=base64.b64decode(d.get("masterKey", "")),
        )

    @classmethod
    def from_json(cls, data: bytes) -> "LedgerMetadata":
        return cls.from_dict(json.loads(data))


_FIELDS = frozenset(f.name for f in fields(LedgerMetadata))
