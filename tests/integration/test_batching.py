"""Batched frames (ADD_BATCH with group acknowledgements, READ_RANGE) against real
bookies: fencing in the middle of a batch, peers without the capability, and a
bookie killed with batches in flight."""

import json
import signal
import threading
import time

import pytest

import bk
from bk import protocol as P
from bk.client import digest as D
from bk.errors import EFENCED, ENOENTRY, EOK, EUA, LedgerFencedError
from bk.testing import BookieConnection, shell_ok, wait_until

pytestmark = pytest.mark.timeout(120)

PW = b"secret"
MK = D.master_key(PW)


def _recv_acks(conn, want: int, timeout: float = 10.0):
    """Group acknowledgements (and other answers) until ``want`` entries were answered:
    returns ({(ledger, entry) acked}, {(ledger, entry): status}, other answers)."""
    acked, errors, other = set(), {}, []
    deadline = time.monotonic() + timeout
    while len(acked) + len(errors) < want:
        assert time.monotonic() < deadline, (acked, errors, other)
        msg = conn.recv()
        if msg[0] == P.ADD_BATCH:
            P.check_add_ack(msg)
            runs, errs = msg[3], msg[4]
            for i in range(0, len(runs), 3):
                for e in range(runs[i + 1], runs[i + 2] + 1):
                    acked.add((runs[i], e))
            for i in range(0, len(errs), 3):
                errors[(errs[i], errs[i + 1])] = errs[i + 2]
        else:
            other.append(msg)
    return acked, errors, other


def _entries(lid, first, last, lac=-1):
    return [(lid, e, lac, b"dg%d" % e, b"payload-%d" % e) for e in range(first, last + 1)]


def _fresh_ledger_ids(cluster, n=1, same_shard=False):
    """``n`` ledger ids no client of the (shared) cluster will ever use; with
    ``same_shard``, ids whose ledgers live on one shard of the first bookie."""
    shards = cluster.store.bookie_info(cluster.bookies[0].bookie_id)["numShards"]
    ids = []
    while len(ids) < n:
        lid = cluster.store.new_ledger_id()
        if not (same_shard and ids and P.shard_of(lid, shards) != P.shard_of(ids[0], shards)):
            ids.append(lid)
    return ids


def _shard_conn(cluster, lid, **kw):
    bid = cluster.bookies[0].bookie_id
    n = cluster.store.bookie_info(bid)["numShards"]
    return BookieConnection(bid, shard=P.shard_of(lid, n), **kw)


def test_hello_announces_the_features(shared_cluster):
    cluster = shared_cluster
    with BookieConnection(cluster.bookies[0].bookie_id, shard=0) as c:
        c.send(P.hello(c.next_rid(), 0))
        msg = c.recv()
        assert msg[0] == P.HELLO and msg[2] == EOK
        assert msg[6] & P.FEATURE_ADD_BATCH and msg[6] & P.FEATURE_READ_RANGE


def test_batch_hitting_a_fenced_ledger_midway(shared_cluster):
    """Batch A, a fence, batch B pipelined on one connection: A is acknowledged,
    every entry of B gets EFENCED, a recovery batch still goes in, and the data
    the bookie serves is exactly what was acknowledged."""
    cluster = shared_cluster
    lid, = _fresh_ledger_ids(cluster)
    with _shard_conn(cluster, lid) as c:
        # One write: the bookie reads all three frames in one pass.
        c.send_raw(P.encode_add_batch(c.next_rid(), MK, 0, _entries(lid, 0, 4))
                   + P.encode_frame(P.read_lac(c.next_rid(), lid, True, MK))
                   + P.encode_add_batch(c.next_rid(), MK, 0, _entries(lid, 5, 9, lac=4)))
        acked, errors, other = _recv_acks(c, 10)
        assert acked == {(lid, e) for e in range(5)}
        assert errors == {(lid, e): EFENCED for e in range(5, 10)}
        if not other:                      # held with the same group, sent after its ack
            other.append(c.recv())
        assert len(other) == 1 and other[0][0] == P.READ_LAC and other[0][2] == EOK
        # a later batch of the old writer: refused entry by entry too
        c.send_raw(P.encode_add_batch(c.next_rid(), MK, 0, _entries(lid, 5, 7)))
        acked, errors, _ = _recv_acks(c, 3)
        assert not acked and errors == {(lid, e): EFENCED for e in range(5, 8)}
        # recovery adds (FLAG_RECOVERY) go in on the fenced ledger
        c.send_raw(P.encode_add_batch(c.next_rid(), MK, P.FLAG_RECOVERY, _entries(lid, 5, 6)))
        acked, errors, _ = _recv_acks(c, 2)
        assert acked == {(lid, 5), (lid, 6)} and not errors
        # a wrong master key: EUA per entry, nothing stored
        c.send_raw(P.encode_add_batch(c.next_rid(), b"x" * 20, P.FLAG_RECOVERY,
                                      _entries(lid, 7, 8)))
        acked, errors, _ = _recv_acks(c, 2)
        assert not acked and errors == {(lid, 7): EUA, (lid, 8): EUA}
        for e in range(10):
            r = c.call(P.read(c.next_rid(), lid, e))
            if e <= 6:
                assert r[2] == EOK and r[6] == b"dg%d" % e and r[7] == b"payload-%d" % e, r
            else:
                assert r[2] == ENOENTRY, r
        # a range read returns the same, in one frame, the missing ones skipped
        r = c.call(P.read_range(c.next_rid(), lid, 0, 20, 1 << 20))
        assert r[0] == P.READ_RANGE and r[2] == EOK and r[4] == 21
        ents = r[5]
        assert [ents[i] for i in range(0, len(ents), 4)] == list(range(7))
        assert [ents[i + 3] for i in range(0, len(ents), 4)] == \
            [b"payload-%d" % e for e in range(7)]
        # striped and budgeted: entries 1, 3, 5 one at a time
        r = c.call(P.read_range(c.next_rid(), lid, 0, 6, 1, stride=2, offset=1))
        assert r[5][0] == 1 and len(r[5]) == 4 and r[4] == 2


def test_batches_of_several_ledgers_of_one_shard(shared_cluster):
    lids = _fresh_ledger_ids(shared_cluster, 3, same_shard=True)
    with _shard_conn(shared_cluster, lids[0]) as c:
        ents = []
        for e in range(50):
            for lid in lids:
                ents.append((lid, e, e - 1, b"d", b"%d/%d" % (lid, e)))
        c.send_raw(P.encode_add_batch(c.next_rid(), MK, 0, ents))
        acked, errors, _ = _recv_acks(c, 150)
        assert not errors and acked == {(lid, e) for lid in lids for e in range(50)}
        for lid in lids:
            r = c.call(P.read(c.next_rid(), lid, 49))
            assert r[2] == EOK and r[7] == b"%d/49" % lid and r[8] == 48


def test_malformed_batch_closes_only_that_connection(shared_cluster):
    cluster = shared_cluster
    lid, = _fresh_ledger_ids(cluster)
    frame = P.encode_add_batch(1, MK, 0, _entries(lid, 0, 3))
    records = b"".join(P.add_record_head(l, e, a, d, len(p)) + p
                       for l, e, a, d, p in _entries(lid, 0, 3))
    bad = P.add_batch_head(1, MK, 0, 5, len(records)) + records    # announces 5 of 4
    with _shard_conn(cluster, lid) as c:
        c.send_raw(bad)
        assert c.closed_by_peer()
    with _shard_conn(cluster, lid) as c:       # the bookie serves on
        c.send_raw(frame)
        acked, errors, _ = _recv_acks(c, 4)
        assert len(acked) == 4 and not errors


def _features(client):
    return {c.bookie_id: c.features for c in client._io._conns.values()
            if c.state == 3}


def _write_read(client, n=2000, E=3, qw=3, qa=2):
    lh = client.create_ledger(E, qw, qa, password=PW)
    data = [b"e%05d" % i * 20 for i in range(n)]
    assert lh.add_entries(data) == n - 1
    futs = [lh.add_entry_async(b"async%d" % i) for i in range(300)]
    assert [f.result(30) for f in futs] == list(range(n, n + 300))
    lh.close()
    rh = client.open_ledger_no_recovery(lh.ledger_id, password=PW)
    got = rh.read_entries(0, rh.last_add_confirmed)
    assert [e.data for e in got] == data + [b"async%d" % i for i in range(300)]
    return lh.ledger_id


def test_client_forced_to_the_old_path_against_new_bookies(shared_cluster):
    cluster = shared_cluster
    with bk.BookKeeper(cluster.metadata_uri, frameBatching=False) as client:
        _write_read(client)
        feats = _features(client)
        assert feats and set(feats.values()) == {0}
    with bk.BookKeeper(cluster.metadata_uri) as client:   # and the batched one, same bookies
        _write_read(client, E=3, qw=2, qa=2)
        feats = _features(client)
        assert feats and all(f & P.FEATURE_ADD_BATCH for f in feats.values())


def test_bookie_that_does_not_announce_batches(cluster_factory):
    """A mixed ensemble: one bookie without the capability gets single ADDs and
    READs, the others batches; the ledger is whole either way."""
    cluster = cluster_factory(2)
    old = cluster.add_bookie(frameBatching=False)
    with BookieConnection(old.bookie_id, shard=0) as c:
        c.send(P.hello(c.next_rid(), 0))
        assert c.recv()[6] == 0
    with bk.BookKeeper(cluster.metadata_uri) as client:
        lid = _write_read(client)
        feats = _features(client)
        assert feats[old.bookie_id] == 0
        assert all(f & P.FEATURE_ADD_BATCH for b, f in feats.items() if b != old.bookie_id)
    # everything is on the old bookie too (E = Qw = 3)
    n = cluster.store.bookie_info(old.bookie_id)["numShards"]
    with BookieConnection(old.bookie_id, shard=P.shard_of(lid, n)) as c:
        r = c.call(P.read(c.next_rid(), lid, 2299))
        assert r[2] == EOK and r[7] == b"async299"


def test_fenced_while_batches_are_in_flight(shared_cluster):
    """A writer streaming batches is fenced by a recovery: it gets LedgerFencedError,
    and every entry it had acknowledged is in the recovered ledger."""
    cluster = shared_cluster
    with bk.BookKeeper(cluster.metadata_uri) as w, bk.BookKeeper(cluster.metadata_uri) as r:
        lh = w.create_ledger(3, 3, 2, password=PW)
        acked = []
        failed = []
        lock = threading.Lock()

        def cb(exc, eid):
            with lock:
                (acked if exc is None else failed).append((eid, exc))

        for i in range(3000):
            lh.add_entry_async(b"w%d" % i, cb)
        wait_until(lambda: len(acked) >= 1000, 30, "first acks")
        rh = r.open_ledger(lh.ledger_id, password=PW)          # fences mid-stream
        with pytest.raises(LedgerFencedError):
            for k in range(100000):
                lh.add_entry_async(b"late%d" % k, cb)
                if k % 500 == 0:
                    time.sleep(0.001)
        wait_until(lambda: len(acked) + len(failed) == lh._submitted, 30, "all callbacks")
        assert failed and all(isinstance(e, LedgerFencedError) for _, e in failed)
        ids = sorted(eid for eid, _ in acked)
        assert ids == list(range(len(ids)))                    # in order, no holes
        assert rh.last_add_confirmed >= ids[-1]
        got = rh.read_entries(0, rh.last_add_confirmed)
        sent = [b"w%d" % k for k in range(3000)] + [b"late%d" % k for k in range(100000)]
        assert [e.data for e in got] == sent[:len(got)]


def test_bookie_killed_mid_batch_loses_nothing_acknowledged(cluster_factory):
    cluster = cluster_factory(4)
    with bk.BookKeeper(cluster.metadata_uri, addEntryTimeoutSec=3) as client:
        lh = client.create_ledger(3, 3, 2, password=PW)
        acked = {}
        errors = []
        lock = threading.Lock()

        def cb(exc, eid):
            with lock:
                if exc is None:
                    acked[eid] = True
                else:
                    errors.append(exc)

        payload = b"z" * 1024
        for i in range(3000):
            lh.add_entry_async(payload + b"%d" % i, cb)
        wait_until(lambda: len(acked) >= 1500, 30, "first acks")
        orig = list(lh.metadata.last_ensemble)
        victim = orig[1]
        cluster.bookie(victim).kill(signal.SIGKILL)
        # big batches in flight to the dead bookie and after it
        last = lh.add_entries([payload + b"%d" % i for i in range(3000, 8000)])
        assert last == 7999
        assert not errors and len(acked) == 3000, errors
        lh.close()
        md = client.ledger_metadata(lh.ledger_id)
        assert victim not in md.last_ensemble
        # The fragment before the change keeps its bookies; a victim that had
        # confirmed none of the acknowledged entries (under load it can lag the
        # other two by 1,500) has them all moved: one fragment, from entry 0.
        assert (len(md.ensembles) >= 2 and md.ensembles[0] == (0, orig)) or \
            [f for f, _ in md.ensembles] == [0], md.ensembles
        rh = client.open_ledger(lh.ledger_id, password=PW)
        assert rh.last_add_confirmed == 7999
        got = rh.read_entries(0, 7999)
        assert [e.data for e in got] == [payload + b"%d" % i for i in range(8000)]


def test_range_reads_of_a_striped_ledger_with_a_dead_bookie(cluster_factory):
    """E=3 Qw=2: each bookie is asked for the entries it is the first replica of;
    with one bookie killed, its share comes from the next replica."""
    cluster = cluster_factory(3)
    with bk.BookKeeper(cluster.metadata_uri, readEntryTimeoutSec=3) as client:
        lh = client.create_ledger(3, 2, 2, password=PW)
        data = [b"s%d" % i * 50 for i in range(3000)]
        lh.add_entries(data)
        lh.close()
        rh = client.open_ledger_no_recovery(lh.ledger_id, password=PW)
        assert [e.data for e in rh.read_entries(0, 2999)] == data
        assert [e.entry_id for e in rh.read_entries(1234, 1300)] == list(range(1234, 1301))
        assert rh.read_entries(2999, 2999)[0].data == data[2999]
        cluster.bookie(lh.metadata.last_ensemble[1]).kill(signal.SIGKILL)
        got = rh.read_entries(0, 2999)
        assert [e.data for e in got] == data
        assert got[-1].length == sum(len(d) for d in data)


@pytest.mark.parametrize("batching", [True, False])
def test_recovery_reads_a_long_tail_by_ranges(cluster_factory, batching):
    """600 entries beyond any LAC on all three bookies (one of which takes no
    batches) and entry 600 on one bookie only: recovery fences, reads the tail
    (READ_RANGE windows, single READs from the old bookie) and closes at 599, or
    at 600 if it saw that copy before two bookies said they lack it (both are
    BookKeeper's semantics: 600 was never acknowledged, but the writer sent it)."""
    cluster = cluster_factory(2)
    old = cluster.add_bookie(frameBatching=False)
    with bk.BookKeeper(cluster.metadata_uri) as w:
        lh = w.create_ledger(3, 3, 2, password=PW)
        lid = lh.ledger_id
        ens = lh.metadata.last_ensemble
        sign = D.EntryDigest(lid, "crc32c", PW).sign
        ents, length = [], 0
        for e in range(601):
            data = b"tail-%d" % e * 10
            length += len(data)
            ents.append((lid, e, -1, sign(e, -1, length, data), data))
        for b in ens:
            n = cluster.store.bookie_info(b)["numShards"]
            with BookieConnection(b, shard=P.shard_of(lid, n)) as c:
                mine = ents if b == ens[0] else ents[:600]
                if b == old.bookie_id:
                    for x in mine:
                        assert c.call(P.add(c.next_rid(), x[0], x[1], x[2], MK, x[3], x[4]))[2] == EOK
                else:
                    c.send_raw(P.encode_add_batch(c.next_rid(), MK, 0, mine))
                    acked, errors, _ = _recv_acks(c, len(mine))
                    assert len(acked) == len(mine) and not errors
        with bk.BookKeeper(cluster.metadata_uri, frameBatching=batching) as r:
            rh = r.open_ledger(lid, password=PW)
            last = rh.last_add_confirmed
            assert rh.is_closed and last in (599, 600)
            got = rh.read_entries(0, last)
            assert [e.data for e in got] == [x[4] for x in ents[:last + 1]]
            assert rh.length == sum(len(x[4]) for x in ents[:last + 1])
        with pytest.raises(LedgerFencedError):
            lh.add_entry(b"late")


def test_bench_compare_runs_both_paths(shared_cluster):
    cluster = shared_cluster
    r = shell_ok("--metadata", cluster.metadata_uri, "bench", "writes", "--duration", "0.5",
                 "--compare", "--json")
    out = json.loads(r.stdout)
    assert out["single"]["batching"] is False and out["batched"]["batching"] is True
    assert out["single"]["entries"] > 0 and out["batched"]["entries"] > 0
    assert out["single"]["errors"] == out["batched"]["errors"] == 0
    assert out["ratio"]["entries_per_sec"] > 0
    r = shell_ok("bench", "bookie", cluster.bookies[0].bookie_id, "--count", "3000", "--compare",
                 "--json")
    single, batched = json.loads(r.stdout)
    assert single["batched"] is False and batched["batched"] is True
    assert single["adds"] == batched["adds"] == 3000
    assert batched["bookie_cpu_us_per_add"] > 0
