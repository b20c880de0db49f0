#!/usr/bin/env python3
"""Regenerate conf/bk_server.conf, conf/client.conf and docs/configuration.md
from the settings registry.

The registry (bk/config.py) is the single definition of every key; the conf
files document the same keys with their defaults, and the reference page lists
them grouped by the registry's sections. tests/unit/test_config.py and
tests/unit/test_docs.py fail when they drift apart. Run: python scripts/gen_conf.py
"""

import os
import sys
import textwrap

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bk.config import BOTH, CLIENT, SERVER, SETTINGS, sections  # noqa: E402

HEADERS = {
    "bk_server.conf": """\
# bk bookie configuration: key=value lines, '#' starts a comment.
# Every key is defined once in bk/config.py (type, default, doc); an unknown
# key or a bad value stops the bookie with an error naming the key.
# Precedence: defaults < this file < environment BK_<key> < command-line flags.
# Durations keep BookKeeper's units: a key ending in MSec/Millis/Time is milliseconds.
""",
    "client.conf": """\
# bk client configuration (bk.BookKeeper(conf=bk.config.Config.load("conf/client.conf"))).
# Same rules as bk_server.conf: one registry, BK_<key> environment overrides.
""",
}
# Values that differ from the registry default in the shipped file, to make a
# fresh checkout's `bookie start --conf conf/bk_server.conf` work locally.
SHIPPED = {
    "bk_server.conf": {
        "metadataServiceUri": "etcd://127.0.0.1:2379/ledgers",
        "journalDirectories": "data/bookie/journal",
        "ledgerDirectories": "data/bookie/ledgers",
    },
    "client.conf": {"metadataServiceUri": "etcd://127.0.0.1:2379/ledgers"},
}


def render(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(value)
    return str(value)


def generate(name, scopes):
    out = [HEADERS[name]]
    for s in SETTINGS.values():
        if s.scope not in scopes:
            continue
        out.append("")
        for line in textwrap.wrap(s.doc, 76):
            out.append(f"# {line}")
        value = SHIPPED[name].get(s.name, render(s.default))
        if s.name in SHIPPED[name]:
            out.append(f"# (default: {render(s.default)})")
        out.append(f"{s.name}={value}")
    return "\n".join(out) + "\n"


def expected_files():
    return {"bk_server.conf": generate("bk_server.conf", (SERVER, BOTH)),
            "client.conf": generate("client.conf", (CLIENT, BOTH))}


REFERENCE_HEAD = """\
# Configuration reference

<!-- Generated from bk/config.py by scripts/gen_conf.py: do not edit by hand. -->

Every key bk reads is defined once, in the registry of `bk/config.py`, with its
type, default and documentation; this page is generated from it, as are
`conf/bk_server.conf` (bookies, `bookie autorecovery`, `bkshell --conf`) and
`conf/client.conf` (the client).

- **Where values come from**, lowest precedence first: the defaults below, a
  `key=value` file (`bookie start --conf FILE`; `bk.BookKeeper(conf=
  bk.config.Config.load("conf/client.conf"))`), environment variables
  `BK_<key>` (for example `BK_journalSyncData=false`), then explicit
  overrides: `bookie start --set key=value` and its flags (`--port`,
  `--journal-dir`, ...), or keyword arguments of the client
  (`bk.BookKeeper(uri, addEntryTimeoutSec=5)`) and of `open_log_writer`.
- **Strict**: an unknown key or a value that does not parse, or lies outside
  its range, is an error naming the key (`bk.errors.ConfigError`; a bookie
  exits with code 2). A typo never falls back silently to a default.
- **Units** are stated in each key's meaning: keys keep BookKeeper's names and
  units where the concept exists (milliseconds for most durations; seconds
  where the name or BookKeeper says so). Durations given as command-line
  flags are seconds.
- **Applies to**: `bookie` keys are read by bookies (and `bookie
  autorecovery`), `client` keys by `bk.BookKeeper`, `both` by each.
"""

_SCOPE_WORDS = {SERVER: "bookie", CLIENT: "client", BOTH: "both"}
_TYPE_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string",
               list: "list"}


def _cell(text):
    """Text that is safe in a Markdown table cell (no HTML, no column breaks)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") \
        .replace("|", "\\|")


def _number(v):
    return f"{v:g}" if isinstance(v, float) else str(v)


def _type_cell(s):
    words = _TYPE_NAMES[s.type]
    if s.minimum is not None and s.maximum is not None:
        words += f", {_number(s.minimum)}..{_number(s.maximum)}"
    elif s.minimum is not None:
        words += f", >= {_number(s.minimum)}"
    elif s.maximum is not None:
        words += f", <= {_number(s.maximum)}"
    return words


def _default_cell(s):
    text = render(s.default)
    return f"`{text}`" if text else "(empty)"


def generate_reference():
    out = [REFERENCE_HEAD]
    for title, settings in sections():
        out.append(f"\n## {title}\n")
        out.append("| key | type | default | applies to | meaning |")
        out.append("|---|---|---|---|---|")
        for s in settings:
            out.append(f"| `{s.name}` | {_type_cell(s)} | {_default_cell(s)} | "
                       f"{_SCOPE_WORDS[s.scope]} | {_cell(s.doc)} |")
    return "\n".join(out) + "\n"


def expected_docs():
    """Generated pages under docs/, by file name."""
    return {"configuration.md": generate_reference()}


if __name__ == "__main__":
    root = os.path.join(os.path.dirname(__file__), "..")
    outputs = [(os.path.join("conf", name), text) for name, text in expected_files().items()]
    outputs += [(os.path.join("docs", name), text) for name, text in expected_docs().items()]
    for rel, text in outputs:
        with open(os.path.join(root, rel), "w") as f:
            f.write(text)
        print("wrote", rel)
