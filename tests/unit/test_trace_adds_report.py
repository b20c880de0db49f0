"""scripts/trace_adds.py's stall report on made-up traces (no processes): which
loop passes are on a slow add's path. The worker's part begins at the earlier of
the client's "sent" and the worker's select that returned with the add: the
client reads "sent" after its write returned, and a client thread held up there
takes it after the worker answered (seen under load), which once left the
worker's passes off the path of every add slow for the client's sake."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load():
    spec = importlib.util.spec_from_file_location(
        "trace_adds", os.path.join(ROOT, "scripts", "trace_adds.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def probe(kind, pid, stalls):
    return {"kind": kind, "pid": pid, "passes": len(stalls), "busy": 0.0,
            "stalls": stalls, "wakes": [], "totals": {}}


def report(ta, client_late: bool) -> str:
    adds, worker, client = [], [], []
    for i in range(100):
        base = 10.0 + i
        t = {"sub": base, "w_select": base + 0.003, "released": base + 0.0046,
             "sent": base + (0.0050 if client_late else 0.0020), "c_read": base + 0.300}
        # the worker's passes: the one that read the add, the one that answered it
        worker += [(t["w_select"], 0.0002, 0.0002, 0.0, 0.0, {"_on_readable": 0.0001}),
                   (t["released"] - 0.0001, 0.0002, 0.0002, 0.0, 0.0, {})]
        # the client's I/O thread: one long pass before the write
        client.append((base + 0.001, 0.290, 0.01, 0.28, 0.0, {"_write": 0.29}))
        adds.append((0.3, {"sub -> pick": 0.3}, ta.add_path(t, 7)))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ta.stall_report("TLS", [(0.0, 200.0)], [probe("worker", 7, worker),
                                                 probe("client I/O", 1, client)],
                        [], [], adds, show=1)
    return out.getvalue()


def shares(text):
    m = re.search(r"a client I/O stall on the path of (\d+)% .* a stall of the worker of "
                  r"the 2nd acknowledgement on (\d+)%", text)
    assert m, text
    return int(m.group(1)), int(m.group(2))


def test_the_workers_pass_is_on_the_path_when_the_client_took_sent_after_its_answer():
    ta = load()
    assert shares(report(ta, client_late=True)) == (100, 100)


def test_and_when_sent_came_first():
    ta = load()
    assert shares(report(ta, client_late=False)) == (100, 100)
