"""etcd hygiene and metadata for many ledgers, against real etcd and bookies: one
elected compactor (and only the current one exporting its metrics), NOSPACE
reported clearly and survived, etcd's db size in use and allocated, reads of
only the ledgers asked about, ids in blocks."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

import bk
from bk.errors import MetadataCompactedError, MetadataError, MetadataSpaceError
from bk.meta import compactor
from bk.meta.compactor import Compactor
from bk.meta.store import ID_BLOCK_BITS, MetadataStore, ledger_key_name
from bk.testing import http_get, shell_ok, stop_bookie, wait_until

PW = b"meta"


def test_two_compactor_candidates_one_compacts(store):
    a = MetadataStore(store.uri)
    b = MetadataStore(store.uri)
    ca = Compactor(a, "a", interval=0.3, ttl=2).start()
    cb = Compactor(b, "b", interval=0.3, ttl=2).start()
    try:
        for i in range(50):
            store.put_json("junk/k", {"i": i})        # history to compact
        wait_until(lambda: ca.compactions + cb.compactions >= 3, what="three compactions")
        leader, other = (ca, cb) if ca.compactions else (cb, ca)
        assert other.compactions == 0 and leader.is_leader and not other.is_leader
        rec, _ = store.get_json(compactor.RECORD)
        assert rec["by"] == leader.identifier
        first = store.compact_revision()
        assert 0 < first <= store.revision()
        # each compaction goes to the revision read one interval earlier: the newest
        # history survives
        assert store.compact_revision() <= rec["next"]
        # the leader goes away: the other takes over and compacts further
        leader.stop()
        store.put_json("junk/k", {"i": "more"})
        wait_until(lambda: other.compactions >= 2, what="the other candidate compacting")
        assert store.compact_revision() > first
        out = json.loads(shell_ok("--metadata", store.uri, "metastatus", "--json").output)
        assert out["compactor"] == other.identifier and out["alarms"] == []
        # A running compactor compacts again every interval (its own record is new
        # history each time): metastatus and the store are compared once it stopped
        # (under load it compacted between the two reads: 61 against 62).
        other.stop()
        wait_until(lambda: not other._thread.is_alive(), what="the compactor stopped")
        rev = store.compact_revision()
        assert json.loads(shell_ok("--metadata", store.uri, "metastatus", "--json").output)[
            "compactRevision"] == rev
        # the bundled etcd (3.5.1) has known durability bugs: said per endpoint
        assert [r["version"] for r in out["endpoints"]] == ["3.5.1"]
        assert "14370" in out["endpoints"][0]["warning"]
    finally:
        ca.stop()
        cb.stop()
        a.close()
        b.close()


def test_existing_ledgers_reads_only_the_ids_asked_at_one_revision(store):
    ids = [store.new_ledger_id() for _ in range(250)]
    for lid in ids:
        store.put_json(ledger_key_name(lid), {"id": lid})
    mine = ids[::10]                              # sparse among the others: point reads
    before = store.revision()
    store.delete_json(ledger_key_name(mine[3]))
    assert store.existing_ledgers(mine, revision=before) == set(mine)
    assert store.existing_ledgers(mine) == set(mine) - {mine[3]}
    dense = ids[100:180]                          # one range over their span
    assert store.existing_ledgers(dense + [ids[-1] + 12345]) == set(dense)
    store.compact(store.revision())
    with pytest.raises(MetadataCompactedError):
        store.existing_ledgers(mine, revision=before)


def test_ids_come_in_blocks_and_never_repeat(store):
    blocks = []

    def grab():
        blocks.append(store.reserve_ledger_ids())
    ts = [threading.Thread(target=grab) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    ids = [i for b in blocks for i in b]
    assert len(ids) == 8 << ID_BLOCK_BITS and len(set(ids)) == len(ids)
    assert store.new_ledger_id() > max(ids)


def test_nospace_is_a_clear_error_and_writes_resume_after_metacompact(cluster_factory):
    c = cluster_factory(3, etcd_quota_bytes=24 << 20,
                        conf_overrides={"metadataCompactionIntervalSeconds": 0})
    uri = c.metadata_uri
    with bk.BookKeeper(uri) as client:
        lh = client.create_ledger(3, 2, 2, password=PW)
        lh.add_entries([b"before-%d" % i for i in range(10)])
        blob = "x" * 400_000
        with pytest.raises(MetadataSpaceError) as full:
            for i in range(500):                  # history of one key fills the quota
                c.store.put_json("junk/blob", {"i": i, "blob": blob})
        assert "NOSPACE" in str(full.value) and "metacompact" in str(full.value)
        assert c.store.alarms() == ["NOSPACE"]
        with pytest.raises(MetadataError, match="NOSPACE"):
            client.create_ledger(3, 2, 2, password=PW)
        # adds to an open ledger go on: they touch no metadata
        lh.add_entries([b"during-%d" % i for i in range(10)])
        with pytest.raises(MetadataError, match="NOSPACE"):
            lh.close()
        out = shell_ok("--metadata", uri, "metacompact", "--defrag", "--disarm").output
        assert "disarmed: NOSPACE" in out
        assert c.store.alarms() == []
        lh.close()                                # retries just the metadata write
        rh = client.open_ledger(lh.ledger_id, password=PW)
        got = [e.data for e in rh.read_entries(0, 19)]
        assert got == [b"before-%d" % i for i in range(10)] + [b"during-%d" % i
                                                                 for i in range(10)]
        lh2 = client.create_ledger(3, 2, 2, password=PW)
        lh2.add_entry(b"after")
        lh2.close()


def test_one_bookie_of_a_cluster_compacts(cluster_factory):
    c = cluster_factory(3, conf_overrides={"metadataCompactionIntervalSeconds": 1})
    for i in range(20):
        c.store.put_json("junk/k", {"i": i})
    wait_until(lambda: c.store.compact_revision() > 0, what="a compaction by a bookie")
    wait_until(lambda: (c.store.get_json(compactor.RECORD)[0] or {}).get("compacted"),
               what="the compaction recorded")
    rec, _ = c.store.get_json(compactor.RECORD)

    def logs(b):
        with open(b.log_file) as f:
            return f.read()
    leaders = [b.bookie_id for b in c.bookies if "compacts etcd's history every" in logs(b)]
    assert leaders == [rec["by"]]
    # every bookie warned at start that the bundled etcd (3.5.1) loses acknowledged
    # writes in a crash, naming the endpoint and the release to run instead
    for b in c.bookies:
        assert f"metadata store 127.0.0.1:{c.etcd.client_port}: etcd 3.5.1 is not safe" in logs(b)
        assert "Run etcd 3.5.6 or later" in logs(b)


def test_metastatus_says_the_db_size_in_use_and_defrag_gives_the_rest_back(store):
    # history to free: 100 keys of 64 KiB, then deleted
    blob = "x" * 65536
    for i in range(100):
        store.put_json(f"junk/{i}", {"blob": blob})
    for i in range(100):
        store.delete_json(f"junk/{i}")
    store.compact(store.revision(), physical=True)
    # etcd's backend (bbolt) hands the pages compaction freed to its free list
    # only at a later write's commit (none reads the old ones any more): a live
    # cluster writes all the time, this test writes a key per look

    def freed():
        store.put_json("junk/tick", {})
        allocated, in_use = store.db_sizes()
        return in_use < allocated // 2
    wait_until(freed, what="etcd's in-use size to fall below half its db")
    out = json.loads(shell_ok("--metadata", store.uri, "metastatus", "--json").output)
    row = out["endpoints"][0]
    assert 0 < row["dbSizeInUse"] < row["dbSize"] // 2
    text = shell_ok("--metadata", store.uri, "metastatus").output
    assert " in use)" in text.splitlines()[0]
    got = json.loads(shell_ok("--metadata", store.uri, "metacompact", "--defrag",
                              "--json").output)
    assert 0 < got["dbSizeInUseBefore"] < got["dbSizeBefore"] // 2
    # defragmentation rewrote the file with only what was in use: the slack went
    assert got["dbSizeAfter"] < got["dbSizeBefore"] // 2
    assert (got["dbSizeAfter"] - got["dbSizeInUseAfter"]
            < (got["dbSizeBefore"] - got["dbSizeInUseBefore"]) // 4)
    assert store.db_sizes() == (got["dbSizeAfter"], got["dbSizeInUseAfter"])


def _compactor_metrics(port) -> dict:
    """The compactor's samples on one bookie's /metrics (absent: not exported)."""
    status, text, _ = http_get(port, "/metrics")
    assert status == 200, text
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith("bookkeeper_metadata_")}


def test_a_compactor_paused_past_its_lease_stops_exporting_its_metrics(cluster_factory):
    # A compaction interval far longer than the test: a deposed leader's own turn
    # never comes, so only its keep-alive finding the lease expired can take its
    # metrics back.
    c = cluster_factory(2, num_shards=1, conf_overrides={
        "httpServerEnabled": "true", "httpServerPort": 0,
        "metadataCompactionIntervalSeconds": 3600})
    by_id = {b.bookie_id: b for b in c.bookies}
    ports = {b: c.store.bookie_info(b)["httpPort"] for b in by_id}

    def compactor_id():
        return (c.store.get_json(compactor.ELECTION)[0] or {}).get("id")
    wait_until(lambda: compactor_id() in by_id, what="a compactor elected")
    first = compactor_id()
    other = next(b for b in by_id if b != first)
    # the leader exports etcd's db size from its election on
    wait_until(lambda: _compactor_metrics(ports[first]).get(
        "bookkeeper_metadata_DB_SIZE_BYTES", 0) > 0, what="the leader exporting the db size")
    pids = stop_bookie(by_id[first])
    try:
        wait_until(lambda: compactor_id() == other, 30, "the other bookie elected compactor")
        wait_until(lambda: _compactor_metrics(ports[other]).get(
            "bookkeeper_metadata_DB_SIZE_BYTES", 0) > 0, what="the new leader exporting")
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    # awake, the deposed leader's keep-alive finds its lease expired: it exports
    # neither the count nor the db size any more, while the new leader does
    wait_until(lambda: _compactor_metrics(ports[first]) == {}, 30,
               "the deposed compactor taking its metrics back")
    assert compactor_id() == other
    now = _compactor_metrics(ports[other])
    assert now["bookkeeper_metadata_DB_SIZE_BYTES"] > 0
    assert 0 < now["bookkeeper_metadata_DB_SIZE_IN_USE_BYTES"] <= now["bookkeeper_metadata_DB_SIZE_BYTES"]
    assert now["bookkeeper_metadata_COMPACTIONS_total"] == 0
    with open(by_id[first].log_file) as f:
        assert "lease of lock compactor expired" in f.read()
