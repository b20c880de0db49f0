"""Findings of the cluster-safety review that are not about identity, tombstones
or checkpoints: segments too small for a frame, EBADREQ is not a bookie
failure, read-only flips survive an etcd outage. Real etcd and bookies."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import bk
from bk import protocol as P
from bk.errors import BadRequestError, EOK, EREADONLY
from bk.testing import BookieConnection, wait_until

PW = b"pw"




def test_segment_smaller_than_a_frame_is_refused(cluster_factory, tmp_path):
    c = cluster_factory(0)
    conf = tmp_path / "b.conf"
    conf.write_text(f"metadataServiceUri={c.metadata_uri}\nbookiePort=0\n"
                    f"journalDirectories={tmp_path}/j\nledgerDirectories={tmp_path}/l\n"
                    f"journalPreAllocSizeMB=4\n")          # default 5 MiB frames
    env = {k: v for k, v in os.environ.items() if not k.startswith("BK_")}
    r = subprocess.run([sys.executable, "-m", "bk.cli.bookie", "start", "--conf", str(conf)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    assert "journalPreAllocSizeMB" in r.stderr and "nettyMaxFrameSizeBytes" in r.stderr
    assert "Traceback" not in r.stderr
    assert not os.path.exists(tmp_path / "j")             # refused before touching disks


def test_entry_of_almost_a_frame_round_trips(shared_cluster):
    big = os.urandom(5 * 1024 * 1024 - 4096)              # within the 5 MiB frame limit
    with bk.BookKeeper(shared_cluster.metadata_uri) as client:
        lh = client.create_ledger(3, 2, 2, password=PW)
        assert lh.add_entry(big) == 0
        ensembles = client.ledger_metadata(lh.ledger_id).ensembles
        lh.close()
        assert len(ensembles) == 1                         # no bookie was replaced
        rh = client.open_ledger(lh.ledger_id, password=PW)
        assert next(iter(rh.read_entries(0, 0))).data == big


def test_ebadreq_fails_the_add_without_replacing_the_bookie(shared_cluster):
    with bk.BookKeeper(shared_cluster.metadata_uri, addEntryTimeoutSec=5) as client:
        # A client that believes every bookie has one shard sends some ledgers' adds
        # to a shard that does not own them: the bookies answer EBADREQ.
        for b in shared_cluster.bookies:
            client._shards[b.bookie_id] = 1
        while True:
            lh = client.create_ledger(3, 3, 2, password=PW)
            if P.shard_of(lh.ledger_id, 2) == 1:
                break
        before = client.ledger_metadata(lh.ledger_id).ensembles
        with pytest.raises(BadRequestError) as ei:
            lh.add_entry(b"x")
        msg = str(ei.value)
        assert "EBADREQ" in msg and "not replaced" in msg and "shard" in msg
        assert client.ledger_metadata(lh.ledger_id).ensembles == before
        with pytest.raises(BadRequestError):
            lh.add_entry(b"y")                             # the handle stays failed


def test_read_only_flip_registered_after_etcd_outage(cluster_factory, small_fs):
    c = cluster_factory(0)
    b = c.add_bookie(journalDirectories=str(small_fs / "journal"),
                     ledgerDirectories=str(small_fs / "ledgers"), journalPreAllocSizeMB=4,
                     nettyMaxFrameSizeBytes=2 << 20, numShards=1,
                     diskUsageThreshold=0.6, diskUsageLwmThreshold=0.5, diskCheckInterval=200)
    lid = 1 << 50
    add = lambda w, eid: w.call(P.add(w.next_rid(), lid, eid, eid - 1, b"k" * 20, b"",
                                      b"x"))[2]
    with BookieConnection(b.bookie_id, 0) as w:
        assert add(w, 0) == EOK
        c.etcd.stop()
        filler = small_fs / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * (44 << 20))                    # over 60%: read-only
        wait_until(lambda: add(w, 1) == EREADONLY, what="the bookie turning read-only")
        c.etcd.start()
        wait_until(lambda: b.bookie_id in c.store.list_bookies(readonly=True),
                   what="read-only registration once etcd is back")
        assert b.bookie_id not in c.store.list_bookies()
        os.unlink(filler)                                  # and back, etcd up this time
        wait_until(lambda: b.bookie_id in c.store.list_bookies(), what="writable again")
        assert b.bookie_id not in c.store.list_bookies(readonly=True)
