"""Logs built from ledgers (bk.log) against real etcd and real bookie processes:
ownership and fencing, crashes of writers and bookies, tailing, truncation."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import bk
from bk.errors import (LedgerFencedError, LogFencedError, LogTruncatedError, NoSuchLogError)
from bk.log.records import Position
from bk.testing import wait_until

pytestmark = pytest.mark.timeout(120)


def _read_all(client, name, start="earliest"):
    """Every record of the log up to its last position now (the log has no writer)."""
    last = client.log_info(name).last_position
    out = []
    if last is None:
        return out
    with client.open_log_reader(name, start=start) as r:
        while not out or out[-1].position < last:
            batch = r.read_batch(1000, timeout=10)
            assert batch, f"no record after {out[-1].position if out else None}, last {last}"
            out.extend(batch)
    return out


def _check_exactly_once(records, acked):
    """records: what a reader read; acked: {position: data} of every append that returned."""
    positions = [r.position for r in records]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    datas = [r.data for r in records]
    assert len(set(datas)) == len(datas), "a record appears twice"
    got = {r.position: r.data for r in records}
    for pos, data in acked.items():
        assert got.get(pos) == data, f"acknowledged record {data!r} at {pos} not read there"


def test_duelling_writers_keep_every_acknowledged_record_once_in_order(shared_cluster):
    """Two clients take the log from each other over and over while appending."""
    name = "duel"
    acked = {}
    lock = threading.Lock()
    errors = []

    def duel(tag):
        try:
            with shared_cluster.client(timeout=2) as c:
                last = Position(0, 0, 0)
                for rnd in range(4):
                    w = c.open_log_writer(name, logRollEntries=4)
                    try:
                        for i in range(15):
                            data = f"{tag}-{rnd}-{i}".encode()
                            try:
                                pos = w.append(data) if i % 2 else \
                                    w.append_many([data + b"-m", data])
                            except LogFencedError:
                                break
                            # One writer's positions never go backwards.
                            assert pos > last, (pos, last)
                            last = pos
                            with lock:
                                acked[pos] = data
                    finally:
                        w.close()
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=duel, args=(t,)) for t in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not errors, errors
    with shared_cluster.client(timeout=2) as c:
        records = _read_all(c, name)
        _check_exactly_once(records, acked)
        assert c.log_info(name).epoch == 8
        assert len(records) >= len(acked) > 20


_KILLED_WRITER = textwrap.dedent("""
    import sys, collections, bk
    c = bk.BookKeeper(sys.argv[1], addEntryTimeoutSec=2)
    w = c.open_log_writer("crash", logRollEntries=20, logBatchLingerMs=1)
    pending = collections.deque()
    i = 0
    while True:
        data = b"rec-%d" % i
        pending.append((w.append_async(data), data))
        i += 1
        while pending and (pending[0][0].done() or len(pending) > 50):
            fut, d = pending.popleft()
            print(fut.result(), d.decode(), flush=True)
""")


def test_writer_killed_mid_stream_loses_no_acknowledged_record(shared_cluster):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(bk.__file__)), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER,
                             shared_cluster.metadata_uri],
                            stdout=subprocess.PIPE, env=env, text=True)
    printed = {}
    try:
        deadline = time.monotonic() + 60
        while len(printed) < 400:
            assert time.monotonic() < deadline and proc.poll() is None, "writer did not run"
            line = proc.stdout.readline()
            pos, data = line.split()
            printed[Position.parse(pos)] = data.encode()
    finally:
        proc.kill()
        proc.wait()
    with shared_cluster.client(timeout=2) as c:
        with c.open_log_writer("crash") as w:      # takes over: fences, closes the segments
            after = w.append(b"after")
        assert after > max(printed)
        printed[after] = b"after"
        records = _read_all(c, "crash")
        _check_exactly_once(records, printed)
        # Nothing but the killed writer's own records (in its order) and ours.
        seq = [int(r.data.split(b"-")[1]) for r in records[:-1]]
        assert seq == list(range(len(seq)))


def test_bookie_killed_during_appends_writer_goes_on(cluster_factory):
    cluster = cluster_factory(4)
    with cluster.client(timeout=2) as c:
        w = c.open_log_writer("bookiedies", ensemble_size=3, write_quorum_size=3,
                              ack_quorum_size=2)
        acked = {}
        for i in range(50):
            acked[w.append(b"a-%d" % i)] = b"a-%d" % i
        victim = c.ledger_metadata(c.log_info("bookiedies").segments[-1]["ledger_id"]) \
            .last_ensemble[0]
        cluster.bookie(victim).kill()
        for i in range(50):
            acked[w.append(b"b-%d" % i)] = b"b-%d" % i
        w.append_many([b"c-%d" % i for i in range(500)])
        w.close()
        records = _read_all(c, "bookiedies")
        _check_exactly_once(records, acked)
        assert [r.data for r in records[100:]] == [b"c-%d" % i for i in range(500)]
        assert victim not in c.ledger_metadata(
            c.log_info("bookiedies").segments[-1]["ledger_id"]).last_ensemble


def test_tailing_reader_sees_each_record_as_acknowledged_across_rolls_and_writers(shared_cluster):
    name = "tail"
    with shared_cluster.client(timeout=2) as c:
        assert c.create_log(name) is True
        assert c.create_log(name) is False
        got = []
        stop = threading.Event()
        errors = []

        def tail():
            try:
                with c.open_log_reader(name, start="earliest") as r:
                    while not stop.is_set():
                        rec = r.read_next(timeout=0.2)
                        if rec is not None:
                            got.append(rec)
            except Exception as e:
                errors.append(e)

        t = threading.Thread(target=tail)
        t.start()
        try:
            acked = []
            w = c.open_log_writer(name, logRollEntries=3, logBatchLingerMs=5)
            for i in range(12):        # 12 entries of one record: rolls after 3, 6, 9
                acked.append((w.append(b"w1-%d" % i), b"w1-%d" % i))
                # The last record is seen without a later append (explicit LAC).
                wait_until(lambda: len(got) == len(acked), timeout=20, step=0.01,
                           what=f"record {i} at the reader")
            w2 = c.open_log_writer(name, logRollEntries=3)   # takes over from w
            for i in range(5):
                acked.append((w2.append(b"w2-%d" % i), b"w2-%d" % i))
                wait_until(lambda: len(got) == len(acked), timeout=20, step=0.01,
                           what=f"w2 record {i} at the reader")
            fut = w2.append_async(b"async")                # lingers, then is sent
            acked.append((fut.result(10), b"async"))
            wait_until(lambda: len(got) == len(acked), timeout=20, step=0.01,
                       what="the async record at the reader")
            w2.close()
            w.close()
        finally:
            stop.set()
            t.join(10)
        assert not errors, errors
        assert [(r.position, r.data) for r in got] == acked
        info = c.log_info(name)
        assert len({p.segment for p, _ in acked}) >= 5 and info.records == len(acked)
        assert info.last_position == acked[-1][0]


def test_truncation_while_a_reader_is_behind(shared_cluster):
    name = "trunc"
    with shared_cluster.client(timeout=2) as c:
        w = c.open_log_writer(name, logRollEntries=2)
        acked = [w.append(b"r-%d" % i) for i in range(12)]    # 6 segments of 2 entries
        behind = c.open_log_reader(name)
        first = behind.read_next(timeout=5)
        assert first.position == acked[0] and first.data == b"r-0"
        point = acked[7]                                     # inside segment 3
        deleted = c.truncate_log(name, before=point)
        assert len(deleted) == 3                              # segments 0, 1, 2
        seen = []
        with pytest.raises(LogTruncatedError):
            while True:
                rec = behind.read_next(timeout=5)
                assert rec is not None
                seen.append(rec.position)
        assert all(p < point for p in seen)                  # never past the gap
        with pytest.raises(LogTruncatedError):
            c.open_log_reader(name, start=acked[2])
        records = _read_all(c, name)
        assert [r.position for r in records] == acked[7:]
        assert c.log_info(name).first_position == point
        # A point past the end of the open segment would hide later records. The
        # writer rolls in the background once a segment is full: wait until it has
        # (the next segment is in the metadata and the writer writes to it).
        wait_until(lambda: not (w._rolling or w._roll_wanted)
                   and c.log_info(name).segments[-1]["segment"] == w._segment,
                   timeout=10, what="the writer's roll to finish")
        with pytest.raises(ValueError, match="ends at entry"):
            c.truncate_log(name, before=Position(w._segment, 1000, 0))
        with pytest.raises(ValueError, match="past the log's end"):
            c.truncate_log(name, before=Position(w._segment + 1, 5, 0))
        # The open segment is never deleted, whatever the point.
        w.append(b"more")
        c.truncate_log(name, before=Position(w._segment, 0, 0))
        assert c.log_info(name).segments[-1]["state"] == "open"
        assert c.open_log_reader(name).read_next(timeout=5).data == b"more"
        w.close()
        assert c.delete_log(name)
        assert name not in c.list_logs()
        for lid in deleted:
            with pytest.raises(bk.errors.NoSuchLedgerError):
                c.ledger_metadata(lid)


def test_deposed_writer_gets_log_fenced_error(shared_cluster):
    name = "deposed"
    with shared_cluster.client(timeout=2) as c:
        w1 = c.open_log_writer(name)
        p1 = w1.append(b"one")
        w2 = c.open_log_writer(name)
        with pytest.raises(LogFencedError) as ei:
            w1.append(b"lost")
        assert isinstance(ei.value, LedgerFencedError)
        with pytest.raises(LogFencedError):
            w1.append_async(b"lost too").result(10)
        p2 = w2.append(b"two")
        assert p2 > p1
        # Deposed before its roll: the roll's CAS loses against the new epoch.
        w3 = c.open_log_writer(name)
        segs = len(c.log_info(name).segments)
        with pytest.raises(LogFencedError):
            w2.roll()
        assert len(c.log_info(name).segments) == segs
        p3 = w3.append(b"three")
        w1.close()
        w2.close()
        w3.close()
        assert [(r.position, r.data) for r in _read_all(c, name)] == \
            [(p1, b"one"), (p2, b"two"), (p3, b"three")]
        info = c.log_info(name)
        assert info.records == 3 and info.epoch == 3
        # Errors of the API: unknown log, bad name, oversized record.
        with pytest.raises(NoSuchLogError):
            c.open_log_reader("nope")
        with pytest.raises(NoSuchLogError):
            c.log_info("nope")
        with pytest.raises(NoSuchLogError):
            c.truncate_log("nope", before=Position(0, 0, 0))
        with pytest.raises(ValueError, match="log name"):
            c.open_log_writer("a/b")
        with c.open_log_writer(name) as w:
            with pytest.raises(ValueError, match="entry limit"):
                w.append(bytes(c.conf.nettyMaxFrameSizeBytes))


def test_writer_broken_beyond_repair_fails_clearly_and_a_new_writer_continues(cluster):
    name = "broken"
    with cluster.client(timeout=2) as c:
        w = c.open_log_writer(name, ensemble_size=3, write_quorum_size=3, ack_quorum_size=3)
        before = [w.append(b"ok-%d" % i) for i in range(5)]
        victim = cluster.bookies[0]
        victim.kill()                     # no replacement: the ensemble cannot be repaired
        with pytest.raises(bk.errors.BKError) as ei:
            w.append(b"doomed")
        assert "open a new writer" in str(ei.value)
        with pytest.raises(type(ei.value)):
            w.append(b"still doomed")     # the writer stays broken, with the same error
        w.close()
        victim.start()
        wait_until(lambda: victim.bookie_id in c.bookies(), timeout=20, step=0.01,
                   what="the bookie back")
        with c.open_log_writer(name, ensemble_size=3, write_quorum_size=3,
                               ack_quorum_size=3) as w2:
            after = w2.append(b"after")
        records = _read_all(c, name)
        datas = [r.data for r in records]
        assert datas[:5] == [b"ok-%d" % i for i in range(5)] and datas[-1] == b"after"
        assert set(datas[5:-1]) <= {b"doomed"}      # may or may not be in, never twice
        assert [r.position for r in records[:5]] == before and records[-1].position == after


def test_rolls_by_age_and_by_bytes(shared_cluster):
    with shared_cluster.client(timeout=2) as c:
        with c.open_log_writer("age", logRollSeconds=0.3) as w:
            p0 = w.append(b"first")
            # An idle segment that holds entries rolls once it is old enough.
            wait_until(lambda: len(c.log_info("age").segments) == 2, timeout=20, step=0.01,
                       what="a roll by age")
            p1 = w.append(b"second")
        assert p1.segment == p0.segment + 1
        assert [r.data for r in _read_all(c, "age")] == [b"first", b"second"]
        with c.open_log_writer("size", logRollBytes=1000, logBatchBytes=300) as w:
            last = w.append_many([bytes(100)] * 50)        # 5000 bytes: about 5 rolls
            wait_until(lambda: len(c.log_info("size").segments) >= 5, timeout=20, step=0.01,
                       what="rolls by size")
        info = c.log_info("size")
        assert info.records == 50 and info.bytes == 5000 and info.last_position == last
        assert all(s["bytes"] <= 1000 + 300 for s in info.segments)
        assert len(_read_all(c, "size")) == 50
        # A reader from "latest" sees only what comes after it opened; a Position
        # starts exactly there; a reader iterates.
        latest = c.open_log_reader("size", start="latest")
        assert latest.read_batch(10, timeout=0.2) == []
        with c.open_log_writer("size") as w:
            new = w.append_many([b"new-1", b"new-2"])
        assert [x.data for x in latest.read_batch(10, timeout=5)] == [b"new-1", b"new-2"]
        latest.close()
        with c.open_log_reader("size", start=new) as r:
            assert next(iter(r)) == bk.LogRecord(new, b"new-2")


_DIES_AFTER_ONE_APPEND = textwrap.dedent("""
    import os, sys, bk
    c = bk.BookKeeper(sys.argv[1])
    w = c.open_log_writer("sunk")
    print(w.append(b"from-the-dead-writer"), flush=True)
    os._exit(0)                  # its segment stays open, as after a crash
""")


def _staged_ledger(client, records):
    from bk.log.records import encode_record_set
    lh = client.create_ledger(3, 2, 2)
    lh.add_entry(encode_record_set(records))
    lh.close()
    return {"ledger_id": lh.ledger_id, "last_entry_id": lh.last_add_confirmed,
            "records": len(records), "bytes": sum(map(len, records))}


def test_new_writer_fences_an_open_segment_that_a_sink_appended_after(shared_cluster):
    """append_ledgers (an exactly-once sink's commit) racing a writer that then dies:
    the closed segments it appended come after the dead writer's open one, and the
    next writer must still fence and close that one (not only the last two)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(bk.__file__)), os.environ.get("PYTHONPATH")])))
    uri = shared_cluster.metadata_uri
    out = subprocess.run([sys.executable, "-c", _DIES_AFTER_ONE_APPEND, uri],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    dead_pos = Position.parse(out.stdout.split()[0])
    with shared_cluster.client(timeout=2) as c:
        for batch in range(2):
            assert bk.log.append_ledgers(c, "sunk", [_staged_ledger(c, [b"sink-%d" % batch])],
                                         "a-sink", batch)
        segs = c.log_info("sunk").segments
        assert [s["state"] for s in segs] == ["open", "closed", "closed"]
        with c.open_log_writer("sunk") as w:
            after = w.append(b"after")
        segs = c.log_info("sunk").segments
        assert [s["state"] for s in segs] == ["closed"] * 4
        assert segs[0]["records"] == 1
        records = _read_all(c, "sunk")
        assert [(r.position, r.data) for r in records] == [
            (dead_pos, b"from-the-dead-writer"), (Position(1, 0, 0), b"sink-0"),
            (Position(2, 0, 0), b"sink-1"), (after, b"after")]
