#!/usr/bin/env python3
"""Regenerate conf/bk_server.conf and conf/client.conf from the settings registry.

The registry (bk/config.py) is the single definition of every key; the conf
files document the same keys with their defaults. tests/unit/test_config.py
fails when they drift apart. Run: python scripts/gen_conf.py
"""

import os
import sys
import textwrap

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bk.config import BOTH, CLIENT, SERVER, SETTINGS  # noqa: E402

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


if __name__ == "__main__":
    root = os.path.join(os.path.dirname(__file__), "..", "conf")
    for fname, text in expected_files().items():
        with open(os.path.join(root, fname), "w") as f:
            f.write(text)
        print("wrote", os.path.join("conf", fname))
