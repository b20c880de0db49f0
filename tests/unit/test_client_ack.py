"""The write handle's quorum/ordering logic, driven by hand (no sockets, no threads)."""

import itertools
import random

import pytest

from bk import protocol as P
from bk.client.health import BookieHealth
from bk.client.ledger import _TRANSITIONS, LedgerHandle, WriterState
from bk.config import Config
from bk.errors import (EFENCED, EIO, EOK, EREADONLY, ETOOMANYREQUESTS, BookieUnavailableError,
                       LedgerClosedError, LedgerFencedError, NoSuchLedgerError, TimeoutError)
from bk.meta.ledger import LedgerMetadata


class FakeLoop:
    def __init__(self):
        self.rids = itertools.count(1)
        self.batching = True
        self.batch_bytes = 1 << 20
        self.generation = 1
        self.now = 0.0
        self._tickers = []
        self.q = []
        self.timers = []        # (when, fn, args) on the fake clock ``now``

    def call_soon(self, fn, *args):
        self.q.append((fn, args))

    def call_later(self, delay, fn, *args):
        self.timers.append((self.now + delay, fn, args))

    def register_handle(self, handle):
        pass

    def run(self):
        while self.q:
            fn, args = self.q.pop(0)
            fn(*args)

    def advance(self, dt):
        """Move the fake clock on by ``dt`` and run the timers that came due."""
        self.now += dt
        due = sorted((t for t in self.timers if t[0] <= self.now), key=lambda t: t[0])
        self.timers = [t for t in self.timers if t[0] > self.now]
        for _, fn, args in due:
            fn(*args)
        self.run()

    def next_timer(self):
        """Move the fake clock to the earliest timer and run it."""
        self.advance(min(t[0] for t in self.timers) - self.now)


class FakeConn:
    def __init__(self, bid):
        self.bookie_id = bid
        self.sent = []          # (rid, op)

    def send_adds(self, ops, frames=None):
        if frames is not None:
            # whole ADD_BATCH frames encoded once for the write quorum: the same
            # records, in order, under the handle's master key
            fb = P.FrameBuffer(1 << 30)
            for f in frames:
                fb.feed(f)
            msgs = list(fb.frames())
            assert len(msgs) == len(frames) and all(m[0] == P.ADD_BATCH for m in msgs)
            assert {(m[2], m[3]) for m in msgs} == {ops[0].handle._bkey}
            assert sum(m[4] for m in msgs) == len(ops)
            assert b"".join(bytes(m[5]) for m in msgs) == \
                b"".join(op.head + op.data for op in ops)
        for op in ops:
            # what a bookie would get: the single ADD and the batch record agree
            msg = P.decode_body(op.single_frame()[4:])
            assert msg[0] == P.ADD and msg[3] == op.entry_id
            rec = P.encode_add_batch(0, b"", 0, [tuple(msg[2:5]) + tuple(msg[7:9])])
            assert rec.endswith(op.head + op.data)
            self.sent.append((msg[1], op, msg))

    def forget_adds(self, lid):
        self.forgotten = lid


class FakeExecutor:
    def __init__(self):
        self.jobs = []

    def submit(self, fn):
        self.jobs.append(fn)


class FakeStore:
    """The ledger's metadata: there, or ``deleted``."""

    def __init__(self):
        self.deleted = False
        self.reads = 0

    def read_ledger(self, lid):
        self.reads += 1
        if self.deleted:
            raise NoSuchLedgerError(f"read ledger {lid}: no such ledger")
        return None, 1


class FakeClient:
    uri = "etcd://fake/ledgers"

    def __init__(self, bookies):
        self._io = FakeLoop()
        self.conf = Config.load(env={})
        self.conns = {b: FakeConn(b) for b in bookies}
        self._executor = FakeExecutor()
        self._closed = False
        self._health = BookieHealth(60)
        self._store = FakeStore()

    def _connection(self, bid, lid):
        return self.conns.setdefault(bid, FakeConn(bid))


def make(E=3, qw=3, qa=2):
    bookies = [f"b{i}:1" for i in range(E)]
    client = FakeClient(bookies)
    md = LedgerMetadata(ledger_id=5, ensemble_size=E, write_quorum_size=qw,
                        ack_quorum_size=qa, ensembles=[(0, bookies)])
    return client, LedgerHandle(client, md, 1, b"", writable=True)


def run(client):
    client._io.run()


def reply(conn, rid, status=EOK):
    for r, op, msg in conn.sent:
        if r == rid:
            op.on_reply(conn, [P.ADD, rid, status, msg[2], msg[3]])
            return
    raise AssertionError("no such request")


def test_write_sets_and_piggybacked_lac():
    client, h = make(E=3, qw=2, qa=2)
    done = []
    for i in range(6):
        h.add_entry_async(b"x%d" % i, lambda exc, eid: done.append(eid))
    run(client)
    c = client.conns
    assert [m[3] for _, _, m in c["b0:1"].sent] == [0, 2, 3, 5]
    assert [m[3] for _, _, m in c["b1:1"].sent] == [0, 1, 3, 4]
    assert [m[4] for _, _, m in c["b0:1"].sent] == [-1, -1, -1, -1]  # nothing acked yet


def test_acks_in_entry_order_whatever_the_reply_order():
    client, h = make(E=3, qw=3, qa=2)
    done = []
    for i in range(50):
        h.add_entry_async(b"x%d" % i, lambda exc, eid: done.append((exc, eid)))
    run(client)
    replies = [(conn, rid) for conn in client.conns.values() for rid, _, _ in conn.sent]
    random.Random(4).shuffle(replies)
    for conn, rid in replies:
        reply(conn, rid)
        assert [eid for _, eid in done] == list(range(len(done)))
        assert h.last_add_confirmed == len(done) - 1
    assert len(done) == 50 and all(exc is None for exc, _ in done)
    assert h.length == sum(len(b"x%d" % i) for i in range(50))


def test_one_ack_is_not_enough_and_head_blocks():
    client, h = make(E=3, qw=3, qa=2)
    done = []
    for i in range(2):
        h.add_entry_async(b"y", lambda exc, eid: done.append(eid))
    run(client)
    b0, b1 = client.conns["b0:1"], client.conns["b1:1"]
    reply(b0, b0.sent[1][0])
    reply(b1, b1.sent[1][0])        # entry 1 has a quorum, entry 0 not yet
    assert done == [] and h.last_add_confirmed == -1
    reply(b0, b0.sent[0][0])
    assert done == [] and h.last_add_confirmed == -1
    reply(b1, b1.sent[0][0])
    assert done == [0, 1] and h.last_add_confirmed == 1


def test_fenced_beyond_qw_minus_qa_fails_everything():
    client, h = make(E=3, qw=3, qa=2)
    errs = []
    for i in range(3):
        h.add_entry_async(b"z", lambda exc, eid: errs.append((type(exc), eid)))
    run(client)
    b0, b1 = client.conns["b0:1"], client.conns["b1:1"]
    reply(b0, b0.sent[0][0], EFENCED)     # one fenced copy: Qa still reachable
    assert errs == []
    reply(b1, b1.sent[0][0], EFENCED)
    # fenced, or deleted (a tombstone says EFENCED too)? The metadata decides, on a
    # metadata thread, and nothing fails before it did
    assert errs == [] and len(client._executor.jobs) == 1 and client._store.reads == 0
    reply(b2 := client.conns["b2:1"], b2.sent[0][0], EFENCED)   # asked once, not again
    assert len(client._executor.jobs) == 1
    client._executor.jobs.pop()()
    run(client)
    assert client._store.reads == 1
    assert errs == [(LedgerFencedError, 0), (LedgerFencedError, 1), (LedgerFencedError, 2)]
    with pytest.raises(LedgerFencedError) as ei:
        h.add_entry(b"later")
    assert "ledger 5" in str(ei.value) and "fenced" in str(ei.value)


def test_refused_adds_of_a_deleted_ledger_say_deleted():
    client, h = make(E=3, qw=3, qa=2)
    errs = []
    for i in range(3):
        h.add_entry_async(b"z", lambda exc, eid: errs.append((type(exc), eid)))
    run(client)
    b0, b1, b2 = (client.conns[f"b{i}:1"] for i in range(3))
    reply(b0, b0.sent[0][0], EFENCED)
    reply(b1, b1.sent[0][0], EFENCED)
    # while the metadata is asked, a bookie timing out starts no ensemble change
    h._bookie_failed(b2, TimeoutError("late"))
    assert not h._state.changing and len(client._executor.jobs) == 1
    client._store.deleted = True
    client._executor.jobs.pop()()
    run(client)
    assert errs == [(NoSuchLedgerError, 0), (NoSuchLedgerError, 1), (NoSuchLedgerError, 2)]
    assert h.failure()[0] is NoSuchLedgerError
    with pytest.raises(NoSuchLedgerError) as ei:
        h.add_entry(b"later")
    assert "ledger 5" in str(ei.value) and "deleted" in str(ei.value)


def test_bookie_error_freezes_acks_until_the_ensemble_change():
    client, h = make(E=3, qw=3, qa=2)
    done = []
    for i in range(3):
        h.add_entry_async(b"w", lambda exc, eid: done.append(eid))
    run(client)
    b0, b1, b2 = (client.conns[f"b{i}:1"] for i in range(3))
    reply(b0, b0.sent[0][0])
    reply(b1, b1.sent[0][0])
    assert done == [0]
    reply(b2, b2.sent[1][0], EIO)                    # b2 fails: ensemble change starts
    run(client)
    assert h._state.changing and len(client._executor.jobs) == 1
    reply(b0, b0.sent[1][0])
    reply(b1, b1.sent[1][0])
    assert done == [0]                               # frozen while changing
    # complete the change by hand: b2 -> b3 from entry 1
    new_md = h.metadata.replace(ensembles=[(0, ["b0:1", "b1:1", "b2:1"]),
                                           (1, ["b0:1", "b1:1", "b3:1"])])
    h._prepare_conns(["b3:1"])
    b3 = client.conns["b3:1"]
    h._commit_change(new_md, 2, {2: b3})
    assert done == [0, 1]                            # entry 1 had b0 + b1
    assert [m[3] for _, _, m in b3.sent] == [1, 2]   # pending entries resent to b3
    reply(b3, b3.sent[1][0])
    reply(b0, b0.sent[2][0])
    assert done == [0, 1, 2]
    assert h.last_add_confirmed == 2
    reply(b2, b2.sent[2][0])                         # a late ack of the replaced bookie: ignored


def test_bad_payloads_consume_no_entry_id():
    client, h = make()
    with pytest.raises(TypeError):
        h.add_entry_async("str")
    with pytest.raises(ValueError):
        h.add_entry_async(b"x" * (6 << 20))
    h.add_entry_async(b"ok")
    run(client)
    assert client.conns["b0:1"].sent[0][2][3] == 0


def test_piggybacked_lac_is_the_lac_when_the_batch_is_built():
    client, h = make(E=3, qw=3, qa=2)
    done = []
    h._submit([b"a%d" % i for i in range(4)], lambda exc, eid: done.append(eid))
    run(client)
    b0, b1 = client.conns["b0:1"], client.conns["b1:1"]
    for rid, _, _ in list(b0.sent):
        reply(b0, rid)
        reply(b1, rid)
    assert done == [3] and h.last_add_confirmed == 3
    h._submit([b"b%d" % i for i in range(4)], None)
    run(client)
    assert [(m[3], m[4]) for _, _, m in b0.sent] == \
        [(0, -1), (1, -1), (2, -1), (3, -1), (4, 3), (5, 3), (6, 3), (7, 3)]


def _busy_setup(qa=3):
    client, h = make(E=3, qw=3, qa=qa)
    done = []
    h.add_entry_async(b"v", lambda exc, eid: done.append((exc, eid)))
    run(client)
    return client, h, done, [client.conns[f"b{i}:1"] for i in range(3)]


def test_overloaded_bookie_gets_the_add_again_and_stays():
    client, h, done, (b0, b1, b2) = _busy_setup()
    rid = b2.sent[0][0]
    reply(b0, rid)
    reply(b1, rid)
    reply(b2, rid, ETOOMANYREQUESTS)
    run(client)
    assert not h._state.changing and client._executor.jobs == [] and h._failed_slots == set()
    assert done == [] and len(b2.sent) == 1
    client._io.next_timer()                            # the back-off ran out: resent
    assert [(r, m[3]) for r, _, m in b2.sent] == [(rid, 0), (rid, 0)]
    assert len(b0.sent) == len(b1.sent) == 1          # only to the bookie that refused
    reply(b2, rid, ETOOMANYREQUESTS)
    client._io.next_timer()
    assert len(b2.sent) == 3
    reply(b2, rid)
    assert done == [(None, 0)] and h.last_add_confirmed == 0
    assert h.metadata.ensembles == [(0, ["b0:1", "b1:1", "b2:1"])]
    assert client._executor.jobs == []


def test_back_off_doubles():
    client, h, done, (b0, b1, b2) = _busy_setup()
    rid = b2.sent[0][0]
    waits = []
    for _ in range(4):
        reply(b2, rid, ETOOMANYREQUESTS)
        t0 = client._io.now
        client._io.next_timer()
        waits.append(round(client._io.now - t0, 6))
    assert waits == [0.002, 0.004, 0.008, 0.016] and len(b2.sent) == 5


def test_overloaded_past_the_add_timeout_is_replaced():
    client, h, done, (b0, b1, b2) = _busy_setup()
    rid = b2.sent[0][0]
    reply(b0, rid)
    reply(b1, rid)
    resends = 0
    while True:
        reply(b2, rid, ETOOMANYREQUESTS)
        run(client)
        if not client._io.timers:
            break
        client._io.next_timer()
        resends += 1
        assert resends < 50, "unbounded retries"
    # bounded: a few ms doubling up to addEntryTimeoutSec (10 s by default)
    assert 5 < resends < 20
    assert client._io.now >= float(client.conf.addEntryTimeoutSec)
    assert h._state.changing and len(client._executor.jobs) == 1 and h._failed_slots == {2}
    assert done == []                                  # frozen until the replacement


def test_busy_bookie_still_gets_its_copy_once_qa_acked():
    client, h, done, (b0, b1, b2) = _busy_setup(qa=2)
    rid = b2.sent[0][0]
    reply(b2, rid, ETOOMANYREQUESTS)
    reply(b0, rid)
    reply(b1, rid)
    assert done == [(None, 0)]
    client._io.next_timer()
    # acknowledged by Qa, but b2 must still get its copy: resent, no ensemble change
    assert len(b2.sent) == 2 and client._executor.jobs == []
    reply(b2, b2.sent[1][0])
    assert h._nconfirmed(0) == 3
    h._tick(client._io.now)
    assert not h._unconfirmed


def test_read_only_bookie_is_replaced_at_once():
    client, h, done, (b0, b1, b2) = _busy_setup()
    reply(b1, b1.sent[0][0], EREADONLY)
    run(client)
    assert h._state.changing and len(client._executor.jobs) == 1 and h._failed_slots == {1}
    assert client._io.timers == [] and len(b1.sent) == 1


def test_record_frames_split_at_the_frame_limits():
    import itertools as it

    from bk.client import connection as C

    class Op:
        def __init__(self, i, size):
            self.head = b"h%03d" % i
            self.data = bytes([i % 256]) * size
            self.wlen = len(self.head) + len(self.data)

    key = (b"k" * 20, 0)

    def frames(ops, limit):
        """(count, records) of each frame, decoded back from its bytes."""
        out = []
        for f in C.record_frames(ops, limit, key, it.count(1)):
            fb = P.FrameBuffer(1 << 30)
            fb.feed(f)
            (msg,) = list(fb.frames())
            assert msg[0] == P.ADD_BATCH and msg[2:4] == [key[0], key[1]]
            out.append((msg[4], bytes(msg[5])))
        return out

    ops = [Op(i, 96) for i in range(25)]            # 100 bytes each
    got = frames(ops, 1000)
    assert [(c, len(r)) for c, r in got] == [(10, 1000), (10, 1000), (5, 500)]
    assert b"".join(r for _, r in got) == b"".join(o.head + o.data for o in ops)
    # one frame's worth (the path without a Python step per op)
    assert frames(ops[:10], 1000) == [(10, b"".join(o.head + o.data for o in ops[:10]))]
    # an op larger than the limit still goes, alone in its frame
    big = [Op(0, 10), Op(1, 5000), Op(2, 10)]
    assert [c for c, _ in frames(big, 1000)] == [1, 1, 1]
    # the entry count bounds a frame too
    many = [Op(i, 0) for i in range(C.BATCH_ENTRIES + 1)]
    assert [c for c, _ in frames(many, 1 << 30)] == [C.BATCH_ENTRIES, 1]
    assert C.record_frames([], 1000, key, it.count(1)) == []


class _RunHandle:
    """What a connection asks of a write handle: the runs it confirms, advances."""

    def __init__(self, lid=7):
        self._lid = lid
        self.runs = []          # (conn, first, last) as confirmed
        self.advanced = 0

    def _confirm_run(self, conn, first, last):
        self.runs.append((conn.bookie_id, first, last))

    def _advance(self):
        self.advanced += 1

    def confirmed(self):
        return [e for _, a, b in self.runs for e in range(a, b + 1)]


class _RunOp:
    def __init__(self, h, e):
        self.handle, self.entry_id, self.done = h, e, False

    def on_reply(self, conn, msg):
        self.reply = msg


def _ready_conn():
    from bk.client import connection as C

    class Loop:
        rids = itertools.count(1)
        _timeouts = {}
        _dirty = []

    conn = C.Connection(Loop(), "b0", 0, ("127.0.0.1", 1))
    conn.state, conn.dirty = C.READY, True
    return conn


def test_group_ack_confirms_the_oldest_send_of_an_entry_first():
    """Two handles of one ledger in one client (a writer and its recovery) send
    the same entry ids on one connection: each acknowledgement confirms the
    oldest outstanding send of an entry, one handle's op at a time."""
    conn = _ready_conn()
    writer, recovery = _RunHandle(), _RunHandle()
    conn.send_adds([_RunOp(writer, e) for e in range(3)])
    conn.send_adds([_RunOp(recovery, e) for e in range(1, 3)])
    conn._on_add_ack([P.ADD_BATCH, 0, 0, [7, 0, 2], []])
    assert writer.confirmed() == [0, 1, 2] and recovery.confirmed() == []
    assert writer.advanced == 1 and recovery.advanced == 0
    assert sorted(conn.adds[7]) == [1, 2]
    conn._on_add_ack([P.ADD_BATCH, 0, 0, [7, 1, 2], []])
    assert recovery.confirmed() == [1, 2] and recovery.advanced == 1
    assert 7 not in conn.adds
    # a run naming entries nobody sent, or a ledger without adds, is ignored
    conn._on_add_ack([P.ADD_BATCH, 0, 0, [7, 0, 5, 8, 0, 1], []])
    assert writer.confirmed() == [0, 1, 2] and recovery.confirmed() == [1, 2]


def test_group_ack_confirms_a_whole_run_as_one_range():
    """One handle's adds on a connection: a run is confirmed as one range when
    the connection held every entry of it, and only the entries it held when
    some are missing (answered already, or never sent here); errors of the same
    acknowledgement go to their ops, and the handle advances once."""
    conn = _ready_conn()
    h = _RunHandle()
    ops = [_RunOp(h, e) for e in range(10)]
    conn.send_adds(ops[:6])
    conn.send_adds(ops[6:])
    assert conn.adds[7].owner is h
    conn._on_add_ack([P.ADD_BATCH, 0, 0, [7, 0, 3, 7, 5, 5], [7, 4, ETOOMANYREQUESTS]])
    assert h.runs == [("b0", 0, 3), ("b0", 5, 5)] and h.advanced == 1
    assert ops[4].reply[2:] == [ETOOMANYREQUESTS, 7, 4]
    assert sorted(conn.adds[7]) == [6, 7, 8, 9]
    # 2..3 answered already, 6..7 still held: only 6 and 7 are confirmed
    conn._on_add_ack([P.ADD_BATCH, 0, 0, [7, 2, 7], []])
    assert h.runs[2:] == [("b0", 6, 6), ("b0", 7, 7)] and h.advanced == 2
    conn._on_add_ack([P.ADD_BATCH, 0, 0, [7, 8, 9], []])
    assert h.runs[4:] == [("b0", 8, 9)] and 7 not in conn.adds


def test_silent_bookie_is_replaced_after_qa_and_gets_the_entries():
    """E3 Qw3 Qa2: b2 never answers. Entries are acknowledged by b0 + b1, yet b2 is
    replaced after addEntryTimeoutSec, from the first entry it did not confirm,
    and the replacement is sent every entry from there (Qw copies again)."""
    client, h = make(E=3, qw=3, qa=2)
    done = []
    for i in range(4):
        h.add_entry_async(b"s%d" % i, lambda exc, eid: done.append(eid))
    run(client)
    b0, b1, b2 = (client.conns[f"b{i}:1"] for i in range(3))
    reply(b2, b2.sent[0][0])                          # b2 confirms entry 0 only
    for i in range(4):
        reply(b0, b0.sent[i][0])
        reply(b1, b1.sent[i][0])
    assert done == [0, 1, 2, 3]
    h._tick(client._io.now)
    assert [op.entry_id for op in h._unconfirmed] == [1, 2, 3]    # 0 is on all three
    assert client._executor.jobs == []
    client._io.now += float(client.conf.addEntryTimeoutSec)
    h._tick(client._io.now)
    assert h._state.changing and h._failed_slots == {2} and h._change_from == 1
    new_md = h.metadata.replace(ensembles=[(0, ["b0:1", "b1:1", "b2:1"]),
                                           (1, ["b0:1", "b1:1", "b3:1"])])
    h._prepare_conns(["b3:1"])
    b3 = client.conns["b3:1"]
    h._commit_change(new_md, 2, {2: b3})
    assert b2.forgotten == 5
    assert [m[3] for _, _, m in b3.sent] == [1, 2, 3]
    for rid, _, _ in list(b3.sent):
        reply(b3, rid)
    h._tick(client._io.now)
    assert not h._unconfirmed and not h._state.changing


# --- the writer's state table ----------------------------------------------------------
W = WriterState


def test_every_transition_keeps_the_meaning_of_the_columns():
    for (st, event), nxt in _TRANSITIONS.items():
        assert nxt.takes_adds == (not nxt.closed and not nxt.broken), nxt
        if event == "close":
            assert nxt.closed and (nxt.broken, nxt.changing) == (st.broken, st.changing)
        elif event == "fail":
            assert nxt.broken and not nxt.changing and nxt.closed == st.closed
        elif event == "change":
            assert not st.changing and not st.broken and nxt.changing
            assert nxt.closed == st.closed
        else:
            assert event == "changed" and (st.changing or st.broken) and not nxt.changing
            assert (nxt.closed, nxt.broken) == (st.closed, st.broken)
    # close and fail are possible from every state; nothing leaves a broken handle
    assert all((st, ev) in _TRANSITIONS for st in W for ev in ("close", "fail"))
    assert all(nxt.broken for (st, _), nxt in _TRANSITIONS.items() if st.broken)


def test_moves_not_in_the_table_are_refused():
    client, h = make()
    with pytest.raises(RuntimeError, match="cannot 'changed' when OPEN"):
        h._move("changed")
    assert h._state is W.OPEN
    h._move("change")
    with pytest.raises(RuntimeError, match="cannot 'change' when CHANGING"):
        h._move("change")
    h._move("fail")
    with pytest.raises(RuntimeError, match="cannot 'change' when BROKEN"):
        h._move("change")
    assert h._state is W.BROKEN


def _bookie_fails(client, h, conn):
    reply(conn, conn.sent[0][0], EIO)
    run(client)


def test_close_during_an_ensemble_change_waits_for_it_then_refuses_adds():
    client, h = make(E=3, qw=3, qa=2)
    h.add_entry_async(b"w", lambda exc, eid: None)
    run(client)
    b0, b1, b2 = (client.conns[f"b{i}:1"] for i in range(3))
    _bookie_fails(client, h, b2)
    assert h._state is W.CHANGING
    h.add_entry_async(b"queued while changing", lambda exc, eid: None)   # adds still queue
    assert h._move("close") is W.CHANGING and h._state is W.CLOSING_CHANGING
    assert h.is_closed
    with pytest.raises(LedgerClosedError, match="ledger handle is closed"):
        h.add_entry_async(b"after close")
    new_md = h.metadata.replace(ensembles=[(0, ["b0:1", "b1:1", "b3:1"])])
    h._prepare_conns(["b3:1"])
    h._commit_change(new_md, 2, {2: client.conns["b3:1"]})
    assert h._state is W.CLOSING


def test_failure_while_changing_or_closed_keeps_the_handle_broken():
    client, h = make(E=3, qw=3, qa=2)
    failed = []
    h.add_entry_async(b"w", lambda exc, eid: failed.append(type(exc)))
    run(client)
    b0, b1, b2 = (client.conns[f"b{i}:1"] for i in range(3))
    _bookie_fails(client, h, b2)
    reply(b0, b0.sent[0][0], EFENCED)
    reply(b1, b1.sent[0][0], EFENCED)
    client._executor.jobs.pop()()           # fenced or deleted? fenced (metadata there)
    run(client)
    assert h._state is W.BROKEN and failed == [LedgerFencedError]
    assert h.failure()[0] is LedgerFencedError
    # the change in flight ends and changes nothing; the handle stays broken
    new_md = h.metadata.replace(ensembles=[(0, ["b0:1", "b1:1", "b3:1"])])
    h._prepare_conns(["b3:1"])
    h._commit_change(new_md, 2, {2: client.conns["b3:1"]})
    assert h._state is W.BROKEN and client.conns["b3:1"].sent == []
    with pytest.raises(LedgerFencedError):
        h.add_entry_async(b"later")
    h._move("close")
    assert h._state is W.BROKEN_CLOSED
    with pytest.raises(LedgerClosedError):           # closed is said before broken
        h.add_entry_async(b"after close")


# --- group acknowledgements through real connections into a real handle ------------------
def _make_wired(E=3, qw=3, qa=2):
    """A write handle whose bookies are real Connections (READY, no socket): adds go
    into their ``adds``, and group acknowledgements are fed to ``_on_add_ack``."""
    from bk.client import connection as C

    client, _ = make(E, qw, qa)
    loop = client._io
    loop._dirty, loop._timeouts, loop._connecting, loop.health = [], {}, set(), None

    def connection(bid, lid):
        c = client.conns.get(bid)
        if not isinstance(c, C.Connection):
            c = client.conns[bid] = C.Connection(loop, bid, 0, ("127.0.0.1", 1))
            c.state, c.features = C.READY, P.FEATURE_ADD_BATCH
        return c

    client._connection = connection
    md = LedgerMetadata(ledger_id=5, ensemble_size=E, write_quorum_size=qw, ack_quorum_size=qa,
                        ensembles=[(0, [f"b{i}:1" for i in range(E)])])
    h = LedgerHandle(client, md, 1, b"", writable=True)
    return client, h, [client.conns[f"b{i}:1"] for i in range(E)]


def _ack(conn, *runs, errors=()):
    acked = [x for first, last in runs for x in (5, first, last)]
    conn._on_add_ack([P.ADD_BATCH, 0, 0, acked, [x for e, st in errors for x in (5, e, st)]])


def _submit(client, h, n, done):
    for i in range(n):
        h.add_entry_async(b"e%d" % i, lambda exc, eid: done.append((exc, eid)))
    run(client)


def test_runs_acknowledge_in_order_and_a_duplicate_counts_once():
    client, h, (b0, b1, b2) = _make_wired()
    done = []
    _submit(client, h, 10, done)
    _ack(b0, (0, 9))
    assert done == [] and h.last_add_confirmed == -1          # one bookie of Qa=2
    _ack(b0, (0, 9))                                           # again: nothing held, nothing counted
    h._confirm_run(b0, 0, 9)                                   # a second confirmation by its slot
    h._advance()
    assert done == [] and [h._nconfirmed(e) for e in range(10)] == [1] * 10
    _ack(b1, (4, 9))                                           # out of order: the head waits
    assert done == [] and h.last_add_confirmed == -1
    _ack(b1, (0, 1))
    assert [e for _, e in done] == [0, 1] and h.last_add_confirmed == 1
    _ack(b2, (2, 3))                                           # 2, 3 complete the gap: 0..9
    assert [e for _, e in done] == list(range(10)) and all(x is None for x, _ in done)
    assert h.last_add_confirmed == 9
    assert [op.entry_id for op in h._unconfirmed] == list(range(10))   # two of three each
    _ack(b2, (0, 1), (4, 9))
    # 2, 3 lack b1; 4..9 are on all three but wait behind them (held in order)
    assert [op.entry_id for op in h._unconfirmed] == list(range(2, 10))
    _ack(b1, (2, 3))
    assert not h._unconfirmed and not any(c.adds for c in (b0, b1, b2))


def test_a_bookie_failing_between_two_acks_of_one_run():
    """b1 confirms the first half of a run, then its connection breaks: acks freeze
    (the second half has only b0), the new fragment starts after what b1 and b0
    confirmed, and b1's replacement gets exactly the entries from there."""
    client, h, (b0, b1, b2) = _make_wired()
    done = []
    _submit(client, h, 10, done)
    _ack(b0, (0, 9))
    _ack(b1, (0, 4))
    assert [e for _, e in done] == [0, 1, 2, 3, 4]
    b1._fail(BookieUnavailableError("b1 broke"), fast=True)    # 5..9 fail on b1
    run(client)
    assert h._state.changing and h._failed_slots == {1} and len(client._executor.jobs) == 1
    _ack(b1, (5, 9))                                           # (a late answer: not counted)
    _ack(b2, (0, 9))
    assert [e for _, e in done] == [0, 1, 2, 3, 4]             # frozen while changing
    assert h._change_from is None                              # b1 confirmed all it acked
    new_md = h.metadata.replace(ensembles=[(0, ["b0:1", "b1:1", "b2:1"]),
                                           (5, ["b0:1", "b3:1", "b2:1"])])
    h._prepare_conns(["b3:1"])
    b3 = client.conns["b3:1"]
    h._commit_change(new_md, 2, {1: b3})
    assert [e for _, e in done] == list(range(10))             # b0 + b2
    assert sorted(b3.adds[5]) == [5, 6, 7, 8, 9]               # resent from the new fragment
    assert [op.entry_id for op in h._unconfirmed] == [5, 6, 7, 8, 9]
    assert [h._nconfirmed(e) for e in range(5, 10)] == [2] * 5  # b1's went with it
    _ack(b3, (5, 7))
    assert [op.entry_id for op in h._unconfirmed] == [8, 9]
    _ack(b3, (8, 9))
    assert not h._unconfirmed and not h._state.changing


def test_a_replaced_bookie_loses_its_confirmations_from_the_new_fragment():
    """E3 Qw3 Qa3. b1 confirmed entries 0..3, then is failed (timed out); what it
    answers after that does not count, and once it is replaced from entry 3 its
    confirmation of 3 goes too: 3..5 are acknowledged only when the replacement
    has them, never on a bookie that left their write set."""
    client, h, (b0, b1, b2) = _make_wired(qa=3)
    done = []
    _submit(client, h, 6, done)
    _ack(b0, (0, 5))
    _ack(b2, (0, 2))
    _ack(b1, (0, 3))
    assert [e for _, e in done] == [0, 1, 2]
    h._bookie_failed(b1, TimeoutError("b1 timed out"))
    assert h._state.changing
    _ack(b1, (4, 5))                                # after it failed: not counted
    assert [h._confirmed_by(e, 1) for e in range(6)] == [True] * 4 + [False] * 2
    _ack(b2, (3, 5))
    assert [e for _, e in done] == [0, 1, 2]        # frozen while changing
    new_md = h.metadata.replace(ensembles=[(0, ["b0:1", "b1:1", "b2:1"]),
                                           (3, ["b0:1", "b3:1", "b2:1"])])
    h._prepare_conns(["b3:1"])
    b3 = client.conns["b3:1"]
    h._commit_change(new_md, 2, {1: b3})
    assert [e for _, e in done] == [0, 1, 2] and sorted(b3.adds[5]) == [3, 4, 5]
    assert [h._confirmed_by(e, 1) for e in range(6)] == [True] * 3 + [False] * 3
    _ack(b3, (3, 4))
    assert [e for _, e in done] == [0, 1, 2, 3, 4]
    _ack(b3, (5, 5))
    assert [e for _, e in done] == list(range(6)) and not h._unconfirmed


def test_a_hole_in_a_run_waits_for_the_resend():
    """b0 answers 0..5 but refuses 3 as overloaded (two runs and an error in one
    acknowledgement): entry 3 has b1 only, so the LAC stops at 2 until the resend
    of 3 is confirmed; then 3..5 follow at once."""
    client, h, (b0, b1, b2) = _make_wired()
    done = []
    _submit(client, h, 6, done)
    _ack(b1, (0, 5))
    _ack(b0, (0, 2), (4, 5), errors=[(3, ETOOMANYREQUESTS)])
    assert [e for _, e in done] == [0, 1, 2] and h.last_add_confirmed == 2
    client._io.next_timer()                                    # the back-off: resent to b0
    assert sorted(b0.adds[5]) == [3]
    _ack(b0, (3, 3))
    assert [e for _, e in done] == list(range(6)) and h.last_add_confirmed == 5


def test_the_bitsets_follow_what_is_in_flight():
    """Many entries through: _ack_base moves on, so each slot's int spans the
    entries in flight, not the ledger; entries are still counted right after it."""
    from bk.client import ledger as L

    client, h, conns = _make_wired()
    done = []
    n = 0
    for _ in range(30):
        _submit(client, h, 500, done)
        for c in conns[:2]:
            _ack(c, (n, n + 499))
        if n:
            _ack(conns[2], (n - 500, n - 1))          # b2 one batch behind
        n += 500
        assert len(done) == n and h.last_add_confirmed == n - 1
        assert [op.entry_id for op in h._unconfirmed] == list(range(n - 500, n))
    assert h._ack_base > n - L._REBASE_AT - 1000
    assert all(a.bit_length() <= L._REBASE_AT + 1000 for a in h._acks)
    _ack(conns[2], (n - 500, n - 1))
    assert not h._unconfirmed


def test_quorum_masks_count_the_bitsets():
    """Every shape's masks (the general fold and the few-operator ones) give, per
    bit, whether at least Qa and at least Qw of the slots have it."""
    from bk.client import ledger as L

    rnd = random.Random(7)
    shapes = [(E, qw, qa) for E in range(1, 6) for qw in range(1, E + 1) for qa in range(1, qw + 1)]
    assert {(3, 3, 2), (3, 3, 3), (2, 2, 2)} <= set(shapes)
    for E, qw, qa in shapes:
        f = L.masks_for(E, qw, qa)
        for _ in range(30):
            acks = [rnd.getrandbits(64) & rnd.getrandbits(64) for _ in range(E)]
            q_a, q_w = f(acks)
            for bit in range(64):
                n = sum((a >> bit) & 1 for a in acks)
                assert (q_a >> bit) & 1 == (n >= qa) and (q_w >> bit) & 1 == (n >= qw), \
                    (E, qw, qa, bit)


def _observed(hist):
    return sum(b.get() for b in hist._buckets)


def test_blocking_adds_one_entry_per_acknowledgement():
    """One entry in flight at a time (blocking adds: the single-entry path of
    _advance and of the group acknowledgement): each is acknowledged by its
    second bookie, not its first, held until its third, its latency observed
    once, and the connections keep nothing of it afterwards."""
    client, h, conns = _make_wired()
    done = []
    seen = _observed(h._m_add_ok)
    for e in range(300):                       # past _REBASE_AT: the bitsets move on
        _submit(client, h, 1, done)
        first, second, third = conns[e % 3], conns[(e + 1) % 3], conns[(e + 2) % 3]
        _ack(first, (e, e))
        assert len(done) == e and h.last_add_confirmed == e - 1
        _ack(second, (e, e))
        assert done[-1] == (None, e) and h.last_add_confirmed == e
        assert [op.entry_id for op in h._unconfirmed] == [e]
        _ack(second, (e, e))                   # a duplicate: nothing held, nothing counted
        _ack(third, (e, e))
        assert not h._unconfirmed and not any(c.adds for c in conns)
        assert _observed(h._m_add_ok) == seen + e + 1
    assert h.length == sum(len(b"e0") for _ in range(300))
    # the head alone acknowledged while the next entry waits for its second bookie
    _submit(client, h, 2, done)
    _ack(conns[0], (300, 301))
    _ack(conns[1], (300, 300))
    assert done[-1] == (None, 300) and h.last_add_confirmed == 300
    assert [op.entry_id for op in h._pending] == [301]
    _ack(conns[2], (301, 301))
    assert done[-1] == (None, 301) and [op.entry_id for op in h._unconfirmed] == [300, 301]
    _ack(conns[2], (300, 300))
    assert [op.entry_id for op in h._unconfirmed] == [301]


def test_fully_confirmed_entries_leave_unconfirmed_around_a_gap():
    """An entry every bookie confirmed by the time it is acknowledged (answers
    that came while acknowledgements were frozen) is not held in _unconfirmed,
    which then has a gap: a later run of the third bookie frees the entries
    below its end, and only those."""
    client, h, (b0, b1, b2) = _make_wired()
    done = []
    _submit(client, h, 6, done)
    _ack(b0, (0, 5))
    _ack(b1, (0, 0))
    assert [op.entry_id for op in h._unconfirmed] == [0]
    h._move("change")                   # frozen, as during an ensemble change
    _ack(b1, (1, 2))
    _ack(b2, (1, 1))                    # 1 on all three, 2 on two
    assert [e for _, e in done] == [0]
    h._move("changed")
    h._advance()
    assert [e for _, e in done] == [0, 1, 2]
    assert [op.entry_id for op in h._unconfirmed] == [0, 2]
    _ack(b2, (0, 0))                    # b2 now has 0..1: 0 goes, 2 stays
    assert [op.entry_id for op in h._unconfirmed] == [2]
    _ack(b1, (3, 5))
    assert [op.entry_id for op in h._unconfirmed] == [2, 3, 4, 5]
    _ack(b2, (2, 4))                    # contiguous: 2..4 go, 5 stays
    assert [op.entry_id for op in h._unconfirmed] == [5]
    _ack(b2, (5, 5))
    assert not h._unconfirmed and [e for _, e in done] == list(range(6))


def test_a_read_handle_refuses_adds_as_closed():
    """Every add of a handle opened for reading fails with LedgerClosedError (not
    an AttributeError of the writer's state it lacks), and consumes nothing."""
    bookies = ["b0:1", "b1:1", "b2:1"]
    client = FakeClient(bookies)
    md = LedgerMetadata(ledger_id=5, ensemble_size=3, write_quorum_size=3,
                        ack_quorum_size=2, ensembles=[(0, bookies)])
    h = LedgerHandle(client, md, 1, b"", writable=False)
    for add in (h.add_entry_async, lambda d: h.add_entry_async(d, lambda *a: None),
                h.add_entry, lambda d: h.add_entries([d])):
        with pytest.raises(LedgerClosedError, match="read-only"):
            add(b"x")
    assert client._io.q == [] and h.last_add_confirmed == -1
