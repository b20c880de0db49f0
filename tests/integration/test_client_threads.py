"""Blocking adds from many threads, each on a ledger of its own (the shape of a
process creating, writing and closing many ledgers at once), against real bookies:
acknowledged in order and read back as acknowledged, nothing acknowledged lost when
a bookie dies (kill -9) or hangs (SIGSTOP) while they are in flight, and threads
sharing TLS connections never break them, bursts of asynchronous adds included
(several 16 KiB records per connection and pass of the client's I/O thread)."""

import threading

import pytest

from bk.meta.ledger import LedgerState
from bk.testing import bookie_lost, wait_until

pytestmark = pytest.mark.timeout(180)

PW = b"threads"


ENTRY = 8 << 10          # a burst of 40 entries of 8 KiB: 320 KiB per connection


def _writers(client, n_threads, stop, acked, errors, per_thread=None, ensemble=(3, 2, 2),
             burst=0):
    """Threads each writing to a ledger of its own: blocking adds (one in flight per
    handle), or with ``burst`` bursts of that many ENTRY-sized add_entry_async, each
    burst awaited; ``acked[lid]`` lists (entry id, payload) as acknowledged."""
    handles = []

    def run(k):
        try:
            lh = client.create_ledger(*ensemble, password=PW)
            handles.append(lh)
            acked[lh.ledger_id] = got = []
            i = 0
            while not stop.is_set() and (per_thread is None or i < per_thread):
                if burst:
                    pending = []
                    for _ in range(burst):
                        data = (b"%d-%d-" % (k, i)).ljust(ENTRY, b"x")
                        pending.append((lh.add_entry_async(data), data))
                        i += 1
                    got.extend((fut.result(30), data) for fut, data in pending)
                else:
                    data = b"t%d-%d" % (k, i)
                    got.append((lh.add_entry(data), data))
                    i += 1
            lh.close()
        except Exception as e:      # asserted by the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    return threads, handles


def _check_ledgers(client, acked):
    for lid, got in acked.items():
        ids = [e for e, _ in got]
        assert ids == list(range(len(ids))), f"ledger {lid}: acknowledged ids out of order"
        md = client.ledger_metadata(lid)
        assert md.state == LedgerState.CLOSED
        assert md.last_entry_id == len(got) - 1
        if got:
            rh = client.open_ledger_no_recovery(lid, password=PW)
            read = [(e.entry_id, e.data) for e in rh.read_entries(0, len(got) - 1)]
            assert read == got, f"ledger {lid}: what was read differs from what was acked"


def test_blocking_adds_from_many_threads_in_order(shared_cluster):
    with shared_cluster.client(timeout=5) as client:
        acked, errors = {}, []
        threads, _ = _writers(client, 8, threading.Event(), acked, errors, per_thread=60)
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert len(acked) == 8
        _check_ledgers(client, acked)


def _lose_a_bookie(cluster, client, how, threads, stop, handles, acked, more):
    """Kill -9 (``how="kill"``) or SIGSTOP (``"stop"``) the first bookie of the first
    handle's ensemble while the writers run; wait until every writer acknowledged
    ``more`` entries past that moment, stop them, and check that the ledgers
    that had the bookie replaced it."""
    victim = cluster.bookie(handles[0].metadata.last_ensemble[0])
    marks = {lid: len(v) for lid, v in acked.items()}
    with bookie_lost(victim, how):
        wait_until(lambda: all(len(acked[lid]) >= n + more for lid, n in marks.items()),
                   90, f"every writer acknowledged {more} more entries after the loss")
        stop.set()
        for t in threads:
            t.join(60)
    changed = 0
    for lh in handles:
        md = client.ledger_metadata(lh.ledger_id)
        if victim.bookie_id in md.ensembles[0][1]:
            assert victim.bookie_id not in md.last_ensemble
            changed += 1
    assert changed >= 1, "no ledger replaced the lost bookie"


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_bookie_lost_during_blocking_adds_from_many_threads(cluster_factory, how):
    cluster = cluster_factory(4)
    with cluster.client(timeout=3, addEntryTimeoutSec=1) as client:
        stop = threading.Event()
        acked, errors = {}, []
        threads, handles = _writers(client, 6, stop, acked, errors)
        wait_until(lambda: len(acked) == 6 and all(len(v) >= 20 for v in acked.values()),
                   60, "every writer acknowledged 20 entries")
        # every writer goes on past the loss (each ledger with the victim in its
        # ensemble changes it)
        _lose_a_bookie(cluster, client, how, threads, stop, handles, acked, more=30)
        assert not errors, errors
        _check_ledgers(client, acked)


def test_tls_blocking_adds_from_threads_sharing_connections(cluster_factory):
    # one shard per bookie: every ledger of every thread shares the same three
    # connections, so adds of different threads meet on each of them
    cluster = cluster_factory(3, num_shards=1, secure=True)
    with cluster.client(timeout=5, **cluster.client_settings()) as client:
        acked, errors = {}, []
        threads, handles = _writers(client, 8, threading.Event(), acked, errors,
                                    per_thread=80, ensemble=(3, 3, 2))
        for t in threads:
            t.join(150)
        assert not errors, errors
        conns = [c for c in client._io._conns.values() if c.sock is not None]
        assert len(conns) == 3 and all(c.tls is not None for c in conns)
        # a TLS stream that got two threads' records mixed would have broken (the
        # bookie fails the connection), and the ledgers would have changed ensembles
        for lh in handles:
            assert len(client.ledger_metadata(lh.ledger_id).ensembles) == 1
        _check_ledgers(client, acked)


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_tls_bursts_from_threads_survive_a_bookie_lost(cluster_factory, how):
    # one shard per bookie: every thread's ledger shares the same TLS connections.
    # A SIGSTOPped bookie takes no more ciphertext: its connections fill up
    # mid-stream (records queued whole in the TLS backlog) until the writers
    # replace it, and the quorum's acknowledgements keep coming from the others.
    cluster = cluster_factory(4, num_shards=1, secure=True)
    with cluster.client(timeout=5, addEntryTimeoutSec=2, **cluster.client_settings()) as client:
        stop = threading.Event()
        acked, errors = {}, []
        threads, handles = _writers(client, 4, stop, acked, errors, ensemble=(3, 3, 2),
                                    burst=40)
        wait_until(lambda: len(acked) == 4 and all(len(v) >= 80 for v in acked.values()),
                   60, "every writer acknowledged two bursts")
        _lose_a_bookie(cluster, client, how, threads, stop, handles, acked, more=80)
        assert not errors, errors
        _check_ledgers(client, acked)
