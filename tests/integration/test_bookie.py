"""The bookie server through its wire protocol: real etcd, real bookie processes."""

import os
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

from bk import protocol as P
from bk.errors import (EBADREQ, EFENCED, ENOENTRY, ENOLEDGER, EOK, EREADONLY, EUA,
                       BookieUnavailableError)
from bk.testing import BookieConnection, bookie_localcluster, wait_until

KEY = b"k" * 20
OTHER = b"x" * 20


def shard_of(lid, b):
    return P.shard_of(lid, b.num_shards)


def conn(b, lid=0):
    return BookieConnection(b.bookie_id, shard=shard_of(lid, b))


def add(c, lid, eid, data, lac=-1, key=KEY, recovery=False):
    return c.call(P.add(c.next_rid(), lid, eid, lac, key, b"d%d" % eid, data, recovery=recovery))


def read(c, lid, eid, **kw):
    return c.call(P.read(c.next_rid(), lid, eid, **kw))


# The tests up to the first kill share one cluster: each uses its own ledger ids
# (11; 10, 12; 5, 7; 20, 22; 30; 40).


def test_misrouted_add_and_fence_get_ebadreq(shared_cluster):
    b = shared_cluster.bookies[0]
    lid = 11
    wrong = 1 - shard_of(lid, b)
    with BookieConnection(b.bookie_id, shard=wrong) as c:
        assert add(c, lid, 0, b"x")[2] == EBADREQ
        r = c.call(P.read(c.next_rid(), lid, 0, fence=True, master_key=KEY))
        assert r[2] == EBADREQ
    with conn(b, lid) as c:                    # nothing was created on the wrong shard
        assert add(c, lid, 0, b"x")[2] == EOK
    with BookieConnection(b.bookie_id, shard=wrong) as c:
        assert c.call(P.get_list_of_entries(c.next_rid(), lid))[2] == ENOLEDGER


def test_adds_then_reads_across_shards(shared_cluster):
    b = shared_cluster.bookies[0]
    for lid in (10, 12):                       # two ledgers, two shards
        with conn(b, lid) as c:
            for eid in range(50):
                resp = add(c, lid, eid, b"entry-%d-%d" % (lid, eid), lac=eid - 1)
                assert resp[:5] == [P.ADD, resp[1], EOK, lid, eid]
    assert {shard_of(lid, b) for lid in (10, 12)} == {0, 1}
    for lid in (10, 12):
        with conn(b, lid) as c:
            for eid in (0, 17, 49):
                r = read(c, lid, eid)
                assert r[2] == EOK
                assert (r[3], r[4], r[5], r[6], r[7]) == (lid, eid, eid - 1, b"d%d" % eid,
                                                          b"entry-%d-%d" % (lid, eid))
            lac = c.call(P.read_lac(c.next_rid(), lid))
            assert lac[2:] == [EOK, lid, 48, 49]
            ents = c.call(P.get_list_of_entries(c.next_rid(), lid))
            assert ents[2] == EOK and P.ranges_to_ids(ents[4]) == list(range(50))
            assert c.call(P.ping(c.next_rid()))[2] == EOK


def test_missing_ledger_and_entry(shared_cluster):
    with conn(shared_cluster.bookies[0], 5) as c:
        assert read(c, 5, 0)[2] == ENOLEDGER
        add(c, 5, 0, b"x")
        assert read(c, 5, 1)[2] == ENOENTRY
        assert c.call(P.get_list_of_entries(c.next_rid(), 7))[2] == ENOLEDGER


def test_fencing_semantics_and_master_key(shared_cluster):
    b = shared_cluster.bookies[0]
    lid = 20
    with conn(b, lid) as c:
        assert add(c, lid, 0, b"a")[2] == EOK
        assert add(c, lid, 1, b"b", key=OTHER)[2] == EUA          # wrong master key
        r = c.call(P.read_lac(c.next_rid(), lid, fence=True, master_key=OTHER))
        assert r[2] == EUA                                          # cannot fence with another key
        assert add(c, lid, 1, b"b", lac=0)[2] == EOK                # not fenced by that
        r = c.call(P.read_lac(c.next_rid(), lid, fence=True, master_key=KEY))
        assert r[2:] == [EOK, lid, 0, 1]
        assert add(c, lid, 2, b"c", lac=1)[2] == EFENCED            # the old writer is out
        assert add(c, lid, 2, b"c", lac=1, recovery=True)[2] == EOK  # recovery writes go in
        assert read(c, lid, 2)[7] == b"c"
    # A fencing READ fences too, also a ledger the bookie never saw.
    with conn(b, lid + 2) as c:
        r = read(c, lid + 2, 0, fence=True, master_key=KEY)
        assert r[2] in (ENOENTRY, ENOLEDGER)
        assert add(c, lid + 2, 0, b"late")[2] == EFENCED


def test_long_poll_read(shared_cluster):
    b = shared_cluster.bookies[0]
    lid = 30
    with conn(b, lid) as writer, conn(b, lid) as reader:
        add(writer, lid, 0, b"e0")
        # Nothing past LAC -1 yet... the LAC of the bookie is -1: times out with no entry.
        t0 = time.monotonic()
        r = read(reader, lid, 0, long_poll=True, previous_lac=-1, timeout_ms=300)
        assert r[2] == EOK and r[8] == -1 and r[7] is None
        assert time.monotonic() - t0 >= 0.25
        # A waiting long poll is answered when an add carries a higher LAC.
        rid = reader.next_rid()
        reader.send(P.read(rid, lid, 0, long_poll=True, previous_lac=-1, timeout_ms=10000))
        time.sleep(0.2)
        add(writer, lid, 1, b"e1", lac=0)
        r = reader.recv()
        assert r[1] == rid and r[2] == EOK and r[8] == 0 and r[4] == 0 and r[7] == b"e0"


def test_bookie_info(shared_cluster):
    with conn(shared_cluster.bookies[0]) as c:
        info = c.call(P.get_bookie_info(c.next_rid()))[3]
    assert info["total_bytes"] > info["free_bytes"] > 0
    assert info["num_shards"] == 2 and info["readonly"] is False


def test_bad_input_closes_only_that_connection(shared_cluster):
    b = shared_cluster.bookies[0]
    lid = 40
    with conn(b, lid) as good:
        add(good, lid, 0, b"keep")
        cases = [
            b"\x00\x00\x00\x05" + b"\xc1" * 5,                     # undecodable msgpack
            struct.pack(">I", 64 << 20) + b"x" * 10,               # announces 64 MiB
            P.encode_frame({"not": "a list"}),                     # wrong type of body
            P.encode_frame([P.ADD, 1, "ledger", 0, -1, KEY, 0, b"", b"x"]),  # wrong field type
            P.encode_frame([99, 1]),                               # unknown op
            P.encode_frame([P.READ, 1, lid]),                      # wrong arity
        ]
        for data in cases:
            with conn(b, lid) as bad:
                bad.send_raw(data)
                assert bad.closed_by_peer(), data[:12]
        # A truncated frame: the client goes away mid-frame.
        with conn(b, lid) as bad:
            bad.send_raw(P.encode_frame(P.ping(1))[:-1])
        # Plain garbage before any HELLO, straight to the arbiter.
        s = socket.create_connection(("127.0.0.1", b.port), timeout=5)
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        s.settimeout(5)
        try:
            assert s.recv(100) == b""
        except ConnectionResetError:
            pass                                # closed with our bytes unread: a reset
        s.close()
        # The old connection and new ones still work, and nothing was lost.
        assert add(good, lid, 1, b"still", lac=0)[2] == EOK
        assert read(good, lid, 0)[7] == b"keep"
    assert b.alive


def test_kill9_then_restart_keeps_acknowledged_adds_and_fences(cluster):
    b = cluster.bookies[0]
    acked = {}
    for lid in (50, 51, 52):
        with conn(b, lid) as c:
            for eid in range(200):
                data = os.urandom(100) + b"%d" % eid
                assert add(c, lid, eid, data, lac=eid - 1)[2] == EOK
                acked[(lid, eid)] = data
    with conn(b, 51) as c:
        assert c.call(P.read_lac(c.next_rid(), 51, fence=True, master_key=KEY))[2] == EOK
    b.kill()                      # SIGKILL to arbiter and shards: no drain, no checkpoint
    b.start()
    for lid in (50, 51, 52):
        with conn(b, lid) as c:
            for eid in range(200):
                r = read(c, lid, eid)
                assert r[2] == EOK and r[7] == acked[(lid, eid)]
            assert add(c, lid, 200, b"more")[2] == (EFENCED if lid == 51 else EOK)
            assert add(c, lid, 200, b"more", key=OTHER)[2] == EUA


def _log(b) -> str:
    with open(b.log_file, errors="replace") as f:
        return f.read()


def test_restart_right_after_kill9_outwaits_the_old_registration(cluster_factory):
    # The new process finds the killed one's registration and waits for its lease to
    # expire: its remaining TTL plus etcd's revocation delay. The killed process ran
    # with a 6 s lease, the new one with 2 s, so that wait is longer than the new
    # process's own lease lives. It keeps its own lease alive meanwhile: it used to
    # fail with "requested lease not found" (or register on a lease about to expire).
    ttl = 2
    c = cluster_factory(1, conf_overrides={"registrationTtlSeconds": 3 * ttl})
    b = c.bookies[0]
    b.kill()
    b.write_conf(registrationTtlSeconds=ttl)
    b.start(wait=False)
    wait_until(lambda: "waiting for the old registration to expire" in _log(b),
               what="the new process waiting for the old registration")
    b.wait_registered()
    # and it stays registered past the TTL of its first lease (kept alive, not lost)
    until = time.monotonic() + ttl + 1
    while time.monotonic() < until:
        info = c.store.bookie_info(b.bookie_id)
        assert info is not None and info["pid"] == b.pid, info
        time.sleep(0.1)


def test_kill9_of_one_shard_worker(cluster):
    b = cluster.bookies[0]
    with conn(b, 0) as c0, conn(b, 1) as c1:
        for eid in range(20):
            add(c0, 0, eid, b"s0-%d" % eid)
            add(c1, 1, eid, b"s1-%d" % eid)
        workers = b.worker_pids()
        assert len(workers) == 2
        # Find shard 0's worker: its connection breaks when it dies.
        info = c0.call(P.get_bookie_info(c0.next_rid()))[3]
        os.kill(info["pid"], signal.SIGKILL)
        with pytest.raises((BookieUnavailableError, OSError)):
            add(c0, 0, 20, b"lost?")
        # The other shard never stopped serving.
        assert add(c1, 1, 20, b"s1-20", lac=19)[2] == EOK
    wait_until(lambda: len(b.worker_pids()) == 2 and info["pid"] not in b.worker_pids(),
               what="shard worker restart")
    with conn(b, 0) as c0:
        for eid in range(20):
            assert read(c0, 0, eid)[7] == b"s0-%d" % eid
        assert add(c0, 0, 20, b"s0-20", lac=19)[2] == EOK
    assert b.alive


def test_registration_and_graceful_stop(cluster):
    store = cluster.store
    ids = sorted(b.bookie_id for b in cluster.bookies)
    assert store.list_bookies() == ids
    b0, b1 = cluster.bookies[0], cluster.bookies[1]
    assert b0.stop() == 0                          # SIGTERM drains and exits 0
    assert b0.bookie_id not in store.list_bookies()   # deregistered at once
    b1.kill()
    # A dead bookie's registration disappears within the TTL (3 s in tests).
    wait_until(lambda: b1.bookie_id not in store.list_bookies(), timeout=10,
               what="registration expiry")
    assert not os.path.exists(os.path.join(b0.dir, "bookie.pid"))


def test_cookie_mismatch_refuses_to_start(cluster):
    b = cluster.bookies[0]
    b.stop()
    b.write_conf(numShards=3)
    with pytest.raises(Exception, match="numShards"):
        b.start(timeout=30)
    assert b.last_exit == 4
    b.write_conf(numShards=2, journalDirectories=os.path.join(b.dir, "other-journal"))
    with pytest.raises(Exception, match="cookie|directory"):
        b.start(timeout=30)
    b.write_conf(journalDirectories=os.path.join(b.dir, "journal"))
    b.start()
    assert b.bookie_id in cluster.store.list_bookies()


def test_worker_boot_failure_stops_the_bookie(cluster):
    b = cluster.bookies[0]
    b.stop()
    seg_dir = os.path.join(b.dir, "journal", "shard-1")
    for name in os.listdir(seg_dir):
        if name.endswith(".seg"):
            with open(os.path.join(seg_dir, name), "r+b") as f:
                f.write(b"this is not a journal segment")
    with pytest.raises(Exception, match="shard 1"):
        b.start(timeout=30)
    assert b.last_exit == 3


def test_gc_gives_space_back_and_keeps_live_ledgers(cluster_factory):
    from bk.meta.ledger import LedgerMetadata

    c = cluster_factory(1, num_shards=1, conf_overrides={
        "gcWaitTime": 300, "journalPreAllocSizeMB": 1, "minorCompactionThreshold": 0.5,
        "minorCompactionInterval": 0, "logSizeLimit": 1 << 20,
        "dbStorage_writeCacheMaxSizeMb": 2, "flushIntervalBytes": 1 << 20,
        "nettyMaxFrameSizeBytes": 512 * 1024})
    b, store = c.bookies[0], c.store
    payload = os.urandom(4000)
    lids = []
    for _ in range(3):
        lid = store.new_ledger_id()
        store.create_ledger(LedgerMetadata(lid, 1, 1, 1, [(0, [b.bookie_id])]))
        lids.append(lid)
    with BookieConnection(b.bookie_id, 0) as conn0:
        for eid in range(600):                  # ~7 MB over ~7 segments, interleaved
            for lid in lids:
                assert add(conn0, lid, eid, payload + b"%d" % eid)[2] == EOK
    ldir = os.path.join(b.dir, "ledgers", "shard-0", "entrylogs")

    def log_bytes():
        total = 0
        for f in os.listdir(ldir):
            try:
                total += os.path.getsize(os.path.join(ldir, f))
            except FileNotFoundError:       # compacted away between listing and stat
                pass
        return total

    before = log_bytes()
    assert before > 4 << 20                     # flushed into several entry logs
    store.delete_ledger(lids[0])
    store.delete_ledger(lids[1])
    wait_until(lambda: log_bytes() < before * 0.6, timeout=30,
               what=f"compaction (entry logs {before} bytes before)")
    assert log_bytes() < before * 0.6, (before, log_bytes(), sorted(os.listdir(ldir)))
    with BookieConnection(b.bookie_id, 0) as conn0:
        for eid in range(600):
            assert read(conn0, lids[2], eid)[7] == payload + b"%d" % eid
        assert read(conn0, lids[0], 0)[2] == ENOLEDGER


def test_read_only_mode(cluster_factory, small_fs):
    c = cluster_factory(0)
    b = c.add_bookie(journalDirectories=str(small_fs / "journal"),
                     ledgerDirectories=str(small_fs / "ledgers"), journalPreAllocSizeMB=4,
                     nettyMaxFrameSizeBytes=2 << 20,
                     diskUsageThreshold=0.6, diskUsageLwmThreshold=0.5, diskCheckInterval=200)
    with conn(b, 0) as w:
        assert add(w, 0, 0, b"before")[2] == EOK
        filler = small_fs / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * (44 << 20))        # push usage over 60%
        wait_until(lambda: b.bookie_id in c.store.list_bookies(readonly=True),
                   what="read-only registration")
        assert b.bookie_id not in c.store.list_bookies()
        wait_until(lambda: add(w, 0, 1, b"x", lac=0)[2] == EREADONLY, what="EREADONLY")
        assert read(w, 0, 0)[7] == b"before"          # reads still served
        os.unlink(filler)
        wait_until(lambda: b.bookie_id in c.store.list_bookies(), what="writable again")
        wait_until(lambda: add(w, 0, 1, b"after", lac=0)[2] == EOK, what="adds accepted")
        assert read(w, 0, 1)[7] == b"after"


def _bookie_cmd(*args, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("BK_")}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "bk.cli.bookie", *args],
                          capture_output=True, text=True, timeout=60, env=e)


def test_config_errors_name_the_key(tmp_path):
    conf = tmp_path / "bad.conf"
    conf.write_text("journalDirectorys=/tmp/x\n")
    r = _bookie_cmd("start", "--conf", str(conf))
    assert r.returncode == 2 and "journalDirectorys" in r.stderr and "Traceback" not in r.stderr
    conf.write_text("bookiePort=lots\nmetadataServiceUri=etcd://127.0.0.1:1/x\n")
    r = _bookie_cmd("start", "--conf", str(conf))
    assert r.returncode == 2 and "bookiePort" in r.stderr
    conf.write_text(f"ledgerDirectories={tmp_path}/l\njournalDirectories={tmp_path}/j\n")
    r = _bookie_cmd("start", "--conf", str(conf))
    assert r.returncode == 2 and "metadataServiceUri" in r.stderr
    r = _bookie_cmd("start", "--conf", str(conf), env={"BK_numShards": "-3"})
    assert r.returncode == 2 and "numShards" in r.stderr


def test_daemon_start_status_stop(cluster_factory, tmp_path):
    c = cluster_factory(0)
    from bk.testing import TEST_DEFAULTS, BookieProcess
    from bk.util import free_port

    b = BookieProcess(c.metadata_uri, str(tmp_path / "d"), free_port(), store=c.store,
                      conf_overrides=TEST_DEFAULTS)
    r = _bookie_cmd("start", "--conf", b.conf_file, "--daemon")
    assert r.returncode == 0, r.stderr
    assert "started" in r.stdout
    try:
        assert _bookie_cmd("status", "--conf", b.conf_file).returncode == 0
        wait_until(lambda: b.bookie_id in c.store.list_bookies(), what="registration")
        with BookieConnection(b.bookie_id, 0) as cc:
            assert add(cc, 0, 0, b"daemon")[2] == EOK
        r = _bookie_cmd("start", "--conf", b.conf_file, "--daemon")
        assert r.returncode != 0 and "already running" in r.stderr
    finally:
        r = _bookie_cmd("stop", "--conf", b.conf_file)
    assert r.returncode == 0 and "stopped" in r.stdout
    assert _bookie_cmd("status", "--conf", b.conf_file).returncode == 3
    assert b.bookie_id not in c.store.list_bookies()


def test_sigterm_drains_in_flight_adds(cluster):
    b = cluster.bookies[0]
    lid = 60
    c = conn(b, lid)
    n = 3000
    c.send_raw(b"".join(P.encode_frame(P.add(eid + 1, lid, eid, eid - 1, KEY, b"", b"v%d" % eid))
                        for eid in range(n)))
    os.kill(b.pid, signal.SIGTERM)               # while those adds are in flight
    answered = {}
    try:
        while len(answered) < n:
            r = c.recv()
            answered[r[4]] = r[2]
    except (BookieUnavailableError, OSError):
        pass
    c.close()
    assert b.proc.wait(30) == 0
    assert answered, "the bookie answered nothing before stopping"
    assert set(answered.values()) == {EOK}       # drained: answered adds are acknowledged ones
    b.start()
    with conn(b, lid) as c:
        for eid in answered:
            assert read(c, lid, eid)[7] == b"v%d" % eid


def test_group_commit_one_sync_for_a_burst(cluster_factory):
    # A long group wait makes the whole burst land in one group: 500 adds, a few syncs.
    c = cluster_factory(1, num_shards=1, conf_overrides={"journalMaxGroupWaitMSec": 300,
                                                         "journalBufferedWritesThreshold": 1 << 30})
    b = c.bookies[0]
    with BookieConnection(b.bookie_id, 0) as cc:
        before = cc.call(P.get_bookie_info(cc.next_rid()))[3]
        cc.send_raw(b"".join(P.encode_frame(P.add(eid + 1, 7, eid, eid - 1, KEY, b"", b"x" * 100))
                             for eid in range(500)))
        statuses = [cc.recv()[2] for _ in range(500)]
        after = cc.call(P.get_bookie_info(cc.next_rid()))[3]
    assert statuses == [EOK] * 500
    assert after["synced_records"] - before["synced_records"] >= 500
    assert after["syncs"] - before["syncs"] in range(1, 6)    # shared, not one per add


def test_wiped_directories_stop_the_bookie(cluster):
    # Directories removed under a running bookie must stop it (exit 4), never be
    # recreated empty while it stays registered.
    import shutil
    b = cluster.bookies[0]
    shutil.rmtree(os.path.join(b.dir, "ledgers"))
    assert b.proc.wait(30) == 4
    wait_until(lambda: b.bookie_id not in cluster.store.list_bookies(), what="deregistration")
    assert "cookie" in open(b.log_file).read()


def test_localcluster_stops_everything_even_on_repeated_ctrl_c(tmp_path):
    """An impatient second Ctrl-C used to abort the stop half way, leaving bookies
    (own sessions) running without their etcd."""
    with bookie_localcluster(str(tmp_path / "lc")) as (p, out):
        pids = [int(line.split("(pid ")[1].split(",")[0]) for line in out if "running (pid" in line]
        assert len(pids) == 2, "".join(out)
        for _ in range(3):
            p.send_signal(signal.SIGINT)
            time.sleep(0.2)
        assert p.wait(60) == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
