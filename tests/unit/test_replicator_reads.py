"""The replicator's read pipeline when a source's connection breaks part way
through the READ_RANGEs of one batch (no processes: a fake pool that behaves as
bk.rawclient.BookiePool does: a failed send drops the bookie's connection, so
the answers still due on it fail too)."""

import pytest

from bk import protocol as P
from bk.autorecovery.replicator import Replicator
from bk.errors import ENOENTRY, EOK, BKError

LID = 7


class FakePool:
    """Bookie "A" answers READ_RANGE but its connection breaks at the second send;
    bookie "B" answers READs, holding only ``b_holds``."""

    def __init__(self, b_holds):
        self.b_holds = set(b_holds)
        self.sends = 0
        self.dropped = False
        self.b_asked = []

    def features(self, src, lid):
        return P.FEATURE_READ_RANGE if src == "A" else 0

    def rids(self, src, lid, n):
        return list(range(n))

    def send(self, src, lid, msgs):
        self.sends += 1
        if self.sends == 2:
            self.dropped = True
            raise BKError(f"bookie {src}: connection broke")
        return msgs

    def recv(self, ticket):
        if self.dropped:
            raise BKError("bookie A: connection broke")
        raise AssertionError("the second send always breaks the connection")

    def calls(self, src, lid, msgs):
        assert src == "B"
        out = []
        for m in msgs:
            e = m[3]
            self.b_asked.append(e)
            if e in self.b_holds:
                out.append((P.READ, 0, EOK, LID, e, -1, b"d%d" % e, b"p%d" % e))
            else:
                out.append((P.READ, 0, ENOENTRY, LID, e))
        return out


def read_batch(pool, batch):
    r = Replicator(None, pool, "etcd://127.0.0.1:1/x")
    tried = set()
    _, sent = r._send_reads(LID, batch, lambda e: ["A", "B"], tried, 2)
    return r._collect_reads(LID, "T", sent, lambda e: ["A", "B"], tried)


def test_each_entry_goes_to_its_next_source_once():
    pool = FakePool(b_holds=range(4))
    got = read_batch(pool, [0, 1, 2, 3])
    assert sorted(got) == [0, 1, 2, 3]
    assert got[2] == (-1, b"d2", b"p2")
    # residue 0 (0 and 2) was sent to A as a READ_RANGE before the break, residue
    # 1 failed to send: each entry is read from B once, not the first ones twice
    assert sorted(pool.b_asked) == [0, 1, 2, 3]


def test_an_entry_on_no_source_is_named_once():
    pool = FakePool(b_holds=[0, 1, 3])
    with pytest.raises(BKError) as e:
        read_batch(pool, [0, 1, 2, 3])
    assert "entries [2] are on no reachable replica" in str(e.value)
