"""The auditor's checks against a bookie that is paused (SIGSTOP) and whose
registration expired: its port still accepts connections (the kernel's backlog)
and nothing answers HELLO. Found by the soak (--autorecovery, 2026-11-28): the
socket's timeout escaped BookiePool.num_shards as a bare TimeoutError, so the
whole periodic check failed with a trace instead of counting one bookie
unreachable."""

import signal

import pytest

import bk
from bk.autorecovery.checker import fragment_problems, replica_problems
from bk.errors import BookieUnavailableError
from bk.rawclient import BookiePool
from bk.testing import closed_ledger, stop_bookie, wait_until


def test_checks_count_a_paused_unregistered_bookie_unreachable(cluster):
    with bk.BookKeeper(cluster.metadata_uri) as c:
        lid = closed_ledger(c, [b"e%d" % i for i in range(6)], 3, 3, 2)
    store = cluster.store
    md, _ = store.read_ledger(lid)
    victim = cluster.bookies[0]
    stop_bookie(victim)
    pool = BookiePool(store, timeout=1.0)
    try:
        # its lease expires: the pool then learns its shards from HELLO, not etcd
        wait_until(lambda: victim.bookie_id not in store.list_bookies(), timeout=30,
                   what="the paused bookie's registration expired")
        with pytest.raises(BookieUnavailableError):
            pool.num_shards(victim.bookie_id)
        for check in (fragment_problems, replica_problems):
            res = check(pool, md)
            assert set(res.unreachable) == {victim.bookie_id}, (check.__name__, res.unreachable)
            assert not res.missing, (check.__name__, res.missing)
    finally:
        victim.kill(signal.SIGCONT)
        pool.close()
