"""ioThreadSliceMicros on real processes: a started bookie's shard-worker loops and
a client's I/O thread carry the configured slice (read back from the kernel);
the bookie's other threads and processes keep the default."""

from __future__ import annotations

import os
import threading

from bk import sched
from bk.testing import wait_until

SLICE = 300          # us; not the kernel's default anywhere (0.75 ms x (1 + log2 cores))


def _threads(pid: int) -> dict:
    """tid -> thread name of a process."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
        except OSError:
            pass                                  # a thread that just ended
    return out


def _io_threads() -> list:
    """Native ids of this process's client I/O threads."""
    return [t.native_id for t in threading.enumerate() if t.name == "bk-io"]


def test_worker_loops_and_the_client_io_thread_carry_the_slice(cluster_factory):
    default = sched.current_slice()              # this process was given no hint
    supported = default is not None
    c = cluster_factory(1, num_shards=2, conf_overrides={"ioThreadSliceMicros": SLICE})
    b = c.bookies[0]
    wait_until(lambda: len(b.worker_pids()) == 2, 30, "both shard workers")
    workers = b.worker_pids()
    with c.client(ioThreadSliceMicros=SLICE) as bk:
        h = bk.create_ledger(1, 1, 1, password=b"p")
        h.add_entry(b"x")                        # the I/O thread runs (started on first use)
        assert h.read_entries(0, 0)[0].data == b"x"
        io = _io_threads()
        assert len(io) == 1
        io_slice = sched.current_slice(io[0])
        h.close()
    loops = [sched.current_slice(pid) for pid in workers]   # a worker's loop: its main thread
    others = {name: sched.current_slice(tid) for pid in workers
              for tid, name in _threads(pid).items() if tid != pid}
    arbiter = sched.current_slice(b.pid)
    if supported:
        assert io_slice == SLICE
        assert loops == [SLICE, SLICE]
        # the sync and flusher threads were started by the loop after its request
        assert others and set(others.values()) == {default}, others
        assert arbiter == default
        assert sched.current_slice() == default            # the application's thread
    else:
        assert io_slice is None and loops == [None, None]


def test_without_the_setting_nothing_is_asked(cluster_factory):
    default = sched.current_slice()
    c = cluster_factory(1, num_shards=1)
    b = c.bookies[0]
    wait_until(lambda: len(b.worker_pids()) == 1, 30, "the shard worker")
    with c.client() as bk:
        h = bk.create_ledger(1, 1, 1, password=b"p")
        h.add_entry(b"y")
        io = _io_threads()
        assert [sched.current_slice(t) for t in io] == [default]
        h.close()
    assert [sched.current_slice(pid) for pid in b.worker_pids()] == [default]
