"""Concurrent ledger writes share etcd transactions (bk.meta.combiner) and keep
the semantics of each write alone: every create or CAS gets the answer it would
have had by itself, and an etcd killed mid-batch loses nothing it acknowledged."""

import gc
import threading
import time
import weakref

import pytest

from bk.errors import LedgerExistsError, MetadataError, MetadataVersionError
from bk.meta.etcd_server import EtcdServer
from bk.meta.ledger import LedgerMetadata, LedgerState
from bk.meta.store import MetadataStore
from bk.testing import sigstop, wait_until


def md(lid: int, **kw) -> LedgerMetadata:
    return LedgerMetadata(ledger_id=lid, ensemble_size=3, write_quorum_size=2,
                          ack_quorum_size=2, ensembles=[(0, ["a:1", "b:1", "c:1"])],
                          password_digest=b"\x01\x02", **kw)


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(str(tmp_path / "etcd")).start()
    yield server
    server.stop()


@pytest.fixture
def store(etcd):
    with MetadataStore(etcd.uri("combine"), timeout=5) as s:
        s.format()
        yield s


def _in_threads(n, fn, *args):
    """Run ``fn(i, *args)`` in ``n`` threads released together; {i: result or exception}."""
    out, go = {}, threading.Barrier(n)

    def run(i):
        go.wait()
        try:
            out[i] = fn(i, *args)
        except Exception as e:        # the test asserts on it
            out[i] = e
    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out


def close_again(store, lh, last_entry: int):
    """A handle whose close failed (etcd away) closed again: its metadata was either
    still OPEN or already CLOSED at ``last_entry`` (the txn landed before the
    answer was lost); the close retries only the metadata write. Returns the
    metadata after it."""
    m = store.read_ledger(lh.ledger_id)[0]
    assert m.state in (LedgerState.OPEN, LedgerState.CLOSED), m
    if m.state == LedgerState.CLOSED:
        assert m.last_entry_id == last_entry
    lh.close()
    return store.read_ledger(lh.ledger_id)[0]

def test_concurrent_creates_share_transactions_each_with_its_own_answer(store):
    ids = list(store.reserve_ledger_ids())[:200]
    taken = set(ids[::7])                       # these exist already
    for lid in taken:
        store.create_ledger(md(lid))
    before = store._combiner.batches

    def create(i):
        results = {}
        for lid in ids[i::8]:
            try:
                results[lid] = store.create_ledger(md(lid))
            except LedgerExistsError as e:
                results[lid] = e
        return results
    out = _in_threads(8, create)
    got = {}
    for r in out.values():
        assert isinstance(r, dict), r
        got.update(r)
    assert set(got) == set(ids)
    for lid, r in got.items():
        if lid in taken:
            assert isinstance(r, LedgerExistsError) and str(lid) in str(r)
        else:
            assert isinstance(r, int), r
            m, version = store.read_ledger(lid)
            assert version == r and m.ledger_id == lid
    assert store._combiner.batches > before      # some transactions carried several


def test_concurrent_cas_writes_win_or_lose_alone(store):
    ids = list(store.reserve_ledger_ids())[:64]
    versions = {lid: store.create_ledger(md(lid)) for lid in ids}
    stale = set(ids[::3])
    for lid in stale:                           # someone else wrote these meanwhile
        m, v = store.read_ledger(lid)
        store.write_ledger(m.replace(last_entry_id=5), v)

    def close(i):
        lid = ids[i]
        m = md(lid).replace(state=LedgerState.CLOSED, last_entry_id=9, length=90)
        try:
            return store.write_ledger(m, versions[lid])
        except MetadataVersionError as e:
            return e
    out = _in_threads(len(ids), close)
    for i, lid in enumerate(ids):
        m, v = store.read_ledger(lid)
        if lid in stale:
            assert isinstance(out[i], MetadataVersionError), out[i]
            assert m.state == LedgerState.OPEN and m.last_entry_id == 5   # not overwritten
        else:
            assert out[i] == v and m.state == LedgerState.CLOSED and m.last_entry_id == 9


def test_etcd_killed_mid_batch_keeps_every_acknowledged_create(etcd, store):
    """kill -9 etcd while 16 threads create ledgers as fast as they can: every create
    that returned a version exists after the restart; the others raised MetadataError."""
    ids = iter(store.reserve_ledger_ids())
    lock = threading.Lock()
    acked, failed, stop = {}, [], threading.Event()

    def writer():
        while not stop.is_set():
            with lock:
                lid = next(ids)
            try:
                acked[lid] = store.create_ledger(md(lid))
            except MetadataError:
                failed.append(lid)
                return
    ts = [threading.Thread(target=writer) for _ in range(16)]
    for t in ts:
        t.start()
    wait_until(lambda: len(acked) >= 300, timeout=60, what="creates under way")
    etcd.kill()
    # the writers go on until one of them meets the dead etcd (a loaded machine may
    # not have scheduled any of them between the kill and a stop)
    wait_until(lambda: failed, timeout=60, what="a create failing on the dead etcd")
    stop.set()
    for t in ts:
        t.join(60)
    etcd.start()
    for lid, version in acked.items():
        m, v = store.read_ledger(lid)
        assert m.ledger_id == lid and v == version


def test_etcd_killed_mid_batch_of_closes_keeps_every_answer_exact(cluster_factory):
    """kill -9 etcd while 12 threads close ledgers (closes sharing transactions): a
    close that returned left the ledger CLOSED at its last entry; one that raised
    left it OPEN or CLOSED at that same entry (its outcome unknown, never another
    state) and, retried once etcd is back, closes it exactly there."""
    cluster = cluster_factory(3)
    lock = threading.Lock()
    closed, unknown = [], []
    with cluster.client(timeout=3, metadataTimeoutMillis=2000) as client:
        handles, length = [], {}
        for i in range(12 * 30):
            lh = client.create_ledger(3, 2, 2, password=b"pw")
            data = [b"%d-%d" % (i, k) for k in range(3)]
            lh.add_entries(data)
            handles.append(lh)
            length[lh.ledger_id] = sum(map(len, data))
        go = threading.Barrier(12)

        def closer(mine):
            go.wait()
            for lh in mine:
                try:
                    lh.close()
                except MetadataError:
                    with lock:
                        unknown.append(lh)
                    return
                with lock:
                    closed.append(lh)
        ts = [threading.Thread(target=closer, args=(handles[i::12],)) for i in range(12)]
        for t in ts:
            t.start()
        wait_until(lambda: len(closed) >= 60, timeout=60, what="closes under way")
        cluster.etcd.kill()                     # every thread is closing: some mid-batch
        for t in ts:
            t.join(60)
        assert unknown and len(closed) < len(handles)
        cluster.etcd.start()
        store = cluster.store
        for lh in closed:
            m = store.read_ledger(lh.ledger_id)[0]
            assert (m.state, m.last_entry_id, m.length) == (
                LedgerState.CLOSED, 2, length[lh.ledger_id])
        for lh in unknown:
            m = close_again(store, lh, last_entry=2)
            assert (m.state, m.last_entry_id, m.length) == (
                LedgerState.CLOSED, 2, length[lh.ledger_id])
        rh = client.open_ledger_no_recovery(unknown[0].ledger_id, password=b"pw")
        assert [e.data.split(b"-")[1] for e in rh.read_entries(0, 2)] == [b"0", b"1", b"2"]


def test_etcd_stopped_then_killed_under_full_ledger_churn_wakes_every_parked_thread(
        cluster_factory):
    """SIGSTOP etcd while 16 threads create, write and close ledgers through one
    client: a leader's transaction hangs and the creates and closes behind it queue
    up, their threads parked (bk.park). kill -9 the stopped etcd: every thread
    returns (none stays parked), with its ledger either done or a MetadataError;
    after the restart every acknowledged create exists with the metadata it was
    given, every acknowledged close left its ledger CLOSED at entry 0, and an
    unknown close, retried, closes it there."""
    cluster = cluster_factory(3)
    lock = threading.Lock()
    done, open_handles, failed_creates = [], [], []
    stop = threading.Event()
    # a transaction hangs up to 20 s on the stopped etcd: long enough for every
    # thread to block behind it whatever the machine's load
    in_meta = [False] * 16          # thread i is in create_ledger or close
    with cluster.client(timeout=3, metadataTimeoutMillis=20000) as client:
        def churn(i):
            while not stop.is_set():
                in_meta[i] = True
                try:
                    lh = client.create_ledger(3, 2, 2, password=b"pw")
                except MetadataError:
                    with lock:
                        failed_creates.append(1)
                    return
                in_meta[i] = False
                lh.add_entry(b"payload-%d" % lh.ledger_id)
                in_meta[i] = True
                try:
                    lh.close()
                except MetadataError:
                    with lock:
                        open_handles.append(lh)
                    return
                in_meta[i] = False
                with lock:
                    done.append(lh)
        # daemons: a thread left parked must fail this test, not hang the run
        ts = [threading.Thread(target=churn, args=(i,), daemon=True) for i in range(16)]
        for t in ts:
            t.start()
        wait_until(lambda: len(done) >= 200, timeout=60, what="ledgers under way")
        sigstop(cluster.etcd.pid)                   # the txns in flight hang
        # then every thread blocks on a create or close: one leads the hung
        # transaction, the others are parked, queued or in its batch
        wait_until(lambda: all(in_meta), timeout=15, what="every thread blocked on etcd")
        stop.set()
        cluster.etcd.kill()
        deadline = time.monotonic() + 60
        for t in ts:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in ts), "a thread stayed parked"
        assert open_handles or failed_creates
        cluster.etcd.start()
        store = cluster.store
        for lh in done:
            m = store.read_ledger(lh.ledger_id)[0]
            assert (m.state, m.last_entry_id, m.length) == (
                LedgerState.CLOSED, 0, len(b"payload-%d" % lh.ledger_id))
            assert m.ensembles == lh.metadata.ensembles and m.password_digest
        for lh in open_handles:
            m = close_again(store, lh, last_entry=0)
            assert (m.state, m.last_entry_id) == (LedgerState.CLOSED, 0)


def test_a_created_written_and_closed_handle_dies_by_its_reference_count(cluster_factory):
    """What one ledger leaves behind once its handle is dropped: nothing for the
    cyclic garbage collector (a reference cycle per ledger makes a process creating
    thousands of ledgers a second run full collections over its whole heap). With
    the collector off, the handle and its digest are freed as the last reference
    goes (the client's I/O thread lets go of it within a tick: it holds the last
    task it ran, and the handle's ticker until the next tick); the ledger is
    closed at its entry in etcd."""
    cluster = cluster_factory(3)

    def one_ledger():
        lh = client.create_ledger(3, 2, 2, password=b"pw")
        lh.add_entry(b"x" * 100)
        lh.close()
        return lh
    with cluster.client() as client:
        one_ledger()                    # connections made
        gc.collect()
        gc.disable()
        try:
            lh = one_ledger()
            lid = lh.ledger_id
            handle, digest_sign = weakref.ref(lh), weakref.ref(lh._digest.sign)
            del lh
            one_ledger()
            wait_until(lambda: handle() is None and digest_sign() is None,
                       what="the handle and its digest freed with the collector off")
        finally:
            gc.enable()
        md = client._store.read_ledger(lid)[0]
        assert md.state == LedgerState.CLOSED and md.last_entry_id == 0
