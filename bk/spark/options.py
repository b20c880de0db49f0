"""The ``bookkeeper`` data source's options, parsed and checked once (every entry
point calls :func:`parse_options`); plain values, so they travel to executors."""

from __future__ import annotations

import dataclasses
import os

from bk.config import SETTINGS
from bk.log import metadata
from bk.log.records import Position
from bk.security import CLIENT_KEYS

LOG_SCHEMA = ("log string, position string, segment long, ledger_id long, entry_id long, "
              "slot int, data binary")
LEDGER_SCHEMA = "ledger_id long, entry_id long, data binary"
PROBLEM_SCHEMA = "ledger_id long, entry_id long, bookie string, problem string"

# Spark's own options, which reach a data source too: they pass.
SPARK_OPTIONS = {"path", "paths", "checkpointlocation", "queryname"}


@dataclasses.dataclass(frozen=True)
class Options:
    """The data source's options, parsed and checked (plain values: picklable)."""

    uri: str
    log: str | None = None
    ledgers: tuple = ()
    password: bytes = b""
    starting: str = "earliest"
    ending: str = "latest"
    min_partitions: int = 1
    max_records: int | None = None
    fail_on_data_loss: bool = True
    given: frozenset = frozenset()      # the options set by the user (canonical names)
    # client security settings (bk.security), as (key, value) pairs: file paths and
    # flags only, never a secret (a token or password lives in a file on every host)
    security: tuple = ()


# The client's security settings a source or sink takes as options (bk.security):
# authToken is not one of them (Spark shows options in plans and its UI; use
# authTokenFile).
SECURITY_OPTIONS = tuple(k for k in CLIENT_KEYS if k != "authToken")
_NAMES = {n.lower(): n for n in (
    "metadataServiceUri", "log", "ledgers", "password", "startingPosition", "endingPosition",
    "minPartitions", "maxRecordsPerTrigger", "failOnDataLoss", "authToken",
    *SECURITY_OPTIONS)}


def _position_option(name: str, value: str) -> str:
    v = value.strip().lower()
    if v in ("earliest", "latest"):
        return v
    try:
        return str(Position.parse(value))
    except ValueError as e:
        raise ValueError(f"option {name}: 'earliest', 'latest' or a Position: {e}") from None


def _int_option(name: str, value: str, minimum: int) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        raise ValueError(f"option {name}: {value!r} is not an integer") from None
    if n < minimum:
        raise ValueError(f"option {name}: {n} is below the minimum {minimum}")
    return n


def parse_options(raw) -> Options:
    """Options from Spark's (case-insensitive) option map; ValueError naming the
    option that is unknown, missing or malformed."""
    got = {}
    for k, v in dict(raw).items():
        lk = k.lower()
        if lk in SPARK_OPTIONS:
            continue
        if lk not in _NAMES:
            raise ValueError(f"unknown option {k!r} of data source 'bookkeeper' (known: "
                             f"{', '.join(sorted(_NAMES.values()))})")
        got[_NAMES[lk]] = v
    uri = got.get("metadataServiceUri") or os.environ.get("BK_metadataServiceUri")
    if not uri:
        raise ValueError("option metadataServiceUri is required (etcd://host:port/ledgers)")
    if not uri.startswith("etcd://"):
        raise ValueError(f"option metadataServiceUri: {uri!r} is not etcd://host:port/prefix")
    kw = {"uri": uri}
    if ("log" in got) == ("ledgers" in got):
        raise ValueError("give exactly one of the options log and ledgers")
    if "log" in got:
        metadata.check_log_name(got["log"])
        kw["log"] = got["log"]
    else:
        try:
            kw["ledgers"] = tuple(int(x) for x in got["ledgers"].split(",") if x.strip())
        except ValueError:
            raise ValueError(f"option ledgers: {got['ledgers']!r} is not a list of ledger "
                             f"ids such as '12,15'") from None
        if not kw["ledgers"] or any(x < 0 for x in kw["ledgers"]):
            raise ValueError(f"option ledgers: {got['ledgers']!r} names no ledger")
        for name in ("startingPosition", "endingPosition", "maxRecordsPerTrigger"):
            if name in got:
                raise ValueError(f"option {name} applies to a log, not to ledgers")
    if "password" in got:
        kw["password"] = got["password"].encode("utf-8")
    if "startingPosition" in got:
        kw["starting"] = _position_option("startingPosition", got["startingPosition"])
    if "endingPosition" in got:
        kw["ending"] = _position_option("endingPosition", got["endingPosition"])
        if kw["ending"] == "earliest":
            raise ValueError("option endingPosition: 'latest' or a Position")
    if "minPartitions" in got:
        kw["min_partitions"] = _int_option("minPartitions", got["minPartitions"], 1)
    if "maxRecordsPerTrigger" in got:
        kw["max_records"] = _int_option("maxRecordsPerTrigger", got["maxRecordsPerTrigger"], 1)
    if "failOnDataLoss" in got:
        v = str(got["failOnDataLoss"]).strip().lower()
        if v not in ("true", "false"):
            raise ValueError(f"option failOnDataLoss: {got['failOnDataLoss']!r} is not "
                             f"true or false")
        kw["fail_on_data_loss"] = v == "true"
    if "authToken" in got:
        raise ValueError("option authToken: Spark shows options in query plans; put the "
                         "token in a file on every host and give authTokenFile")
    security = []
    for name in SECURITY_OPTIONS:
        if name in got:
            try:
                security.append((name, SETTINGS[name].parse(str(got[name]))))
            except ValueError as e:
                raise ValueError(f"option {name}: {e}") from None
    kw["security"] = tuple(security)
    kw["given"] = frozenset(got)
    return Options(**kw)


READ_ONLY = ("startingPosition", "endingPosition", "minPartitions", "maxRecordsPerTrigger",
              "failOnDataLoss")


def refuse(opts: Options, names, what: str) -> None:
    """ValueError if the user set any option of ``names``, which do not apply to ``what``."""
    for name in names:
        if name in opts.given:
            raise ValueError(f"option {name} does not apply to {what}")
