"""TLSStream (bk.security.tls), the TLS of the client's I/O loop and the shard
workers, over real non-blocking sockets and real TLS contexts: frames larger
than a record, records split over socket reads, the frame buffer's size."""

import os
import socket
import ssl

import pytest

from bk import protocol as P
from bk.config import Config
from bk.security import pki, tls


def conf(**kw):
    return Config.load(overrides=kw, env={})


def stream_pair(tmp_path, sndbuf=None):
    """(client, server, client socket, server socket): TLSStreams over a
    connected non-blocking socket pair (send buffers of ``sndbuf`` bytes if
    given), handshake done."""
    ca = pki.make_ca(str(tmp_path))
    crt, key = ca.issue("bookie", ["127.0.0.1"], common_name="bookie")
    server_ctx = tls.server_context(conf(tlsCertificatePath=crt, tlsKeyStore=key))
    client_ctx = tls.client_context(conf(tlsEnabled=True, tlsTrustStore=ca.cert_path))
    a, b = socket.socketpair()
    for s in (a, b):
        s.setblocking(False)
        if sndbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    client = tls.TLSStream(client_ctx, a, server_side=False, server_hostname="127.0.0.1")
    server = tls.TLSStream(server_ctx, b, server_side=True)
    scratch = bytearray(1 << 16)
    done = {client: False, server: False}
    for _ in range(100):
        for t in (client, server):
            t.feed(scratch)
            done[t] = done[t] or t.handshake()
            t.flush()
        if all(done.values()):
            break
    assert all(done.values())
    return client, server, a, b


@pytest.fixture
def pair(tmp_path):
    """(client, server) TLSStreams over a connected socket pair, handshake done."""
    client, server, a, b = stream_pair(tmp_path)
    yield client, server
    a.close()
    b.close()


def _pump(src, dst, fb, scratch, want):
    """Send src's backlog and decrypt it at dst, one socket read (of at most
    len(scratch) bytes) at a time, until ``want`` frames arrived; the frames and
    how many reads it took."""
    frames, reads = [], 0
    for _ in range(1_000_000):
        src.flush()
        reads += 1
        dst.recv_into(fb, scratch)
        frames += fb.frames()
        if len(frames) >= want:
            return frames, reads
    raise AssertionError(f"{len(frames)} of {want} frames arrived")


def test_a_frame_larger_than_a_record_arrives_whole_over_small_reads(pair):
    """A 1 MiB frame is 64+ records; read 1000 ciphertext bytes at a time, records
    arrive cut anywhere (header and body split across reads), and the frame comes
    out whole, once, after its last record; the small frame after it too."""
    client, server = pair
    body = bytes(range(256)) * 4096                      # 1 MiB, not all zeros
    big = P.encode_frame([P.PING, 1, body])
    small = P.encode_frame([P.PING, 2, b"tail"])
    client.encrypt([big, small])
    assert client.backlog_bytes > len(big) + len(small)  # plaintext plus record overhead
    fb = P.FrameBuffer(4 << 20)
    frames, reads = _pump(client, server, fb, bytearray(1000), 2)
    assert [m[1] for m in frames] == [1, 2]
    assert frames[0][2] == body and frames[1][2] == b"tail"
    assert reads > len(big) // 1000                      # it did come in pieces
    assert fb.pending == 0 and client.backlog_bytes == 0


def test_many_records_per_read_do_not_grow_the_frame_buffer(pair):
    """Frames of ~30 KiB (two records each, as a batch of adds) read whole in one
    socket read: the frame buffer keeps the size a plaintext connection has
    (each SSL read asks it for one record's room, not a socket read's)."""
    client, server = pair
    fb = P.FrameBuffer(1 << 20, capacity=1 << 18)
    scratch = bytearray(1 << 18)
    for i in range(200):
        client.encrypt([P.encode_frame([P.PING, i, bytes(30_000)])])
        frames, _ = _pump(client, server, fb, scratch, 1)
        assert [m[1] for m in frames] == [i]
    assert len(fb._buf) == 1 << 18


def test_answers_flow_both_ways_interleaved_with_partial_records(pair):
    """Requests one way and answers the other, each side reading whatever part of
    the other's records has arrived: every frame arrives once, in order."""
    client, server = pair
    fbs, fbc = P.FrameBuffer(1 << 20), P.FrameBuffer(1 << 20)
    scratch = bytearray(7001)                            # cuts records anywhere
    sent = answered = 0
    got_server, got_client = [], []
    for _ in range(100_000):
        if sent < 500:
            client.encrypt([P.encode_frame([P.PING, sent, b"r" * (sent * 37 % 20_000)])])
            sent += 1
        client.flush()
        server.recv_into(fbs, scratch)
        for m in fbs.frames():
            got_server.append(m[1])
            server.encrypt([P.encode_frame([P.PING, m[1], b"a" * 50])])
        server.flush()
        client.recv_into(fbc, scratch)
        got_client += [m[1] for m in fbc.frames()]
        answered = len(got_client)
        if answered == 500:
            break
    assert got_server == got_client == list(range(500))


def test_a_full_socket_keeps_the_rest_of_one_piece_and_of_later_ones_in_order(tmp_path):
    """Small send buffers: the one-piece backlog (one large encrypt) is taken in
    parts, later encrypts queue behind what is left, ``backlog_bytes`` counts what
    waits, and everything arrives once, in order, whatever scratch each read uses."""
    client, server, a, b = stream_pair(tmp_path, sndbuf=8192)
    try:
        body = bytes(range(256)) * 2048                  # 512 KiB
        client.encrypt([P.encode_frame([P.PING, 1, body])])
        assert len(client.backlog) == 1
        left = client.flush()
        assert 0 < left == client.backlog_bytes          # the socket took only a part
        assert left == sum(map(len, client.backlog))
        client.encrypt([P.encode_frame([P.PING, 2, b"second"])])
        client.encrypt([P.encode_frame([P.PING, 3, b"third"])])
        assert client.backlog_bytes == sum(map(len, client.backlog))
        fb = P.FrameBuffer(4 << 20)
        scratches = [bytearray(3000), bytearray(1 << 16), bytearray(777)]
        got = []
        for i in range(100_000):
            left = client.flush()
            assert left == sum(map(len, client.backlog))
            server.recv_into(fb, scratches[i % 3])       # a new scratch each time
            got += fb.frames()
            if len(got) == 3:
                break
        assert [m[1] for m in got] == [1, 2, 3]
        assert got[0][2] == body and got[2][2] == b"third"
        assert client.backlog == [] and client.backlog_bytes == 0
    finally:
        a.close()
        b.close()


def test_one_buffer_and_many_buffers_encrypt_to_the_same_frames(pair):
    """A lone buffer (the fast path), a list of small ones joined, and a list with a
    buffer of several records among small ones all decrypt to the frames sent."""
    client, server = pair
    big = P.encode_frame([P.PING, 2, b"x" * 100_000])
    sends = [[P.encode_frame([P.PING, 0, b"alone"])],
             [P.encode_frame([P.PING, 1, b"s" * 30])] * 3,
             [big[:40], big[40:], P.encode_frame([P.PING, 3, b"after"])]]
    fb = P.FrameBuffer(1 << 20)
    scratch = bytearray(1 << 18)
    got = []
    for bufs in sends:
        client.encrypt(bufs)
        client.flush()
        server.recv_into(fb, scratch)
        got += fb.frames()
    assert [m[1] for m in got] == [0, 1, 1, 1, 2, 3]
    assert got[0][2] == b"alone" and got[4][2] == b"x" * 100_000


def test_eof_in_the_middle_of_a_record_ends_the_stream_after_the_whole_ones(pair):
    """The peer's socket closes half way through a record: the records before it
    are delivered, then ``eof`` is set; no exception, no half frame."""
    client, server = pair
    client.encrypt([P.encode_frame([P.PING, 1, b"whole"])])
    whole = b"".join(bytes(x) for x in client.backlog)
    client.backlog.clear()
    client.backlog_bytes = 0
    client.encrypt([P.encode_frame([P.PING, 2, b"y" * 5000])])
    second = b"".join(bytes(x) for x in client.backlog)
    client.sock.sendall(whole + second[:len(second) // 2])
    client.sock.shutdown(socket.SHUT_WR)
    fb = P.FrameBuffer(1 << 20)
    scratch = bytearray(1 << 16)
    frames = []
    for _ in range(1000):
        server.recv_into(fb, scratch)
        frames += fb.frames()
        if server.eof:
            break
    assert server.eof
    assert [m[1] for m in frames] == [1]
    assert server.recv_into(fb, scratch) == 0 and list(fb.frames()) == []


def test_close_notify_ends_the_stream_after_the_frames_before_it(pair):
    """The peer sends frames, then TLS's close_notify (``unwrap``) in the same
    socket read: the frames come out, then ``eof`` is set, with no exception."""
    client, server = pair
    client.encrypt([P.encode_frame([P.PING, i, b"z" * 2000]) for i in range(5)])
    with pytest.raises(ssl.SSLWantReadError):        # waits for the peer's close_notify
        client.obj.unwrap()
    client._pull()
    while client.flush():
        pass
    fb = P.FrameBuffer(1 << 20)
    got = server.recv_into(fb, bytearray(1 << 18))
    assert got == 5 * len(P.encode_frame([P.PING, 0, b"z" * 2000]))
    assert [m[1] for m in fb.frames()] == list(range(5))
    assert server.eof


def test_a_throwaway_ca_leaves_nothing_behind_when_its_process_exits():
    """pki.throwaway_ca (the benchmarks' TLS runs): its directory, private keys
    included, exists while the process runs and is gone once it exits."""
    import subprocess
    import sys
    code = ("from bk.security import pki; ca = pki.throwaway_ca(); "
            "crt, key = ca.issue('b', ['127.0.0.1']); import os; "
            "assert os.path.exists(key) and os.path.exists(os.path.join(ca.dir, 'ca.key')); "
            "print(ca.dir)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out.startswith("/") and "throwaway" in out
    assert not os.path.exists(out)
