"""What bk costs etcd besides ledger writes: candidates waiting in an election look
twice a second (etcd's own count of Range calls), and a local cluster's etcd
runs with half the machine's cores (GOMAXPROCS) unless the operator chose; a
candidate still takes over from a leader killed -9 once its lease expires."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import urllib.request

import pytest

from bk.localcluster import LocalCluster
from bk.meta import EtcdServer, MetadataStore
from bk.meta.compactor import Compactor
from bk.meta.etcd_server import colocated_env
from bk.meta.recipes import Election
from bk.testing import wait_until


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(str(tmp_path_factory.mktemp("etcd")), env={"GOMAXPROCS": "1"})
    server.start()
    yield server
    server.stop()


def _kv_calls(etcd, method: str | None = None) -> float:
    """etcd's count of the KV calls it answered (its /metrics): all of them (Range,
    Txn, Put, DeleteRange), or those of ``method``."""
    want = f'grpc_method="{method}"' if method else 'grpc_service="etcdserverpb.KV"'
    n = 0.0
    with urllib.request.urlopen(etcd.client_url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("grpc_server_handled_total") and want in line:
                n += float(line.rpartition(" ")[2])
    return n


def test_a_waiting_candidate_looks_only_when_its_next_look_is_due(etcd):
    # The auditor and the compactor call campaign(timeout=...) in a loop to check for
    # a stop. The back-off this replaced restarted with each call, so every call
    # looked at once (~7 looks a second per candidate). The pace is now kept
    # across calls: a call made before the next look is due asks etcd nothing.
    with MetadataStore(etcd.uri("campaign")) as store:
        leader = Election(store, "auditor", "bookie-1:3181", ttl=5)
        assert leader.campaign(timeout=5)
        waiting = Election(store, "auditor", "bookie-2:3181", ttl=5, look_every=3600)
        before = _kv_calls(etcd)
        assert not waiting.campaign(timeout=0)        # its first look: due, lost
        first = _kv_calls(etcd) - before
        assert first >= 1
        for _ in range(20):                           # none due for an hour
            assert not waiting.campaign(timeout=0.01)
        assert _kv_calls(etcd) - before == first
        assert waiting.leader() == "bookie-1:3181" and not waiting.is_leader
        # a candidate at the default pace takes over once the leader is gone
        paced = Election(store, "auditor", "bookie-3:3181", ttl=5)
        assert paced.look_every == Election.LOOK_EVERY
        assert not paced.campaign(timeout=0)
        epoch = leader.epoch
        leader.resign()
        wait_until(lambda: paced.campaign(timeout=0.2), timeout=10, what="the takeover")
        assert paced.epoch > epoch and paced.leader() == "bookie-3:3181"
        paced.resign()


LEADER = textwrap.dedent("""
    import sys, time
    from bk.meta import MetadataStore
    from bk.meta.recipes import Election
    store = MetadataStore(sys.argv[1])
    e = Election(store, "compactor", "leader-process", ttl=2)
    assert e.campaign(timeout=10)
    print("epoch", e.epoch, flush=True)
    while True:
        time.sleep(1)
""")


def test_a_paced_candidate_takes_over_from_a_leader_killed_9(etcd):
    # The candidate loops on campaign(timeout=1.0) as the compactor and the auditor do;
    # the leader process is SIGKILLed: no resign, its key goes with its 2 s lease.
    uri = etcd.uri("killed-leader")
    p = subprocess.Popen([sys.executable, "-c", LEADER, uri], stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().split()
        assert line[0] == "epoch", line
        old_epoch = int(line[1])
        with MetadataStore(uri) as store:
            candidate = Election(store, "compactor", "candidate", ttl=2)
            assert not candidate.campaign(timeout=1.0)
            assert candidate.leader() == "leader-process"
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
            # paced (test_a_waiting_candidate_looks_only_when_its_next_look_is_due),
            # it still takes over once the dead leader's lease expires
            wait_until(lambda: candidate.campaign(timeout=1.0), timeout=30,
                       what="the candidate taking over")
            assert candidate.is_leader and candidate.leader() == "candidate"
            assert candidate.epoch > old_epoch
            candidate.resign()
    finally:
        p.kill()
        p.wait()


def test_a_waiting_compactor_looks_every_half_ttl(etcd):
    # compactions every few minutes lose nothing to a leader that comes seconds late;
    # each waiting bookie looked twice a second (and, a new Election per second, kept
    # no pace), now every ttl/2
    uri = etcd.uri("compactors")
    with MetadataStore(uri) as a, MetadataStore(uri) as b:
        a.format()
        leader = Compactor(a, "a", interval=300, ttl=10).start()
        waiting = None
        try:
            wait_until(lambda: leader.last is not None, timeout=10, what="a's first step")
            waiting = Compactor(b, "b", interval=300, ttl=10).start()
            wait_until(lambda: waiting._election is not None
                       and waiting._election._next_look > 0, what="b's first look")
            election = waiting._election
            assert election.look_every == 5.0
            first, before = election._next_look, _kv_calls(etcd, "Range")
            wait_until(lambda: election._next_look != first, timeout=30,
                       what="b's second look")
            # the second look (and the first, if its read was still on its way when
            # the pace was set): twice a second, it was ~10 reads in these 5 s
            assert _kv_calls(etcd, "Range") - before <= 2
            assert election._next_look - first >= election.look_every
            assert leader.is_leader and not waiting.is_leader
        finally:
            for c in (leader, waiting):
                if c is not None:
                    c.stop()


def test_colocated_env_gives_etcd_half_the_cores_unless_the_operator_chose(monkeypatch):
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    assert colocated_env(cores=2) == {"GOMAXPROCS": "1"}
    assert colocated_env(cores=1) == {"GOMAXPROCS": "1"}
    assert colocated_env(cores=16) == {"GOMAXPROCS": "8"}
    monkeypatch.setenv("GOMAXPROCS", "3")
    assert colocated_env(cores=16) == {}          # etcd inherits the operator's 3


def test_etcd_runs_with_the_environment_it_was_given(etcd, tmp_path, monkeypatch):
    with open(f"/proc/{etcd.pid}/environ", "rb") as f:
        env = f.read().split(b"\0")
    assert b"GOMAXPROCS=1" in env
    with open(etcd.log_file) as f:
        assert "--- bk: starting GOMAXPROCS=1 " in f.read()
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    local = LocalCluster(num_bookies=1, base_dir=str(tmp_path))._make_etcd(None)
    assert local.env == colocated_env() and local.env["GOMAXPROCS"].isdigit()
