"""The names /work/shared/API.md promises ("Python client", "Errors", "Logs built
from ledgers") exist with the shapes it gives: error classes under BKError (and
their categories), the str-valued ledger state, Position's order, text and
parse, the handle's properties. No processes: the behaviour behind each is in
the integration tests (see docs/client.md)."""

import builtins
import inspect

import pytest

import bk
from bk import errors as E

# "Errors (bk.errors)": BKError is the root; at least these.
API_ERRORS = ["LedgerFencedError", "NoSuchLedgerError", "NoSuchEntryError", "BadPasswordError",
              "NotEnoughBookiesError", "DigestMismatchError", "MetadataVersionError",
              "LedgerClosedError", "LedgerRecoveryError", "BookieUnavailableError",
              "TimeoutError", "ProtocolError", "ReadOnlyBookieError", "TooManyRequestsError",
              # logs, security, close
              "LogFencedError", "LogTruncatedError", "NoSuchLogError", "SecurityError",
              "AuthError", "ClientClosedError", "MetadataError"]


@pytest.mark.parametrize("name", API_ERRORS)
def test_every_error_api_md_names_is_a_bkerror(name):
    cls = getattr(E, name)
    assert inspect.isclass(cls) and issubclass(cls, E.BKError) and cls is not E.BKError


def test_error_details_api_md_gives():
    assert issubclass(E.BKError, Exception)
    assert E.BadPasswordError.code == E.EUA                       # "BadPasswordError (EUA)"
    assert issubclass(E.TimeoutError, E.BKError) and issubclass(E.TimeoutError, builtins.TimeoutError)
    assert issubclass(E.LogFencedError, E.LedgerFencedError)     # "a LedgerFencedError"
    assert issubclass(E.AuthError, E.SecurityError)
    # a deleted ledger and a fenced one are told apart (docs/client.md)
    assert not issubclass(E.NoSuchLedgerError, E.LedgerFencedError)
    assert not issubclass(E.LedgerFencedError, E.NoSuchLedgerError)


def test_public_names_of_the_package():
    for name in ("BookKeeper", "LedgerMetadata", "LedgerState", "Position", "LogRecord",
                 "errors"):
        assert getattr(bk, name) is not None
    with pytest.raises(AttributeError):
        bk.NoSuchName        # noqa: B018


def test_ledger_state_is_str_valued():
    assert [s.value for s in bk.LedgerState] == ["OPEN", "IN_RECOVERY", "CLOSED"]
    assert bk.LedgerState.CLOSED == "CLOSED" and str(bk.LedgerState.IN_RECOVERY) == "IN_RECOVERY"


def test_handle_properties_are_properties():
    # "lh.last_add_confirmed, rh.is_closed and rh.length are properties"
    from bk.client.ledger import LedgerHandle
    for name in ("last_add_confirmed", "is_closed", "length", "ledger_id", "metadata"):
        assert isinstance(inspect.getattr_static(LedgerHandle, name), property), name


def test_position_order_text_and_parse():
    P = bk.Position
    a, b, c = P(0, 5, 2), P(0, 6, 0), P(1, 0, 0)
    assert a < b < c and isinstance(a, tuple)
    assert str(a) == "0:5:2" and P.parse("0:5:2") == a and P.parse(str(c)) == c
    with pytest.raises(ValueError):
        P.parse("0:5")
