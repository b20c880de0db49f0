"""Staging ledgers of exactly-once sinks: registered before they exist, collected
when no commit can take them any more.

A sink (``bk.spark``'s) writes each task's rows to a *staging* ledger and its
driver appends the staged ledgers to the log in one CAS (``bk.log.append_ledgers``).
A task that dies after creating its ledger (an executor killed, a lost
container) never reports it, and the driver's commit or abort cannot delete
what it does not know about. So a task first allocates the ledger's id, records
it under ``sparkstaging/<log>/<ledger id>`` with who it is for (the sink and
batch of a streaming query, the write id of a batch job), and only then creates
the ledger under that id: there is no moment at which a staging ledger exists
without its record.

:func:`collect` deletes the records of ledgers that made it into the log, and
the ledgers (and records) that can no longer be committed:

* those of a streaming ``sink`` with a batch id up to ``up_to_batch`` (the
  sink's commit of batch N, or its abort of N: the batches of one query run one
  at a time, so nothing of batch <= N is still to be committed once N is
  committed or aborted; a replay of N is refused by the log's batch id);
* those of the batch job ``write`` (its commit or abort: the job is over);
* with ``older_than``: any whose sink committed a batch >= theirs, or that is
  older than that many seconds (``bkshell cleanstaging``, for drivers that died
  too: a batch job running longer than that would lose its output, so the
  default is generous).

A zombie task that registers after a collection leaves its ledger to the next
one. The ledgers also carry custom metadata (``bk.spark``, ``bk.spark.sink``,
``bk.spark.batch``, ``bk.spark.write``) for people reading ``bkshell ledgermetadata``.
"""

from __future__ import annotations

import logging
import os
import socket
import time

from bk.errors import BKError, NoSuchLedgerError, NoSuchLogError
from bk.log import metadata
from bk.log.records import check_log_name

log = logging.getLogger("bk.log")

PREFIX = "sparkstaging"


def _key(name: str, ledger_id: int | None = None) -> str:
    check_log_name(name)
    return f"{PREFIX}/{name}/" + ("" if ledger_id is None else str(int(ledger_id)))


def create(client, name: str, *, sink: str | None = None, batch: int | None = None,
           write: str | None = None, password: bytes = b"", shape: dict | None = None):
    """A new staging ledger for log ``name``, registered first; its write handle."""
    lid = client.new_ledger_id()
    info = {"sink": sink, "batch": batch, "write": write, "ctime": time.time(),
            "host": socket.gethostname(), "pid": os.getpid()}
    client._store.cas_json(_key(name, lid), info, None)
    custom = {"bk.log": name, "bk.spark": "staging"}
    for k, v in (("sink", sink), ("batch", batch), ("write", write)):
        if v is not None:
            custom[f"bk.spark.{k}"] = str(v)
    try:
        return client.create_ledger(**(shape or {}), password=password,
                                    custom_metadata=custom, ledger_id=lid)
    except BaseException:
        forget(client, name, lid)
        raise


def forget(client, name: str, ledger_id: int) -> None:
    """Delete a staging ledger (if it exists) and then its record."""
    try:
        client.delete_ledger(ledger_id)
    except NoSuchLedgerError:
        pass
    client._store.delete_json(_key(name, ledger_id))


def pending(client, name: str | None = None) -> list[dict]:
    """The registered staging ledgers (of log ``name``, or of every log)."""
    out = []
    prefix = _key(name) if name is not None else PREFIX + "/"
    for rel, info, _ver in client._store.list_json(prefix):
        log_name, _, lid = rel[len(PREFIX) + 1:].rpartition("/")
        if lid.isdigit():
            out.append({**info, "log": log_name, "ledger_id": int(lid)})
    return out


def collect(client, name: str, *, sink: str | None = None, up_to_batch: int | None = None,
            write: str | None = None, older_than: float | None = None,
            dry_run: bool = False) -> list[int]:
    """Forget the staging records of ledgers in log ``name``; delete the staging
    ledgers that no commit can take any more (see the module's doc). Returns the
    ids of the ledgers deleted (or, with ``dry_run``, that would be)."""
    entries = pending(client, name)
    if not entries:
        return []
    try:
        rec, _ = metadata.read(client._store, name)
    except NoSuchLogError:
        rec = None
    in_log = {s["ledger_id"] for s in rec["segments"]} if rec else set()
    now = time.time()
    deleted = []
    for e in entries:
        lid = e["ledger_id"]
        if lid in in_log:
            if not dry_run:
                client._store.delete_json(_key(name, lid))
            continue
        b = e.get("batch")
        dead = (write is not None and e.get("write") == write) or (
            sink is not None and e.get("sink") == sink
            and (up_to_batch is None or b is None or b <= up_to_batch))
        if not dead and older_than is not None:
            done = metadata.committed_batch(rec, e["sink"]) if rec and e.get("sink") else None
            dead = (done is not None and b is not None and b <= done) or \
                now - float(e.get("ctime", now)) > older_than
        if not dead:
            continue
        deleted.append(lid)
        if dry_run:
            continue
        try:
            forget(client, name, lid)
        except BKError as err:
            log.warning("log %s: could not delete staging ledger %d: %s", name, lid, err)
    if deleted:
        log.info("log %s: deleted %d staging ledger(s) that no commit can take: %s",
                 name, len(deleted), deleted)
    return deleted
