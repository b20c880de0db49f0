"""The ``logs/<name>`` record in etcd and every change to it, in one place.

The record is JSON::

    {"version": 1, "epoch": 3, "truncated_before": "2:0:0" | null,
     "segments": [{"segment": 0, "ledger_id": 12, "state": "closed",
                   "first_position": "0:0:0", "last_entry_id": 41,
                   "records": 4100, "bytes": 410000, "ctime": 1700000000.0}, ...]}

Every change is a compare-and-swap on the key's mod revision (``cas_json``).
The transitions here are pure functions from a record to the next record; the
callers (writer, truncation, deletion) CAS the result and, when the CAS is
lost, re-read and decide again: a lost CAS never overwrites what another
client wrote.
"""

from __future__ import annotations

import copy
import time

from bk.errors import NoSuchLogError
from bk.log.records import Position, check_log_name
from bk.retry import retry_cas

FORMAT_VERSION = 1
OPEN, CLOSED = "open", "closed"
_PREFIX = "logs"


def key(name: str) -> str:
    return f"{_PREFIX}/{check_log_name(name)}"


def new_record() -> dict:
    return {"version": FORMAT_VERSION, "epoch": 0, "segments": [], "truncated_before": None}


def read(store, name: str) -> tuple[dict, int]:
    """(record, version) of log ``name``; NoSuchLogError if there is none."""
    rec, ver = store.get_json(key(name))
    if rec is None:
        raise NoSuchLogError(f"log {name!r} does not exist ({store.uri})")
    return rec, ver


def read_or_create(store, name: str) -> tuple[dict, int]:
    """(record, version), creating an empty log (CAS on absence) if there is none."""
    def attempt() -> tuple[dict, int]:
        rec, ver = store.get_json(key(name))
        if rec is not None:
            return rec, ver
        rec = new_record()
        return rec, store.cas_json(key(name), rec, None)   # lost: created concurrently
    return retry_cas(f"create log {name!r}", attempt, tries=10)


def list_names(store) -> list[str]:
    out = []
    for rel, _value, _ver in store.list_json(_PREFIX + "/"):
        out.append(rel[len(_PREFIX) + 1:])
    return sorted(out)


def truncated_before(rec: dict) -> Position | None:
    t = rec.get("truncated_before")
    return Position.parse(t) if t else None


def next_segment_number(rec: dict) -> int:
    segs = rec["segments"]
    if segs:
        return segs[-1]["segment"] + 1
    t = truncated_before(rec)
    return t.segment if t else 0


# --- transitions (pure: record in, record out) ----------------------------------
def with_segment_closed(rec: dict, segment: int, last_entry_id: int, records: int,
                        nbytes: int) -> dict:
    """The record with ``segment`` closed at ``last_entry_id`` (a no-op if it is
    already closed or gone)."""
    out = copy.deepcopy(rec)
    for s in out["segments"]:
        if s["segment"] == segment and s["state"] == OPEN:
            s.update(state=CLOSED, last_entry_id=int(last_entry_id), records=int(records),
                     bytes=int(nbytes))
    return out


def with_new_segment(rec: dict, ledger_id: int, new_epoch: bool) -> tuple[dict, int]:
    """The record with an open segment on ``ledger_id`` appended (and the epoch
    bumped when a writer takes ownership); returns (record, segment number)."""
    out = copy.deepcopy(rec)
    seg = next_segment_number(rec)
    if new_epoch:
        out["epoch"] = int(rec["epoch"]) + 1
    out["segments"].append({
        "segment": seg, "ledger_id": int(ledger_id), "state": OPEN,
        "first_position": str(Position(seg, 0, 0)), "last_entry_id": -1,
        "records": 0, "bytes": 0, "ctime": time.time()})
    return out, seg


def truncation(rec: dict, before: Position) -> tuple[dict, list[int]]:
    """The record truncated before ``before``, and the ledgers that may be deleted:
    the closed segments wholly before ``before``'s segment. An open segment is
    never dropped (a writer may still be using it)."""
    out = copy.deepcopy(rec)
    old = truncated_before(rec)
    point = max(before, old) if old else before
    segs = out["segments"]
    i = 0       # only a prefix of closed segments goes, so what stays is contiguous
    while i < len(segs) and segs[i]["segment"] < point.segment and segs[i]["state"] == CLOSED:
        i += 1
    drop = [s["ledger_id"] for s in segs[:i]]
    keep = segs[i:]
    out["segments"] = keep
    out["truncated_before"] = str(point)
    return out, drop


def committed_batch(rec: dict, sink: str) -> int | None:
    """The last batch id that ``sink`` committed to this log (None: none yet)."""
    b = rec.get("sinks", {}).get(sink)
    return None if b is None else int(b)


def with_ledgers_appended(rec: dict, ledgers, sink: str | None = None,
                          batch_id: int | None = None) -> dict:
    """The record with already-written, closed ledgers appended as closed segments
    (``ledgers``: dicts with ``ledger_id``, ``last_entry_id``, ``records``, ``bytes``),
    in order, after every segment there; with ``sink``, ``batch_id`` is remembered as
    that sink's last committed batch (``sinks`` in the record), so that a caller can
    refuse to append the same batch twice (see ``bk.log.append_ledgers``)."""
    out = copy.deepcopy(rec)
    seg = next_segment_number(rec)
    now = time.time()
    for led in ledgers:
        out["segments"].append({
            "segment": seg, "ledger_id": int(led["ledger_id"]), "state": CLOSED,
            "first_position": str(Position(seg, 0, 0)),
            "last_entry_id": int(led["last_entry_id"]), "records": int(led["records"]),
            "bytes": int(led["bytes"]), "ctime": now})
        seg += 1
    if sink is not None:
        out.setdefault("sinks", {})[sink] = int(batch_id)
    return out
