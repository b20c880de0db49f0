"""LedgerMetadata.to_json's template path writes exactly the bytes of the generic
encoding of to_dict(), and LedgerMetadata.new makes what the constructor makes."""

from __future__ import annotations

import json

import pytest

from bk.meta.ledger import LedgerMetadata, LedgerState

ENS = ["127.0.0.1:3181", "127.0.0.1:3182", 'b\u00e9"\\x']


def _generic(md: LedgerMetadata) -> bytes:
    return json.dumps(md.to_dict(), separators=(",", ":")).encode("utf-8")


CASES = [
    LedgerMetadata(ledger_id=7, ensemble_size=3, write_quorum_size=2, ack_quorum_size=2,
                   ensembles=[(0, ENS)], password_digest=b"\x01\x02", master_key=b"k" * 20,
                   ctime=1764196000.123456),
    LedgerMetadata(ledger_id=2 ** 62, ensemble_size=3, write_quorum_size=3, ack_quorum_size=1,
                   ensembles=[(0, ENS), (5, ENS[::-1])], digest_type="mac",
                   custom_metadata={"z": b"1", "a": b"\xff", "\u00fc": b""}, ctime=12.5),
    LedgerMetadata(ledger_id=1, ensemble_size=1, write_quorum_size=1, ack_quorum_size=1,
                   ensembles=[(0, ["x"])], ctime=0),                 # an int ctime
    LedgerMetadata(ledger_id=1, ensemble_size=1, write_quorum_size=1, ack_quorum_size=1,
                   ensembles=[(0, ["x"])], ctime=float("nan")),
]
CASES.append(CASES[0].replace(state=LedgerState.CLOSED, last_entry_id=10, length=1234))
CASES.append(CASES[1].replace(state=LedgerState.IN_RECOVERY))


@pytest.mark.parametrize("md", CASES, ids=range(len(CASES)))
def test_to_json_is_the_generic_encoding(md):
    for _ in range(2):                  # the second time from the caches
        assert md.to_json() == _generic(md)
    back = LedgerMetadata.from_json(md.to_json())
    assert (back.ensembles, back.state, back.custom_metadata, back.master_key) == \
        (md.ensembles, md.state, md.custom_metadata, md.master_key)


def test_new_makes_what_the_constructor_makes():
    kw = dict(ledger_id=9, ensemble_size=3, write_quorum_size=2, ack_quorum_size=2,
              ensembles=[(0, ENS)], ctime=5.0)
    assert LedgerMetadata.new(**kw).__dict__ == LedgerMetadata(**kw).__dict__
    a, b = LedgerMetadata.new(**{k: v for k, v in kw.items() if k != "ctime"}), \
        LedgerMetadata(**{k: v for k, v in kw.items() if k != "ctime"})
    assert a.custom_metadata == {} and a.ctime > 0 and a.replace(ctime=b.ctime) == b
    with pytest.raises(TypeError):
        LedgerMetadata.new(**kw, colour="red")
    with pytest.raises(TypeError):
        LedgerMetadata.new(ledger_id=1)
