"""Client against real etcd and real bookie processes.

Tests that do not kill or restart bookies share one module-scoped cluster;
the destructive ones get their own through ``cluster_factory``.
"""

import logging
import os
import signal
import threading
import time

import pytest

import bk
from bk import protocol as P
from bk.client import digest as D
from bk.errors import (BadPasswordError, BKError, DigestMismatchError, LedgerClosedError,
                       LedgerFencedError, LedgerRecoveryError, NoSuchEntryError,
                       MetadataError, NoSuchLedgerError, NotEnoughBookiesError)
from bk.meta.ledger import LedgerState
from bk.testing import BookieConnection, bookie_lost, wait_until

pytestmark = pytest.mark.timeout(90)

PW = b"secret"


@pytest.fixture
def client(shared_cluster):
    with shared_cluster.client(timeout=5) as cl:
        yield cl


def _raw_add(cluster, bookie_id, lid, eid, lac, length, data):
    """Store an entry of a crc32c ledger (password PW) on one bookie, as its writer would."""
    n = cluster.store.bookie_info(bookie_id)["numShards"]
    with BookieConnection(bookie_id, shard=P.shard_of(lid, n)) as c:
        sig = D.EntryDigest(lid, "crc32c", PW).sign(eid, lac, length, data)
        r = c.call(P.add(c.next_rid(), lid, eid, lac, D.master_key(PW), sig, data))
        assert r[2] == bk.errors.EOK, r


# --- basics ------------------------------------------------------------------

def test_create_add_read_close(client):
    lh = client.create_ledger(3, 2, 2, password=PW, custom_metadata={"app": b"x"})
    assert lh.last_add_confirmed == -1
    assert [lh.add_entry(b"e%d" % i) for i in range(5)] == list(range(5))
    assert lh.add_entries([b"b%d" % i for i in range(100)]) == 104
    assert lh.last_add_confirmed == 104
    fut = lh.add_entry_async(b"async")
    assert fut.result(10) == 105
    lh.close()
    assert lh.is_closed
    with pytest.raises(LedgerClosedError):
        lh.add_entry(b"late")
    md = client.ledger_metadata(lh.ledger_id)
    assert md.state == LedgerState.CLOSED and md.last_entry_id == 105
    assert md.length == 5 * 2 + 10 * 2 + 90 * 3 + 5
    assert md.custom_metadata == {"app": b"x"}
    assert md.ensemble_size == 3 and md.write_quorum_size == 2 and md.ack_quorum_size == 2
    assert PW not in md.to_json()
    assert lh.ledger_id in set(client.list_ledgers())

    rh = client.open_ledger(lh.ledger_id, password=PW)
    assert rh.is_closed and rh.last_add_confirmed == 105 and rh.length == md.length
    entries = rh.read_entries(0, 105)
    assert [e.entry_id for e in entries] == list(range(106))
    assert entries[0].data == b"e0" and entries[104].data == b"b99" and entries[105].data == b"async"
    with pytest.raises(NoSuchEntryError):
        rh.read_entries(100, 106)

    client.delete_ledger(lh.ledger_id)
    with pytest.raises(NoSuchLedgerError):
        client.ledger_metadata(lh.ledger_id)
    assert len(client.bookies()) == 3 and client.bookies(readonly=True) == []


def test_bad_arguments_consume_no_entry_id(client, shared_cluster):
    with pytest.raises(ValueError):
        client.create_ledger(2, 3, 2)
    with pytest.raises(ValueError):
        client.create_ledger(3, 2, 0)
    with pytest.raises(ValueError):
        client.create_ledger(3, 2, 2, digest_type="md5")
    with pytest.raises(NotEnoughBookiesError):
        client.create_ledger(4, 2, 2)
    lh = client.create_ledger(3, 2, 2)
    with pytest.raises(TypeError):
        lh.add_entry("text")
    with pytest.raises(ValueError):
        lh.add_entry(b"x" * (6 * 1024 * 1024))
    with pytest.raises(TypeError):
        lh.add_entries([b"ok", 5])
    assert lh.add_entry(b"first") == 0
    lh.close()


def test_create_ledger_checks_quorums_and_writable_bookies(client):
    before = list(client.list_ledgers())
    for e, qw, qa in [(2, 3, 2), (3, 2, 3), (3, 3, 0), (0, 0, 0), (3, 3, 4), (1, 0, 0),
                      (-1, -1, -1)]:
        with pytest.raises(ValueError) as ei:
            client.create_ledger(e, qw, qa, password=PW)
        assert f"E={e} Qw={qw} Qa={qa}" in str(ei.value)
    with pytest.raises(NotEnoughBookiesError) as ei:
        client.create_ledger(4, 3, 2, password=PW)
    assert "ensemble size 4" in str(ei.value) and "need 4" in str(ei.value) \
        and "found 3" in str(ei.value)
    assert list(client.list_ledgers()) == before          # a refused create leaves nothing
    writable = set(client.bookies())
    for e, qw, qa in [(1, 1, 1), (2, 2, 1), (3, 1, 1), (3, 3, 3)]:
        lh = client.create_ledger(e, qw, qa, password=PW)
        ens = lh.metadata.last_ensemble
        assert len(ens) == len(set(ens)) == e and set(ens) <= writable   # never two on one
        payloads = [b"q%d" % i for i in range(2 * e)]
        assert lh.add_entries(payloads) == 2 * e - 1
        lh.close()
        rh = client.open_ledger_no_recovery(lh.ledger_id, password=PW)
        assert [x.data for x in rh.read_entries(0, 2 * e - 1)] == payloads


def test_list_ledgers_streams_in_pages(client):
    ids = []
    for _ in range(25):
        with client.create_ledger(1, 1, 1) as lh:
            ids.append(lh.ledger_id)
    store = client._store
    before = store.rpc_counts["range"]
    it = client.list_ledgers(page_size=10)
    first = next(it)
    # lazy: requests until the first page, over id windows that grow 16x while empty
    # (ids sit high: the cluster's scope is in their top bits)
    lead = store.rpc_counts["range"] - before
    listed = [first] + list(it)
    # exactly the empty windows below the smallest id, then the one holding it:
    # windows start 2**40 wide and grow by min(16, page_size) while empty
    lo, width, windows = 0, 1 << 40, 1
    while min(listed) >= lo + width:
        lo, width, windows = lo + width, width * 10, windows + 1
    assert lead == windows
    assert listed == sorted(set(listed)) and set(ids) <= set(listed)   # ascending, each once
    pages = (len(listed) + 9) // 10
    # and at most 16 past the last id, to the end of the id space (2**63 = 16**15.75)
    assert pages >= 3 and pages <= store.rpc_counts["range"] - before <= lead + 2 * pages + 16
    before = store.rpc_counts["range"]
    assert list(client.list_ledgers()) == listed
    assert store.rpc_counts["range"] - before <= lead + 1 + 16    # default: 1000 ids a page


def test_uri_scheme_and_unreachable_etcd():
    with pytest.raises(ValueError):
        bk.BookKeeper("zk://127.0.0.1:2181/ledgers")
    from bk.util import free_port
    uri = f"etcd://127.0.0.1:{free_port()}/ledgers"
    t0 = time.monotonic()
    with pytest.raises(BKError) as ei:
        bk.BookKeeper(uri, metadataTimeoutMillis=1000)
    assert uri in str(ei.value) or f"127.0.0.1:{uri.split(':')[2].split('/')[0]}" in str(ei.value)
    assert time.monotonic() - t0 < 15


def test_lac_piggyback_and_unconfirmed_reads(client):
    lh = client.create_ledger(3, 3, 2, password=PW)
    for i in range(10):
        lh.add_entry(b"p%d" % i)
    rh = client.open_ledger_no_recovery(lh.ledger_id, password=PW)
    assert rh.last_add_confirmed == 8          # the writer's last entry minus one
    assert not rh.is_closed
    assert [e.data for e in rh.read_entries(0, 8)] == [b"p%d" % i for i in range(9)]
    with pytest.raises(NoSuchEntryError):
        rh.read_entries(0, 9)
    assert rh.read_unconfirmed_entries(9, 9)[0].data == b"p9"
    with pytest.raises(NoSuchEntryError):
        rh.read_unconfirmed_entries(10, 10)
    lh.add_entry(b"p10")
    assert rh.read_last_add_confirmed() == 9
    assert rh.last_add_confirmed == 9
    lh.close()
    assert rh.read_last_add_confirmed() == 10


def test_wrong_password_changes_nothing(client):
    lh = client.create_ledger(3, 2, 2, password=PW)
    lh.add_entry(b"x")
    for opener in (client.open_ledger, client.open_ledger_no_recovery):
        with pytest.raises(BadPasswordError):
            opener(lh.ledger_id, password=b"wrong")
    assert client.ledger_metadata(lh.ledger_id).state == LedgerState.OPEN
    assert lh.add_entry(b"y") == 1
    lh.close()


# --- fencing and recovery ---------------------------------------------------------

def test_recovery_fences_the_writer(client, shared_cluster):
    lh = client.create_ledger(3, 2, 2, password=PW)
    for i in range(10):
        lh.add_entry(b"w%d" % i)
    with bk.BookKeeper(shared_cluster.metadata_uri) as other:
        rh = other.open_ledger(lh.ledger_id, password=PW)
        assert rh.is_closed and rh.last_add_confirmed == 9
        with pytest.raises(LedgerFencedError) as ei:
            lh.add_entry(b"after")
        assert f"ledger {lh.ledger_id}" in str(ei.value) and "fenced" in str(ei.value)
        with pytest.raises(LedgerFencedError):
            lh.add_entry(b"again")
        lh.close()                        # CLOSED at the same last entry: fine
        assert lh.last_add_confirmed == rh.metadata.last_entry_id == 9
        assert [e.data for e in rh.read_entries(0, 9)] == [b"w%d" % i for i in range(10)]


def test_acknowledged_entries_survive_concurrent_recovery(client, shared_cluster):
    lh = client.create_ledger(3, 2, 2, password=PW)
    acked = []
    stop = threading.Event()
    errors = []

    def writer():
        i = 0
        while not stop.is_set():
            try:
                eid = lh.add_entry(b"payload-%d" % i)
            except LedgerFencedError as e:
                errors.append(e)
                return
            acked.append((eid, b"payload-%d" % i))
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    while len(acked) < 50:
        time.sleep(0.01)
    with bk.BookKeeper(shared_cluster.metadata_uri) as other:
        rh = other.open_ledger(lh.ledger_id, password=PW)
        t.join(30)
        stop.set()
        assert not t.is_alive() and errors
        last = rh.metadata.last_entry_id
        assert acked and all(eid <= last for eid, _ in acked)
        assert acked[-1][0] >= last - 1
        got = {e.entry_id: e.data for e in rh.read_entries(0, last)}
        for eid, data in acked:
            assert got[eid] == data


def test_concurrent_recoveries_converge(client, shared_cluster):
    lh = client.create_ledger(3, 2, 2, password=PW)
    lh.add_entries([b"c%d" % i for i in range(200)])
    results, errors = [], []

    def recover():
        try:
            with bk.BookKeeper(shared_cluster.metadata_uri) as cl:
                h = cl.open_ledger(lh.ledger_id, password=PW)
                results.append((h.metadata.last_entry_id, h.length))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=recover) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    md = client.ledger_metadata(lh.ledger_id)
    assert md.state == LedgerState.CLOSED and md.last_entry_id == 199
    assert set(results) == {(199, md.length)}
    with pytest.raises(LedgerFencedError):
        lh.add_entry(b"late")


def test_recovery_of_unacknowledged_tail(client, shared_cluster):
    """Entries a dying writer left on too few bookies: one on 2 of its 3 bookies
    must be recovered (at most one bookie can deny it); one on a single bookie may
    be recovered or dropped, and the closed ledger agrees with what happened."""
    lh = client.create_ledger(3, 3, 2, password=PW)
    lh.add_entries([b"t%d" % i for i in range(20)])
    lid = lh.ledger_id
    md = client.ledger_metadata(lid)
    dg = D.EntryDigest(lid, "crc32c", PW)
    base = sum(len(b"t%d" % i) for i in range(20))

    def raw_add(bid, eid, lac, length, data):
        n = shared_cluster.store.bookie_info(bid)["numShards"]
        with BookieConnection(bid, shard=P.shard_of(lid, n)) as c:
            r = c.call(P.add(c.next_rid(), lid, eid, lac, D.master_key(PW),
                             dg.sign(eid, lac, length, data), data))
            assert r[2] == 0

    for bid in md.write_set(20)[:2]:
        raw_add(bid, 20, 19, base + 3, b"t20")
    raw_add(md.write_set(21)[0], 21, 19, base + 6, b"t21")
    rh = client.open_ledger(lid, password=PW)
    assert rh.last_add_confirmed in (20, 21)
    assert rh.length == base + 3 * (rh.last_add_confirmed - 19)
    got = [e.data for e in rh.read_entries(0, rh.last_add_confirmed)]
    assert got == [b"t%d" % i for i in range(rh.last_add_confirmed + 1)]
    # What recovery kept is now on its whole write set.
    for bid in md.write_set(20):
        n = shared_cluster.store.bookie_info(bid)["numShards"]
        with BookieConnection(bid, shard=P.shard_of(lid, n)) as c:
            r = c.call(P.read(c.next_rid(), lid, 20))
            assert r[2] == 0 and r[7] == b"t20"


def test_close_loses_its_cas_to_another_client(client, shared_cluster):
    """close() after another client changed the metadata: CLOSED at the writer's last
    entry is success (test_recovery_fences_the_writer); CLOSED at another entry, or a
    recovery under way (IN_RECOVERY), is LedgerFencedError and the metadata stays."""
    lh = client.create_ledger(3, 3, 2, password=PW)
    lh.add_entries([b"c%d" % i for i in range(10)])
    lid, ws = lh.ledger_id, lh.metadata.write_set(10)
    length = lh.length + 3
    # The writer's add of entry 10 reached two bookies; its acknowledgements never came.
    for bid in ws[:2]:
        _raw_add(shared_cluster, bid, lid, 10, 9, length, b"c10")
    with bk.BookKeeper(shared_cluster.metadata_uri) as other:
        assert other.open_ledger(lid, password=PW).last_add_confirmed == 10
    with pytest.raises(LedgerFencedError) as ei:
        lh.close()
    assert f"ledger {lid}" in str(ei.value) and "at entry 10" in str(ei.value) \
        and "is 9" in str(ei.value)
    md = client.ledger_metadata(lid)
    assert md.state == LedgerState.CLOSED and md.last_entry_id == 10 and md.length == length

    lh = client.create_ledger(3, 2, 2, password=PW)
    lh.add_entries([b"r%d" % i for i in range(5)])
    md, version = shared_cluster.store.read_ledger(lh.ledger_id)
    shared_cluster.store.write_ledger(md.replace(state=LedgerState.IN_RECOVERY), version)
    with pytest.raises(LedgerFencedError) as ei:
        lh.close()
    assert "being recovered" in str(ei.value)
    md = client.ledger_metadata(lh.ledger_id)
    assert md.state == LedgerState.IN_RECOVERY and md.last_entry_id == -1


def test_read_moves_on_when_a_bookie_lacks_the_entry(client, shared_cluster):
    lh = client.create_ledger(3, 3, 2, password=PW)
    lh.add_entries([b"m%d" % i for i in range(5)])
    lid, ws = lh.ledger_id, lh.metadata.write_set(5)
    # Entry 5 is on the last two bookies of its write set, not on the first one.
    for bid in ws[1:]:
        _raw_add(shared_cluster, bid, lid, 5, 4, lh.length + 2, b"m5")
    rh = client.open_ledger_no_recovery(lid, password=PW)
    assert [e.data for e in rh.read_unconfirmed_entries(3, 5)] == [b"m3", b"m4", b"m5"]
    shard = P.shard_of(lid, shared_cluster.bookie(ws[0]).num_shards)
    with BookieConnection(ws[0], shard=shard) as c:
        assert c.call(P.read(c.next_rid(), lid, 5))[2] == bk.errors.ENOENTRY


def test_delete_ledger_then_bookies_drop_its_entries(client, shared_cluster):
    gone = client.create_ledger(3, 3, 3, password=PW)
    gone.add_entries([b"g%d" % i for i in range(10)])
    gone.close()
    kept = client.create_ledger(3, 3, 3, password=PW)
    kept.add_entries([b"k%d" % i for i in range(10)])
    kept.close()
    lid = gone.ledger_id

    def entries_on(b, ledger):
        with BookieConnection(b.bookie_id, shard=P.shard_of(ledger, b.num_shards)) as c:
            r = c.call(P.get_list_of_entries(c.next_rid(), ledger))
            return r[2], P.ranges_to_ids(r[4])

    assert [entries_on(b, lid) for b in shared_cluster.bookies] == \
        [(bk.errors.EOK, list(range(10)))] * 3
    client.delete_ledger(lid)
    for call in (client.ledger_metadata, client.delete_ledger):
        with pytest.raises(NoSuchLedgerError):
            call(lid)
    for opener in (client.open_ledger, client.open_ledger_no_recovery):
        with pytest.raises(NoSuchLedgerError):
            opener(lid, password=PW)
    assert lid not in set(client.list_ledgers()) and kept.ledger_id in set(client.list_ledgers())
    # Bookies drop the entries at their next garbage collection (SIGUSR1: now).
    def collected():
        for b in shared_cluster.bookies:
            os.kill(b.pid, signal.SIGUSR1)
        return all(entries_on(b, lid)[0] == bk.errors.ENOLEDGER for b in shared_cluster.bookies)

    wait_until(collected, step=0.2, what="every bookie to drop the deleted ledger")
    assert [entries_on(b, lid) for b in shared_cluster.bookies] == [(bk.errors.ENOLEDGER, [])] * 3
    for b in shared_cluster.bookies:
        with BookieConnection(b.bookie_id, shard=P.shard_of(lid, b.num_shards)) as c:
            assert c.call(P.read(c.next_rid(), lid, 0))[2] == bk.errors.ENOLEDGER
        assert entries_on(b, kept.ledger_id) == (bk.errors.EOK, list(range(10)))
    rh = client.open_ledger(kept.ledger_id, password=PW)
    assert [e.data for e in rh.read_entries(0, 9)] == [b"k%d" % i for i in range(10)]


@pytest.mark.parametrize("digest_type", ["crc32", "crc32c", "mac", "dummy"])
def test_digest_types_and_corruption(client, shared_cluster, digest_type):
    lh = client.create_ledger(3, 3, 2, digest_type=digest_type, password=PW)
    lh.add_entries([b"d%d" % i for i in range(10)])
    lh.close()
    lid = lh.ledger_id
    rh = client.open_ledger_no_recovery(lid, password=PW)
    assert [e.data for e in rh.read_entries(0, 9)] == [b"d%d" % i for i in range(10)]
    if digest_type == "dummy":
        return
    md = rh.metadata
    ws = md.write_set(5)
    bad = D.EntryDigest(lid, digest_type, PW).sign(5, 4, 999, b"d5")  # wrong length/lac
    for i, bid in enumerate(ws):
        n = shared_cluster.store.bookie_info(bid)["numShards"]
        with BookieConnection(bid, shard=P.shard_of(lid, n)) as c:
            r = c.call(P.add(c.next_rid(), lid, 5, 3, D.master_key(PW), bad, b"EVIL",
                             recovery=True))
            assert r[2] == 0
        if i == 0:
            # the first replica is corrupt: the reader moves on to a good copy
            assert rh.read_entries(5, 5)[0].data == b"d5"
    with pytest.raises(DigestMismatchError) as ei:
        rh.read_entries(5, 5)
    assert "entry 5" in str(ei.value) and str(lid) in str(ei.value)


def test_tailing_reader_long_poll(client, shared_cluster):
    lh = client.create_ledger(3, 2, 2, password=PW)
    n = 30

    def write():
        for i in range(n):
            lh.add_entry(b"tail%d" % i)
            time.sleep(0.01)
        lh.close()

    rh = client.open_ledger_no_recovery(lh.ledger_id, password=PW)
    t = threading.Thread(target=write)
    t.start()
    got = []
    deadline = time.monotonic() + 30
    while len(got) < n and time.monotonic() < deadline:
        lac, e = rh.read_last_add_confirmed_and_entry(len(got), timeout=1.0)
        if e is not None:
            assert e.entry_id == len(got)
            got.append(e.data)
    t.join(10)
    assert got == [b"tail%d" % i for i in range(n)]
    assert rh.read_last_add_confirmed_and_entry(n, timeout=0.2) == (n - 1, None)


def test_tailing_reader_length_follows_the_entries_it_reads(client):
    lh = client.create_ledger(3, 2, 2, password=PW)
    sizes = [(i * 37) % 300 + 1 for i in range(20)]
    writer_length = []                      # the writer's length after each entry
    for i, n in enumerate(sizes):
        lh.add_entry(bytes([65 + i % 26]) * n)
        writer_length.append(lh.length)
    assert writer_length[-1] == sum(sizes)
    rh = client.open_ledger_no_recovery(lh.ledger_id, password=PW)
    assert rh.last_add_confirmed == 18 and rh.length == 0          # nothing read yet
    assert sum(len(e.data) for e in rh.read_entries(0, 9)) == rh.length == sum(sizes[:10])
    assert rh.read_entries(2, 3) and rh.length == writer_length[9]  # never moves back
    rh.read_entries(10, 18)
    assert rh.length == sum(sizes[:19]) == writer_length[18]
    # an entry past the LAC is not counted: recovery might still drop it
    assert rh.read_unconfirmed_entries(19, 19)[0].length == writer_length[19]
    assert rh.length == writer_length[18]
    # the long poll reads the entry it waited for
    lh.add_entry(b"z" * 5)
    lac, e = rh.read_last_add_confirmed_and_entry(19, timeout=5.0)
    assert lac == 19 and e.entry_id == 19 and rh.length == writer_length[19] == lh.length - 5
    lh.close()
    assert rh.read_last_add_confirmed() == 20
    assert rh.is_closed and rh.length == lh.length == sum(sizes) + 5


def test_add_entries_piggyback_the_lac_of_the_acknowledged_batch(client, shared_cluster):
    # Qw = Qa = E: when add_entries returns, every bookie has every entry.
    lh = client.create_ledger(3, 3, 3, password=PW)
    assert lh.add_entries([b"a%d" % i for i in range(10)]) == 9
    assert lh.add_entries([b"b%d" % i for i in range(10)]) == 19
    rh = client.open_ledger_no_recovery(lh.ledger_id, password=PW)
    assert rh.last_add_confirmed == 9          # what batch 2 told the bookies
    lid = lh.ledger_id
    dg = D.EntryDigest(lid, "crc32c", PW)
    for b in shared_cluster.bookies:
        with BookieConnection(b.bookie_id, shard=P.shard_of(lid, b.num_shards)) as c:
            for eid in range(20):
                r = c.call(P.read(c.next_rid(), lid, eid))
                assert r[2] == bk.errors.EOK
                assert r[5] == (-1 if eid < 10 else 9), (b.bookie_id, eid, r[5])
                dg.verify(eid, r[5], r[6], r[7])        # the LAC is signed as sent
    lh.add_entries([b"c0"])
    assert rh.read_last_add_confirmed() == 19
    lh.close()


def test_adds_from_many_threads_ack_in_order(client):
    lh = client.create_ledger(3, 3, 2, password=PW)
    order = []

    def cb(exc, eid):
        assert exc is None
        order.append(eid)

    def work(k):
        for i in range(300):
            lh.add_entry_async(b"%d-%d" % (k, i), cb)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lh.close()
    assert order == list(range(1200))
    assert lh.last_add_confirmed == 1199


# --- failures ---------------------------------------------------------------------

def test_bookie_killed_mid_stream(cluster_factory):
    cluster = cluster_factory(4)
    with cluster.client(timeout=3, addEntryTimeoutSec=2) as client:
        lh = client.create_ledger(3, 2, 2, password=PW)
        acked = {}
        errors = []

        def writer():
            try:
                # one add at a time (each waits for its group commit): 1000 of them
                # outlast the kill after 300 and the ensemble change by far
                for i in range(1000):
                    eid = lh.add_entry_async(b"k%d" % i).result(30)
                    acked[eid] = b"k%d" % i
            except Exception as e:  # pragma: no cover - asserted below
                errors.append(e)

        # pipelined too: a window of adds in flight when the bookie dies
        t = threading.Thread(target=writer)
        t.start()
        futs = []
        while len(acked) < 300:
            time.sleep(0.005)
        victim = lh.metadata.last_ensemble[0]
        cluster.bookie(victim).kill(signal.SIGKILL)
        for i in range(500):
            futs.append(lh.add_entry_async(b"f%d" % i))
        ids = [f.result(30) for f in futs]
        t.join(60)
        assert not errors, errors
        lh.close()
        md = client.ledger_metadata(lh.ledger_id)
        assert len(md.ensembles) >= 2 and victim not in md.last_ensemble
        rh = client.open_ledger(lh.ledger_id, password=PW)
        got = {e.entry_id: e.data for e in rh.read_entries(0, rh.last_add_confirmed)}
        assert len(got) == 1500
        for eid, data in acked.items():
            assert got[eid] == data
        assert sorted(ids) == ids and all(got[eid].startswith(b"f") for eid in ids)


def test_ensemble_change_that_loses_its_cas(cluster_factory):
    """A writer's ensemble change loses its CAS and re-reads: a ledger still OPEN gets
    the change on the new version (keeping the other writer's change); one another
    client put IN_RECOVERY or CLOSED fails every outstanding add with LedgerFencedError.
    The other client here changes only the metadata, so no bookie answers EFENCED:
    only the lost CAS can tell the writer."""
    cluster = cluster_factory(4)
    store = cluster.store
    victim = cluster.bookies[0].bookie_id
    with cluster.client(timeout=3) as client:
        handles = []
        while len(handles) < 3:
            lh = client.create_ledger(3, 2, 2, password=PW)
            if victim in lh.metadata.last_ensemble:
                handles.append(lh)
            else:
                lh.close()
        still_open, in_recovery, closed = handles
        written = {}
        for lh in handles:
            # the next entry's write set starts at the victim: nothing more can be
            # acknowledged without an ensemble change
            n = 3 + lh.metadata.last_ensemble.index(victim)
            written[lh] = [b"x%d" % i for i in range(n)]
            assert lh.add_entries(written[lh]) == n - 1
        md, v = store.read_ledger(still_open.ledger_id)
        store.write_ledger(md.replace(custom_metadata={"tag": b"v2"}), v)
        md, v = store.read_ledger(in_recovery.ledger_id)
        store.write_ledger(md.replace(state=LedgerState.IN_RECOVERY), v)
        md, v = store.read_ledger(closed.ledger_id)
        closed_md = md.replace(state=LedgerState.CLOSED, last_entry_id=closed.last_add_confirmed,
                               length=closed.length)
        store.write_ledger(closed_md, v)
        cluster.bookie(victim).kill(signal.SIGKILL)

        futs = {lh: [lh.add_entry_async(b"y%d" % i) for i in range(3)] for lh in handles}
        n = len(written[still_open])
        assert [f.result(30) for f in futs[still_open]] == [n, n + 1, n + 2]
        md = client.ledger_metadata(still_open.ledger_id)
        assert md.state == LedgerState.OPEN and md.custom_metadata == {"tag": b"v2"}
        assert [first for first, _ in md.ensembles] == [0, n] and victim not in md.last_ensemble
        assert md.ensembles[0][1] == still_open.metadata.ensembles[0][1]
        for lh, state in ((in_recovery, LedgerState.IN_RECOVERY), (closed, LedgerState.CLOSED)):
            ensembles = lh.metadata.ensembles
            for f in futs[lh]:
                with pytest.raises(LedgerFencedError) as ei:
                    f.result(30)
                assert state.value in str(ei.value)
            with pytest.raises(LedgerFencedError):
                lh.add_entry(b"later")
            md = client.ledger_metadata(lh.ledger_id)      # the writer changed nothing
            assert md.state == state and md.ensembles == ensembles == [(0, ensembles[0][1])]
            assert md.last_entry_id == (closed_md.last_entry_id if lh is closed else -1)
        still_open.close()

        # The victim is dead: reads move on to the other bookie of each write set.
        expected = written[still_open] + [b"y0", b"y1", b"y2"]
        with cluster.client(timeout=3) as reader:
            for lh, data in ((still_open, expected), (closed, written[closed])):
                rh = reader.open_ledger_no_recovery(lh.ledger_id, password=PW)
                assert [e.data for e in rh.read_entries(0, rh.last_add_confirmed)] == data


def test_running_client_sees_new_and_dead_bookies(cluster_factory):
    cluster = cluster_factory(3)
    with cluster.client(timeout=3) as client:
        with pytest.raises(NotEnoughBookiesError):
            client.create_ledger(4, 2, 2, password=PW)
        cluster.add_bookie()
        every = {b.bookie_id for b in cluster.bookies}
        lh = client.create_ledger(4, 2, 2, password=PW)          # the new bookie is chosen
        assert set(lh.metadata.last_ensemble) == every and len(every) == 4
        lh.add_entries([b"n%d" % i for i in range(8)])
        lh.close()
        # The client's view comes from its watch of bookies/ (a lagging view falls
        # back to a fresh read when it has too few, which the create above may have
        # used); the watch itself brings the new bookie in.
        wait_until(lambda: client._writable_view() == every,
                   what="the watch to see the new bookie")

        dead = cluster.bookies[0]
        dead.kill(signal.SIGKILL)
        # its registration's lease runs out; the watch drops it
        wait_until(lambda: dead.bookie_id not in client._writable_view(),
                   what="the watch to drop it")
        assert set(client.bookies()) == every - {dead.bookie_id}
        for _ in range(5):                                 # never the dead one
            with client.create_ledger(3, 2, 2, password=PW) as lh:
                assert set(lh.metadata.last_ensemble) == every - {dead.bookie_id}
                assert lh.add_entry(b"alive") == 0
        with pytest.raises(NotEnoughBookiesError) as ei:
            client.create_ledger(4, 2, 2, password=PW)
        assert "need 4" in str(ei.value) and "found 3" in str(ei.value)


def test_recovery_needs_enough_bookies(cluster_factory):
    cluster = cluster_factory(3)
    with cluster.client(timeout=3) as client:
        lh = client.create_ledger(3, 3, 3, password=PW)
        lh.add_entries([b"q%d" % i for i in range(20)])
        lid = lh.ledger_id
        cluster.bookies[0].kill(signal.SIGKILL)
        with cluster.client(timeout=3) as other:
            with pytest.raises((LedgerRecoveryError, NotEnoughBookiesError)):
                other.open_ledger(lid, password=PW)
            cluster.add_bookie()
            rh = other.open_ledger(lid, password=PW)
            assert rh.is_closed and rh.last_add_confirmed >= 18
            data = [e.data for e in rh.read_entries(0, rh.last_add_confirmed)]
            assert data == [b"q%d" % i for i in range(len(data))]


def test_fence_survives_bookie_restarts(cluster_factory):
    cluster = cluster_factory(3)
    with cluster.client(timeout=3) as client:
        lh = client.create_ledger(3, 2, 2, password=PW)
        lh.add_entries([b"r%d" % i for i in range(10)])
        with cluster.client(timeout=3) as other:
            rh = other.open_ledger(lh.ledger_id, password=PW)
            assert rh.last_add_confirmed == 9
        for b in cluster.bookies:
            b.restart()
        with pytest.raises(LedgerFencedError):
            lh.add_entry(b"after restart")
        # and a raw add (no client-side state) is refused by the bookies themselves
        lid = lh.ledger_id
        for b in cluster.bookies:
            with BookieConnection(b.bookie_id, shard=P.shard_of(lid, b.num_shards)) as c:
                dg = D.EntryDigest(lid, "crc32c", PW)
                r = c.call(P.add(c.next_rid(), lid, 10, 9, D.master_key(PW),
                                 dg.sign(10, 9, 100, b"x"), b"x"))
                assert r[2] == bk.errors.EFENCED


def test_explicit_lac(shared_cluster):
    with bk.BookKeeper(shared_cluster.metadata_uri, explicitLacInterval=100) as cl:
        lh = cl.create_ledger(3, 2, 2, password=PW)
        for i in range(5):
            lh.add_entry(b"e%d" % i)
        rh = cl.open_ledger_no_recovery(lh.ledger_id, password=PW)
        wait_until(lambda: rh.read_last_add_confirmed() >= 4, timeout=5,
                   what="the reader to see the LAC of the last add")
        assert rh.last_add_confirmed == 4          # no further add was needed
        lh.close()


def test_client_used_after_fork(client):
    lh = client.create_ledger(3, 2, 2, password=PW)
    lh.add_entries([b"f%d" % i for i in range(10)])
    lh.close()
    client.ledger_metadata(lh.ledger_id)         # the parent's connections are in use
    pid = os.fork()
    if pid == 0:                                   # child: same client object
        code = 1
        try:
            rh = client.open_ledger_no_recovery(lh.ledger_id, password=PW)
            if [e.data for e in rh.read_entries(0, 9)] == [b"f%d" % i for i in range(10)]:
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    # and the parent still works
    rh = client.open_ledger_no_recovery(lh.ledger_id, password=PW)
    assert rh.read_entries(9, 9)[0].data == b"f9"


def test_hung_bookie_is_replaced_after_add_timeout(cluster_factory):
    cluster = cluster_factory(4)
    with cluster.client(timeout=3, addEntryTimeoutSec=1) as client:
        lh = client.create_ledger(3, 3, 3, password=PW)
        lh.add_entries([b"h%d" % i for i in range(10)])
        victim = cluster.bookie(lh.metadata.last_ensemble[1])
        with bookie_lost(victim, "stop"):
            t0 = time.monotonic()
            assert lh.add_entry(b"after") == 10
            assert 0.9 < time.monotonic() - t0 < 15
            assert victim.bookie_id not in lh.metadata.last_ensemble
            assert lh.metadata.ensembles[-1][0] == 10
        lh.close()
        rh = client.open_ledger_no_recovery(lh.ledger_id, password=PW)
        assert [e.data for e in rh.read_entries(0, 10)][-2:] == [b"h9", b"after"]


def test_read_only_bookie_is_replaced_and_not_picked_again(cluster_factory, caplog):
    cluster = cluster_factory(4)
    with cluster.client(timeout=3) as client:
        lh = client.create_ledger(3, 3, 3, password=PW)
        lh.add_entries([b"o%d" % i for i in range(10)])
        first = list(lh.metadata.last_ensemble)
        victim, other = cluster.bookie(first[0]), cluster.bookie(first[1])
        spare = next(b.bookie_id for b in cluster.bookies if b.bookie_id not in first)
        # Restarted with no disk headroom, the bookie serves read-only (EREADONLY to adds).
        victim.stop()
        victim.write_conf(diskUsageThreshold=0.0, diskUsageLwmThreshold=0.0)
        victim.start()
        assert client.bookies(readonly=True) == [victim.bookie_id]
        # A new ledger goes to the writable bookies only.
        with client.create_ledger(3, 3, 3, password=PW) as ro_check:
            assert set(ro_check.metadata.last_ensemble) == set(first) - {victim.bookie_id} \
                | {spare}
        with pytest.raises(NotEnoughBookiesError):
            client.create_ledger(4, 3, 3, password=PW)
        with BookieConnection(victim.bookie_id, shard=P.shard_of(lh.ledger_id, victim.num_shards)) as c:
            dg = D.EntryDigest(lh.ledger_id, "crc32c", PW)
            r = c.call(P.add(c.next_rid(), lh.ledger_id, 10, 9, D.master_key(PW),
                             dg.sign(10, 9, 100, b"x"), b"x"))
            assert r[2] == bk.errors.EREADONLY
        with caplog.at_level(logging.WARNING, logger="bk.client"):
            assert lh.add_entry(b"after") == 10
        assert any(victim.bookie_id in r.getMessage() and "read-only" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert lh.metadata.ensembles == [
            (0, first), (10, [spare if b == victim.bookie_id else b for b in first])]
        # Another member dies; the only bookie outside the ensemble is the read-only
        # one: not writable, so no replacement (a bookie that failed this writer is
        # only avoided, but a read-only one is no candidate at all).
        other.kill(signal.SIGKILL)
        with pytest.raises(NotEnoughBookiesError) as ei:
            lh.add_entry(b"then")
        assert "need 1 writable bookies, found 0" in str(ei.value)
        assert victim.bookie_id not in str(ei.value).split("excluding")[-1]
        md = client.ledger_metadata(lh.ledger_id)
        assert md.ensembles == lh.metadata.ensembles and len(md.ensembles) == 2
        rh = client.open_ledger_no_recovery(lh.ledger_id, password=PW)
        assert [e.data for e in rh.read_unconfirmed_entries(9, 10)] == [b"o9", b"after"]


def test_close_during_an_etcd_outage_can_be_retried(cluster_factory):
    cluster = cluster_factory(3)
    with cluster.client(timeout=3, metadataTimeoutMillis=2000) as client:
        lh = client.create_ledger(3, 2, 2, password=PW)
        data = [b"o%d" % i for i in range(10)]
        lh.add_entries(data[:5])
        cluster.etcd.stop()
        lh.add_entries(data[5:])                 # adds need no metadata: they go on
        with pytest.raises(MetadataError) as ei:
            lh.close()
        assert cluster.metadata_uri in str(ei.value)
        with pytest.raises(LedgerClosedError):   # closing began: no more adds
            lh.add_entry(b"late")
        cluster.etcd.start()
        assert cluster.store.read_ledger(lh.ledger_id)[0].state == LedgerState.OPEN

        def client_reaches_etcd():               # its gRPC channel reconnects on its own
            try:                                 # schedule (seconds on a loaded machine)
                return client.ledger_metadata(lh.ledger_id).state == LedgerState.OPEN
            except MetadataError:
                return False
        wait_until(client_reaches_etcd, timeout=30, what="the client to reach etcd again")
        lh.close()                               # retries only the metadata write
        md = cluster.store.read_ledger(lh.ledger_id)[0]
        assert (md.state, md.last_entry_id, md.length) == (
            LedgerState.CLOSED, 9, sum(map(len, data)))
        lh.close()                               # closed: nothing more to do
        rh = client.open_ledger_no_recovery(lh.ledger_id, password=PW)
        assert [e.data for e in rh.read_entries(0, 9)] == data


@pytest.mark.parametrize("quarantine", [0.0, 3600.0])
def test_failed_bookie_that_came_back_is_picked_after_its_quarantine(cluster_factory,
                                                                      quarantine):
    """A long-lived ledger on E=3 of 4 bookies: A fails and is replaced by the spare;
    A comes back; then B fails. A replaces B whether or not A's quarantine is
    over: a quarantined bookie is avoided while others exist, never refused when
    it is the last one (BookKeeper's bookieQuarantineTimeSeconds; before, the
    writes failed with "not enough bookies")."""
    cluster = cluster_factory(4)
    with cluster.client(timeout=3, bookieQuarantineTimeSeconds=quarantine) as client:
        lh = client.create_ledger(3, 3, 2, password=PW)
        data = [b"q%d" % i for i in range(30)]
        lh.add_entries(data[:10])
        a, b = lh.metadata.last_ensemble[:2]
        cluster.bookie(a).kill(signal.SIGKILL)
        lh.add_entries(data[10:20])                       # A replaced by the spare
        assert a not in lh.metadata.last_ensemble
        cluster.bookie(a).start()
        wait_until(lambda: a in client._writable_view(), what="A registered again")
        cluster.bookie(b).kill(signal.SIGKILL)
        lh.add_entries(data[20:])                         # B replaced by A
        assert a in lh.metadata.last_ensemble and b not in lh.metadata.last_ensemble
        lh.close()
        rh = client.open_ledger(lh.ledger_id, password=PW)
        assert [e.data for e in rh.read_entries(0, 29)] == data
