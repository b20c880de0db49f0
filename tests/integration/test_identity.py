"""Cluster identity: a bookie with data never joins (or garbage-collects against) a
cluster that does not know it; ledger ids and shards. Real etcd, real bookies."""

from __future__ import annotations

import json
import os
import signal
import socket

import pytest

import bk
from bk import localcluster
from bk import protocol as P
from bk.errors import ClusterNotFormattedError, EOK, ENOLEDGER
from bk.bookie.layout import COOKIE_FILE
from bk.meta.store import REVISION_BITS, id_scope
from bk.testing import BookieConnection, wait_until

KEY = b"k" * 20
EXIT_COOKIE = 4




def refused(b, timeout=60.0) -> str:
    """Start ``b``, expect it to exit with the cookie exit code; return its log."""
    b.start(wait=False)
    code = b.proc.wait(timeout)
    with open(b.log_file, errors="replace") as f:
        text = f.read()
    assert code == EXIT_COOKIE, text[-2000:]
    return text


def raw_add(b, lid, eid, data):
    with BookieConnection(b.bookie_id, shard=P.shard_of(lid, b.num_shards)) as c:
        return c.call(P.add(c.next_rid(), lid, eid, eid - 1, KEY, b"", data))[2]


def raw_read(b, lid, eid):
    with BookieConnection(b.bookie_id, shard=P.shard_of(lid, b.num_shards)) as c:
        r = c.call(P.read(c.next_rid(), lid, eid))
        return r[2], r[7]


def test_restart_against_unknown_prefix_is_refused_and_data_survives(cluster_factory):
    c = cluster_factory(1)
    b = c.bookies[0]
    lid = 1 << 50
    assert raw_add(b, lid, 0, b"precious") == EOK
    b.stop()
    good = b.metadata_uri
    typo = c.etcd.uri("ledgres")
    b.write_conf(metadataServiceUri=typo)
    log = refused(b)
    assert "/ledgres" in log and "mistyped" in log
    with c.store.__class__(typo) as s:             # the bookie changed nothing there
        assert not s.is_formatted() and s.read_cookie(b.bookie_id)[0] is None
    b.write_conf(metadataServiceUri=good)
    b.start()
    assert raw_read(b, lid, 0) == (EOK, b"precious")


def test_restart_against_reformatted_cluster_is_refused(cluster_factory):
    c = cluster_factory(1)
    b = c.bookies[0]
    old = c.store.instance_id
    assert raw_add(b, 1 << 50, 0, b"x") == EOK
    b.stop()
    c.store.format(force=True)                     # 'bkshell metaformat --force'
    new = c.store.instance_id
    log = refused(b)
    assert old in log and new in log and "format --force" in log
    assert c.store.read_cookie(b.bookie_id)[0] is None      # nothing written back


def test_empty_bookie_on_unformatted_cluster_is_refused(cluster_factory):
    c = cluster_factory(0)
    b = c._new_bookie(metadataServiceUri=c.etcd.uri("nothing-here"))
    log = refused(b)
    assert "metaformat" in log and "/nothing-here" in log
    assert not any(os.path.exists(os.path.join(d, COOKIE_FILE))
                   for d in (os.path.join(b.dir, "journal"), os.path.join(b.dir, "ledgers")))


def test_old_cookie_version_is_refused(cluster_factory):
    c = cluster_factory(1)
    b = c.bookies[0]
    b.stop()
    for d in ("journal", "ledgers"):
        path = os.path.join(b.dir, d, COOKIE_FILE)
        with open(path) as f:
            cookie = json.load(f)
        cookie["version"] = 1
        with open(path, "w") as f:
            json.dump(cookie, f)
    log = refused(b)
    assert "format version 1" in log


def test_gc_acts_only_on_a_listing_of_the_bookies_cluster(cluster_factory):
    c = cluster_factory(1, conf_overrides={"gcWaitTime": 3600_000})
    b = c.bookies[0]
    lid = (1 << 50) + 7                 # entries on the bookie, no metadata: garbage
    assert raw_add(b, lid, 0, b"orphan") == EOK
    cookie, _ = c.store.read_cookie(b.bookie_id)
    c.store.delete_cookie(b.bookie_id)  # the cluster no longer knows this bookie
    os.kill(b.pid, signal.SIGUSR1)
    wait_until(lambda: "garbage collection skipped" in open(b.log_file).read(),
               what="the GC refusal in the log")
    assert raw_read(b, lid, 0) == (EOK, b"orphan")
    # With the cookie back the same GC drops the orphan: the refusal above mattered.
    c.store.write_cookie(b.bookie_id, cookie)
    os.kill(b.pid, signal.SIGUSR1)
    wait_until(lambda: raw_read(b, lid, 0)[0] == ENOLEDGER, what="the orphan dropped")


def test_client_refuses_a_prefix_without_a_cluster(shared_cluster):
    with pytest.raises(ClusterNotFormattedError, match="metaformat"):
        bk.BookKeeper(shared_cluster.etcd.uri("typo"))


def test_ids_are_instance_scoped_and_spread_over_shards(shared_cluster):
    scope = id_scope(shared_cluster.store.instance_id)
    shards = [0, 0]
    with bk.BookKeeper(shared_cluster.metadata_uri) as client:
        ids = [client.create_ledger(3, 2, 2, password=b"p").ledger_id for _ in range(1000)]
    assert len(set(ids)) == len(ids)
    assert {i >> REVISION_BITS for i in ids} == {scope}
    for i in ids:
        shards[P.shard_of(i, 2)] += 1
    assert 450 <= shards[0] <= 550, shards


def test_running_bookie_does_not_join_a_cluster_reformatted_under_it(cluster_factory):
    c = cluster_factory(1)
    b = c.bookies[0]
    assert b.bookie_id in c.store.list_bookies()
    c.store.format(force=True)          # its registration and cookie are gone
    wait_until(lambda: "does not register" in open(b.log_file).read(),
               what="the refusal to re-register in the log")
    assert b.bookie_id not in c.store.all_bookies()
    assert c.store.read_cookie(b.bookie_id)[0] is None


def test_a_bookie_that_cannot_bind_leaves_no_cookie_and_gets_another_port(cluster_factory,
                                                                           monkeypatch):
    """A port picked free can be taken before the bookie binds it: the bookie binds
    before it creates its cookie, so it exits leaving none (the cluster would audit a
    bookie that never ran as lost), and the local cluster starts it on another port."""
    c = cluster_factory(0)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    picks = iter([port])
    real = localcluster.free_port
    monkeypatch.setattr(localcluster, "free_port", lambda host="127.0.0.1": next(picks, None)
                        or real(host))
    try:
        b = c.add_bookie()
    finally:
        taken.close()
    assert b.alive and b.port != port
    with open(b.log_file, errors="replace") as f:
        assert f"cannot bind 127.0.0.1:{port}" in f.read()
    assert c.store.read_cookie(f"127.0.0.1:{port}")[0] is None
    assert c.store.read_cookie(b.bookie_id)[0] is not None
    assert c.store.list_bookies() == [b.bookie_id]
