"""bk.errors: categories callers can catch, each status code declared once."""
import pytest

from bk import errors as E


def test_every_status_code_has_one_class_name_and_text():
    codes = [v for k, v in vars(E).items() if k.isupper() and k.startswith("E")
             and isinstance(v, int) and k != "EOK"]
    assert sorted(codes) == sorted(E.STATUS_ERRORS)
    for code, cls in E.STATUS_ERRORS.items():
        assert cls.code == code and issubclass(cls, E.BookieError)
        err = E.error_for_status(code, "read entry 3 of ledger 9 from b:1")
        assert type(err) is cls and err.code == code
        assert str(err).startswith("read entry 3 of ledger 9 from b:1: ")
        assert E.status_name(code) != str(code)
    assert E.status_name(E.EOK) == "EOK" and E.status_name(99) == "99"
    assert type(E.error_for_status(99, "x")) is E.BookieError


@pytest.mark.parametrize("cls,category", [
    (E.LedgerFencedError, E.BookieError), (E.NoSuchEntryError, E.BookieError),
    (E.LogFencedError, E.LedgerFencedError), (E.TooManyRequestsError, E.TransientError),
    (E.BookieUnavailableError, E.TransientError), (E.TimeoutError, E.TransientError),
    (E.NotEnoughBookiesError, E.TransientError), (E.ClusterIdentityError, E.MetadataError),
    (E.ClusterNotFormattedError, E.MetadataError), (E.AuthError, E.SecurityError),
    (E.BadRequestError, E.ProtocolError), (E.ConfigError, ValueError),
])
def test_categories(cls, category):
    assert issubclass(cls, category) and issubclass(cls, E.BKError)


def test_a_lost_cas_is_not_a_store_failure_and_timeouts_are_builtin_timeouts():
    assert not issubclass(E.MetadataVersionError, E.MetadataError)
    assert not issubclass(E.MetadataVersionError, E.TransientError)
    assert issubclass(E.TimeoutError, TimeoutError)
    with pytest.raises(AssertionError):
        E._status(E.EFENCED, "EFENCED", "again")(type("Twice", (E.BookieError,), {}))


# --- bk.retry ---------------------------------------------------------------------------
from bk.retry import Backoff, Retry, retry_cas  # noqa: E402


def test_backoff_grows_to_its_cap_resets_and_stops_at_the_deadline():
    s = Backoff(first=0.1, factor=2, cap=0.5).start()
    assert [round(s.next_delay(), 3) for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    s.reset()
    assert s.next_delay() == 0.1
    import time
    # the deadline cuts the 10 s delay to what is left (5 s: room for a loaded machine)
    s = Backoff(first=10).start(deadline=time.monotonic() + 5)
    assert 0 < s.next_delay() <= 5
    s = Backoff().start(deadline=time.monotonic() - 1)
    assert s.next_delay() is None
    s = Backoff(first=1.0, jitter=0.5).start()
    assert all(0.5 <= s.next_delay() <= 2.0 for _ in range(3))


def test_retry_retries_what_it_is_told_and_no_more():
    calls, slept = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise E.BookieUnavailableError("down")
        return "ok"
    assert Retry(tries=5).call(flaky, sleep=slept.append) == "ok"
    assert len(calls) == 3 and slept == [0.05, 0.1]
    calls.clear()
    with pytest.raises(E.BookieUnavailableError):
        Retry(tries=2).call(flaky, sleep=slept.append)
    assert len(calls) == 2

    def fenced():
        calls.append(1)
        raise E.LedgerFencedError("fenced")
    calls.clear()
    with pytest.raises(E.LedgerFencedError):
        Retry(tries=5).call(fenced, sleep=slept.append)
    assert len(calls) == 1                    # not transient: never retried

    def closed():
        calls.append(1)
        raise E.ClientClosedError("client is closed")
    calls.clear()
    assert issubclass(E.ClientClosedError, E.TransientError)
    with pytest.raises(E.ClientClosedError):
        Retry(tries=5).call(closed, sleep=slept.append)
    assert len(calls) == 1                    # a closed client: never retried


def test_retry_cas_retries_lost_swaps_only_and_is_bounded():
    n = []

    def lose_twice():
        n.append(1)
        if len(n) < 3:
            raise E.MetadataVersionError("lost")
        return len(n)
    assert retry_cas("x", lose_twice) == 3
    with pytest.raises(E.MetadataVersionError, match="update y: 4 compare-and-swaps lost"):
        retry_cas("update y", lambda: (_ for _ in ()).throw(E.MetadataVersionError("l")), tries=4)
    with pytest.raises(E.LockLostError):
        retry_cas("z", lambda: (_ for _ in ()).throw(E.LockLostError("gone")))
