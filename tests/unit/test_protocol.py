"""The sans-IO codec: no sockets, just bytes in and frames out."""

import struct

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from bk import protocol as P
from bk.errors import ProtocolError

ints = st.integers(min_value=-1, max_value=2**63 - 1)
blobs = st.binary(max_size=2048)
requests = st.one_of(
    st.builds(P.hello, ints, st.integers(-1, 255), st.one_of(st.none(), st.text(max_size=20))),
    st.builds(P.add, ints, ints, ints, ints, blobs, blobs, blobs, st.booleans()),
    st.builds(P.read, ints, ints, ints, st.booleans(), st.one_of(st.none(), blobs),
              st.booleans(), ints, st.integers(0, 60000)),
    st.builds(P.read_lac, ints, ints, st.booleans(), st.one_of(st.none(), blobs)),
    st.builds(P.write_lac, ints, ints, blobs, ints),
    st.builds(P.get_bookie_info, ints),
    st.builds(P.get_list_of_entries, ints, ints),
    st.builds(P.ping, ints),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(requests, min_size=1, max_size=20), st.integers(1, 64))
def test_round_trip_in_arbitrary_chunks(msgs, chunk):
    data = b"".join(P.encode_frame(m) for m in msgs)
    fb = P.FrameBuffer()
    out = []
    for i in range(0, len(data), chunk):
        fb.feed(data[i:i + chunk])
        out.extend(fb.frames())
    assert out == msgs
    assert fb.pending == 0
    for m in out:
        assert P.check_request(m) == m[0]


def test_partial_frame_waits_for_more():
    frame = P.encode_frame(P.ping(7))
    fb = P.FrameBuffer()
    fb.feed(frame[:-1])
    assert list(fb.frames()) == []
    assert fb.pending == len(frame) - 1
    fb.feed(frame[-1:])
    assert list(fb.frames()) == [[P.PING, 7]]


def test_oversized_frame_is_refused_before_reading_it():
    fb = P.FrameBuffer(max_frame_size=1024)
    fb.feed(struct.pack(">I", 1025))
    with pytest.raises(ProtocolError, match="exceeds the limit of 1024"):
        list(fb.frames())


@pytest.mark.parametrize("body,match", [
    (b"\xc1", "undecodable"),
    (msgpack.packb({"a": 1}), "not a non-empty array"),
    (msgpack.packb([]), "not a non-empty array"),
    (msgpack.packb(5), "not a non-empty array"),
])
def test_bad_bodies(body, match):
    fb = P.FrameBuffer()
    fb.feed(struct.pack(">I", len(body)) + body)
    with pytest.raises(ProtocolError, match=match):
        list(fb.frames())


def test_empty_frame_is_an_error():
    fb = P.FrameBuffer()
    fb.feed(b"\0\0\0\0")
    with pytest.raises(ProtocolError, match="empty frame"):
        list(fb.frames())


@pytest.mark.parametrize("msg,match", [
    ([99, 1], "unknown op"),
    (["ADD", 1], "unknown op"),
    ([P.READ, 1, 2], "READ request has 3 fields, expected 8"),
    ([P.PING, "x"], "request id is not an integer"),
])
def test_check_request_names_the_problem(msg, match):
    with pytest.raises(ProtocolError, match=match):
        P.check_request(msg)


def test_buffer_compacts_instead_of_growing():
    fb = P.FrameBuffer()
    frame = P.encode_frame(P.add(1, 1, 1, 0, b"k", b"d", b"x" * 1000))
    for _ in range(500):
        fb.feed(frame)
        assert len(list(fb.frames())) == 1
    assert len(fb._buf) == 1 << 18          # reused, never grown


def test_recv_buffer_takes_bytes_without_feed_and_grows_only_for_a_large_frame():
    fb = P.FrameBuffer(capacity=4096)
    small = P.encode_frame(P.ping(1))
    big = P.encode_frame(P.add(2, 1, 1, 0, b"k", b"d", b"y" * 100000))
    data = small + big + small
    out = []
    i = 0
    while i < len(data):
        view = fb.recv_buffer(1000)
        k = min(1000, len(data) - i)
        view[:k] = data[i:i + k]             # what sock.recv_into(view) does
        fb.commit(k)
        i += k
        out.extend(fb.frames())
    assert out == [[P.PING, 1], P.add(2, 1, 1, 0, b"k", b"d", b"y" * 100000), [P.PING, 1]]
    assert fb.pending == 0
    assert len(fb._buf) >= 100000            # grew for the large frame
    fb.feed(small)
    assert list(fb.frames()) == [[P.PING, 1]]
    assert len(fb._buf) == 4096              # and shrank back once it was consumed


entries = st.lists(st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1),
                             st.integers(-1, 2**63 - 1), st.binary(max_size=40), blobs),
                   min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(entries, ints, blobs, st.integers(0, 1), st.integers(1, 64))
def test_add_batch_round_trip(ents, rid, key, flags, chunk):
    data = P.encode_add_batch(rid, key, flags, ents) + P.encode_frame(P.ping(3))
    fb = P.FrameBuffer()
    out = []
    for i in range(0, len(data), chunk):
        fb.feed(data[i:i + chunk])
        out.extend(fb.frames())
    assert len(out) == 2 and out[1] == [P.PING, 3]
    msg = out[0]
    assert P.check_request(msg) == P.ADD_BATCH
    assert msg[1:5] == [rid, key, flags, len(ents)]
    assert P.decode_add_batch(msg[5], msg[4]) == [tuple(e) for e in ents]
    # each record's journal body is ledger .. payload, exactly
    for (lid, eid, lac, start, end), e in zip(P.split_add_batch(msg[5], msg[4]), ents):
        body = msg[5][start:end]
        assert struct.unpack_from("<qqqH", body) == (lid, eid, lac, len(e[3]))
        assert body[26:] == e[3] + e[4]


def test_add_batch_head_matches_a_whole_encoding():
    ents = [(5, 0, -1, b"dg", b"payload"), (6, 9, 8, b"", b"")]
    records = b"".join(P.add_record_head(l, e, a, d, len(p)) + p for l, e, a, d, p in ents)
    frame = P.add_batch_head(7, b"key", 1, 2, len(records)) + records
    assert frame == P.encode_add_batch(7, b"key", 1, ents)
    st_ = P.add_record_struct(2)
    assert st_.pack(7, 5, 0, -1, 2, b"dg") == P.add_record_head(5, 0, -1, b"dg", 7)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 2**40)), max_size=50),
       st.lists(st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 2**40),
                          st.integers(1, 200)), max_size=5), ints)
def test_group_ack_round_trip(oks, errs, rid):
    acked = []
    for lid, e in oks:
        P.ack_run(acked, lid, e)
    errors = [x for t in errs for x in t]
    frame = P.encode_frame(P.add_ack(rid, acked, errors))
    fb = P.FrameBuffer()
    fb.feed(frame)
    (msg,) = fb.frames()
    P.check_add_ack(msg)
    assert msg == [P.ADD_BATCH, rid, 0, acked, errors]
    expanded = [(acked[i], e) for i in range(0, len(acked), 3)
                for e in range(acked[i + 1], acked[i + 2] + 1)]
    assert expanded == oks                   # runs, in order, nothing lost or added
    assert len(acked) <= 3 * len(oks)


def test_group_ack_uses_runs_not_lists():
    acked = []
    for e in range(1000):
        P.ack_run(acked, 9, e)
    P.ack_run(acked, 4, 0)
    P.ack_run(acked, 9, 1000)
    assert acked == [9, 0, 999, 4, 0, 0, 9, 1000, 1000]


@settings(max_examples=100, deadline=None)
@given(ints, ints, ints, ints, st.integers(0, 2**31), st.booleans(),
       st.one_of(st.none(), blobs), st.integers(1, 10), st.integers(0, 9))
def test_read_range_round_trip(rid, lid, first, last, budget, fence, key, stride, offset):
    msg = P.read_range(rid, lid, first, last, budget, fence, key, stride, offset)
    fb = P.FrameBuffer()
    fb.feed(P.encode_frame(msg))
    (out,) = fb.frames()
    assert out == msg and P.check_request(out) == P.READ_RANGE


def _records(ents):
    return b"".join(P.add_record_head(l, e, a, d, len(p)) + p for l, e, a, d, p in ents)


@pytest.mark.parametrize("mangle,match", [
    (lambda r: r[:-1], "truncated"),                       # last payload cut short
    (lambda r: r[:40], "truncated"),                       # second record's head cut
    (lambda r: r + b"\0", "carries 1 more bytes"),         # trailing garbage
])
def test_bad_add_batch_records(mangle, match):
    recs = _records([(1, 0, -1, b"dd", b"x" * 10), (1, 1, 0, b"dd", b"y" * 10)])
    with pytest.raises(ProtocolError, match=match):
        P.split_add_batch(mangle(recs), 2)


def test_add_batch_negative_ids():
    for lid, eid in ((-1, 0), (1, -5)):
        recs = struct.pack("<IqqqH", 1, lid, eid, -1, 0) + b"x"
        with pytest.raises(ProtocolError, match="negative"):
            P.split_add_batch(recs, 1)


@pytest.mark.parametrize("count,match", [
    (3, "truncated"),                                      # announces more than it holds
    (1, "carries"),                                        # announces fewer
    (0, "bad entry count"),
    (-1, "bad entry count"),
    (P.MAX_BATCH_ENTRIES + 1, "bad entry count"),          # oversized
    ("2", "bad entry count"),
])
def test_add_batch_wrong_counts(count, match):
    recs = _records([(1, 0, -1, b"", b"a"), (1, 1, 0, b"", b"b")])
    with pytest.raises(ProtocolError, match=match):
        P.split_add_batch(recs, count)


def test_add_batch_records_must_be_bin_and_oversized_frame_is_refused():
    with pytest.raises(ProtocolError, match="not a bin"):
        P.split_add_batch([1, 2], 1)
    frame = P.encode_add_batch(1, b"k", 0, [(1, e, -1, b"", b"z" * 1000) for e in range(10)])
    fb = P.FrameBuffer(max_frame_size=5000)
    fb.feed(frame)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        list(fb.frames())
    # a record announcing a huge payload is truncated, not a big allocation
    bad = struct.pack("<IqqqH", 2**32 - 1, 1, 0, -1, 0) + b"x"
    with pytest.raises(ProtocolError, match="truncated"):
        P.split_add_batch(bad, 1)


@pytest.mark.parametrize("msg", [
    [P.ADD_BATCH, 1, 0, [1, 2], []],
    [P.ADD_BATCH, 1, 0, [1, 2, 3], [1]],
    [P.ADD_BATCH, 1, 0, None, []],
    [P.ADD_BATCH, 1, 0, [1, 2, 3]],
])
def test_malformed_group_ack(msg):
    with pytest.raises(ProtocolError):
        P.check_add_ack(msg)


@given(st.lists(st.integers(0, 10000), unique=True))
def test_ranges_round_trip(ids):
    ids = sorted(ids)
    assert P.ranges_to_ids(P.ids_to_ranges(ids)) == ids


def test_ranges_are_compact():
    assert P.ids_to_ranges([0, 1, 2, 5, 7, 8]) == [0, 2, 5, 5, 7, 8]


@pytest.mark.parametrize("rid", [0, 127, 128, 255, 256, 70_000, 2**32, 2**63])
@pytest.mark.parametrize("key", [b"k" * 20, b"", None, b"x" * 255])
@pytest.mark.parametrize("count", [9, 200, 300])
def test_a_large_add_batch_keeps_its_records_in_place(rid, key, count):
    """A bookie's FrameBuffer (``views``) gives a large ADD_BATCH's records as a
    view of its buffer, with the same fields the general decoding gives; a
    small frame, or any FrameBuffer without ``views``, decodes them to bytes."""
    ents = [(5, e, e - 1, b"dg", bytes([e % 251]) * (9000 // count)) for e in range(count)]
    frame = P.encode_add_batch(rid, key, 1, ents)
    assert len(frame) > P.IN_PLACE_MIN
    general = P.decode_body(frame[4:])
    fb = P.FrameBuffer(views=True)
    fb.feed(frame + P.encode_frame(P.ping(3)))
    got = list(fb.frames())
    assert type(got[0][5]) is memoryview and got[1] == [P.PING, 3]
    assert got[0][:5] == general[:5] and bytes(got[0][5]) == general[5]
    assert P.decode_add_batch(got[0][5], count) == [tuple(e) for e in ents]
    plain = P.FrameBuffer()
    plain.feed(frame)
    (pm,) = plain.frames()
    assert pm == general and type(pm[5]) is bytes
    small = P.encode_add_batch(rid, key, 1, ents[:1])
    fb.feed(small)
    (msg,) = fb.frames()
    assert type(msg[5]) is bytes and msg == P.decode_body(small[4:])


def test_an_add_batch_framed_otherwise_is_decoded_the_general_way():
    """Anything but add_batch_head's framing (a str key, a negative rid, records in
    a bin16, a bin32 whose length is not the rest of the body) is left to
    msgpack: the same list (or the same ProtocolError) as without views."""
    records = _records([(5, e, e - 1, b"", b"p" * 1000) for e in range(10)])
    bodies = [
        P._packb([P.ADD_BATCH, 1, "key", 0, 10, records]),
        P._packb([P.ADD_BATCH, -1, b"key", 0, 10, records]),
        P._packb([P.ADD_BATCH, 1, b"key", 0, 10, records]),   # the records in a bin16
        P._packb([P.ADD_BATCH, 1, b"key", 0, 10, records, 7])[:-1],   # a 7-array, cut
        b"\x96\x08\x01\xc4\x03key\x00\x0a\xc6" + struct.pack(">I", len(records) + 1) + records,
    ]
    for body in bodies:
        frame = struct.pack(">I", len(body)) + body
        fb = P.FrameBuffer(views=True)
        fb.feed(frame)
        try:
            want = [P.decode_body(body)]
        except P.ProtocolError as e:
            with pytest.raises(P.ProtocolError) as got:
                list(fb.frames())
            assert str(got.value) == str(e)
            continue
        got = list(fb.frames())
        assert got == want and all(type(m[5]) is not memoryview for m in got)
