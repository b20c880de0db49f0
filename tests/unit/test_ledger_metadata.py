"""LedgerMetadata's fragment arithmetic, shared by re-replication, the auditor's
checks and the Spark check."""
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
