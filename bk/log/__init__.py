"""Logs built from ledgers (BookKeeper's "Ledgers to logs").

A log is a named, ordered list of ledgers (segments) kept in ``logs/<name>``
in etcd and changed only by compare-and-swap (:mod:`bk.log.metadata`). One
writer owns a log at a time (:mod:`bk.log.writer`); readers follow it
(:mod:`bk.log.reader`); records travel in record sets (:mod:`bk.log.records`).

This module is the log manager behind the client's ``*_log*`` methods:
creating, listing, describing, truncating and deleting logs.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from bk.errors import BKError, MetadataVersionError, NoSuchLedgerError
from bk.log import metadata
from bk.log.records import LogRecord, Position, check_log_name
from bk.log.writer import segment_tail
from bk.meta.ledger import LedgerState
from bk.retry import retry_cas

__all__ = ["Position", "LogRecord", "LogInfo", "create_log", "list_logs", "log_info",
           "truncate_log", "delete_log", "append_ledgers"]

log = logging.getLogger("bk.log")


class LogInfo(NamedTuple):
    """What ``client.log_info`` says about a log. ``segments`` are the record's
    segment dicts (the open one with its records and bytes so far);
    ``first_position`` / ``last_position`` are None for an empty log."""

    name: str
    segments: list
    first_position: Position | None
    last_position: Position | None
    records: int
    bytes: int
    epoch: int = 0
    truncated_before: Position | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "epoch": self.epoch,
                "first_position": str(self.first_position) if self.first_position else None,
                "last_position": str(self.last_position) if self.last_position else None,
                "records": self.records, "bytes": self.bytes,
                "truncated_before": str(self.truncated_before) if self.truncated_before
                else None,
                "segments": self.segments}


def create_log(client, name: str) -> bool:
    """Create an empty log; False if it already existed."""
    check_log_name(name)
    try:
        client._store.cas_json(metadata.key(name), metadata.new_record(), None)
        return True
    except MetadataVersionError:
        return False


def list_logs(client) -> list[str]:
    return metadata.list_names(client._store)


def _segment_now(client, seg: dict) -> tuple[dict, int]:
    """A copy of ``seg`` with its totals now (the open one's up to its LAC), and the
    number of records in its last entry that has any."""
    out = dict(seg)
    try:
        h = client.open_ledger_no_recovery(seg["ledger_id"])
        try:
            last, data_last, slots, records, nbytes = segment_tail(client, h)
        finally:
            h.close()
    except NoSuchLedgerError:
        return out, (-1, 0)
    out.update(last_entry_id=last, records=records, bytes=nbytes)
    return out, (data_last, slots)


def log_info(client, name: str) -> LogInfo:
    """Closed segments from the record (no bookie reads); the open ones up to their
    LAC, and the last record's position, from their last entries."""
    rec, _ = metadata.read(client._store, name)
    trunc = metadata.truncated_before(rec)
    segs = []
    tails = {}
    for seg in rec["segments"]:
        if seg["state"] == metadata.OPEN:
            s, tails[seg["segment"]] = _segment_now(client, seg)
        else:
            s = dict(seg)
        segs.append(s)
    first = last = None
    with_records = [s for s in segs if s["records"]]
    if with_records:
        first = Position(with_records[0]["segment"], 0, 0)
        if trunc and trunc > first:
            first = trunc
        s = with_records[-1]
        if s["segment"] not in tails:
            _, tails[s["segment"]] = _segment_now(client, s)
        data_last, slots = tails[s["segment"]]
        if data_last >= 0 and slots:
            last = Position(s["segment"], data_last, slots - 1)
    return LogInfo(name, segs, first, last, sum(s["records"] for s in segs),
                   sum(s["bytes"] for s in segs), int(rec["epoch"]), trunc)


def truncate_log(client, name: str, before) -> list[int]:
    """Record the truncation point ``before`` and delete the ledgers of the closed
    segments wholly before it; returns the deleted ledger ids."""
    before = Position.parse(before)
    store = client._store

    def attempt() -> list[int]:
        rec, version = metadata.read(store, name)
        segs = rec["segments"]
        end = metadata.next_segment_number(rec)
        if before.segment > end or (before.segment == end and (before.entry_id or before.slot)):
            raise ValueError(f"truncate log {name} before {before}: past the log's end "
                             f"(next segment {end})")
        new, drop = metadata.truncation(rec, before)
        for s in segs:
            if s["segment"] != before.segment:
                continue
            # A point past the end would hide records appended later: refuse it.
            end = s["last_entry_id"]
            if s["state"] == metadata.OPEN:
                end = _confirmed_end(client, s["ledger_id"])
            if before.entry_id > end + 1:
                raise ValueError(f"truncate log {name} before {before}: segment "
                                 f"{s['segment']} ends at entry {end}")
        store.cas_json(metadata.key(name), new, version)
        return drop
    drop = retry_cas(f"truncate log {name}", attempt)
    # The truncation point is recorded first, so a reader finding a ledger gone
    # always learns why.
    for lid in drop:
        _delete_ledger(client, lid)
    return drop


def _confirmed_end(client, lid: int) -> int:
    """The last confirmed entry of an open segment's ledger (its LAC, or its last
    entry if it was closed meanwhile)."""
    h = client.open_ledger_no_recovery(lid)
    try:
        if h.metadata.state == LedgerState.CLOSED:
            return h.metadata.last_entry_id
        return h.last_add_confirmed
    finally:
        h.close()


def _delete_ledger(client, lid: int) -> None:
    try:
        client.delete_ledger(lid)
    except NoSuchLedgerError:
        pass
    except BKError as e:
        log.warning("could not delete ledger %d: %s", lid, e)


def append_ledgers(client, name: str, ledgers, sink: str | None = None,
                   batch_id: int | None = None) -> bool:
    """Append closed ledgers written elsewhere (record sets, ``bk.log.records``) to log
    ``name`` as its next closed segments, by CAS (the log is created if absent).

    ``ledgers``: dicts with ``ledger_id``, ``last_entry_id``, ``records``, ``bytes``.
    With ``sink`` and ``batch_id`` (an exactly-once sink, such as ``bk.spark``'s),
    the append happens only if that sink's last committed batch id is lower, and
    is recorded with it in the same CAS: returns False (nothing appended) for a
    batch already committed, so a replayed batch is never appended twice."""
    if (sink is None) != (batch_id is None):
        raise ValueError(f"append ledgers to log {name}: give both sink and batch_id, or neither")
    store = client._store

    def attempt() -> bool:
        rec, version = metadata.read_or_create(store, name)
        if sink is not None:
            last = metadata.committed_batch(rec, sink)
            if last is not None and last >= batch_id:
                return False
        new = metadata.with_ledgers_appended(rec, ledgers, sink, batch_id)
        store.cas_json(metadata.key(name), new, version)
        return True
    return retry_cas(f"append ledgers to log {name}", attempt)


def delete_log(client, name: str) -> list[int]:
    """Delete the log record, then its ledgers; returns the ledger ids."""
    store = client._store

    def attempt() -> dict:
        rec, version = metadata.read(store, name)
        store.delete_json(metadata.key(name), version)
        return rec
    rec = retry_cas(f"delete log {name}", attempt)
    lids = [s["ledger_id"] for s in rec["segments"]]
    for lid in lids:
        _delete_ledger(client, lid)
    return lids
