"""bk.client.health: quarantine and read order, on a clock passed in."""

from bk.client.health import BookieHealth


def test_failed_bookies_go_last_until_the_quarantine_ends():
    h = BookieHealth(10)
    ws = ["a", "b", "c"]
    assert h.order(ws, now=0) is ws                  # nothing failed: unchanged
    h.failed("a", now=100)
    h.failed("b", now=101)
    assert h.order(ws, now=102) == ["c", "a", "b"]   # the others keep their order
    assert h.quarantined_set(now=105) == {"a", "b"}
    assert h.order(ws, now=110.5) == ["a", "c", "b"]  # a's quarantine is over
    assert h.order(ws, now=200) == ws
    assert h.snapshot() == {"a": {"failures": 1, "quarantined": False},
                            "b": {"failures": 1, "quarantined": False}}


def test_an_answer_lifts_the_quarantine():
    h = BookieHealth(60)
    h.failed("a", now=0)
    h.failed("a", now=1)
    assert h.quarantined("a", now=2)
    h.ok("a")
    assert not h.quarantined("a", now=3)
    assert h.snapshot()["a"] == {"failures": 2, "quarantined": False}


def test_zero_quarantine_remembers_nothing():
    h = BookieHealth(0)
    h.failed("a", now=5)
    assert h.order(["a", "b"], now=5) == ["a", "b"]
