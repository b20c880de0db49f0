"""LeaseLock and Election against a real etcd, including a holder SIGSTOPped
past its lease whose writes, once resumed, change nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from bk.meta import EtcdServer, MetadataStore
from bk.meta.recipes import Election, LeaseLock, LockLostError
from bk.testing import sigstop, wait_until


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(str(tmp_path_factory.mktemp("etcd")))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def store(etcd, request):
    with MetadataStore(etcd.uri(f"r-{request.node.name}")) as s:
        yield s


def test_lock_is_exclusive_and_tokens_grow(store):
    a = LeaseLock(store, "locks/1", {"owner": "a"}, ttl=5)
    b = LeaseLock(store, "locks/1", {"owner": "b"}, ttl=5)
    assert a.try_acquire() and a.held
    assert not b.try_acquire() and not b.held
    assert not b.acquire(timeout=0.3)
    assert store.get_json("locks/1")[0] == {"owner": "a"}
    assert store.put_json_if("data", 1, [a.guard()])
    with pytest.raises(LockLostError):
        b.guard()
    first = a.token
    a.release()
    assert store.get_json("locks/1")[0] is None
    assert b.acquire(timeout=5) and b.token > first
    assert not store.put_json_if("data", 2, [store._client().transactions.create(
        store._key("locks/1")) == first])          # the old token fences nothing in
    assert store.get_json("data")[0] == 1
    b.release()


def test_election_names_the_leader_and_its_epoch(store):
    e1 = Election(store, "auditor", "bookie-1:3181", ttl=5)
    e2 = Election(store, "auditor", "bookie-2:3181", ttl=5)
    assert e1.campaign(timeout=5) and e1.is_leader
    assert not e2.campaign(timeout=0.3)
    assert e2.leader() == "bookie-1:3181"
    epoch = e1.epoch
    e1.resign()
    assert e2.campaign(timeout=5) and e2.leader() == "bookie-2:3181" and e2.epoch > epoch
    e2.resign()
    assert e1.leader() is None


HOLDER = textwrap.dedent("""
    import sys, time
    from bk.meta import MetadataStore
    from bk.meta.recipes import LeaseLock, LockLostError
    store = MetadataStore(sys.argv[1])
    lock = LeaseLock(store, "locks/held", {"owner": "paused"}, ttl=2)
    assert lock.acquire(timeout=10)
    print("token", lock.token, flush=True)
    n = 0
    while True:
        n += 1
        try:
            ok = store.put_json_if("owned-data", {"by": "paused", "n": n}, [lock.guard()])
            print("wrote" if ok else "fenced", n, flush=True)
        except LockLostError:
            print("lost", n, flush=True)
        time.sleep(0.1)
""")


def test_sigstopped_holder_changes_nothing_after_its_lease_expired(store):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, store.uri], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().startswith("token")
        wait_until(lambda: p.stdout.readline().startswith("wrote"), what="the holder writing")
        sigstop(p.pid)
        mine = LeaseLock(store, "locks/held", {"owner": "new"}, ttl=5)
        assert mine.acquire(timeout=30)              # the paused holder's lease expired
        store.put_json_if("owned-data", {"by": "new"}, [mine.guard()])
        os.kill(p.pid, signal.SIGCONT)
        # Resumed, the old holder tries again: fenced by the token, or it noticed
        # the lost lease; either way its writes change nothing.
        seen = []
        wait_until(lambda: seen.append(p.stdout.readline().split()[0]) or
                   seen[-1] in ("fenced", "lost"), what="the old holder being fenced")
        assert store.get_json("owned-data")[0] == {"by": "new"}
        mine.release()
    finally:
        p.kill()
        p.wait()
