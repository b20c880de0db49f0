#!/usr/bin/env python
"""What one group commit costs a shard worker's thread, without a cluster.

    python scripts/bench_group_cycle.py                  # groups of 43 entries (30,000/s on a quiet VM)
    python scripts/bench_group_cycle.py --entries 10 43 150
    python scripts/bench_group_cycle.py --tls            # the client's connection is TLS
    python scripts/bench_group_cycle.py --frames 2       # two frames of 43 a group (a group wait)

A real ShardWorker (real storage in a temporary directory, Linux AIO syncs as in
production) in this process and one client socket on the loopback. A cycle is
one group: the client sends one ADD_BATCH of N entries of 1 KiB (or ``--frames``
of them, each read in a pass of its own, as a group wait gathers them); the
worker reads and appends it (``_on_readable``), begins the group's sync (``_start_sync``:
the journal's pwrite and ``io_submit``); once the AIO completion is signalled
the worker reaps it and answers the group (``_on_aio_done``); the client reads
its acknowledgement. The worker's steps are timed with the thread's CPU clock
(not the waits between them), so the figure is a worker's CPU per group and
per entry at that group size; the difference between two sizes splits it into
a fixed part per group and a part per entry. Run it alternating between two
trees (``PYTHONPATH=<tree>``) for an A/B of the worker's per-group path.
"""

import argparse
import os
import select
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import msgpack  # noqa: E402

from bk import protocol as P  # noqa: E402
from bk.bookie.worker import ShardWorker  # noqa: E402
from bk.config import Config  # noqa: E402

KEY = b"k" * 20


class _Worker(ShardWorker):
    def _may_sync_inline(self) -> bool:      # the pipelined sync, as at 30,000 entries/s
        return False


def _boot(tmp: str, tls_conf: dict) -> ShardWorker:
    conf = Config.load(env={}, overrides={
        "journalDirectories": os.path.join(tmp, "journal"),
        "ledgerDirectories": os.path.join(tmp, "ledgers"),
        "numShards": 1, "enableStatistics": True, **tls_conf})
    ctrl, _arbiter = socket.socketpair()
    w = _Worker(conf, 0, 1, ctrl)
    w._keep = _arbiter
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1,
                                               signal.SIGHUP)}
    try:
        w._boot()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    return w


class _Client:
    def __init__(self, w: ShardWorker, ca=None):
        srv = socket.create_server(("127.0.0.1", 0))
        self.sock = socket.create_connection(srv.getsockname())
        theirs, _ = srv.accept()
        srv.close()
        for s in (self.sock, theirs):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.fb = P.FrameBuffer(1 << 24)
        self.tls = None
        before = set(w.conns)
        w._adopt(theirs.detach(), msgpack.packb(P.hello(1, 0, start_tls=ca is not None),
                                                use_bin_type=True))
        (self.conn,) = w.conns - before
        self.w = w
        if ca is not None:
            self._handshake(ca)
        self.recv_frames()

    def _handshake(self, ca):
        import ssl
        from bk.security import tls
        ctx = ssl.create_default_context(cafile=ca)
        self.recv_frames()                      # HELLO's answer, in plaintext
        self.tls = tls.TLSStream(ctx, self.sock, server_side=False, server_hostname="127.0.0.1")
        self.sock.setblocking(False)
        ep = select.epoll()
        ep.register(self.conn.sock.fileno(), select.EPOLLIN)
        while not self.tls.handshake():
            self.tls.flush()
            ep.poll(0.5)
            self.w._on_readable(self.conn)
            select.select([self.sock], [], [], 0.5)
            self.tls.feed(bytearray(1 << 16))
        self.tls.flush()
        self.send(P.encode_frame(P.auth(2, None)))
        ep.poll(1)
        self.w._on_readable(self.conn)
        ep.close()

    def send(self, frame: bytes):
        if self.tls is None:
            self.sock.setblocking(True)
            self.sock.sendall(frame)
            return
        self.tls.encrypt([frame])
        while self.tls.flush():
            select.select([], [self.sock], [], 1)

    def recv_frames(self) -> list:
        self.sock.setblocking(True)
        while True:
            if self.tls is None:
                n = self.sock.recv_into(self.fb.recv_buffer(1 << 16), 1 << 16)
                self.fb.commit(n)
            else:
                select.select([self.sock], [], [], 1)
                self.sock.setblocking(False)
                self.tls.recv_into(self.fb, bytearray(1 << 16))
            got = list(self.fb.frames())
            if got:
                return got


def run(entries: int, cycles: int, tls_conf: dict, ca, frames: int = 1) -> tuple:
    tmp = tempfile.mkdtemp(prefix="bk-group-cycle-")
    w = _boot(tmp, tls_conf)
    if w._aio is None:
        raise SystemExit("no Linux AIO here: the loop would sync on its thread")
    c = _Client(w, ca)
    ep = select.epoll()
    ep.register(c.conn.sock.fileno(), select.EPOLLIN)
    lid, eid = 7, 0
    payload = b"p" * 1000
    clock = time.thread_time
    per_cycle = []
    steps = [0.0, 0.0, 0.0]
    warm = min(200, cycles)
    for i in range(warm + cycles):
        read = 0.0
        for _ in range(frames):
            frame = P.encode_add_batch(eid, KEY, 0, [(lid, e, e - 1, b"", payload)
                                                     for e in range(eid, eid + entries)])
            eid += entries
            c.send(frame)
            ep.poll(5)                # the frame is there, as the loop's epoll says
            t0 = clock()
            w._on_readable(c.conn)
            read += clock() - t0
        t1 = clock()
        t0 = t1 - read
        w._start_sync()
        t2 = clock()
        spent = 0.0
        while w.sync_job is not None:
            ready, _, _ = select.select([w._aio.fd, w._sync_r], [], [], 5)
            t3 = clock()
            if w._aio.fd in ready:
                w._on_aio_done()
            elif w._sync_r in ready:  # the first group after a roll syncs on the thread
                w._on_sync_done()
            spent += clock() - t3
        c.recv_frames()
        if i >= warm:
            per_cycle.append(t2 - t0 + spent)
            steps[0] += t1 - t0
            steps[1] += t2 - t1
            steps[2] += spent
    w.storage.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return statistics.median(per_cycle), [s / cycles for s in steps]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--entries", type=int, nargs="+", default=[43])
    p.add_argument("--cycles", type=int, default=2000)
    p.add_argument("--tls", action="store_true")
    p.add_argument("--frames", type=int, default=1, help="ADD_BATCH frames of --entries a group")
    a = p.parse_args()
    tls_conf, ca = {}, None
    if a.tls:
        from bk.security import pki
        authority = pki.throwaway_ca("bk-group-cycle-ca-")
        crt, key = authority.issue("bookie", ["127.0.0.1"])
        tls_conf = {"tlsCertificatePath": crt, "tlsKeyStore": key, "tlsRequired": False}
        ca = authority.cert_path
    for per_frame in a.entries:
        n = per_frame * a.frames
        med, (read, begin, done) = run(per_frame, a.cycles, tls_conf, ca, a.frames)
        how = f" in {a.frames} frames" if a.frames > 1 else ""
        print(f"{n} entries a group{how}{' (TLS)' if a.tls else ''}: worker CPU per group "
              f"{med * 1e6:.1f} us (median), {med / n * 1e6:.2f} us an entry; means: "
              f"read+append {read * 1e6:.1f}, begin sync {begin * 1e6:.1f}, "
              f"completion+answer {done * 1e6:.1f} us")


if __name__ == "__main__":
    main()
