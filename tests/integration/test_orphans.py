"""A process that starts a local cluster and dies (kill -9, a Ctrl-C at the wrong
moment) takes its bookies, their shard workers and etcd with it: each bookie is
started with ``--stop-with <its pid>`` and stops as on SIGTERM (drained, journals
synced, pid file removed); etcd dies with it (PR_SET_PDEATHSIG). A bookie started
without the option (an operator's) ignores its parent's death."""

import json
import os
import signal
import subprocess
import sys


from bk.client.bookkeeper import BookKeeper
from bk.localcluster import BookieProcess
from bk.meta.store import MetadataStore
from bk.testing import TEST_DEFAULTS, LocalCluster, process_state, wait_until
from bk.util import free_port

ENTRIES = 40

# The parent: starts a cluster of three bookies, two forked by bk.testing's launcher
# (as tests start them) and one Popen'd by bk.localcluster (as benches and `bookie
# localcluster` do), writes ENTRIES entries to an open ledger on all three, prints
# what runs, and waits to be killed.
PARENT = r"""
import json, os, signal, sys
import bk
from bk import localcluster, testing
from bk.util import free_port
base, entries = sys.argv[1], int(sys.argv[2])
c = testing.LocalCluster(num_bookies=2, base_dir=base).start()
popen = localcluster.BookieProcess(c.metadata_uri, os.path.join(base, "bookie-2"), free_port(),
                                   2, testing.TEST_DEFAULTS, store=c.store).start()
client = bk.BookKeeper(c.metadata_uri)
lh = client.create_ledger(ensemble_size=3, write_quorum_size=3, ack_quorum_size=3,
                          password=b"orphans")
for i in range(entries):
    lh.add_entry(b"entry %d" % i)
launchers = [l.proc.pid for l in testing._Launcher._launchers.values()]
print(json.dumps({"etcd": c.etcd.pid, "ledger": lh.ledger_id, "launchers": launchers,
                  "bookies": [{"pid": b.pid, "workers": b.worker_pids(), "dir": b.dir,
                               "id": b.bookie_id} for b in [*c.bookies, popen]]}), flush=True)
signal.pause()
"""


def _dead(pid: int) -> bool:
    return process_state(pid) in ("gone", "Z")


def _start_parent(script: str, *args) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen([sys.executable, "-c", script, *map(str, args)],
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line, f"the parent exited with {p.wait()} before it was up"
    return p, json.loads(line)


def _kill9(p: subprocess.Popen) -> None:
    p.kill()
    p.wait(30)
    p.stdout.close()


def test_cluster_ends_with_its_parent(tmp_path):
    base = tmp_path / "cluster"
    p, up = _start_parent(PARENT, base, ENTRIES)
    pids = [up["etcd"], *up["launchers"]]
    for b in up["bookies"]:
        pids += [b["pid"], *b["workers"]]
    assert [len(b["workers"]) for b in up["bookies"]] == [2, 2, 2]
    assert len(up["launchers"]) == 1
    try:
        assert not any(_dead(pid) for pid in pids)
        _kill9(p)
        wait_until(lambda: all(_dead(pid) for pid in pids), timeout=60,
                   what="every process of the dead parent's cluster to end")
    finally:
        for pid in pids:           # whatever the outcome, leave nothing behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for b in up["bookies"]:
        # stopped as on SIGTERM: drained, its workers stopped in time (not killed),
        # its pid file removed
        log = open(os.path.join(b["dir"], "bookie.log")).read()
        assert f"process {p.pid} (--stop-with) exited: stopping" in log
        assert f"bookie {b['id']} stopped" in log
        assert "did not stop" not in log and "Traceback" not in log
        assert not os.path.exists(os.path.join(b["dir"], "bookie.pid"))

    # The same directories, restarted: every bookie replays every entry of the ledger
    with LocalCluster(num_bookies=3, base_dir=str(base)) as c:
        assert sorted(b.bookie_id for b in c.bookies) == sorted(b["id"] for b in up["bookies"])
        for b in up["bookies"]:
            assert c.entries_on(b["id"], up["ledger"]) == set(range(ENTRIES))
        with c.client() as client:
            rh = client.open_ledger(up["ledger"], password=b"orphans")
            assert rh.last_add_confirmed == ENTRIES - 1
            assert [e.data for e in rh.read_entries(0, ENTRIES - 1)] == \
                [b"entry %d" % i for i in range(ENTRIES)]


# The parent of two bookies of an etcd it does not own: one started by BookieProcess
# (with --stop-with), one as an operator starts one (`bookie start --conf`).
PARENT_OF_TWO = r"""
import json, signal, subprocess, sys
from bk.client.bookkeeper import BookKeeper
from bk.localcluster import BookieProcess
from bk.meta.store import MetadataStore
from bk.testing import TEST_DEFAULTS
from bk.util import free_port
uri, base = sys.argv[1], sys.argv[2]
store = MetadataStore(uri)
out = {}
for name in ("local", "operator"):
    b = BookieProcess(uri, f"{base}/{name}", free_port(), 1, TEST_DEFAULTS, store=store)
    if name == "local":
        b.start()
    else:
        with open(b.log_file, "ab") as log:
            b.proc = subprocess.Popen(
                [sys.executable, "-m", "bk.cli.bookie", "start", "--conf", b.conf_file],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        b.wait_registered()
    out[name] = {"pid": b.pid, "workers": b.worker_pids(), "id": b.bookie_id, "dir": b.dir}
print(json.dumps(out), flush=True)
signal.pause()
"""


def test_a_bookie_without_stop_with_ignores_its_parent(tmp_path, etcd):
    uri = etcd.uri("orphans")
    with MetadataStore(uri) as store:
        store.format()
    p, up = _start_parent(PARENT_OF_TWO, uri, tmp_path)
    local, operator = up["local"], up["operator"]
    try:
        _kill9(p)
        wait_until(lambda: all(_dead(pid) for pid in [local["pid"], *local["workers"]]),
                   timeout=60, what="the bookie started with --stop-with to end")
        # the operator's bookie runs on, registered alone, and serves
        assert not any(_dead(pid) for pid in [operator["pid"], *operator["workers"]])
        with BookKeeper(uri, addEntryTimeoutSec=3, readEntryTimeoutSec=3) as client:
            wait_until(lambda: client.bookies() == [operator["id"]], timeout=30,
                       what="only the operator's bookie to be registered")
            lh = client.create_ledger(ensemble_size=1, write_quorum_size=1,
                                      ack_quorum_size=1, password=b"p")
            lh.add_entry(b"still here")
            lh.close()
            rh = client.open_ledger(lh.ledger_id, password=b"p")
            assert [e.data for e in rh.read_entries(0, 0)] == [b"still here"]
        assert not any(_dead(pid) for pid in [operator["pid"], *operator["workers"]])
    finally:
        for who in (local, operator):
            try:
                os.killpg(who["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_bookie_whose_process_to_stop_with_is_gone_does_not_start(tmp_path, etcd):
    """The parent died while the bookie was starting, before the watch began."""
    uri = etcd.uri("gone")
    with MetadataStore(uri) as store:
        store.format()
        gone = subprocess.Popen(["true"])
        gone.wait()
        b = BookieProcess(uri, str(tmp_path / "b"), free_port(), 1, TEST_DEFAULTS, store=store)
        run = subprocess.run([sys.executable, "-m", "bk.cli.bookie", "start", "--conf",
                              b.conf_file, "--stop-with", str(gone.pid)],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert f"process {gone.pid} (--stop-with) is gone: not starting" in run.stderr
        assert store.read_cookie(b.bookie_id)[0] is None    # it never got as far
        assert store.bookie_info(b.bookie_id) is None
