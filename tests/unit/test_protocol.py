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
    assert len(fb._buf) < 70000


@given(st.lists(st.integers(0, 10000), unique=True))
def test_ranges_round_trip(ids):
    ids = sorted(ids)
    assert P.ranges_to_ids(P.ids_to_ranges(ids)) == ids


def test_ranges_are_compact():
    assert P.ids_to_ranges([0, 1, 2, 5, 7, 8]) == [0, 2, 5, 5, 7, 8]
