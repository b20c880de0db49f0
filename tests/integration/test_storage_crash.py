"""kill -9 at the moments that matter to the storage: during a flush of the
write cache into entry logs, during a compaction of entry logs, during the
upgrade of a v1 shard. Every acknowledged entry reads back after the restart.
And a real bookie started on v1 data converts it and serves it. Real etcd and
bookie processes (the upgrade: a real `bookie upgrade` process)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import bk
from bk import protocol as P
from bk.bench.scale import evict_files
from bk.bookie import journal as J
from bk.bookie.entrylog import JOURNAL_LOG, is_journal_log
from bk.errors import EFENCED, ENOLEDGER, EOK
from bk.meta.ledger import LedgerMetadata
from bk.testing import BookieConnection, hook_env, hooked_stop, resident_pages, site_hook, \
    wait_until

from test_checkpoints import KEY, pump, shard_info

PAYLOAD = bytes(range(256)) * 4          # 1 KiB
SMALL_CACHE = {"dbStorage_writeCacheMaxSizeMb": 2, "flushIntervalBytes": 1 << 20,
               "flushInterval": 3_600_000}


def read_back(b, lid, acked, payload=PAYLOAD):
    """Every acknowledged entry, read with READ_RANGE, is there and intact."""
    want = sorted(acked)
    got = []
    with BookieConnection(b.bookie_id, shard=P.shard_of(lid, b.num_shards)) as c:
        first = want[0]
        while first <= want[-1]:
            r = c.call(P.read_range(c.next_rid(), lid, first, want[-1], 4 << 20))
            assert r[2] == EOK, r[:3]
            entries = r[5]
            assert all(p == payload for p in entries[3::4])
            got += entries[0::4]
            first = r[4]
    assert set(want) <= set(got), sorted(set(want) - set(got))[:10]


def test_kill9_during_flushes_loses_no_acknowledged_entry(cluster_factory):
    c = cluster_factory(1, num_shards=1, conf_overrides=SMALL_CACHE)
    b = c.bookies[0]
    lid = (1 << 50) + 11
    acked: list[int] = []
    for round_ in range(3):
        stop = threading.Event()
        first = len(acked)
        t = threading.Thread(target=pump, args=(b, lid, first, 1_000_000),
                             kwargs={"stop": stop, "acked": acked})
        t.start()
        try:
            before = shard_info(b, 0)["checkpoints"]
            caught = False
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not caught:
                info = shard_info(b, 0)
                # a flush in flight, not the first one of this run, and enough
                # acknowledged for the kill to put them at risk (a starved
                # client may lag behind what the bookie stored)
                caught = (info["flushing"] and info["checkpoints"] > before
                          and len(acked) > first + 1000)
            assert caught, "no flush in flight was seen"
            stop.set()                      # the load may now end with a broken connection
            b.kill()                        # kill -9 while the flusher writes
        finally:
            stop.set()
            t.join(30)
        assert len(acked) > first + 1000
        b.start()
        read_back(b, lid, acked)


def test_bookies_given_the_same_writes_flush_apart_and_kill9_mid_flush(cluster_factory):
    """Three bookies receive the same adds (as an ensemble's do): each swaps its
    write cache at its own random point of the last quarter below half of it,
    drawn at every swap, so their flushes differ in size although their journals
    hold the same bytes (one fixed threshold made all three flush at the same
    moments). Then kill -9 one of them while such a flush is in flight: every
    acknowledged entry reads back."""
    c = cluster_factory(3, num_shards=1, conf_overrides={
        "dbStorage_writeCacheMaxSizeMb": 8, "flushInterval": 3_600_000})
    lid = (1 << 50) + 21
    n = 10_000                                # ~10.5 MB each: two flushes or more
    acked = [[] for _ in c.bookies]
    # A small window: a swap comes at most a few records past its point (the
    # loop looks once per pass), far less than the quarter (1 MiB) it is drawn in.
    threads = [threading.Thread(target=pump, args=(b, lid, 0, n),
                                kwargs={"acked": a, "window": 8})
               for b, a in zip(c.bookies, acked)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(a == list(range(n)) for a in acked)
    for b in c.bookies:
        wait_until(lambda b=b: not shard_info(b, 0)["flushing"], timeout=30, what="flush done")
    infos = [shard_info(b, 0) for b in c.bookies]
    assert all(i["checkpoints"] >= 2 for i in infos), infos
    sizes = [i["last_flush_bytes"] for i in infos]
    # drawn apart: three draws within 16 KiB of each other are a ~0.1% chance
    assert max(sizes) - min(sizes) > 16 << 10, sizes
    assert all((3 << 20) - (16 << 10) <= x <= (4 << 20) + (16 << 10) for x in sizes), sizes
    b = c.bookies[0]
    more = acked[0]
    stop = threading.Event()
    t = threading.Thread(target=pump, args=(b, lid, n, 1_000_000),
                         kwargs={"stop": stop, "acked": more})
    t.start()
    try:
        before = shard_info(b, 0)["checkpoints"]
        wait_until(lambda: (lambda i: i["flushing"] and i["checkpoints"] > before)(
            shard_info(b, 0)), timeout=60, step=0.002, what="a flush in flight")
        stop.set()
        b.kill()                              # kill -9 while the flusher works
    finally:
        stop.set()
        t.join(30)
    assert len(more) > n
    b.start()
    read_back(b, lid, more)


def test_kill9_during_compaction_loses_nothing(cluster_factory):
    c = cluster_factory(1, num_shards=1, conf_overrides={
        "gcWaitTime": 200, "minorCompactionInterval": 0, "minorCompactionThreshold": 0.9,
        "logSizeLimit": 2 << 20, "dbStorage_writeCacheMaxSizeMb": 2,
        "flushIntervalBytes": 1 << 20})
    b, store = c.bookies[0], c.store
    lids = []
    for _ in range(3):
        lid = store.new_ledger_id()
        store.create_ledger(LedgerMetadata(lid, 1, 1, 1, [(0, [b.bookie_id])]))
        lids.append(lid)
    n = 3000                                   # ~9 MB interleaved: several entry logs
    with BookieConnection(b.bookie_id, 0) as conn:
        for eid in range(n):
            for lid in lids:
                conn.send(P.add(conn.next_rid(), lid, eid, eid - 1, b"k" * 20, b"", PAYLOAD))
            if eid % 50 == 49:
                for _ in range(150):
                    assert conn.recv()[2] == EOK
        for _ in range(n % 50 * 3):
            assert conn.recv()[2] == EOK
    wait_until(lambda: shard_info(b, 0)["entry_logs"] >= 3, timeout=30, what="entry logs")
    store.delete_ledger(lids[0])
    store.delete_ledger(lids[1])
    wait_until(lambda: shard_info(b, 0)["compacting"], timeout=60, step=0.005,
               what="a compaction in flight")
    b.kill()                                   # kill -9 while live runs are copied
    b.start()
    read_back(b, lids[2], range(n))
    # and the space does come back, on a later round
    wait_until(lambda: shard_info(b, 0)["entry_log_bytes"] < n * 1100 * 1.6, timeout=60,
               what="compaction after the restart")
    read_back(b, lids[2], range(n))
    with BookieConnection(b.bookie_id, 0) as conn:
        assert conn.call(P.read(conn.next_rid(), lids[0], 0))[2] == ENOLEDGER


# Stops the shard worker (SIGSTOP, every thread) once a compaction has committed the
# removal of journal segments serving as entry logs to the index, before their
# files are removed (the loop hands that to the flusher after the job): the first
# such compaction after the test armed it (the ``arm`` file exists) that finds the
# ``doomed`` ledger's runs gone from the index, i.e. the one after its deletion.
COMPACTED_HOOK = r'''
import os
from bk.bookie import flusher as F
from bk.bookie.entrylog import JOURNAL_LOG, is_journal_log
from bk.testing import hook_setting, stop_here

_compact = F.Flusher.compact


def compact(self, job):
    _compact(self, job)
    if any(is_journal_log(log_id) for log_id in job.removable) and \
            os.path.exists(hook_setting("arm")) and \
            not self.index.runs_of(int(hook_setting("doomed"))):
        stop_here({"removable": job.removable})


F.Flusher.compact = compact
'''


def test_kill9_with_journal_segments_as_entry_logs(cluster_factory, tmp_path):
    """Flushes of a shard written one ledger at a time leave the records in their
    journal segments, which then serve as entry logs: kill -9 while such a flush
    is in flight, and once the compaction that follows a ledger's deletion has
    dropped its segments from the index, before their files are removed; every
    acknowledged entry reads back, the deleted ledger stays deleted, and the
    space does come back."""
    c = cluster_factory(1, num_shards=1, conf_overrides=dict(
        SMALL_CACHE, journalPreAllocSizeMB=2, nettyMaxFrameSizeBytes=1 << 20, gcWaitTime=200, minorCompactionInterval=0,
        minorCompactionThreshold=0.5))
    b, store = c.bookies[0], c.store
    keep, doomed = [], []
    for lids in (keep, doomed):
        lid = store.new_ledger_id()
        store.create_ledger(LedgerMetadata(lid, 1, 1, 1, [(0, [b.bookie_id])]))
        lids.append(lid)
    keep, doomed = keep[0], doomed[0]
    acked: list[int] = []
    stop = threading.Event()
    t = threading.Thread(target=pump, args=(b, keep, 0, 1_000_000),
                         kwargs={"stop": stop, "acked": acked})
    t.start()
    try:
        def in_flight():
            info = shard_info(b, 0)
            return info["flushing"] and info["journal_segments_as_logs"] >= 2
        wait_until(in_flight, timeout=60, step=0.002,
                   what="a flush in flight after segments became logs")
        stop.set()
        b.kill()                                # kill -9 while the flusher commits
    finally:
        stop.set()
        t.join(30)
    assert len(acked) > 2000
    out, arm = tmp_path / "compacted.json", tmp_path / "armed"
    with site_hook(tmp_path, COMPACTED_HOOK, hook_env(out, arm=arm, doomed=doomed)):
        b.start()                               # (a restart after this one runs without it)
    read_back(b, keep, acked)
    info = shard_info(b, 0)
    assert info["journal_segments_as_logs"] >= 2     # the kept segments serve the reads
    assert info["entry_log_bytes"] < len(acked) * 1100 / 2
    # a ledger of its own segments, then the first one's again: the mark moves past it
    pump(b, doomed, 0, 6000)                    # ~6.4 MB: at least two whole segments
    pump(b, keep, len(acked), 3000, acked=acked)
    wait_until(lambda: not shard_info(b, 0)["flushing"], timeout=30, what="flush done")
    arm.touch()
    store.delete_ledger(doomed)
    # GC deletes the ledger (durably: its tombstone, then the index), then compacts
    # its segments away; the worker stops once the index no longer names them
    stopped = hooked_stop(out, what="the compaction of the deleted ledger's segments")
    jdir = os.path.join(b.dir, "journal", "shard-0")
    compacted = [os.path.join(jdir, J.segment_name(i & ~JOURNAL_LOG))
                 for i in stopped["removable"] if is_journal_log(i)]
    assert len(compacted) >= 2, stopped         # ~6.4 MB of 2 MB segments
    b.kill()                                    # kill -9 before their files are removed
    assert all(map(os.path.exists, compacted))
    b.start()
    read_back(b, keep, acked)
    with BookieConnection(b.bookie_id, 0) as conn:   # the deletion was durable: at once
        assert conn.call(P.read(conn.next_rid(), doomed, 0))[2] == ENOLEDGER
        assert conn.call(P.add(conn.next_rid(), doomed, 6000, 5999, KEY, b"",
                               PAYLOAD))[2] == EFENCED       # and its tombstone holds
    # and the files the index no longer names are removed
    wait_until(lambda: not any(map(os.path.exists, compacted)), timeout=60,
               what="the deleted ledger's segments removed")
    read_back(b, keep, acked)


# Stops the shard worker (SIGSTOP, every thread) once the tombstone of the ``doomed``
# ledger is on disk (Tombstones.add fsync'd it), before the deletion's DELETE record
# and its index update: the ledger's state and runs are all still there.
TOMBSTONED_HOOK = r'''
from bk.bookie import storage as S
from bk.testing import hook_setting, stop_here

_add = S.Tombstones.add


def add(self, ledgers):
    ledgers = list(ledgers)
    _add(self, ledgers)
    if int(hook_setting("doomed")) in ledgers:
        stop_here({"tombstones": len(self)})


S.Tombstones.add = add
'''


def test_kill9_once_a_deleted_ledgers_tombstone_is_durable(cluster_factory, tmp_path):
    """kill -9 at the first moment a deletion holds: the ledger's tombstone fsync'd,
    its state, entries (in the index, and maybe in the journal's tail) all still
    there. The restarted shard drops them as it opens, before it answers anything:
    the ledger is ENOLEDGER from the first answer (a read, a READ_RANGE, a fencing
    READ_LAC), an ADD to it is EFENCED, also with the recovery flag, and the other
    ledger reads back whole."""
    out = tmp_path / "tombstoned.json"
    c = cluster_factory(1, num_shards=1, conf_overrides=dict(SMALL_CACHE, gcWaitTime=200))
    b, store = c.bookies[0], c.store
    keep, doomed = [], []
    for lids in (keep, doomed):
        lid = store.new_ledger_id()
        store.create_ledger(LedgerMetadata(lid, 1, 1, 1, [(0, [b.bookie_id])]))
        lids.append(lid)
    keep, doomed = keep[0], doomed[0]
    b.stop()
    with site_hook(tmp_path, TOMBSTONED_HOOK, hook_env(out, doomed=doomed)):
        b.start()                               # (a restart after this one runs without it)
    acked = pump(b, keep, 0, 500)
    pump(b, doomed, 0, 3000)                    # ~3 MB: flushed (the index), maybe a tail
    pump(b, keep, 500, 500, acked=acked)
    store.delete_ledger(doomed)
    stopped = hooked_stop(out, what="the deleted ledger's tombstone made durable")
    assert stopped["tombstones"] == 1
    b.kill()                                    # kill -9 before its DELETE record
    b.start()
    key = KEY
    with BookieConnection(b.bookie_id, 0) as conn:   # the first answers after the restart
        assert conn.call(P.read(conn.next_rid(), doomed, 0))[2] == ENOLEDGER
        assert conn.call(P.read(conn.next_rid(), doomed, 2999))[2] == ENOLEDGER
        assert conn.call(P.read_range(conn.next_rid(), doomed, 0, 2999, 1 << 20))[2] == \
            ENOLEDGER
        assert conn.call(P.read_lac(conn.next_rid(), doomed, fence=True,
                                    master_key=key))[2] == ENOLEDGER
        assert conn.call(P.add(conn.next_rid(), doomed, 3000, 2999, key, b"",
                               PAYLOAD))[2] == EFENCED
        assert conn.call(P.add(conn.next_rid(), doomed, 3000, 2999, key, b"", PAYLOAD,
                               recovery=True))[2] == EFENCED
    # it was the open that dropped them (the kill came before anything else did)
    with open(b.log_file) as f:
        assert f"dropped 1 ledgers that have tombstones (e.g. {doomed})" in f.read()
    read_back(b, keep, acked)
    assert shard_info(b, 0)["ledgers"] == 1


def _entry(lid: int, e: int) -> bytes:
    return (b"%d/%d;" % (lid, e) * 100)[:1000 + e % 50]


def test_catch_up_through_the_client_from_bookies_holding_more_than_their_caches(
        cluster_factory):
    """Ledgers written interleaved into bookies holding far more than their write
    and read-ahead caches, read back whole through the client (READ_RANGEs,
    the bookies' prefetch, the client's bulk decode) with the bookies' files out
    of the page cache, while another writer keeps the bookies flushing: every
    entry comes back once, in order, intact. E=2: each bookie is asked every
    other entry (Qw=2, the stride over runs of every entry) or holds every other
    one (Qw=1, runs of every other entry)."""
    c = cluster_factory(2, num_shards=1, conf_overrides=dict(
        SMALL_CACHE, dbStorage_readAheadCacheMaxSizeMb=1, logSizeLimit=4 << 20))
    n = 1500
    with bk.BookKeeper(c.metadata_uri) as client:
        hs = [client.create_ledger(2, qw, qw, password=b"p") for qw in (2, 2, 1, 1, 1)]
        for first in range(0, n, 50):
            futs = [h.add_entry_async(_entry(h.ledger_id, e)) for h in hs
                    for e in range(first, first + 50)]
            for f in futs:
                f.result()
        for h in hs:
            h.close()
        for b in c.bookies:
            evict_files(b.dir)
        stop = threading.Event()
        written = []

        def writer():
            w = client.create_ledger(2, 2, 2, password=b"p")
            while not stop.is_set():
                w.add_entries([PAYLOAD] * 100)
                written.append(100)
            w.close()
        t = threading.Thread(target=writer)
        before = [shard_info(b, 0)["checkpoints"] for b in c.bookies]
        t.start()
        try:
            for h in hs:
                r = client.open_ledger(h.ledger_id, password=b"p")
                got = []
                for e in range(0, n, 400):
                    got += r.read_entries(e, min(n - 1, e + 399))
                assert [x.entry_id for x in got] == list(range(n))
                bad = [x.entry_id for x in got if x.data != _entry(h.ledger_id, x.entry_id)]
                assert not bad, bad[:10]
                r.close()
            # the reads ran while flushes did
            wait_until(lambda: all(shard_info(b, 0)["checkpoints"] > k
                                   for b, k in zip(c.bookies, before)),
                       timeout=60, what="flushes during the reads")
        finally:
            stop.set()
            t.join(60)
        assert sum(written) > 0


def _write_v1_shard(jdir: str, ledgers: int, entries: int) -> None:
    """A v1 shard as a crash before its first checkpoint leaves it: entries in the
    journal, no checkpoint file."""
    j = J.Journal(jdir, 16 << 20)
    for _ in j.replay(None):
        pass
    for lid in range(1, ledgers + 1):
        j.append(J.MASTER_KEY, lid, b"k" * 20)
    for e in range(entries):
        for lid in range(1, ledgers + 1):
            j.append_add(lid, e, e - 1, b"d", b"%d/%d." % (lid, e) * 20)
    j.close()


def test_kill9_during_upgrade_then_upgrade_again(tmp_path):
    jroot, lroot = tmp_path / "journal", tmp_path / "ledgers"
    os.makedirs(lroot / "shard-0")
    ledgers, entries = 20, 8000                 # 160k entries: a few seconds to convert
    _write_v1_shard(str(jroot / "shard-0"), ledgers, entries)
    cmd = [sys.executable, "-m", "bk.cli.bookie", "upgrade", "--journal-dir", str(jroot),
           "--ledger-dir", str(lroot), "--set", "journalPreAllocSizeMB=16",
           "--set", "logSizeLimit=1048576"]
    logs = lroot / "shard-0" / "entrylogs"
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # kill -9 once the conversion has written entry logs but not finished
        wait_until(lambda: logs.is_dir() and len(os.listdir(logs)) >= 2 or p.poll() is not None,
                   timeout=120, step=0.005, what="entry logs of the upgrade")
        assert p.poll() is None, "the upgrade finished before it could be killed"
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait(30)
    assert not (lroot / "shard-0" / "index").exists()   # still v1
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "shard 0: upgraded 20 ledgers, 160000 entries" in out.stdout
    from bk.bookie.storage import ShardStorage
    s = ShardStorage(str(jroot / "shard-0"), str(lroot / "shard-0"), segment_size=16 << 20,
                     ledger_dirs=[str(lroot / "shard-0")])
    try:
        for lid in range(1, ledgers + 1):
            status, nxt, got = s.read_range(lid, 0, entries, 64 << 20, max_count=entries)
            assert status == EOK and got[0::4] == list(range(entries))
            assert got[3::4] == [b"%d/%d." % (lid, e) * 20 for e in range(entries)]
    finally:
        s.close()


def test_a_bookie_started_on_v1_data_converts_it_and_serves_it(cluster_factory):
    """The v1 fixture (made by the previous release's code) as a real bookie's
    shard: the bookie converts it at start and serves every entry over the wire."""
    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "storage-v1")
    with open(os.path.join(fixture, "expected.json")) as f:
        exp = json.load(f)
    c = cluster_factory(1, num_shards=1, conf_overrides={"gcWaitTime": 3_600_000})
    b = c.bookies[0]
    b.stop()
    for sub, name in (("journal", "journal"), ("ledgers", "index")):
        shard = os.path.join(b.dir, sub, "shard-0")
        shutil.rmtree(shard)
        shutil.copytree(os.path.join(fixture, name), shard)
    b.start()
    with open(b.log_file) as f:
        assert "upgraded shard" in f.read()
    with BookieConnection(b.bookie_id, 0) as conn:
        for lid_s, want in exp["ledgers"].items():
            lid = int(lid_s)
            r = conn.call(P.read_lac(conn.next_rid(), lid))
            assert r[2] == EOK and (r[4], r[5]) == (want["lac"], want["last"])
            for e, elac in want["entries"].items():
                r = conn.call(P.read(conn.next_rid(), lid, int(e)))
                assert r[2] == EOK and r[5] == elac, (lid, e, r[2])
                assert r[7] == (b"%d:%d|" % (lid, int(e))) * (1 + (lid * 31 + int(e) * 7) % 40)
        assert conn.call(P.read(conn.next_rid(), exp["deleted"][0], 0))[2] == ENOLEDGER


def test_kill9_once_the_flushed_journal_left_the_page_cache(cluster_factory):
    """journalRemovePagesFromCache: a flush drops from the page cache the journal
    the flush before it took. kill -9 (adds going on) once the first segment,
    which serves as an entry log, has no page left in the page cache: after the
    restart every acknowledged entry reads back, from the disk."""
    # The page cache of a journal written through it (buffered): with direct writes
    # (the default) the journal's own writes never enter the page cache.
    c = cluster_factory(1, num_shards=1, conf_overrides=dict(SMALL_CACHE,
                                                             journalPreAllocSizeMB=2,
                                                             nettyMaxFrameSizeBytes=1 << 20,
                                                             journalDirectWrites=False))
    b = c.bookies[0]
    lid = (1 << 50) + 13
    first = os.path.join(b.dir, "journal", "shard-0", J.segment_name(1))
    acked: list[int] = []
    stop = threading.Event()
    t = threading.Thread(target=pump, args=(b, lid, 0, 1_000_000),
                         kwargs={"stop": stop, "acked": acked})
    t.start()
    try:
        wait_until(lambda: len(acked) > 4000 and resident_pages(first) == 0, timeout=60,
                   step=0.01, what="the first journal segment out of the page cache")
        stop.set()
        b.kill()
    finally:
        stop.set()
        t.join(30)
    assert os.path.exists(first)                # kept: the index reads it as an entry log
    b.start()
    read_back(b, lid, acked)
    assert shard_info(b, 0)["journal_segments_as_logs"] >= 1


def test_journal_pages_stay_cached_with_remove_pages_from_cache_false(cluster_factory):
    """journalRemovePagesFromCache=false reaches the shard's storage: after several
    flushes (the first segment full and flushed past) its pages are still cached,
    where the default drops them (the test above)."""
    c = cluster_factory(1, num_shards=1, conf_overrides=dict(
        SMALL_CACHE, journalPreAllocSizeMB=2, nettyMaxFrameSizeBytes=1 << 20,
        journalRemovePagesFromCache=False, journalDirectWrites=False))   # (as above)
    b = c.bookies[0]
    lid = (1 << 50) + 17
    first = os.path.join(b.dir, "journal", "shard-0", J.segment_name(1))
    third = os.path.join(b.dir, "journal", "shard-0", J.segment_name(3))
    before = shard_info(b, 0)["checkpoints"]
    acked: list[int] = []
    stop = threading.Event()
    t = threading.Thread(target=pump, args=(b, lid, 0, 1_000_000),
                         kwargs={"stop": stop, "acked": acked})
    t.start()
    try:
        # two segments past the first and three checkpoints: with the default the
        # first segment would have left the page cache by now
        wait_until(lambda: os.path.exists(third)
                   and shard_info(b, 0)["checkpoints"] >= before + 3, timeout=60, step=0.05,
                   what="a third journal segment and three checkpoints")
    finally:
        stop.set()
        t.join(30)
    assert resident_pages(first) > 0
    read_back(b, lid, acked)
