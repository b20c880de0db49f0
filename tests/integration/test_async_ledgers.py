"""create_ledger_async and close_async (issue 22): many ledgers in flight from one
thread end exactly as the blocking calls leave them, errors come through the
future as the blocking calls raise them, and no future is left pending when etcd
dies or the client closes under them."""

import gc
import os
import signal
import threading
import weakref

import pytest

from bk.bench.metadata import create_close_async
from bk.errors import (BKError, LedgerExistsError, LedgerFencedError, MetadataError,
                       NotEnoughBookiesError)
from bk.meta.etcd_server import EtcdCluster
from bk.meta.ledger import LedgerMetadata, LedgerState
from bk.meta.store import MetadataStore
from bk.testing import sigstop, wait_until

PW = b"async-pw"


@pytest.fixture
def client(shared_cluster):
    with shared_cluster.client(timeout=5) as cl:
        yield cl


def _error(fn):
    """The exception ``fn()`` raises (the test fails if it raises none)."""
    with pytest.raises(BKError) as ei:
        fn()
    return ei.value


def test_many_in_flight_from_one_thread_end_as_the_blocking_path_does(client, shared_cluster):
    """300 creates in flight from one thread, then an entry each and 300 closes in
    flight: every ledger reads back from etcd CLOSED at entry 0 with its length
    and the ensemble its handle was given, like a ledger made by the blocking
    calls; the creates and closes shared etcd transactions."""
    store = shared_cluster.store
    blocking = client.create_ledger(3, 2, 2, password=PW, custom_metadata={"k": b"v"})
    blocking.add_entry(b"entry-blocking")
    blocking.close()
    batches = client._store._combiner.batches
    futs = [client.create_ledger_async(3, 2, 2, password=PW, custom_metadata={"k": b"v"})
            for _ in range(300)]
    handles = [f.result(30) for f in futs]
    assert len({h.ledger_id for h in handles}) == 300
    adds = [h.add_entry_async(b"entry-%d" % h.ledger_id) for h in handles]
    assert [a.result(30) for a in adds] == [0] * 300
    closes = [h.close_async() for h in handles]
    assert [c.result(30) for c in closes] == [None] * 300
    assert client._store._combiner.batches > batches      # transactions were shared
    ref = store.read_ledger(blocking.ledger_id)[0]
    for h in handles:
        m, version = store.read_ledger(h.ledger_id)
        assert (m.state, m.last_entry_id, m.length) == (
            LedgerState.CLOSED, 0, len(b"entry-%d" % h.ledger_id))
        assert m.ensembles == h.metadata.ensembles and len(m.ensembles[0][1]) == 3
        assert (m.ensemble_size, m.write_quorum_size, m.ack_quorum_size, m.digest_type,
                m.password_digest, m.custom_metadata) == (
            ref.ensemble_size, ref.write_quorum_size, ref.ack_quorum_size, ref.digest_type,
            ref.password_digest, ref.custom_metadata)
        assert h.is_closed and h.metadata_version == version
    rh = client.open_ledger_no_recovery(handles[7].ledger_id, password=PW)
    assert rh.read_entries(0, 0)[0].data == b"entry-%d" % handles[7].ledger_id


def test_errors_come_through_the_future_as_the_blocking_calls_raise_them(client):
    """Too large an ensemble: NotEnoughBookiesError; a ledger id that is taken:
    LedgerExistsError; both with the blocking call's message, through the future
    and through a callback. Bad arguments raise at once."""
    blocking = _error(lambda: client.create_ledger(5, 2, 2, password=PW))
    fut = client.create_ledger_async(5, 2, 2, password=PW)
    assert type(fut.exception(10)) is NotEnoughBookiesError
    assert str(fut.exception()) == str(blocking)
    lid = client.new_ledger_id()
    client.create_ledger(3, 2, 2, password=PW, ledger_id=lid).close()
    blocking = _error(lambda: client.create_ledger(3, 2, 2, password=PW, ledger_id=lid))
    assert type(blocking) is LedgerExistsError
    got = []
    done = threading.Event()

    def cb(exc, handle):
        got.append((exc, handle))
        done.set()
    assert client.create_ledger_async(3, 2, 2, password=PW, ledger_id=lid, callback=cb) is None
    wait_until(done.is_set, timeout=10, what="the create's callback")
    (exc, handle), = got
    assert handle is None and type(exc) is LedgerExistsError and str(exc) == str(blocking)
    with pytest.raises(ValueError):
        client.create_ledger_async(2, 3, 2)
    with pytest.raises(TypeError):
        client.create_ledger_async(3, 2, 2, password="not bytes")


def test_a_callback_that_creates_a_ledger_blocking_does_not_stall_the_others(client):
    """Callbacks of asynchronous creates run on the combiner's thread; one that
    creates another ledger with the blocking call (which the contract advises
    against) gets its ledger, and the 100 creates queued behind it complete."""
    inner = []

    def cb(exc, handle):
        assert exc is None
        inner.append(client.create_ledger(3, 2, 2, password=PW))
    futs = [client.create_ledger_async(3, 2, 2, password=PW) for _ in range(100)]
    futs[0].add_done_callback(lambda f: cb(f.exception(), f.result()))
    futs += [client.create_ledger_async(3, 2, 2, password=PW) for _ in range(100)]
    handles = [f.result(30) for f in futs]
    wait_until(lambda: inner, timeout=30, what="the callback's blocking create")
    ids = {h.ledger_id for h in handles} | {inner[0].ledger_id}
    assert len(ids) == 201 and all(client._store.ledger_exists(i) for i in ids)


def test_close_async_of_a_ledger_under_recovery_fails_as_close_does(client, shared_cluster):
    """Another client began recovering the ledger (its metadata is IN_RECOVERY, a
    newer version than the writer's): close_async loses its compare-and-swap,
    re-reads, and fails with close()'s LedgerFencedError; the metadata stays as
    the recovering client left it."""
    store = shared_cluster.store
    handles = [client.create_ledger(3, 2, 2, password=PW) for _ in range(2)]
    for h in handles:
        h.add_entry(b"x")
        m, v = store.read_ledger(h.ledger_id)
        store.write_ledger(m.replace(state=LedgerState.IN_RECOVERY), v)
    blocking = _error(handles[0].close)
    exc = handles[1].close_async().exception(30)
    assert type(blocking) is type(exc) is LedgerFencedError
    assert str(exc) == str(blocking).replace(str(handles[0].ledger_id),
                                             str(handles[1].ledger_id))
    assert store.read_ledger(handles[1].ledger_id)[0].state == LedgerState.IN_RECOVERY


def test_close_async_with_adds_in_flight_waits_for_them(client, shared_cluster):
    """close_async right after 200 adds were submitted: the ledger closes at the
    last of them (the slow path, on a metadata thread)."""
    h = client.create_ledger(3, 2, 2, password=PW)
    adds = [h.add_entry_async(b"e%03d" % i) for i in range(200)]
    h.close_async().result(30)
    assert [a.result(0) for a in adds] == list(range(200))
    m = shared_cluster.store.read_ledger(h.ledger_id)[0]
    assert (m.state, m.last_entry_id, m.length) == (LedgerState.CLOSED, 199, 200 * 4)


def test_client_closed_with_creates_in_flight_completes_every_future(shared_cluster):
    """Close the client with 400 creates queued: every future completes soon, with
    a handle whose ledger exists in etcd or with a BKError."""
    store = shared_cluster.store
    c = shared_cluster.client(timeout=5)
    futs = [c.create_ledger_async(3, 2, 2, password=PW) for _ in range(400)]
    c.close()
    wait_until(lambda: all(f.done() for f in futs), timeout=20, what="every future done")
    errors = [f.exception() for f in futs if f.exception() is not None]
    assert all(isinstance(e, BKError) for e in errors), errors[:3]
    for f in futs:
        if f.exception() is None:
            assert store.ledger_exists(f.result().ledger_id)
    late = c.create_ledger_async(3, 2, 2, password=PW)
    assert isinstance(late.exception(5), BKError)


def test_etcd_stopped_then_killed_with_creates_in_flight(cluster_factory):
    """SIGSTOP etcd while one thread keeps 200 creates in flight, then kill -9 it:
    every future completes (a handle or a MetadataError), none stays pending, and
    after etcd restarts every create reported done exists with the metadata it
    was given. (Stopped first: a single etcd 3.5.1 killed while it answers may
    lose a write it acknowledged, etcd issue 14370; the test of a member killed
    outright is the next one, on three members.)"""
    cluster = cluster_factory(3)
    with cluster.client(timeout=3, metadataTimeoutMillis=4000) as client:
        futs = []
        lock = threading.Lock()
        stop = threading.Event()

        def keep_creating():
            while not stop.is_set():
                with lock:
                    pending = sum(1 for f in futs[-400:] if not f.done())
                if pending < 200:
                    f = client.create_ledger_async(3, 2, 2, password=PW)
                    with lock:
                        futs.append(f)
                else:
                    stop.wait(0.001)
        t = threading.Thread(target=keep_creating, daemon=True)
        t.start()
        wait_until(lambda: sum(1 for f in list(futs) if f.done()) >= 1000, timeout=60,
                   what="creates under way")
        sigstop(cluster.etcd.pid)
        # the transaction in flight hangs and creates queue up behind it
        wait_until(lambda: sum(1 for f in list(futs) if not f.done()) >= 200,
                   timeout=15, what="creates queued behind the stopped etcd")
        cluster.etcd.kill()
        stop.set()
        t.join(10)
        assert not t.is_alive()
        wait_until(lambda: all(f.done() for f in futs), timeout=20, what="every future done")
        errors = [f.exception() for f in futs if f.exception() is not None]
        assert errors and all(isinstance(e, MetadataError) for e in errors), errors[:3]
        cluster.etcd.start()
        store = cluster.store
        done = [f.result() for f in futs if f.exception() is None]
        assert len(done) >= 1000
        for h in done:
            m = store.read_ledger(h.ledger_id)[0]
            assert m.state == LedgerState.OPEN and m.ensembles == h.metadata.ensembles


def test_etcd_stopped_fails_every_queued_create_within_the_timeout(cluster_factory):
    """SIGSTOP etcd (and leave it stopped) with 300 creates queued: the batch in
    flight fails after the store's timeout, the next one after another, and the
    creates queued behind them fail unsent once they waited two timeouts,
    instead of one timeout per batch ahead of them; after SIGCONT no create
    that failed unsent exists in etcd."""
    cluster = cluster_factory(3)
    timeout = 3.0
    with cluster.client(timeout=3, metadataTimeoutMillis=int(timeout * 1000)) as client:
        client.create_ledger_async(3, 2, 2, password=PW).result(10)   # connected, ids
        try:
            # every thread of etcd stopped (bk.testing.sigstop): until one took the
            # signal they all run on, and on a loaded machine answered the first
            # creates (CI, when this test did not wait)
            sigstop(cluster.etcd.pid)
            futs = [client.create_ledger_async(3, 2, 2, password=PW) for _ in range(300)]
            # 300 writes are 5 batches: one timeout each would take 5 timeouts
            wait_until(lambda: all(f.done() for f in futs), timeout=2 * timeout + 4,
                       what="every create failed within about two timeouts")
        finally:
            os.kill(cluster.etcd.pid, signal.SIGCONT)
        errors = [f.exception() for f in futs]
        assert all(isinstance(e, MetadataError) for e in errors), errors[:3]
        store = cluster.store
        assert any("not sent" in str(e) for e in errors)
        unsent = [f for f in futs if "not sent" in str(f.exception())]
        # the unsent creates' ids were never written (the others' outcome is unknown)
        ids = [int(str(f.exception()).split(":")[0].split()[-1]) for f in unsent]
        assert all(str(f.exception()).startswith(f"create ledger {i}: not sent")
                   for f, i in zip(unsent, ids))
        assert not any(store.ledger_exists(i) for i in ids)


@pytest.fixture
def etcd3(tmp_path):
    cluster = EtcdCluster(str(tmp_path / "etcd3"), size=3).start()
    yield cluster
    for m in cluster.members:
        if m.pid:
            try:
                os.kill(m.pid, signal.SIGCONT)
            except OSError:
                pass
    cluster.stop()


def _md(lid):
    return LedgerMetadata(ledger_id=lid, ensemble_size=3, write_quorum_size=2,
                          ack_quorum_size=2, ensembles=[(0, ["a:1", "b:1", "c:1"])],
                          password_digest=b"\x01\x02")


@pytest.mark.parametrize("how", ["sigstop", "kill"])
def test_member_stopped_or_killed_with_async_writes_in_flight(etcd3, how):
    """Three etcd members; the store talks to the first. SIGSTOP or kill -9 it with
    400 asynchronous creates in flight (creates of ids that exist already among
    them: LedgerExistsError each): every callback runs, with a version, a
    LedgerExistsError (only for the taken ids) or another MetadataError, none is left
    waiting past the store's timeout and the batches behind it; every create
    answered with a version exists at that version on the surviving members."""
    with MetadataStore(etcd3.uri("async"), timeout=3) as store:
        store.format()
        ids = list(store.reserve_ledger_ids())
        taken = set(ids[::50])
        for lid in taken:
            store.create_ledger(_md(lid))
        answers = {}
        lock = threading.Lock()

        def answer(lid):
            def cb(exc, version):
                with lock:
                    answers[lid] = exc if exc is not None else version
            return cb
        for lid in ids[:400]:
            store.create_ledger_async(_md(lid), answer(lid))
        victim = etcd3.members[0]
        if how == "kill":
            victim.kill()
        else:
            sigstop(victim.pid)
        for lid in ids[400:800]:
            store.create_ledger_async(_md(lid), answer(lid))
        wait_until(lambda: len(answers) == 800, timeout=60, what="every callback")
        for lid, a in answers.items():
            if isinstance(a, BaseException):
                # a taken id's create may also have been in a batch the kill broke
                assert isinstance(a, MetadataError), a
                assert lid in taken or not isinstance(a, LedgerExistsError), a
            else:
                assert lid not in taken and isinstance(a, int)
        if how == "kill":
            # Refused at once: the client goes on with another member. How many of
            # the 800 got through first is the survivors' election's business (262
            # under load, where "more than 400" was asserted): a create through
            # this store succeeds once they have a leader.
            spare = iter(ids[800:])

            def created():
                lid = next(spare)
                try:
                    answers[lid] = store.create_ledger(_md(lid))
                except MetadataError:
                    return False
                return True
            wait_until(created, timeout=60, step=0.5, what="a create after the kill")
    survivors = ",".join(m.endpoint for m in etcd3.members[1:])
    with MetadataStore(f"etcd://{survivors}/async", timeout=10) as store:
        for lid, a in answers.items():
            if isinstance(a, int):
                assert store.read_ledger(lid)[1] == a


def test_an_async_created_written_and_closed_handle_dies_by_its_reference_count(client):
    """The asynchronous path leaves no reference cycle per ledger either (the
    cyclic collector would then run over every ledger in flight): with the
    collector off, a handle created, written and closed asynchronously is freed
    once dropped."""
    def one_ledger():
        got = []
        done = threading.Event()

        def closed(exc, _):
            got.append(exc)
            done.set()

        def added(exc, _eid):
            assert exc is None
            lh.close_async(callback=closed)
        lh = client.create_ledger_async(3, 2, 2, password=PW).result(10)
        lh.add_entry_async(b"x" * 100, callback=added)
        wait_until(done.is_set, timeout=10, what="the close")
        assert got == [None]
        return lh
    one_ledger()                        # connections made
    gc.collect()
    gc.disable()
    try:
        lh = one_ledger()
        lid = lh.ledger_id
        handle = weakref.ref(lh)
        del lh
        one_ledger()
        wait_until(lambda: handle() is None, what="the handle freed with the collector off")
    finally:
        gc.enable()
    md = client._store.read_ledger(lid)[0]
    assert md.state == LedgerState.CLOSED and md.last_entry_id == 0


def test_the_benchs_async_chains_create_write_and_close_or_raise_the_first_error(
        client, cluster_factory):
    # bench_metadata's default mode: chains of create -> add -> close by callbacks
    out = []
    assert create_close_async(client, 40, 8, out=out) > 0
    assert len(set(out)) == 40
    for lid in out:
        md = client.ledger_metadata(lid)
        assert md.state == LedgerState.CLOSED and md.last_entry_id == 0
    # an error of any link ends the run and is raised, not swallowed or hung on
    small = cluster_factory(2)
    with small.client(timeout=5) as c2:
        with pytest.raises(NotEnoughBookiesError):
            create_close_async(c2, 10, 4)
