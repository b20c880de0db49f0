"""Deleted ledgers stay fenced: a writer that outlived its ledger's recovery and
deletion is never acknowledged again, after the bookies' GC and after kill -9."""

from __future__ import annotations

import os
import signal

import pytest

import bk
from bk import protocol as P
from bk.client.digest import master_key
from bk.errors import EFENCED, ENOLEDGER, NoSuchLedgerError
from bk.testing import BookieConnection, wait_until

PW = b"zombie"




def on_bookie(b, lid, msg_fn):
    with BookieConnection(b.bookie_id, shard=P.shard_of(lid, b.num_shards)) as c:
        return c.call(msg_fn(c.next_rid()))


def entries_status(b, lid):
    return on_bookie(b, lid, lambda rid: P.get_list_of_entries(rid, lid))[2]


def collect_garbage(cluster, lid):
    """SIGUSR1 every bookie until none holds ``lid`` any more."""
    def gone():
        for b in cluster.bookies:
            os.kill(b.pid, signal.SIGUSR1)
        return all(entries_status(b, lid) == ENOLEDGER for b in cluster.bookies)
    wait_until(gone, what=f"every bookie dropping ledger {lid}")


def test_zombie_writer_after_recovery_delete_gc_and_restart(cluster):
    with bk.BookKeeper(cluster.metadata_uri) as a, bk.BookKeeper(cluster.metadata_uri) as b:
        lh = a.create_ledger(3, 2, 2, password=PW)
        for i in range(10):
            lh.add_entry(b"e%d" % i)
        lid = lh.ledger_id
        # B presumes A dead: recovery (fences), then deletes the ledger.
        rh = b.open_ledger(lid, password=PW)
        assert rh.last_add_confirmed == 9
        b.delete_ledger(lid)
        collect_garbage(cluster, lid)
        # Every bookie that held the ledger keeps its tombstone: A is refused, and
        # told that its ledger was deleted (the metadata decides, not the EFENCED).
        with pytest.raises(NoSuchLedgerError):
            lh.add_entry(b"zombie")
        # Kill -9 right after GC: the tombstones were durable before GC finished.
        for bp in cluster.bookies:
            bp.kill()
        for bp in cluster.bookies:
            bp.start()
        key = master_key(PW)
        for bp in cluster.bookies:
            add = on_bookie(bp, lid, lambda rid: P.add(rid, lid, 10, 9, key, b"", b"zombie"))
            assert add[2] == EFENCED, bp
            rec = on_bookie(bp, lid, lambda rid: P.add(rid, lid, 10, 9, key, b"", b"z",
                                                         recovery=True))
            assert rec[2] == EFENCED, bp
            fence = on_bookie(bp, lid, lambda rid: P.read_lac(rid, lid, fence=True,
                                                              master_key=key))
            assert fence[2] == ENOLEDGER, bp
            assert entries_status(bp, lid) == ENOLEDGER     # nothing was created
        with pytest.raises(NoSuchLedgerError):
            lh.add_entry(b"zombie again")
