"""LedgerMetadata's fragment arithmetic, shared by re-replication, the auditor's
checks and the Spark check."""
import dataclasses
import json

import pytest

from bk.meta.ledger import LedgerMetadata, LedgerState


def md(state=LedgerState.OPEN, last=-1):
    return LedgerMetadata(ledger_id=7, ensemble_size=3, write_quorum_size=2,
                          ack_quorum_size=2, state=state, last_entry_id=last,
                          ensembles=[(0, ["a", "b", "c"]), (10, ["a", "d", "c"]),
                                     (10, ["a", "d", "e"]), (25, ["f", "d", "e"])])


def test_fragments_end_where_the_next_begins():
    m = md()
    assert m.fragment_bounds(0) == (0, 9)
    assert m.fragment_bounds(1) == (10, 9)          # replaced before it held anything
    assert m.fragment_bounds(2) == (10, 24)


def test_the_last_fragment_ends_at_the_last_entry_once_closed_else_where_told():
    assert md(LedgerState.CLOSED, 40).fragment_bounds(3) == (25, 40)
    assert md(LedgerState.CLOSED, 40).fragment_bounds(3, last=30) == (25, 40)
    assert md().fragment_bounds(3) == (25, None)     # open, end unknown
    assert md().fragment_bounds(3, last=31) == (25, 31)


def test_json_keys_are_sorted_and_round_trip():
    m = md().replace(custom_metadata={"z": b"1", "a": b"\x00", "M": b"2"},
                     password_digest=b"p" * 48, master_key=b"k" * 20)
    raw = m.to_json()
    assert raw == json.dumps(m.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    assert LedgerMetadata.from_json(raw) == m
    closed = md(LedgerState.CLOSED, 40)
    assert b'"state":"CLOSED"' in closed.to_json() and b"masterKey" not in closed.to_json()
    assert LedgerMetadata.from_json(closed.to_json()) == closed


def test_replace_copies_and_refuses_unknown_fields():
    m = md()
    c = m.replace(state=LedgerState.CLOSED, last_entry_id=40, length=9)
    assert (m.state, m.last_entry_id, m.length) == (LedgerState.OPEN, -1, 0)
    assert c == dataclasses.replace(m, state=LedgerState.CLOSED, last_entry_id=40, length=9)
    with pytest.raises(TypeError):
        m.replace(lastEntryId=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.length = 1
