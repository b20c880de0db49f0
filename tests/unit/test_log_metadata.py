"""The log record's transitions for appending already-written ledgers (pure)."""

from bk.log import metadata


def _rec():
    rec = metadata.new_record()
    rec, _ = metadata.with_new_segment(rec, 10, new_epoch=True)
    return metadata.with_segment_closed(rec, 0, 4, 50, 500)


def test_ledgers_appended_as_closed_segments_in_order():
    rec = _rec()
    led = [{"ledger_id": 21, "last_entry_id": 2, "records": 30, "bytes": 300},
           {"ledger_id": 22, "last_entry_id": 0, "records": 1, "bytes": 7}]
    new = metadata.with_ledgers_appended(rec, led, "q1", 0)
    segs = new["segments"]
    assert [(s["segment"], s["ledger_id"], s["state"]) for s in segs] == \
        [(0, 10, "closed"), (1, 21, "closed"), (2, 22, "closed")]
    assert segs[1]["first_position"] == "1:0:0" and segs[2]["records"] == 1
    assert metadata.committed_batch(new, "q1") == 0
    assert metadata.committed_batch(new, "q2") is None
    assert len(rec["segments"]) == 1           # the input record is not changed
    assert metadata.committed_batch(rec, "q1") is None


def test_sinks_survive_other_transitions():
    new = metadata.with_ledgers_appended(_rec(), [], "q1", 7)
    new, seg = metadata.with_new_segment(new, 30, new_epoch=True)
    assert seg == 1
    new, _ = metadata.truncation(new, metadata.Position(1, 0, 0))
    assert metadata.committed_batch(new, "q1") == 7
    assert metadata.next_segment_number(metadata.with_ledgers_appended(new, [
        {"ledger_id": 31, "last_entry_id": 0, "records": 1, "bytes": 1}])) == 3
