"""``scripts/trace_adds.py`` at a tiny rate: it wraps private methods of the
client and the shard worker by name (a ``sitecustomize`` hook in the bookies),
so a rename or a new ``__slots__`` there silently breaks it (it once crashed
every bookie). This runs it end to end, plaintext and TLS, against real bookies
and checks that every hop of a followed add was seen, and that the loops'
stall probes (client I/O thread, shard workers) saw passes: with a threshold
of 0 ms every pass is a "stall", so every slow add must have one of each loop on
its path."""

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
        env={**os.environ, "TMPDIR": str(tmp_path), "BK_TRACE_STALL_MS": "0"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    text = out.stdout
    for mode in ("plaintext", "TLS"):
        m = re.search(rf"^{mode}: (\d+) entries followed", text, re.M)
        assert m and int(m.group(1)) > 0, f"no {mode} entries followed:\n{text[-3000:]}"
        section = text[m.start():]
        for hop in HOPS:
            assert re.search(rf"^\s+{re.escape(hop)}\s+[\d.]+\s+[\d.]+\s+[\d.]+", section, re.M), \
                f"{mode}: hop {hop!r} missing:\n{section[:3000]}"
        stalls = section[section.index(f"{mode}: loop passes of 0 ms or more"):]
        for kind, loops in (("client I/O", r"1"), ("worker", r"[1-6]")):
            m = re.search(rf"^  {kind} \({loops} loops, (\d+) passes in all runs\): "
                          rf"([\d.]+) stalls per loop-second", stalls, re.M)
            assert m and int(m.group(1)) > 0 and float(m.group(2)) > 0, \
                f"{mode}: no {kind} passes probed:\n{stalls[:3000]}"
        # each loop's steps were timed inside its passes
        assert re.search(r"^    in them .*_on_readable", stalls, re.M), stalls[:3000]
        m = re.search(r"a client I/O stall on the path of (\d+)% .* a stall of the worker of "
                      r"the 2nd acknowledgement on (\d+)%", stalls)
        # With every pass kept (BK_TRACE_STALL_MS=0) both loops are on every slow
        # add's path: the client I/O pass that read its acknowledgement, and the
        # pass of the 2nd-acknowledging worker whose select returned with it (the
        # worker's part of the path begins there at the latest, also when the
        # client, held up after its write, took "sent" after the worker answered)
        assert m and m.group(1) == "100" and m.group(2) == "100", stalls[:3000]
