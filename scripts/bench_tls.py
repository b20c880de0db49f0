#!/usr/bin/env python3
"""Micro-benchmark of TLSStream (bk.security.tls) alone: one process, one
connected socket pair, no bookie, no event loop.

    scripts/bench_tls.py                       # µs per 1 KiB frame, per 40 KiB batch, per ack
    scripts/bench_tls.py --rounds 5 --count 20000
    scripts/bench_tls.py --tls12 ECDHE+AESGCM  # TLS 1.2 with that cipher list (to compare ciphers)
    scripts/bench_tls.py --compare /tmp/base   # also /tmp/base/bk/security/tls.py's TLSStream, alternating
    scripts/bench_tls.py --opcodes --compare /tmp/base   # Python opcodes per send and receive instead

Each case sends frames one way and reads them at the other end, the way the
client and the shard worker do (``encrypt`` + ``flush`` on one side,
``recv_into`` + ``FrameBuffer.frames`` on the other), and prints the CPU time
(``time.thread_time``) of each side per frame, beside the same with plaintext
(``sendmsg`` / ``recv_into``) over the same sockets. Cases:

  frame   one 1 KiB frame per send (an add sent alone)
  batch   40 frames of 1 KiB per send (a 40 KiB batch: one encrypt of 40 buffers)
  ack     one 40-byte frame per send (an answer to an add batch)
  acks10  ten 40-byte frames per send (answers of one group commit, one release)
  q8, q30, q100  what the client sends a bookie: a 40-byte frame head, then the
          batch's records (8, 30, 100 KiB) as one buffer shared by the quorum;
          per 1 KiB of records

Rounds alternate plaintext and TLS; the best and the median round are printed.
"""

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time


def _pair(tls12, cls=None):
    from bk.config import Config
    from bk.security import pki, tls
    with tempfile.TemporaryDirectory(prefix="bk-bench-tls-") as d:   # loaded, then gone
        ca = pki.make_ca(d)
        crt, key = ca.issue("bookie", ["127.0.0.1"], common_name="bookie")
        sctx = tls.server_context(Config.load(overrides={"tlsCertificatePath": crt,
                                                         "tlsKeyStore": key}, env={}))
        cctx = tls.client_context(Config.load(overrides={"tlsEnabled": True,
                                                         "tlsTrustStore": ca.cert_path},
                                              env={}))
    if tls12:
        import ssl
        for c in (sctx, cctx):
            c.maximum_version = ssl.TLSVersion.TLSv1_2
            c.set_ciphers(tls12)
    a, b = socket.socketpair()
    for s in (a, b):
        s.setblocking(False)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    cls = cls or tls.TLSStream
    c = cls(cctx, a, server_side=False, server_hostname="127.0.0.1")
    s = cls(sctx, b, server_side=True)
    scratch = bytearray(1 << 18)
    done = {c: False, s: False}
    for _ in range(100):
        for t in (c, s):
            t.feed(scratch)
            done[t] = done[t] or t.handshake()
            t.flush()
        if all(done.values()):
            break
    assert all(done.values()), "handshake did not finish"
    return c, s, a, b


def _frames(P, size, k):
    body = os.urandom(size)
    if k < 0:       # one frame as a head and its payload (the client's ADD_BATCH)
        f = P.encode_frame([P.PING, 0, body])
        return [f[:40], f[40:]]
    return [P.encode_frame([P.PING, i, body]) for i in range(k)]


def run_tls(P, src, dst, frames, count, scratch):
    """Send ``frames`` ``count`` times; (sender, receiver) CPU µs per frame."""
    fb = P.FrameBuffer(8 << 20)
    k, per = _per(frames)
    tt = time.thread_time_ns
    ts = tr = 0
    for _ in range(count):
        t0 = tt()
        src.encrypt(frames)
        src.flush()
        t1 = tt()
        got = 0
        while got < k:
            dst.recv_into(fb, scratch)
            got += len(list(fb.frames()))
        t2 = tt()
        ts += t1 - t0
        tr += t2 - t1
    n = count * per
    return ts / n / 1000, tr / n / 1000


def run_plain(P, a, b, frames, count, scratch):
    fb = P.FrameBuffer(8 << 20)
    k, per = _per(frames)
    tt = time.thread_time_ns
    ts = tr = 0
    for _ in range(count):
        t0 = tt()
        a.sendmsg(frames)
        t1 = tt()
        got = 0
        while got < k:
            try:
                m = b.recv_into(fb.recv_buffer(1 << 18), 1 << 18)
            except BlockingIOError:
                continue
            fb.commit(m)
            got += len(list(fb.frames()))
        t2 = tt()
        ts += t1 - t0
        tr += t2 - t1
    n = count * per
    return ts / n / 1000, tr / n / 1000


def _per(frames):
    """(frames per send, units per send: frames, or KiB of a head+payload send)."""
    if len(frames) == 2 and len(frames[0]) == 40:
        return 1, len(frames[1]) / 1024
    return len(frames), len(frames)


def opcodes(fn) -> int:
    """Python opcodes ``fn()`` executes (sys.settrace): a count the machine's noise
    does not touch."""
    n = 0

    def tracer(frame, event, arg):
        nonlocal n
        frame.f_trace_opcodes = True
        if event == "opcode":
            n += 1
        return tracer
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return n


def run_opcodes(P, pairs, scratch):
    for name in ("frame", "ack", "q30"):
        size, k = CASES[name]
        frames = _frames(P, size, k)
        for mode, (c, s, _, _) in pairs.items():
            src, dst = (s, c) if size < 100 else (c, s)
            fb = P.FrameBuffer(8 << 20)
            for _ in range(3):            # the last of three (caches, first-call paths)
                snd = opcodes(lambda: (src.encrypt(frames), src.flush()))
                rcv = opcodes(lambda: dst.recv_into(fb, scratch))
                list(fb.frames())
            print(f"{name:8} {mode:6} send {snd:4} opcodes, receive {rcv:4} opcodes")


CASES = {"frame": (1024, 1), "batch": (1024, 40), "ack": (30, 1), "acks10": (30, 10),
         "q8": (8 << 10, -1), "q30": (30 << 10, -1), "q100": (100 << 10, -1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--count", type=int, default=4000, help="sends per case and round "
                    "(frames: count x the case's frames per send)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--tls12", metavar="CIPHERS", help="TLS 1.2 only, with these ciphers")
    ap.add_argument("--compare", metavar="TREE", help="a source tree whose bk/security/tls.py "
                    "TLSStream runs too ('old'), alternating with this one's ('tls')")
    ap.add_argument("--opcodes", action="store_true", help="count the Python opcodes of one "
                    "send and one receive per case instead of timing them")
    a = ap.parse_args()
    from bk import protocol as P
    from bk.security import tls as T
    pairs = {"tls": _pair(a.tls12)}
    if a.compare:
        import importlib.util
        spec = importlib.util.spec_from_file_location(
            "bk_tls_old", os.path.join(a.compare, "bk", "security", "tls.py"))
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        pairs = {"old": _pair(a.tls12, old.TLSStream), **pairs}
    c = pairs["tls"][0]
    print(f"bk.security.tls from {T.__file__}; cipher {c.obj.cipher()[0]} {c.obj.version()}")
    scratch = bytearray(1 << 18)
    if a.opcodes:
        run_opcodes(P, pairs, scratch)
        return
    print(f"{'case':8} {'mode':6} {'send us/frame':>16} {'recv us/frame':>16}   (best / median of "
          f"{a.rounds} rounds; q*: per KiB)")
    for name in a.cases.split(","):
        size, k = CASES[name]
        frames = _frames(P, size, k)
        # small acks flow server -> client (as a bookie answers), the rest client -> server
        ends = {m: ((s, c, sb, sa) if size < 100 else (c, s, sa, sb))
                for m, (c, s, sa, sb) in pairs.items()}
        res = {"plain": [], **{m: [] for m in pairs}}
        sends = max(50, a.count * 4 // abs(k) // max(1, size >> 12)) if k != 1 else a.count * 4
        for m, (src, dst, _, _) in ends.items():
            run_tls(P, src, dst, frames, 200, scratch)          # warm up
        for _ in range(a.rounds):
            x, y = ends["tls"][2:]
            res["plain"].append(run_plain(P, x, y, frames, sends, scratch))
            for m, (src, dst, _, _) in ends.items():
                res[m].append(run_tls(P, src, dst, frames, sends, scratch))
        for mode, rs in res.items():
            snd = sorted(r[0] for r in rs)
            rcv = sorted(r[1] for r in rs)
            print(f"{name:8} {mode:6} {snd[0]:7.3f} /{statistics.median(snd):7.3f} "
                  f"{rcv[0]:7.3f} /{statistics.median(rcv):7.3f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
