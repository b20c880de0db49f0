"""The shard worker's pipelined group commit, step by step: a real worker on real
storage in a temporary directory, real sockets (socketpairs) as its clients, and
its syncs run when the test says (no sync thread, and no inline sync of small
groups: that choice has its own tests), so that each moment of the pipeline can
be looked at: the next group's sync begins before the group whose
sync completed is answered; nothing is answered before its own sync; a failed
sync answers nothing of its group nor of any later one; a connection's answers
keep their order. Every test runs twice, with the journal's writes buffered
(pwrite + fdatasync) and direct (``journalDirectWrites``: the group's O_DIRECT
write is the sync job), and the failures are injected so that they reach
either (:meth:`StepWorker.complete`, :func:`refuse_writes`); then the failure
paths that only a direct write in flight through Linux AIO has."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import sys

import msgpack
import pytest

from bk import protocol as P
from bk.bookie.journal import JournalError
from bk.bookie.worker import ShardWorker
from bk.config import Config
from bk.errors import EOK
from bk.testing import wait_until

KEY = b"k" * 20
LID = 7


class StepWorker(ShardWorker):
    """A shard worker whose syncs the test runs (see :meth:`complete`). Its groups
    all take the pipelined sync unless ``inline`` is set: then a small group is
    synced inline as in production (tests/unit/test_worker_sync_inline.py)."""

    inline = False
    aio = False          # True: syncs through Linux AIO, as in production where it works

    def _start_sync_thread(self):
        pass

    def _open_aio(self):
        return super()._open_aio() if self.aio else None

    def _may_sync_inline(self) -> bool:
        return self.inline and super()._may_sync_inline()

    def complete(self, fail: bool = False):
        """Run the sync in flight (its job, as the sync thread would) and hand the
        completion to the worker, as its loop does. ``fail``: the sync fails (a
        buffered job's fdatasync: its segment is gone, the open fails; a direct
        write: its descriptor refuses writes)."""
        job = self._sync_jobs.popleft()
        assert job is self.sync_job
        if fail and job.parts is not None:
            job.fd = refusing_fd()
        elif fail:
            job.path = job.path + ".gone"
        self._run_sync(job)
        self._on_sync_done()


_REFUSING: list[int] = []


def refusing_fd() -> int:
    """A descriptor every write to which fails (EPERM): a sealed memfd. Unlike a
    missing path or /dev/null's refused fdatasync it fails a direct write too,
    through pwritev or Linux AIO alike (closed after each test)."""
    fd = os.memfd_create("refuses-writes", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    _REFUSING.append(fd)
    return fd


def refuse_writes(j) -> int:
    """The journal's next write or sync on its own thread fails, whichever way it
    writes: direct, its O_DIRECT descriptor refuses writes (and so does a group's
    write handed out after this: the job takes that descriptor); buffered, its
    descriptor takes the pwrite but refuses fdatasync (/dev/null: EINVAL). The
    journal's own descriptor is returned: close it after."""
    if j.direct:
        good, j._dfd = j._dfd, refusing_fd()
        _REFUSING.remove(j._dfd)       # the journal closes it
    else:
        good, j._fd = j._fd, os.open(os.devnull, os.O_WRONLY)
    return good


def _worker_factory(tmp_path, direct: bool):
    made = []

    def make(**conf):
        conf = Config.load(env={}, overrides={
            "journalDirectories": str(tmp_path / "journal"),
            "ledgerDirectories": str(tmp_path / "ledgers"),
            "numShards": 1, "enableStatistics": True, "journalDirectWrites": direct,
            **conf})
        ctrl, arbiter = socket.socketpair()
        w = StepWorker(conf, 0, 1, ctrl)
        sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
        saved = {s: signal.getsignal(s) for s in sigs}
        switch = sys.getswitchinterval()
        try:
            w._boot()
        finally:                         # the worker's process-wide settings: not ours
            for s, h in saved.items():
                signal.signal(s, h)
            sys.setswitchinterval(switch)
        made.append((w, arbiter))
        assert w.storage._journal.direct == (direct and conf.journalSyncData), \
            "the journal did not write the way this test asked"
        return w

    def close():
        for w, arbiter in made:
            if w.storage is not None:
                w.storage.close()
            arbiter.close()
        while _REFUSING:
            os.close(_REFUSING.pop())
    return make, close


@pytest.fixture(params=[False, True], ids=["buffered", "direct"])
def make_worker(tmp_path, request):
    """A step worker maker, once with buffered journal writes, once with direct."""
    make, close = _worker_factory(tmp_path, request.param)
    yield make
    close()


@pytest.fixture
def make_direct_worker(tmp_path):
    """For the tests of what only a direct write has (its write in flight)."""
    make, close = _worker_factory(tmp_path, True)
    yield make
    close()


def tcp_pair():
    with socket.create_server(("127.0.0.1", 0)) as srv:
        ours = socket.create_connection(srv.getsockname())
        theirs, _ = srv.accept()
    for s in (ours, theirs):        # as the arbiter and the clients do: no Nagle delay
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return ours, theirs


class Client:
    """One client connection of the worker (TCP on the loopback), the worker's end
    adopted as the arbiter hands it over."""

    def __init__(self, w: StepWorker):
        self.w = w
        self.sock, theirs = tcp_pair()
        self.sock.setblocking(False)
        before = set(w.conns)
        w._adopt(theirs.detach(), msgpack.packb(P.hello(1, 0), use_bin_type=True))
        (self.conn,) = w.conns - before
        self.fb = P.FrameBuffer(1 << 24)
        self.rid = 10
        hello = self.received()
        assert [m[0] for m in hello] == [P.HELLO] and hello[0][2] == EOK

    def send(self, *msgs):
        """Send requests; the worker reads and dispatches them (one pass)."""
        for m in msgs:
            self.sock.sendall(m if type(m) is bytes else P.encode_frame(m))
        self.w._on_readable(self.conn)

    def add(self, *eids, lid=LID):
        for eid in eids:
            self.rid += 1
            self.send(P.add(self.rid, lid, eid, eid - 1, KEY, b"", b"x%d" % eid))

    def add_batch(self, eids, lid=LID):
        self.rid += 1
        self.send(P.encode_add_batch(self.rid, KEY, 0,
                                     [(lid, e, e - 1, b"", b"y%d" % e) for e in eids]))

    def received(self) -> list:
        """Every answer the worker has sent so far (it sends synchronously)."""
        while True:
            try:
                n = self.sock.recv_into(self.fb.recv_buffer(1 << 16), 1 << 16)
            except BlockingIOError:
                break
            assert n, "the worker closed the connection"
            self.fb.commit(n)
        return list(self.fb.frames())

    def acked(self) -> list:
        """``(ledger, entry)`` of the EOK answers received now (single and grouped)."""
        out = []
        for m in self.received():
            if m[0] == P.ADD:
                assert m[2] == EOK, m
                out.append((m[3], m[4]))
            elif m[0] == P.ADD_BATCH:
                assert m[4] == [], m
                runs = m[3]
                for i in range(0, len(runs), 3):
                    out += [(runs[i], e) for e in range(runs[i + 1], runs[i + 2] + 1)]
            else:
                out.append(tuple(m[:3]))
        return out


def test_the_next_groups_sync_begins_before_the_synced_group_is_answered(make_worker):
    w = make_worker()
    c = Client(w)
    seen = []
    release = w._release

    def watch(held):                      # what was in flight when a group was answered
        seen.append((len(held), w.sync_job))
        release(held)
    w._release = watch

    c.add(0, 1)
    w._start_sync()
    first = w.sync_job
    assert first is not None and c.acked() == []          # syncing: nothing answered
    c.add(2, 3, 4)                                        # the next group, held
    assert c.acked() == [] and len(w._sync_jobs) == 1
    w.complete()
    # group 1 answered, and only after group 2's sync had been handed to the sync thread
    assert c.acked() == [(LID, 0), (LID, 1)]
    second = w.sync_job
    assert second is not None and second is not first and second.end > first.end
    assert seen == [(2, second)]
    assert len(w._sync_jobs) == 1 and w.held == []
    w.complete()
    assert c.acked() == [(LID, 2), (LID, 3), (LID, 4)]
    assert w.sync_job is None and seen[-1] == (3, None)   # nothing held: nothing begun
    assert w.storage._journal._synced == w.storage._journal._off   # all of it durable



def one_syncing_one_held(make_worker):
    """A worker whose group of entry 0 is syncing (not yet complete) and whose
    next group, entry 1, is held; and its client."""
    w = make_worker()
    c = Client(w)
    c.add(0)
    w._start_sync()
    c.add(1)
    return w, c


def test_a_failed_sync_answers_nothing_of_its_group_nor_later(make_worker):
    w, c = one_syncing_one_held(make_worker)
    w.complete()                          # group 1 durable and answered, group 2 syncing
    assert c.acked() == [(LID, 0)]
    c.add(2)                              # group 3, held behind group 2
    with pytest.raises(JournalError):
        w.complete(fail=True)
    assert c.acked() == [] and w.sync_job is None
    w._quiesce()                          # as the exit does: still nothing answered
    assert c.acked() == [] and w.held == []
    c.add(3)                              # the journal refuses; its answer is held
    w._quiesce()
    assert c.acked() == []


def test_a_failed_first_sync_leaves_the_held_group_unanswered(make_worker):
    w, c = one_syncing_one_held(make_worker)
    with pytest.raises(JournalError):
        w.complete(fail=True)
    w._drain()                            # the worker's exit path: no answer, closed
    assert c.fb.pending == 0
    c.sock.setblocking(True)
    data = c.sock.recv(1 << 16)
    assert data == b""                    # closed with nothing sent


def test_group_acknowledgements_of_a_connection_keep_their_order(make_worker):
    w = make_worker()
    a, b = Client(w), Client(w)
    a.add_batch(range(0, 10))
    b.add_batch(range(0, 5), lid=LID + 1)
    w._start_sync()
    a.add_batch(range(10, 20))
    a.add_batch(range(20, 25))            # same group: the same acknowledgement
    b.add(5, lid=LID + 1)
    assert a.received() == [] and b.received() == []
    w.complete()
    got = a.received()
    assert [(m[0], m[3]) for m in got] == [(P.ADD_BATCH, [LID, 0, 9])]
    assert [(m[0], m[3]) for m in b.received()] == [(P.ADD_BATCH, [LID + 1, 0, 4])]
    w.complete()
    got = a.received()
    assert [(m[0], m[3]) for m in got] == [(P.ADD_BATCH, [LID, 10, 24])]
    assert b.acked() == [(LID + 1, 5)]


def test_a_group_that_needs_no_sync_is_answered_after_the_one_before(make_worker):
    """A second fence of a ledger fenced by the group in flight appends nothing, so
    its group begins no sync: it is still answered after the first fence, once that
    one's sync completed."""
    w = make_worker()
    c = Client(w)
    c.add(0)
    w._start_sync()
    w.complete()
    assert c.acked() == [(LID, 0)]
    c.send(P.read_lac(21, LID, fence=True, master_key=KEY))
    w._start_sync()
    assert w.sync_job is not None and c.received() == []
    c.send(P.read_lac(22, LID, fence=True, master_key=KEY))
    assert c.received() == []             # the ledger is fenced, but not durably yet
    w.complete()
    got = c.received()
    assert [(m[0], m[1], m[2]) for m in got] == [(P.READ_LAC, 21, EOK), (P.READ_LAC, 22, EOK)]
    assert w.sync_job is None


def test_long_polls_wake_after_the_sync_of_the_lac(make_worker):
    w = make_worker()
    c, tail = Client(w), Client(w)
    c.add(0, 1)
    w._start_sync()
    w.complete()
    c.received()
    tail.send(P.read(31, LID, 1, long_poll=True, previous_lac=0, timeout_ms=60_000))
    assert tail.received() == []
    c.add(2)                              # carries LAC 1: the tailer's entry is confirmed
    w._start_sync()
    assert tail.received() == []          # not before that sync
    w.complete()
    got = tail.received()
    assert [(m[0], m[1], m[2], m[4], m[7]) for m in got] == [(P.READ, 31, EOK, 1, b"x1")]


def test_quiesce_makes_everything_durable_and_answered_in_order(make_worker):
    w = make_worker()
    c = Client(w)
    c.add(0)
    w._start_sync()
    c.add(1, 2)
    w._run_sync(w._sync_jobs.popleft())   # completed, the loop not told yet
    w._quiesce()                          # takes that completion, syncs the rest
    assert c.acked() == [(LID, 0), (LID, 1), (LID, 2)]
    assert w.sync_job is None and w.held == []
    assert w.storage.unsynced_bytes == 0


def test_without_sync_data_answers_at_once(make_worker):
    w = make_worker(journalSyncData=False)
    c = Client(w)
    c.add(0, 1)
    w._start_sync()
    assert w.sync_job is None and not w._sync_jobs
    assert c.acked() == [(LID, 0), (LID, 1)]


def _aio_completed(w) -> bool:
    """Poll the worker's AIO eventfd as its loop does; True once nothing is in flight."""
    w._on_aio_done()
    return w.sync_job is None


def test_syncs_through_linux_aio_keep_the_group_commit_rules(make_worker):
    """With Linux AIO (bk.bookie.aiosync) a group's fdatasync needs no sync thread:
    nothing is answered before its completion is reaped, groups are answered in
    order, the next group's sync begins first, and _quiesce waits for one in flight."""
    StepWorker.aio = True
    try:
        w = make_worker()
    finally:
        StepWorker.aio = False
    assert w._aio is not None, "Linux AIO is not available here"
    c = Client(w)
    j = w.storage._journal
    w.storage._journal.sync()     # the first segment's directory entry is synced: the
    w.storage._journal._dir_dirty = False     # groups below take AIO, not the thread
    c.add_batch(range(0, 20))
    w._start_sync()
    first = w.sync_job
    assert first is not None and w._aio.busy and not w._sync_jobs and c.acked() == []
    c.add_batch(range(20, 30))                            # the next group, held
    wait_until(lambda: _aio_completed(w) or w.sync_job is not first, timeout=10,
               what="the first group's AIO sync reaped")
    assert c.acked() == [(LID, e) for e in range(20)]    # answered after its sync...
    assert w.sync_job is not None and w._aio.busy       # ...the next one already syncing
    assert j._synced >= first.end and first.error is None
    wait_until(lambda: _aio_completed(w), timeout=10, what="the second AIO sync")
    assert c.acked() == [(LID, e) for e in range(20, 30)]
    assert j._synced == j._off and w.storage.unsynced_bytes == 0
    c.add_batch(range(30, 35))
    w._start_sync()
    assert w._aio.busy
    w._quiesce()                                          # waits for it, answers it
    assert c.acked() == [(LID, e) for e in range(30, 35)] and w.sync_job is None
    assert not w._aio.busy and j._synced == j._off
    assert _aio_completed(w)                              # the eventfd drained, no event


def test_journal_sync_through_aio_false_keeps_the_sync_thread(make_worker):
    StepWorker.aio = True
    try:
        w = make_worker(journalSyncThroughAio=False)
    finally:
        StepWorker.aio = False
    assert w._aio is None
    c = Client(w)
    c.add_batch(range(5))
    w._start_sync()
    assert w.sync_job is not None and len(w._sync_jobs) == 1 and c.acked() == []
    w.complete()
    assert c.acked() == [(LID, e) for e in range(5)]


# --- a direct write in flight through Linux AIO: its failure paths ---------------------

def aio_direct_worker(make_direct_worker):
    """A worker whose groups' direct writes go through Linux AIO, and its client."""
    StepWorker.aio = True
    try:
        w = make_direct_worker()
    finally:
        StepWorker.aio = False
    assert w._aio is not None, "Linux AIO is not available here"
    w.storage._journal.sync()                 # the directory synced: groups take AIO
    w.storage._journal._dir_dirty = False
    return w, Client(w)


def submitted(w, c, first: int, n: int):
    """A batch of ``n`` entries from ``first``, its direct write in flight through AIO."""
    c.add_batch(range(first, first + n))
    w._start_sync()
    job = w.sync_job
    assert job is not None and job.parts is not None and job.waiter is not None
    assert w._aio.busy and not w._sync_jobs
    return job


def test_a_failed_direct_write_through_aio_answers_nothing_of_its_group_nor_later(
        make_direct_worker):
    w, c = aio_direct_worker(make_direct_worker)
    submitted(w, c, 0, 10)
    wait_until(lambda: _aio_completed(w), timeout=10, what="the first write")
    assert c.acked() == [(LID, e) for e in range(10)]
    good = refuse_writes(w.storage._journal)
    try:
        submitted(w, c, 10, 10)               # its write fails (EPERM)
        c.add_batch(range(20, 25))            # held behind it
        with pytest.raises(JournalError):
            wait_until(lambda: _aio_completed(w), timeout=10, what="the failed write")
        assert c.acked() == [] and w._failed and w.sync_job is None
        w._drain()                            # the exit: nothing answered, all closed
        assert w.storage is None and w._aio is None
        c.sock.setblocking(True)
        assert c.sock.recv(1 << 16) == b""
    finally:
        os.close(good)


def test_an_exit_after_a_write_out_found_the_write_in_flight_failed(make_direct_worker):
    """A flush's write-out waits for the group's write in flight (the worker reaps it
    from AIO) and finds it failed: the journal is poisoned, the loop raises. The
    exit that follows answers nothing of that group nor of the held one, and still
    closes the connections and the storage (its last sync's failure must not cut
    the exit short)."""
    w, c = aio_direct_worker(make_direct_worker)
    good = refuse_writes(w.storage._journal)
    try:
        job = submitted(w, c, 0, 10)
        c.add_batch(range(10, 15))            # held
        with pytest.raises(JournalError):
            w.storage._journal.write_out()    # waits for the write in flight: failed
        assert job.done.is_set() and job.error is not None and not w._aio.busy
        w._drain()
        assert w.storage is None and w._failed and w.held == []
        c.sock.setblocking(True)
        assert c.sock.recv(1 << 16) == b""    # closed with nothing sent
    finally:
        os.close(good)


def test_letting_aio_go_with_a_direct_write_in_flight_keeps_its_result(make_direct_worker):
    """AIO dropped while a group's direct write is in flight (the exit's _close_aio
    after a _quiesce that did not wait): the completion is reaped into the job
    first, so that the journal's wait for it (its close, a roll) does not look for
    a context that is gone; the group is then answered as usual."""
    w, c = aio_direct_worker(make_direct_worker)
    job = submitted(w, c, 0, 10)
    w._close_aio()
    assert w._aio is None and job.done.is_set() and job.error is None
    c.add_batch(range(10, 15))
    w._quiesce()
    assert c.acked() == [(LID, e) for e in range(15)]
    j = w.storage._journal
    assert w.sync_job is None and j._synced == j._off


def test_a_direct_write_aio_refuses_goes_to_the_sync_thread(make_direct_worker, monkeypatch):
    """io_submit refuses the group's write: AIO is dropped, the job goes to the sync
    thread, not marked as submitted to AIO (so nothing waits for a reap that will
    never come), and the journal's next write of its blocks runs it if the thread
    has not yet."""
    w, c = aio_direct_worker(make_direct_worker)
    aio = w._aio

    def refused(fd, chunks, offset):
        raise OSError(errno.EINVAL, "io_submit of a direct write failed: Invalid argument")
    monkeypatch.setattr(aio, "submit_write", refused)
    c.add_batch(range(10))
    w._start_sync()
    job = w.sync_job
    assert w._aio is None and job.waiter is None and list(w._sync_jobs) == [job]
    c.add_batch(range(10, 15))
    w.storage._journal.write_out()            # the write not started yet: run here
    assert job.done.is_set() and job.error is None and c.acked() == []
    w.complete()                              # the sync thread's turn: nothing to write
    assert c.acked() == [(LID, e) for e in range(10)]
    w.complete()                              # the held group's, on the thread too
    assert c.acked() == [(LID, e) for e in range(10, 15)]


def test_a_write_out_that_reaped_the_write_in_flight_leaves_one_completion(
        make_direct_worker):
    """The journal reaped the group's write (a flush's write-out, _aio_wait): the
    worker's _quiesce answers that group without reaping again, and the eventfd's
    count left behind completes nothing more."""
    w, c = aio_direct_worker(make_direct_worker)
    job = submitted(w, c, 0, 10)
    c.add_batch(range(10, 15))
    w.storage._journal.write_out()
    assert job.done.is_set() and not w._aio.busy and c.acked() == []
    w._quiesce()
    assert c.acked() == [(LID, e) for e in range(15)] and w.sync_job is None
    assert _aio_completed(w) and c.acked() == []
    submitted(w, c, 15, 5)                    # and the next group goes on as usual
    wait_until(lambda: _aio_completed(w), timeout=10, what="the next write")
    assert c.acked() == [(LID, e) for e in range(15, 20)]
