"""``scripts/trace_adds.py`` at a tiny rate: it wraps private methods of the
client and the shard worker by name (a ``sitecustomize`` hook in the bookies),
so a rename or a new ``__slots__`` there silently breaks it (it once crashed
every bookie). This runs it end to end, plaintext and TLS, against real bookies
and checks that every hop of a followed add was seen."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOPS = ("sub -> pick", "pick -> write0", "write0 -> sent", "sent -> w_select",
        "w_select -> dispatched", "dispatched -> sync0", "sync0 -> released",
        "released -> c_read")


def test_trace_adds_follows_every_hop_in_both_modes(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "trace_adds.py"), "--rate", "2000",
         "--duration", "1.5", "--rounds", "1", "--sample", "5"],
        capture_output=True, text=True, timeout=150, cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    text = out.stdout
    for mode in ("plaintext", "TLS"):
        m = re.search(rf"^{mode}: (\d+) entries followed", text, re.M)
        assert m and int(m.group(1)) > 0, f"no {mode} entries followed:\n{text[-3000:]}"
        section = text[m.start():]
        for hop in HOPS:
            assert re.search(rf"^\s+{re.escape(hop)}\s+[\d.]+\s+[\d.]+\s+[\d.]+", section, re.M), \
                f"{mode}: hop {hop!r} missing:\n{section[:3000]}"
