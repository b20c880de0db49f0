"""The log's sans-IO pieces: record-set codec, Position, names, record transitions."""

import pytest
from hypothesis import given, strategies as st

import bk
from bk.log import metadata
from bk.log.records import (END_OF_SEGMENT, HEADER_SIZE, RECORD_OVERHEAD, Position, RecordSetError,
                            check_log_name, decode_record_set, encode_record_set, encoded_size)

records_st = st.lists(st.binary(max_size=300), max_size=40)


@given(records_st, st.integers(0, 2 ** 63 - 1), st.integers(0, 2 ** 63 - 1))
def test_record_set_round_trip(records, before, nbytes):
    payload = encode_record_set(records, before, nbytes)
    assert len(payload) == encoded_size(sum(map(len, records)), len(records))
    rs = decode_record_set(payload)
    assert rs.records == records
    assert rs.records_before == before and rs.bytes_before == nbytes
    assert rs.records_after == before + len(records)
    assert rs.bytes_after == nbytes + sum(map(len, records))


@given(st.lists(st.binary(min_size=0, max_size=50), min_size=1, max_size=10), st.data())
def test_truncated_or_extended_record_set_is_refused(records, data):
    payload = encode_record_set(records)
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(RecordSetError):
        decode_record_set(payload[:cut])
    with pytest.raises(RecordSetError):
        decode_record_set(payload + b"x")


def test_bad_version_and_absurd_count():
    payload = bytearray(encode_record_set([b"a"]))
    payload[0] = 9
    with pytest.raises(RecordSetError, match="version 9"):
        decode_record_set(bytes(payload))
    with pytest.raises(RecordSetError, match="claims"):
        decode_record_set(b"\x01\x00\xff\xff\xff\xff" + bytes(16))
    assert HEADER_SIZE == 22 and RECORD_OVERHEAD == 4


def test_end_of_segment_marker():
    rs = decode_record_set(encode_record_set([], 7, 70, flags=END_OF_SEGMENT))
    assert rs.end_of_segment and rs.records == [] and rs.records_after == 7
    assert not decode_record_set(encode_record_set([b"x"], 7, 70)).end_of_segment


@given(st.tuples(st.integers(0, 10 ** 12), st.integers(0, 10 ** 12), st.integers(0, 10 ** 6)),
       st.tuples(st.integers(0, 10 ** 12), st.integers(0, 10 ** 12), st.integers(0, 10 ** 6)))
def test_position_order_and_text(a, b):
    pa, pb = Position(*a), Position(*b)
    assert (pa < pb) == (a < b)
    assert Position.parse(str(pa)) == pa
    assert str(pa) == "%d:%d:%d" % a


def test_position_parse_errors_and_api():
    assert bk.Position is Position
    assert bk.Position.parse(" 3:17:0 ") == Position(3, 17, 0)
    for bad in ("", "1:2", "1:2:3:4", "a:b:c", "-1:0:0", None):
        with pytest.raises(ValueError):
            Position.parse(bad)
    rec = bk.LogRecord(Position(0, 1, 2), b"x")
    assert rec.position.slot == 2 and rec.data == b"x"


@pytest.mark.parametrize("name", ["", "a/b", "tab\there", "nul\x00", "del\x7f", ".", "..",
                                  "x" * 201, "é" * 101, 5])
def test_bad_log_names(name):
    with pytest.raises(ValueError, match="log name"):
        check_log_name(name)


@pytest.mark.parametrize("name", ["orders", "a.b-c_d", "x" * 200, "é" * 100, "with space"])
def test_good_log_names(name):
    assert check_log_name(name) == name
    assert metadata.key(name) == "logs/" + name


def test_transitions():
    rec = metadata.new_record()
    r1, s0 = metadata.with_new_segment(rec, 10, new_epoch=True)
    assert s0 == 0 and r1["epoch"] == 1 and rec["segments"] == []   # pure
    r2, s1 = metadata.with_new_segment(r1, 11, new_epoch=False)
    assert s1 == 1 and r2["epoch"] == 1
    r3 = metadata.with_segment_closed(r2, 0, 5, 60, 600)
    assert r3["segments"][0]["state"] == "closed" and r3["segments"][0]["records"] == 60
    assert r2["segments"][0]["state"] == "open"
    # Closing twice keeps the first totals (the takeover and the roll agree anyway).
    assert metadata.with_segment_closed(r3, 0, 9, 1, 1)["segments"][0]["last_entry_id"] == 5
    # Truncation drops closed segments wholly before the point, never an open one.
    r4, drop = metadata.truncation(r3, Position(1, 3, 0))
    assert drop == [10] and [s["segment"] for s in r4["segments"]] == [1]
    assert r4["truncated_before"] == "1:3:0"
    r5, drop = metadata.truncation(r2, Position(1, 0, 0))
    assert drop == [] and len(r5["segments"]) == 2
    # The point never moves back; segment numbers are never reused.
    r6, _ = metadata.truncation(r4, Position(0, 0, 0))
    assert r6["truncated_before"] == "1:3:0"
    assert metadata.next_segment_number(r6) == 2
