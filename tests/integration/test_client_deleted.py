"""A ledger deleted under its handles: every call says NoSuchLedgerError, naming
the ledger, where the bookies' refusal alone would say "fenced" (a tombstone
answers an add with EFENCED); a genuine fence (a recovery open by another
client) still says LedgerFencedError. Real etcd and bookies; the bookies
collect deleted ledgers every 200 ms."""

from __future__ import annotations

import threading

import pytest

from bk import protocol as P
from bk.client import recovery
from bk.errors import (ENOLEDGER, LedgerFencedError, NoSuchLedgerError, NoSuchLogError)
from bk.testing import BookieConnection, bookie_lost, wait_until

PW = b"deleted"


@pytest.fixture(scope="module")
def gc_cluster(module_cluster_factory):
    return module_cluster_factory(3, num_shards=2, conf_overrides={"gcWaitTime": 200})


@pytest.fixture
def two_clients(gc_cluster):
    a = gc_cluster.client(timeout=5.0)
    b = gc_cluster.client(timeout=5.0)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def collected(cluster, lid):
    """Wait until no bookie holds ``lid`` any more (its GC tombstoned it)."""
    def gone():
        for bp in cluster.bookies:
            with BookieConnection(bp.bookie_id, shard=P.shard_of(lid, bp.num_shards)) as c:
                if c.call(P.get_list_of_entries(c.next_rid(), lid))[2] != ENOLEDGER:
                    return False
        return True
    wait_until(gone, timeout=60, what=f"every bookie collecting ledger {lid}")


def deleted_error(exc, lid):
    """``exc`` is NoSuchLedgerError (not a fence) and names the ledger."""
    assert type(exc) is NoSuchLedgerError, repr(exc)
    assert str(lid) in str(exc) and "deleted" in str(exc), str(exc)


def add_until_refused(lh, mode):
    """Add (``mode``: sync, async, pipelined) until an add fails; its error."""
    deadline_hit = []

    def one():
        try:
            if mode == "sync":
                lh.add_entry(b"x")
            elif mode == "async":
                futs = [lh.add_entry_async(b"x") for _ in range(8)]
                for f in futs:
                    f.result(timeout=30)
            else:
                lh.add_entries([b"x"] * 8)
        except Exception as e:       # noqa: BLE001 (the test looks at what it is)
            deadline_hit.append(e)
            return True
        return False
    wait_until(one, timeout=60, what="an add refused")
    return deadline_hit[0]


@pytest.mark.parametrize("mode", ["sync", "async", "pipelined"])
def test_adds_to_a_deleted_ledger_say_deleted(gc_cluster, two_clients, mode):
    a, b = two_clients
    lh = a.create_ledger(3, 2, 2, password=PW)
    lid = lh.ledger_id
    assert lh.add_entries([b"e"] * 5) == 4
    b.delete_ledger(lid)
    collected(gc_cluster, lid)
    deleted_error(add_until_refused(lh, mode), lid)
    # later adds: at once, the same error
    with pytest.raises(NoSuchLedgerError) as ei:
        lh.add_entry(b"later")
    deleted_error(ei.value, lid)
    fut = None
    try:
        fut = lh.add_entry_async(b"later")
    except NoSuchLedgerError as e:
        deleted_error(e, lid)
    if fut is not None:
        deleted_error(fut.exception(timeout=30), lid)
    # the writer's close: its metadata is gone
    with pytest.raises(NoSuchLedgerError) as ei:
        lh.close()
    deleted_error(ei.value, lid)


def test_a_fenced_writer_still_says_fenced(gc_cluster, two_clients):
    a, b = two_clients
    lh = a.create_ledger(3, 2, 2, password=PW)
    lh.add_entries([b"e"] * 5)
    rh = b.open_ledger(lh.ledger_id, password=PW)       # recovery: fences
    assert rh.is_closed and rh.last_add_confirmed == 4
    err = add_until_refused(lh, "sync")
    assert type(err) is LedgerFencedError, repr(err)
    with pytest.raises(LedgerFencedError):
        lh.add_entry_async(b"later").result(timeout=30)
    lh.close()          # the recovery closed it where this writer's LAC is: agreed
    assert b.ledger_metadata(lh.ledger_id).last_entry_id == 4


def test_close_of_a_writer_whose_ledger_was_deleted(gc_cluster, two_clients):
    a, b = two_clients
    for close in ("close", "close_async"):
        lh = a.create_ledger(3, 2, 2, password=PW)
        lh.add_entries([b"e"] * 3)
        b.delete_ledger(lh.ledger_id)     # no GC needed: the close's CAS finds it gone
        with pytest.raises(NoSuchLedgerError) as ei:
            if close == "close":
                lh.close()
            else:
                lh.close_async().result(timeout=30)
        deleted_error(ei.value, lh.ledger_id)


def test_reads_of_a_deleted_ledger_say_deleted(gc_cluster, two_clients):
    a, b = two_clients
    lh = a.create_ledger(3, 2, 2, password=PW)
    lid = lh.ledger_id
    lh.add_entries([b"e%d" % i for i in range(10)])
    lh.close()
    closed = a.open_ledger(lid, password=PW)
    tail = a.open_ledger_no_recovery(lid, password=PW)
    assert [e.data for e in closed.read_entries(0, 9)] == [b"e%d" % i for i in range(10)]
    b.delete_ledger(lid)
    collected(gc_cluster, lid)
    for call in (lambda: closed.read_entries(0, 9), lambda: closed.read_entry(3),
                 lambda: tail.read_entries(0, 9), lambda: tail.read_unconfirmed_entries(0, 9),
                 lambda: closed.read_last_add_confirmed_and_entry(5, timeout=0.2)):
        with pytest.raises(NoSuchLedgerError) as ei:
            call()
        deleted_error(ei.value, lid)


def test_lac_reads_and_long_polls_of_a_deleted_open_ledger(gc_cluster, two_clients):
    a, b = two_clients
    lh = a.create_ledger(3, 2, 2, password=PW)
    lid = lh.ledger_id
    lh.add_entries([b"e"] * 4)
    lh.flush_lac()
    rh = a.open_ledger_no_recovery(lid, password=PW)
    wait_until(lambda: rh.read_last_add_confirmed() == 3, what="the LAC reaching 3")
    # A tailing reader polls while the ledger is deleted under it.
    errors = []

    def tail():
        nxt = 0
        try:
            while nxt < 10_000:
                _lac, entry = rh.read_last_add_confirmed_and_entry(nxt, timeout=0.3)
                if entry is not None:
                    nxt += 1
        except Exception as e:       # noqa: BLE001
            errors.append(e)
    t = threading.Thread(target=tail)
    t.start()
    wait_until(lambda: rh.length > 0, what="the tail reading")
    b.delete_ledger(lid)
    t.join(60)
    assert not t.is_alive()
    assert len(errors) == 1
    deleted_error(errors[0], lid)
    assert "long poll" in str(errors[0])
    with pytest.raises(NoSuchLedgerError) as ei:
        rh.read_last_add_confirmed()
    deleted_error(ei.value, lid)
    collected(gc_cluster, lid)
    with pytest.raises(NoSuchLedgerError) as ei:
        rh.read_last_add_confirmed()
    deleted_error(ei.value, lid)


def _delete_at(client, deleter, method, when):
    """Make ``client``'s metadata store call ``method`` delete the ledger with
    ``deleter`` once ``when(args)`` holds, after the call (one time)."""
    store = client._store
    orig = getattr(store, method)
    fired = []

    def hooked(*args, **kw):
        out = orig(*args, **kw)
        if not fired and when(args, out):
            fired.append(True)
            lid = args[0] if isinstance(args[0], int) else args[0].ledger_id
            deleter.delete_ledger(lid)
        return out
    setattr(store, method, hooked)
    return fired


@pytest.mark.parametrize("at", ["open", "refresh"])
def test_open_without_recovery_of_a_ledger_deleted_during_the_open(gc_cluster, two_clients, at):
    """Deleted after the open read the metadata ("open": its LAC read re-reads it
    and finds it gone), or after that re-read, and collected before the bookies
    are asked ("refresh": every bookie says it has no such ledger)."""
    a, b = two_clients
    with gc_cluster.client() as w:
        lh = w.create_ledger(3, 2, 2, password=PW)
        lh.add_entries([b"e"] * 3)
        lid = lh.ledger_id
        calls = []

        def nth(args, out):
            calls.append(args)
            return len(calls) == (1 if at == "open" else 2)
        fired = _delete_at(a, b, "read_ledger", nth)
        if at == "refresh":
            orig = a._store.read_ledger

            def and_collected(*args, **kw):
                out = orig(*args, **kw)
                if fired and len(fired) == 1:
                    fired.append(True)
                    collected(gc_cluster, lid)
                return out
            a._store.read_ledger = and_collected
        with pytest.raises(NoSuchLedgerError) as ei:
            a.open_ledger_no_recovery(lid, password=PW)
        assert fired
        deleted_error(ei.value, lid)
        assert "read last add confirmed" in str(ei.value)


@pytest.mark.parametrize("at", ["in_recovery", "fenced", "found"])
def test_recovery_open_of_a_ledger_deleted_during_the_open(gc_cluster, two_clients, monkeypatch,
                                                          at):
    """Deleted right after the CAS to IN_RECOVERY (the bookies still hold it: the
    closing CAS finds it gone), or deleted and collected right after the fence
    (reading the last confirmed entry finds no ledger), or right after an entry
    past the LAC was found (its write-back is refused)."""
    a, b = two_clients
    with gc_cluster.client() as w:
        lh = w.create_ledger(3, 2, 2, password=PW)
        for _ in range(3):
            lh.add_entry(b"e")              # LAC on the bookies: 1; entry 2 past it
        lid = lh.ledger_id
        fired = []

        def delete(collect):
            fired.append(True)
            b.delete_ledger(lid)
            if collect:
                collected(gc_cluster, lid)
        if at == "in_recovery":
            orig_write = a._store.write_ledger

            def write(md, *args, **kw):
                out = orig_write(md, *args, **kw)
                if md.state.value == "IN_RECOVERY" and not fired:
                    delete(False)
                return out
            monkeypatch.setattr(a._store, "write_ledger", write)
        elif at == "fenced":
            orig_fence = recovery._fence

            def fence(*args):
                out = orig_fence(*args)
                assert out == 1
                delete(True)
                return out
            monkeypatch.setattr(recovery, "_fence", fence)
        else:
            orig_get = recovery._RecoveryReader.get

            def get(self, entry_id):
                out = orig_get(self, entry_id)
                if out is not None and not fired:
                    delete(True)
                return out
            monkeypatch.setattr(recovery._RecoveryReader, "get", get)
        with pytest.raises(NoSuchLedgerError) as ei:
            a.open_ledger(lid, password=PW)
        assert fired
        deleted_error(ei.value, lid)
        assert "recover ledger" in str(ei.value)


def test_log_writer_and_reader_of_a_deleted_segment(gc_cluster, two_clients):
    a, b = two_clients
    name = "deleted-segment"
    w = a.open_log_writer(name, logBatchLingerMs=1)
    for i in range(5):
        w.append(b"r%d" % i)
    seg = a.log_info(name).segments[-1]
    lid = seg["ledger_id"] if isinstance(seg, dict) else seg.ledger_id
    r = b.open_log_reader(name, start="earliest")
    got = r.read_batch(5, timeout=10)
    while len(got) < 5:
        got += r.read_batch(5 - len(got), timeout=10)
    assert [x.data for x in got] == [b"r%d" % i for i in range(5)]
    b.delete_ledger(lid)
    collected(gc_cluster, lid)
    # the writer: its next append, refused by the bookies
    with pytest.raises(NoSuchLedgerError) as ei:
        for _ in range(100):
            w.append(b"more")
    deleted_error(ei.value, lid)
    assert name in str(ei.value)
    w.close()
    # the tailing reader: its long poll ends with the ledger gone
    with pytest.raises(NoSuchLedgerError) as ei:
        for _ in range(100):
            r.read_next(timeout=0.5)
    deleted_error(ei.value, lid)
    assert name in str(ei.value)
    r.close()
    # a log deleted whole: its reader says the log is gone
    a.delete_log(name)
    with pytest.raises(NoSuchLogError):
        b.open_log_reader(name)


def test_an_ensemble_change_that_finds_the_ledger_deleted_says_deleted(cluster_factory):
    """The bookies still hold the ledger (no GC round yet), so its adds go on until
    one of them is lost: the ensemble change's CAS then finds no metadata, and the
    adds fail as deleted, not with the store's bare "no such ledger"."""
    c = cluster_factory(4, conf_overrides={"gcWaitTime": 3_600_000})
    a, b = c.client(timeout=5.0), c.client(timeout=5.0)
    try:
        lh = a.create_ledger(3, 3, 3, password=PW)
        lid = lh.ledger_id
        lh.add_entries([b"x"] * 10)
        b.delete_ledger(lid)
        assert lh.add_entry(b"y") == 10         # no bookie knows of the deletion yet
        victim = next(bp for bp in c.bookies if bp.bookie_id == lh.metadata.last_ensemble[0])
        with bookie_lost(victim, "kill"):
            with pytest.raises(NoSuchLedgerError) as ei:
                lh.add_entry(b"z")
        deleted_error(ei.value, lid)
    finally:
        a.close()
        b.close()
