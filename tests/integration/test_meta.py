"""MetadataStore and EtcdServer against a real etcd (started here, always stopped).

One etcd serves the module; each test works under its own key prefix so the
tests do not see each other's keys. Tests that restart etcd start their own.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bk.errors import (BKError, CookieMismatchError, LedgerExistsError, MetadataError,
                       MetadataVersionError, NoSuchLedgerError)
from bk.meta import (EtcdServer, LedgerMetadata, LedgerState, MetadataStore,
                     find_etcd_binary, parse_metadata_uri)
from bk.meta.store import CookieVersionError
from bk.util import free_port
from bk.testing import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(str(tmp_path_factory.mktemp("etcd")))
    try:
        server.start()
        yield server
    finally:
        server.stop()
    assert not server.alive


@pytest.fixture
def uri(etcd, request):
    return etcd.uri(f"t-{request.node.name.replace('[', '-').replace(']', '')}")


@pytest.fixture
def store(uri):
    with MetadataStore(uri, timeout=5) as s:
        s.format()                 # what 'bkshell metaformat' does: a cluster to work in
        yield s


def md(lid: int, **kw) -> LedgerMetadata:
    return LedgerMetadata(ledger_id=lid, ensemble_size=3, write_quorum_size=2,
                          ack_quorum_size=2, ensembles=[(0, ["a:1", "b:1", "c:1"])],
                          password_digest=b"\x01\x02", **kw)


# --- etcd server -------------------------------------------------------------------

def test_etcd_server_start_failure_quotes_log(tmp_path):
    assert os.access(find_etcd_binary(), os.X_OK)
    server = EtcdServer(str(tmp_path), extra_args=["--no-such-flag"])
    with pytest.raises(MetadataError) as ei:
        server.start(timeout=10)
    assert "no-such-flag" in str(ei.value)         # the tail of etcd's log
    assert not server.alive
    server.stop()                                   # idempotent


# --- URIs and connectivity -----------------------------------------------------------

def test_parse_metadata_uri():
    assert parse_metadata_uri("etcd://127.0.0.1:2379/ledgers") == ([("127.0.0.1", 2379)],
                                                                   "/ledgers")
    assert parse_metadata_uri("etcd://h1:1,h2:2/a/b/") == ([("h1", 1), ("h2", 2)], "/a/b")
    assert parse_metadata_uri("etcd://h:1") == ([("h", 1)], "/ledgers")
    assert parse_metadata_uri("etcd://[::1]:2379/x") == ([("::1", 2379)], "/x")
    for bad in ["zk://h:2181/ledgers", "http://h:1/x", "h:1/ledgers", "etcd:///x",
                "etcd://h/x", "etcd://h:port/x", "etcd://h:70000/x", "etcd://h:1,/x",
                "etcd://h:1/a//b", "etcd://h:1/x?y=1", "etcd://h:1/../x", ""]:
        with pytest.raises(ValueError) as ei:
            parse_metadata_uri(bad)
        assert repr(bad) in str(ei.value), bad
    with pytest.raises(ValueError, match="zk://"):
        MetadataStore("zk://h:2181/ledgers")


def test_unreachable_etcd_raises_naming_uri():
    uri = f"etcd://127.0.0.1:{free_port()}/ledgers"           # nothing listens there
    store = MetadataStore(uri, timeout=2)
    t0 = time.monotonic()
    with pytest.raises(MetadataError) as ei:
        store.read_ledger(1)
    assert time.monotonic() - t0 < 15           # bounded by the timeout, not a hang
    assert uri in str(ei.value) and "read ledger 1" in str(ei.value)
    store.close()


def test_silent_peer_times_out_within_timeout():
    # accepts TCP connections but never speaks HTTP/2: only the deadline ends the call
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        uri = f"etcd://127.0.0.1:{sock.getsockname()[1]}/ledgers"
        with MetadataStore(uri, timeout=1.5) as store:
            t0 = time.monotonic()
            with pytest.raises(MetadataError) as ei:
                store.new_ledger_id()
            elapsed = time.monotonic() - t0
    # It waited for the deadline (not an instant failure) and did not hang past it.
    assert elapsed > 1.0 and elapsed < 15
    assert uri in str(ei.value)


def test_one_dead_endpoint_of_several(etcd):
    uri = f"etcd://127.0.0.1:{free_port()},{etcd.endpoint}/t-failover"
    with MetadataStore(uri, timeout=2) as store:
        for _ in range(4):                    # whichever endpoint it starts with
            try:
                store.init_layout()
                break
            except MetadataError:
                continue
        for _ in range(5):                    # reads fail over by themselves
            assert store.is_formatted()


def test_closed_store_refuses(uri):
    store = MetadataStore(uri)
    store.close()
    with pytest.raises(MetadataError, match="closed"):
        store.ledger_exists(1)


# --- layout ----------------------------------------------------------------------------

def test_layout_init_idempotent_and_concurrent(uri):
    stores = [MetadataStore(uri) for _ in range(8)]
    try:
        assert not stores[0].is_formatted()
        barrier = threading.Barrier(len(stores))

        def init(s):
            barrier.wait()
            return s.init_layout()

        with ThreadPoolExecutor(len(stores)) as ex:
            results = list(ex.map(init, stores))
        assert results.count(True) == 1
        assert stores[0].init_layout() is False
        assert all(s.is_formatted() for s in stores)
        assert stores[0].layout()["layoutVersion"] == 3
        # One cluster, one identity, whoever won the race.
        assert len({s.instance_id for s in stores}) == 1
    finally:
        for s in stores:
            s.close()


def test_format_with_and_without_force(etcd, uri):
    sibling = uri + "2"              # "/t-x2" shares the text prefix "/t-x" but not "/t-x/"
    with MetadataStore(uri) as store, MetadataStore(sibling) as other:
        store.format()                                   # empty prefix: allowed
        assert store.is_formatted()
        store.create_ledger(md(7))
        other.create_ledger(md(7))
        with pytest.raises(MetadataError) as ei:
            store.format()
        assert "force" in str(ei.value) and uri in str(ei.value)
        assert store.ledger_exists(7)                    # refused: nothing deleted
        before = store.instance_id
        store.format(force=True)
        assert list(store.list_ledgers()) == []
        assert store.is_formatted()
        assert store.instance_id != before               # a new cluster, a new identity
        assert other.ledger_exists(7)                    # the sibling prefix is untouched


def test_unformatted_and_old_layouts_are_refused(uri):
    from bk.errors import ClusterIdentityError, ClusterNotFormattedError
    with MetadataStore(uri) as store:
        with pytest.raises(ClusterNotFormattedError, match="metaformat") as ei:
            store.new_ledger_id()
        assert store.prefix in str(ei.value)
        store.put_json("layout", {"layoutVersion": 1, "ledgerIdGenerator": "etcd-revision"})
        with pytest.raises(ClusterIdentityError, match="layout version 1"):
            store.cluster()
        with pytest.raises(ClusterIdentityError, match="layout version 1"):
            store.new_ledger_id()


def test_ledger_ids_are_scoped_by_instance(etcd, uri):
    from bk.meta.store import REVISION_BITS, id_scope
    with MetadataStore(uri) as store:
        store.format()
        first = store.instance_id
        a = [store.new_ledger_id() for _ in range(3)]
        assert a == sorted(set(a)) and all(0 < x < 2 ** 63 for x in a)
        assert {x >> REVISION_BITS for x in a} == {id_scope(first)}
        store.format(force=True)           # a new cluster on the same etcd
        b = store.new_ledger_id()
        assert b >> REVISION_BITS == id_scope(store.instance_id) != id_scope(first)
        assert b not in a


def test_gc_listing_only_from_the_bookies_cluster(uri):
    from bk.errors import ClusterIdentityError
    with MetadataStore(uri) as store:
        store.format()
        inst = store.instance_id
        store.create_ledger(md(5))
        with pytest.raises(ClusterIdentityError, match="no cookie of bookie b:1"):
            store.list_ledgers_as_member("b:1", inst)
        store.write_cookie("b:1", {"instanceId": inst, "bookieId": "b:1"})
        assert store.list_ledgers_as_member("b:1", inst) == [5]
        with pytest.raises(ClusterIdentityError, match="not other-instance"):
            store.list_ledgers_as_member("b:1", "other-instance")
        store.format(force=True)           # wiped: the cookie is gone, the id changed
        with pytest.raises(ClusterIdentityError):
            store.list_ledgers_as_member("b:1", inst)


# --- ledgers -----------------------------------------------------------------------------

def test_ledger_create_read_delete(store):
    v = store.create_ledger(md(42, custom_metadata={"app": b"x"}))
    assert v > 0 and store.ledger_exists(42) and not store.ledger_exists(43)
    with pytest.raises(LedgerExistsError, match="ledger 42"):
        store.create_ledger(md(42))
    got, version = store.read_ledger(42)
    assert version == v
    assert got == md(42, custom_metadata={"app": b"x"}).replace(ctime=got.ctime)
    assert got.custom_metadata == {"app": b"x"} and got.password_digest == b"\x01\x02"
    with pytest.raises(NoSuchLedgerError, match="ledger 43"):
        store.read_ledger(43)
    with pytest.raises(NoSuchLedgerError, match="ledger 43"):
        store.delete_ledger(43)
    with pytest.raises(MetadataVersionError):
        store.delete_ledger(42, version=v + 1000)
    store.delete_ledger(42, version=v)
    assert not store.ledger_exists(42)
    with pytest.raises(NoSuchLedgerError):
        store.read_ledger(42)
    with pytest.raises(ValueError):
        store.read_ledger(-1)


def test_cas_exactly_one_writer_wins(store):
    v0 = store.create_ledger(md(5))
    proposals = [md(5, state=LedgerState.CLOSED, last_entry_id=9, length=100),
                 md(5, state=LedgerState.IN_RECOVERY)]
    barrier = threading.Barrier(2)

    def write(m):
        barrier.wait()
        try:
            return ("ok", store.write_ledger(m, v0), m)
        except MetadataVersionError as e:
            return ("lost", str(e), m)

    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(write, proposals))
    outcomes = sorted(r[0] for r in results)
    assert outcomes == ["lost", "ok"]
    winner = next(r for r in results if r[0] == "ok")
    loser = next(r for r in results if r[0] == "lost")
    assert "ledger 5" in loser[1]
    stored, version = store.read_ledger(5)
    assert version == winner[1] and version > v0
    assert stored.state == winner[2].state and stored.last_entry_id == winner[2].last_entry_id
    # a stale version never overwrites, a current one does
    with pytest.raises(MetadataVersionError):
        store.write_ledger(loser[2], v0)
    assert store.read_ledger(5)[0].state == winner[2].state
    v2 = store.write_ledger(stored.replace(length=5), version)
    assert store.read_ledger(5) == (stored.replace(length=5), v2)
    store.delete_ledger(5)
    with pytest.raises(NoSuchLedgerError):
        store.write_ledger(stored, v2)


def test_list_ledgers_pages_in_numeric_order(store):
    ids = list(range(1, 2491)) + [5000, 99999, 10 ** 6, 10 ** 12, 2 ** 63 - 1,
                                   123456789, 77777, 31337, 4096, 65536]
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda i: store.create_ledger(md(i)), ids))
    before = store.rpc_counts["range"]
    listed = list(store.list_ledgers(page_size=100))
    assert listed == sorted(ids) and len(listed) == 2500
    # 2500 / 100 pages, plus windows over empty id space (each up to 16 times as
    # wide as the one before)
    assert 25 <= store.rpc_counts["range"] - before <= 25 + 40
    # the iterator is lazy: one page is fetched per 100 ids
    it = store.list_ledgers(page_size=100)
    before = store.rpc_counts["range"]
    first = [next(it) for _ in range(100)]
    assert first == list(range(1, 101)) and store.rpc_counts["range"] - before == 1
    mds = list(store.list_ledger_metadata(page_size=7))
    assert [m.ledger_id for m, _ in mds] == sorted(ids)
    assert all(v > 0 for _, v in mds)
    with pytest.raises(ValueError):
        list(store.list_ledgers(page_size=0))


def test_new_ledger_id_unique_across_threads(uri):
    stores = [MetadataStore(uri) for _ in range(4)]
    stores[0].format()
    try:
        def grab(i):
            s = stores[i % len(stores)]
            return [s.new_ledger_id() for _ in range(50)]

        with ThreadPoolExecutor(20) as ex:
            batches = list(ex.map(grab, range(20)))
        ids = [i for b in batches for i in b]
        assert len(ids) == 1000 and len(set(ids)) == 1000
        assert all(0 < i < 2 ** 63 for i in ids)
        assert all(b == sorted(b) for b in batches)           # monotonic per caller
        assert stores[0].new_ledger_id() > max(ids)           # never reused
    finally:
        for s in stores:
            s.close()


# --- bookies ----------------------------------------------------------------------------

def test_bookie_registration_lifecycle(store):
    reg = store.register_bookie("127.0.0.1:3181", {"port": 3181}, ttl=2)
    try:
        assert reg.alive and not reg.readonly
        assert store.list_bookies() == ["127.0.0.1:3181"]
        assert store.list_bookies(readonly=True) == []
        assert store.bookie_info("127.0.0.1:3181") == {"port": 3181, "readonly": False}
        assert store.bookie_info("nobody:1") is None

        t0 = time.monotonic()
        with pytest.raises(BKError, match="bookie 127.0.0.1:3181 is already registered"):
            store.register_bookie("127.0.0.1:3181", {"port": 1}, ttl=2)
        assert time.monotonic() - t0 < 2 + 3          # about one TTL plus etcd's expiry
        assert store.bookie_info("127.0.0.1:3181")["port"] == 3181   # untouched

        reg.set_readonly(True)
        assert reg.readonly
        assert store.list_bookies() == [] and store.list_bookies(True) == ["127.0.0.1:3181"]
        assert store.all_bookies() == {"127.0.0.1:3181": {"port": 3181, "readonly": True}}
        time.sleep(2.5)                  # longer than the TTL: the thread keeps it alive
        assert reg.alive and store.list_bookies(True) == ["127.0.0.1:3181"]
        reg.set_readonly(False)
        assert store.list_bookies() == ["127.0.0.1:3181"]
        assert store.list_bookies(True) == []
    finally:
        reg.close()
    assert not reg.alive
    assert store.all_bookies() == {}                    # revoked: gone at once
    reg.close()                                         # idempotent


_OWNER = r"""
import sys, time
from bk.meta import MetadataStore
s = MetadataStore(sys.argv[1])
r = s.register_bookie(sys.argv[2], {"pid": __import__("os").getpid()}, ttl=2)
print("registered", flush=True)
time.sleep(60)
"""


def test_registration_of_killed_owner_expires(store, uri):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, uri, "b-killed:1"],
                            stdout=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == b"registered"
        assert store.bookie_info("b-killed:1")["pid"] == proc.pid
        time.sleep(2.5)                       # alive longer than its TTL
        assert store.list_bookies() == ["b-killed:1"]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        # a restarted bookie with the same id waits for the dead one's lease to run out
        reg = store.register_bookie("b-killed:1", {"pid": os.getpid()}, ttl=2)
        took = time.monotonic() - killed
        try:
            assert took < 2 + 1.5, took
            assert store.bookie_info("b-killed:1")["pid"] == os.getpid()
        finally:
            reg.close()
        assert store.list_bookies() == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_registration_of_killed_owner_disappears_within_ttl(store, uri):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, uri, "b-gone:1"],
                            stdout=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == b"registered"
        assert store.list_bookies() == ["b-gone:1"]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        wait_until(lambda: store.list_bookies() == [], timeout=4)
        assert time.monotonic() - killed <= 2 + 1.0      # TTL plus etcd's expiry tick
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_lost_lease_is_registered_again(store):
    reg = store.register_bookie("b-relive:1", {"x": 1}, ttl=2)
    try:
        old_lease = reg.lease_id
        with MetadataStore(store.uri) as other:         # someone revokes it behind our back
            other._client().revoke_lease(old_lease)
            assert other.list_bookies() == []
            wait_until(lambda: other.list_bookies() == ["b-relive:1"], timeout=3)
        assert reg.lease_id != old_lease and reg.alive
        store.format(force=True)                        # key deleted, lease alive
        assert store.list_bookies() == []
        wait_until(lambda: store.list_bookies() == ["b-relive:1"], timeout=3)
    finally:
        reg.close()
    assert store.list_bookies() == []


def test_watch_bookies_sees_add_readonly_and_removal(store):
    seen = []
    cond = threading.Condition()

    def cb(writable, readonly):
        with cond:
            seen.append((sorted(writable), sorted(readonly)))
            cond.notify_all()

    def expect(state):
        with cond:
            assert cond.wait_for(lambda: seen and seen[-1] == state, timeout=5), seen

    cancel = store.watch_bookies(cb)
    try:
        assert seen == [([], [])]                       # called at once, synchronously
        r1 = store.register_bookie("w1:1", {}, ttl=3)
        expect((["w1:1"], []))
        r2 = store.register_bookie("w2:1", {}, ttl=3)
        expect((["w1:1", "w2:1"], []))
        r1.set_readonly(True)
        expect((["w2:1"], ["w1:1"]))
        r2.close()
        expect(([], ["w1:1"]))
        r1.close()
        expect(([], []))
    finally:
        cancel()
    n = len(seen)
    r3 = store.register_bookie("w3:1", {}, ttl=3)
    time.sleep(0.5)
    r3.close()
    assert len(seen) == n                               # cancelled: no more calls


def test_registration_and_watch_survive_etcd_restart(tmp_path):
    server = EtcdServer(str(tmp_path / "etcd")).start()
    try:
        uri = server.uri("restart")
        with MetadataStore(uri, timeout=2) as store:
            seen = []
            cancel = store.watch_bookies(lambda w, r: seen.append(sorted(w)))
            reg = store.register_bookie("r1:1", {}, ttl=2)
            wait_until(lambda: seen[-1] == ["r1:1"], timeout=5)
            server.stop()
            with pytest.raises(MetadataError, match="restart"):
                store.list_bookies()
            time.sleep(1.0)
            server.start()
            wait_until(lambda: store.list_bookies() == ["r1:1"], timeout=8)
            reg2 = store.register_bookie("r2:1", {}, ttl=2)
            wait_until(lambda: seen[-1] == ["r1:1", "r2:1"], timeout=8,
                       what="the watch to see both bookies")
            time.sleep(2.5)
            assert reg.alive and store.list_bookies() == ["r1:1", "r2:1"]
            cancel()
            reg.close()
            reg2.close()
            assert store.list_bookies() == []
    finally:
        server.stop()


# --- cookies ------------------------------------------------------------------------------

def test_cookies(store):
    assert store.read_cookie("c1:1") == (None, None)
    v1 = store.write_cookie("c1:1", {"dirs": ["/a"], "shards": 4})
    with pytest.raises(CookieMismatchError, match="c1:1"):
        store.write_cookie("c1:1", {"dirs": ["/b"]})
    cookie, version = store.read_cookie("c1:1")
    assert cookie == {"dirs": ["/a"], "shards": 4} and version == v1
    v2 = store.write_cookie("c1:1", {"dirs": ["/a", "/b"], "shards": 4}, version=v1)
    assert v2 > v1
    with pytest.raises(CookieMismatchError) as ei:
        store.write_cookie("c1:1", {"dirs": []}, version=v1)        # stale version
    assert isinstance(ei.value, CookieVersionError)
    assert isinstance(ei.value, MetadataVersionError)
    assert store.read_cookie("c1:1") == ({"dirs": ["/a", "/b"], "shards": 4}, v2)
    assert store.delete_cookie("c1:1") is True
    assert store.delete_cookie("c1:1") is False
    assert store.read_cookie("c1:1") == (None, None)


def test_generic_json_helpers(store):
    assert store.get_json("auditor") == (None, None)
    v = store.cas_json("auditor", {"id": "a"}, None)
    with pytest.raises(MetadataVersionError):
        store.cas_json("auditor", {"id": "b"}, None)
    v2 = store.cas_json("auditor", {"id": "b"}, v)
    assert store.get_json("auditor") == ({"id": "b"}, v2)
    store.put_json("logs/x", [1, 2])
    assert [(k, val) for k, val, _ in store.list_json("logs/")] == [("logs/x", [1, 2])]
    assert store.delete_json("logs/x") and not store.delete_json("logs/x")
    with pytest.raises(ValueError):
        store.get_json("../escape")


# --- fork ----------------------------------------------------------------------------------

def test_store_usable_after_fork_in_child_and_parent(store):
    store.create_ledger(md(1))
    parent_client = store._client()
    pid = os.fork()
    if pid == 0:  # child: any failure shows up as the exit code
        code = 1
        try:
            m, _ = store.read_ledger(1)
            lid = store.new_ledger_id()
            store.create_ledger(md(2))
            ok = (m.ledger_id == 1 and lid > 0 and store._client() is not parent_client
                  and store.ledger_exists(2))
            code = 0 if ok else 3
        except BaseException:
            code = 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store._client() is parent_client           # the parent keeps its channel
    assert list(store.list_ledgers()) == [1, 2]       # the child's write is visible
    assert store.read_ledger(2)[0].ledger_id == 2
