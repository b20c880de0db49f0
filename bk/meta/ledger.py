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
import math
import time
from dataclasses import MISSING, dataclass, field, fields

FORMAT_VERSION = 1
DIGEST_TYPES = ("crc32", "crc32c", "mac", "dummy")
# one encoder for every ledger: json.dumps with options builds one per call (~30%
# of to_json's time, twice per ledger created and closed)
_ENCODER = json.JSONEncoder(separators=(",", ":"))
_b64 = base64.b64encode
_encode_str = json.encoder.encode_basestring_ascii      # what _ENCODER writes for a str


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
        # What is the same for every ledger of one client (quorums, digest, password
        # keys, custom metadata) is encoded once, into a template (_template); the
        # bytes are those _ENCODER writes for to_dict() (a unit test compares them).
        ctime = self.ctime
        if ctime.__class__ is not float or not math.isfinite(ctime):
            return _ENCODER.encode(self.to_dict()).encode("utf-8")
        head, mid, tail = _template(self)
        ens = _ENSEMBLES.get
        parts = []
        for first, bookies in self.ensembles:
            key = tuple(bookies)
            enc = ens(key)
            if enc is None:
                enc = _cache(_ENSEMBLES, key, _ENCODER.encode(list(key)))
            parts.append(f"[{int(first)},{enc}]")
        return (f"{head}{ctime!r}{mid}[{','.join(parts)}],\"formatVersion\":"
                f"{int(self.format_version)},\"lastEntryId\":{int(self.last_entry_id)},"
                f"\"ledgerId\":{int(self.ledger_id)},\"length\":{int(self.length)},{tail}"
                f"\"state\":\"{self.state.value}\",\"writeQuorumSize\":"
                f"{int(self.write_quorum_size)}}}").encode("utf-8")

    @classmethod
    def new(cls, **values) -> "LedgerMetadata":
        """``LedgerMetadata(**values)`` at a third of the cost (a frozen dataclass's
        ``__init__`` sets each field through ``object.__setattr__``; create makes
        one per ledger). Nothing is copied: the caller hands over ``values``."""
        new = object.__new__(cls)
        d = new.__dict__
        d.update(_DEFAULTS)
        d.update(values)
        if len(d) != _NFIELDS or d.keys() != _FIELDS:
            d.setdefault("ctime", time.time())
            d.setdefault("custom_metadata", {})
            if d.keys() != _FIELDS:
                raise TypeError(f"LedgerMetadata.new: unknown {sorted(d.keys() - _FIELDS)}, "
                                f"missing {sorted(_FIELDS - d.keys())}")
        return new

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
_NFIELDS = len(_FIELDS)
_DEFAULTS = {f.name: f.default for f in fields(LedgerMetadata) if f.default is not MISSING}

# to_json's caches, bounded (cleared when full): the encoded constant parts per
# (quorums, digest, keys, custom metadata), the encoded bookie list per ensemble.
_TEMPLATES: dict = {}
_ENSEMBLES: dict = {}
_CACHE_LIMIT = 4096


def _cache(cache: dict, key, value):
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = value
    return value


def _template(md: LedgerMetadata) -> tuple[str, str, str]:
    """(text before ctime, text from ctime to the ensembles, text from masterKey
    to passwordDigest included) of ``md``'s JSON."""
    custom = md.custom_metadata
    key = (md.ack_quorum_size, md.digest_type, md.ensemble_size, md.master_key,
           md.password_digest, tuple(sorted(custom.items())) if custom else ())
    t = _TEMPLATES.get(key)
    if t is None:
        enc = _ENCODER.encode
        head = f'{{"ackQuorumSize":{enc(md.ack_quorum_size)},"ctime":'
        mid = (',"customMetadata":' + enc({k: _b64(v).decode("ascii")
                                            for k, v in sorted(custom.items())})
               + f',"digestType":{enc(md.digest_type)},"ensembleSize":'
               f'{enc(md.ensemble_size)},"ensembles":')
        tail = (f'"masterKey":{_encode_str(_b64(md.master_key).decode("ascii"))},'
                if md.master_key else "")
        tail += f'"passwordDigest":{_encode_str(_b64(md.password_digest).decode("ascii"))},'
        t = _cache(_TEMPLATES, key, (head, mid, tail))
    return t
