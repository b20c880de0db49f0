"""Replication workers against real etcd, bookies and standalone `bookie
autorecovery` processes: open ledgers and their grace period, two workers and
a SIGSTOPped one, decommissioning through auto-recovery (also when no auditor
is elected at that instant, and without auto-recovery at all)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

import bk
from bk.autorecovery.status import auditor_id
from bk.errors import LedgerFencedError
from bk.meta import underreplication as UR
from bk.testing import (closed_ledger, hook_env, hooked_stop, http_get, sigstop, site_hook,
                        wait_until)
from bk.util import free_port

PW = b"workers"
AR = {"autoRecoveryDaemonEnabled": True, "lostBookieRecoveryDelay": 0}


def fully_replicated(cluster, md):
    last = md.last_entry_id
    return all(e in cluster.entries_on(b, md.ledger_id)
               for e in range(last + 1) for b in md.write_set(e))


def test_open_ledgers_active_writer_keeps_going_idle_one_fenced_after_grace(cluster_factory):
    grace_ms = 8000
    c = cluster_factory(4, conf_overrides={**AR,
                                           "openLedgerRereplicationGracePeriod": grace_ms})
    with bk.BookKeeper(c.metadata_uri) as client:
        active = client.create_ledger(3, 2, 2, password=PW)
        idle = client.create_ledger(3, 2, 2, password=PW)
        for lh in (active, idle):
            lh.add_entries([b"before-%d" % i for i in range(10)])
        both = set(active.metadata.ensembles[-1][1]) & set(idle.metadata.ensembles[-1][1])
        victim = c.bookie(sorted(both)[0])
        written, errors, stop = [], [], threading.Event()

        def writer():
            i = 0
            while not stop.is_set():
                try:
                    active.add_entry(b"during-%d" % i)
                    written.append(i)
                except Exception as e:       # recorded, asserted on below
                    errors.append(e)
                    return
                i += 1
                stop.wait(0.02)
        t = threading.Thread(target=writer)
        victim.kill()
        t.start()
        try:
            # The idle ledger is marked and stays so for the grace period (the active
            # one may be repaired within milliseconds of its mark: its fragment with
            # the victim is complete once the writer has changed its ensemble).
            wait_until(lambda: idle.ledger_id in {lid for lid, _, _ in
                                                  UR.list_marked(c.store)},
                       timeout=30, what="the idle ledger marked")
            # Within the grace period the idle ledger is left to its writer.
            assert client.ledger_metadata(idle.ledger_id).state.name == "OPEN"
            wait_until(lambda: client.ledger_metadata(idle.ledger_id).is_closed,
                       timeout=grace_ms / 1000 + 60, what="the idle ledger fenced and closed")
            wait_until(lambda: not list(UR.list_marked(c.store)), timeout=60,
                       what="both ledgers repaired")
        finally:
            stop.set()
            t.join(10)
        assert errors == []
        assert len(written) > 0
        # The active writer changed its ensemble itself and was never fenced.
        md = client.ledger_metadata(active.ledger_id)
        assert md.state.name == "OPEN"
        assert all(victim.bookie_id not in ens for _, ens in md.ensembles)
        active.add_entry(b"after")
        active.close()
        rh = client.open_ledger(active.ledger_id, password=PW)
        got = [e.data for e in rh.read_entries(0, rh.last_add_confirmed)]
        assert got == ([b"before-%d" % i for i in range(10)] +
                       [b"during-%d" % i for i in written] + [b"after"])
        assert fully_replicated(c, client.ledger_metadata(active.ledger_id))
        # The idle one: closed with every acknowledged entry, its writer fenced.
        md = client.ledger_metadata(idle.ledger_id)
        assert md.last_entry_id == 9
        assert all(victim.bookie_id not in ens for _, ens in md.ensembles)
        assert fully_replicated(c, md)
        with pytest.raises(LedgerFencedError):
            idle.add_entry(b"zombie")


def _start_worker(uri, log_file, **settings):
    args = [sys.executable, "-m", "bk.cli.bookie", "autorecovery", "--metadata", uri,
            "--log-file", str(log_file)]
    for k, v in settings.items():
        args += ["--set", f"{k}={v}"]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _stop_workers(procs):
    """SIGCONT (one may be stopped), SIGTERM and reap each `bookie autorecovery`;
    kill -9 one that does not end."""
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGCONT)
            p.terminate()
            p.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            p.kill()


def _locks(store):
    return {int(rel.rsplit("/", 1)[1]): v.get("owner")
            for rel, v, _ in store.list_json(UR.LOCKS) if isinstance(v, dict)}


def test_two_workers_and_one_sigstopped_past_its_lease(cluster_factory, tmp_path):
    c = cluster_factory(4, conf_overrides={"lostBookieRecoveryDelay": 0})
    settings = {"registrationTtlSeconds": 3, "lostBookieRecoveryDelay": 0,
                "replicationRateByBytes": 40000, "rwRereplicateBackoffMs": 100}
    logs = [tmp_path / "w1.log", tmp_path / "w2.log"]
    procs = [_start_worker(c.metadata_uri, logs[0], **settings)]
    try:
        with bk.BookKeeper(c.metadata_uri) as client:
            lids = []
            for i in range(6):
                lh = client.create_ledger(3, 2, 2, password=PW)
                lh.add_entries([bytes([65 + i]) * 1024] * 60)
                lh.close()
                lids.append(lh.ledger_id)
            victim = c.bookie(client.ledger_metadata(lids[0]).ensembles[0][1][0])
            mine = [lid for lid in lids if any(victim.bookie_id in ens for _, ens in
                                               client.ledger_metadata(lid).ensembles)]
            w1 = procs[0].pid
            wait_until(lambda: c.store.get_json(UR.AUDITOR)[0] is not None,
                       what="the first worker elected auditor")
            procs.append(_start_worker(c.metadata_uri, logs[1], **settings))
            victim.kill()
            # Catch the first worker holding a ledger's lock, mid-copy (paced to 40 kB/s),
            # and freeze it there.
            owner = f"-{w1}"
            held = []

            def frozen_holding_a_lock():
                if not any(o and o.endswith(owner) for o in _locks(c.store).values()):
                    return False
                sigstop(w1)
                held[:] = [lid for lid, o in _locks(c.store).items() if o and o.endswith(owner)]
                if held:
                    return True
                os.kill(w1, signal.SIGCONT)     # it let go just before: try again
                return False
            wait_until(frozen_holding_a_lock, timeout=60,
                       what="the first worker frozen while holding a lock")
            assert len(held) == 1, held
            # The second worker takes over once the lease has expired, and finishes.
            wait_until(lambda: not list(UR.list_marked(c.store)) and
                       all(victim.bookie_id not in ens for lid in mine
                           for _, ens in client.ledger_metadata(lid).ensembles),
                       timeout=120, what="the second worker finishing everything")
            versions = {lid: c.store.read_ledger(lid)[1] for lid in lids}

            def said():
                return len(re.findall(rf"ledger {held[0]}\b", logs[0].read_text()))
            before = said()
            # (frozen after its last word on the ledger, releasing the lock, it has
            # nothing more to say: it had re-replicated the ledger itself)
            finished = re.search(rf"ledger {held[0]} re-replicated by", logs[0].read_text())
            os.kill(w1, signal.SIGCONT)
            # The resumed worker finishes its step with a stale lock: it changes nothing.
            # Every way out of a step names the ledger (also "nothing left to repair",
            # when it was frozen between taking the lock and reading the ledger).
            wait_until(lambda: finished or said() > before, timeout=60,
                       what="the resumed worker to report on its ledger")
            wait_until(lambda: _locks(c.store).get(held[0]) is None,
                       what="the resumed worker's lock gone")
            assert {lid: c.store.read_ledger(lid)[1] for lid in lids} == versions
            # Each ledger was repaired by one worker, never by both.
            done = {}
            for i, f in enumerate(logs):
                for m in re.finditer(r"ledger (\d+) re-replicated by (\S+)", f.read_text()):
                    done.setdefault(int(m.group(1)), set()).add(m.group(2))
            for lid in mine:
                if lid != held[0]:
                    assert len(done.get(lid, ())) == 1, (lid, done)
            for lid in lids:
                assert fully_replicated(c, client.ledger_metadata(lid))
                rh = client.open_ledger(lid, password=PW)
                assert len(list(rh.read_entries(0, 59))) == 60
    finally:
        _stop_workers(procs)


# In a `bookie autorecovery` process: its worker stops itself (SIGSTOP, every thread)
# the first time it has taken a ledger's lock, before it reads the ledger.
LOCKED_HOOK = r'''
from bk.autorecovery import service
from bk.testing import stop_here

_replicate = service.AutoRecovery._replicate
_stopped = []


def replicate(self, lid, *args, **kwargs):
    if not _stopped:
        _stopped.append(lid)
        stop_here({"ledger": lid})
    return _replicate(self, lid, *args, **kwargs)


service.AutoRecovery._replicate = replicate
'''


def test_a_worker_resumed_past_its_lease_finds_its_ledger_repaired_and_says_so(
        cluster_factory, tmp_path):
    """A worker frozen between taking a ledger's lock and reading the ledger, until
    its lease expired and another worker repaired the ledger: resumed, it finds
    nothing left to do, changes nothing, and says so (it used to end its step
    without a word, which left an operator, and a test, waiting on it)."""
    c = cluster_factory(4, conf_overrides={"lostBookieRecoveryDelay": 0})
    settings = {"registrationTtlSeconds": 3, "lostBookieRecoveryDelay": 0}
    logs = [tmp_path / "w1.log", tmp_path / "w2.log"]
    out = tmp_path / "locked.json"
    with site_hook(tmp_path, LOCKED_HOOK, hook_env(out)):
        procs = [_start_worker(c.metadata_uri, logs[0], **settings)]
    try:
        with bk.BookKeeper(c.metadata_uri) as client:
            lids = [closed_ledger(client, [b"r%d" % e for e in range(20)], password=PW)
                    for _ in range(2)]
            victim = c.bookie(client.ledger_metadata(lids[0]).ensembles[0][1][0])
            mine = [lid for lid in lids if any(victim.bookie_id in ens for _, ens in
                                               client.ledger_metadata(lid).ensembles)]
            victim.kill()
            held = hooked_stop(out, what="the first worker stopped holding a lock")
            assert held["ledger"] in mine
            procs.append(_start_worker(c.metadata_uri, logs[1], **settings))
            wait_until(lambda: not list(UR.list_marked(c.store)) and
                       all(victim.bookie_id not in ens for lid in mine
                           for _, ens in client.ledger_metadata(lid).ensembles),
                       timeout=120, what="the second worker repairing everything")
            versions = {lid: c.store.read_ledger(lid)[1] for lid in lids}
            os.kill(held["pid"], signal.SIGCONT)
            # Found repaired at its read of the mark under the lock: the mark is gone.
            # (Before that read, it found out only at its read of the ledger or, once
            # in ten runs, at its CAS: "its record changed meanwhile".)
            said = (rf"ledger {held['ledger']}: nothing left to repair for "
                    rf"\S+-{held['pid']}\b")
            wait_until(lambda: re.search(said, logs[0].read_text()), timeout=60,
                       what="the resumed worker saying its ledger needs nothing")
            assert {lid: c.store.read_ledger(lid)[1] for lid in lids} == versions
            assert not re.search(rf"ledger {held['ledger']} re-replicated",
                                 logs[0].read_text())
            for lid in lids:
                assert fully_replicated(c, client.ledger_metadata(lid))
    finally:
        _stop_workers(procs)


def test_decommissionbookie_goes_through_autorecovery(cluster_factory):
    # The auditor would wait an hour: decommissioning marks the ledgers itself.
    c = cluster_factory(4, conf_overrides={**AR, "lostBookieRecoveryDelay": 3600})
    with bk.BookKeeper(c.metadata_uri) as client:
        lids = [closed_ledger(client, [b"d%d" % e for e in range(30)], password=PW)
                for _ in range(4)]
        victim = c.bookie(client.ledger_metadata(lids[0]).ensembles[0][1][0])
        wait_until(lambda: c.store.get_json(UR.AUDITOR)[0] is not None, what="an auditor")
        victim.stop()
        wait_until(lambda: victim.bookie_id not in c.store.all_bookies(),
                   what="its registration gone")
        # (if the victim was the auditor, another bookie takes over within the
        # candidates' look interval; decommissionbookie goes through auto-recovery
        # only with an auditor elected)
        wait_until(lambda: auditor_id(c.store) not in (None, victim.bookie_id),
                   what="an auditor other than the stopped bookie")
        r = subprocess.run([sys.executable, "-m", "bk.cli.shell", "--metadata", c.metadata_uri,
                            "decommissionbookie", victim.bookie_id, "--json"],
                           capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        assert report["by_autorecovery"] is True
        assert report["ledgers"] >= 1 and report["failed"] == {}
        assert c.store.read_cookie(victim.bookie_id)[0] is None
        for lid in lids:
            md = client.ledger_metadata(lid)
            assert all(victim.bookie_id not in ens for _, ens in md.ensembles)
            assert fully_replicated(c, md)
        assert not list(UR.list_marked(c.store))
        # A bookie that is still running is refused.
        alive = c.bookies[1] if c.bookies[1] is not victim else c.bookies[2]
        r = subprocess.run([sys.executable, "-m", "bk.cli.shell", "--metadata", c.metadata_uri,
                            "decommissionbookie", alive.bookie_id],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "still registered" in r.stderr


def test_standalone_autorecovery_serves_heartbeat_metrics_and_status(cluster_factory, tmp_path):
    c = cluster_factory(1)
    port = free_port()
    proc = _start_worker(c.metadata_uri, tmp_path / "ar.log", httpServerEnabled="true",
                         httpServerPort=port, registrationTtlSeconds=3)
    try:
        wait_until(lambda: http_get(port, "/heartbeat")[:2] == (200, "OK"), what="/heartbeat")
        me = f"-{proc.pid}"
        wait_until(lambda: json.loads(http_get(port, "/api/v1/autorecovery/status")[1])
                   .get("auditor", "") or "", what="an auditor elected")
        st = json.loads(http_get(port, "/api/v1/autorecovery/status")[1])
        assert st["running"] is True and st["here"] is True and st["enabled"] is True
        assert st["auditor"].endswith(me), st     # nothing else runs auto-recovery
        UR.mark(c.store, 4242, ["127.0.0.1:9"])     # a deleted ledger: unmarked by the worker
        wait_until(lambda: not list(UR.list_marked(c.store)), what="the mark handled")

        def metric(name):
            for line in http_get(port, "/metrics")[1].splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        wait_until(lambda: metric("auditor_NUM_UNDER_REPLICATED_LEDGERS") == 0,
                   what="the auditor's gauge served")
        assert metric("auditor_ELECTED") == 1
        assert metric("replication_REREPLICATED_ENTRIES_total") == 0
        assert http_get(port, "/api/v1/bookie/info")[0] == 404     # not a bookie
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert http_get(port, "/heartbeat")[0] is None              # the port is closed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# A standalone auto-recovery process started with this hook registers as a
# candidate but does not campaign for auditor until the file $AR_HOLD_CAMPAIGN
# exists: the test decides when the next auditor is elected.
HOLD_HOOK = r'''
import os, time
HOLD = os.environ.get("AR_HOLD_CAMPAIGN")
if HOLD:
    from bk.meta import recipes
    _campaign = recipes.Election.campaign

    def campaign(self, timeout=None):
        if self.lock.rel == "auditor" and not os.path.exists(HOLD):
            time.sleep(min(timeout or 1.0, 0.2))
            return False
        return _campaign(self, timeout)
    recipes.Election.campaign = campaign
'''


def _victim_with_ledgers(c, client, n=3):
    lids = [closed_ledger(client, [b"d%d" % e for e in range(20)], password=PW)
            for _ in range(n)]
    victim = c.bookie(client.ledger_metadata(lids[0]).ensembles[0][1][0])
    return lids, victim


def _shell(uri, *args):
    return subprocess.Popen([sys.executable, "-m", "bk.cli.shell", "--metadata", uri, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _retired(c, client, lids, victim):
    assert c.store.read_cookie(victim.bookie_id)[0] is None
    for lid in lids:
        md = client.ledger_metadata(lid)
        assert all(victim.bookie_id not in ens for _, ens in md.ensembles), lid
        assert fully_replicated(c, md), lid


def test_decommissionbookie_waits_for_the_next_auditor_after_one_stopped(cluster_factory,
                                                                         tmp_path):
    c = cluster_factory(4)
    settings = {"registrationTtlSeconds": 3, "lostBookieRecoveryDelay": 3600}
    first = _start_worker(c.metadata_uri, tmp_path / "ar1.log", **settings)
    go = tmp_path / "campaign"
    with site_hook(tmp_path, HOLD_HOOK, {"AR_HOLD_CAMPAIGN": go}):
        second = _start_worker(c.metadata_uri, tmp_path / "ar2.log", **settings)
    procs = [first, second]
    try:
        wait_until(lambda: (auditor_id(c.store) or "").endswith(f"-{first.pid}"),
                   timeout=30, what="the first process elected auditor")
        wait_until(lambda: len(UR.candidates(c.store)) == 2, timeout=30,
                   what="both processes registered as candidates")
        with bk.BookKeeper(c.metadata_uri) as client:
            lids, victim = _victim_with_ledgers(c, client)
            victim.stop()
            wait_until(lambda: victim.bookie_id not in c.store.all_bookies(),
                       what="its registration gone")
            first.terminate()                   # a clean stop: the key goes at once
            first.wait(30)
            wait_until(lambda: auditor_id(c.store) is None, what="no auditor")
            # the second still runs auto-recovery: a hand-over, not a cluster without it
            assert [x.rsplit("-", 1)[1] for x in UR.candidates(c.store)] == [str(second.pid)]
            p = _shell(c.metadata_uri, "decommissionbookie", victim.bookie_id, "--json")
            lines: list[str] = []
            reader = threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True)
            reader.start()
            wait_until(lambda: any("waiting for an auditor" in ln for ln in lines),
                       timeout=30, what="the shell waiting for an auditor")
            assert auditor_id(c.store) is None and p.poll() is None
            go.touch()                            # the second process campaigns now
            p.wait(timeout=180)                   # (its report is far below a pipe's size)
            out = p.stdout.read()
            reader.join(10)                       # stderr is the reader's alone
            assert p.returncode == 0, "".join(lines)
            report = json.loads(out)
            assert report["by_autorecovery"] is True, report
            assert "elected after" in report["how"], report
            assert report["ledgers"] >= 1 and report["failed"] == {}
            assert any("elected after" in ln for ln in lines), lines
            _retired(c, client, lids, victim)
            assert not list(UR.list_marked(c.store))
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(30)


def test_decommissionbookie_without_autorecovery_copies_itself_paced(cluster_factory):
    c = cluster_factory(4)
    with bk.BookKeeper(c.metadata_uri) as client:
        lids, victim = _victim_with_ledgers(c, client)
        # what the victim holds: the ledgers whose ensemble names it (each may, or
        # may not: E=3 of 4 bookies), in each the entries whose write set does
        held = [(lid, e) for lid in lids for e in range(20)
                if victim.bookie_id in client.ledger_metadata(lid).write_set(e)]
        victim.stop()
        wait_until(lambda: victim.bookie_id not in c.store.all_bookies(),
                   what="its registration gone")
        assert auditor_id(c.store) is None and UR.candidates(c.store) == []
        # auto-recovery asked for, none there: a clear refusal after the wait
        p = _shell(c.metadata_uri, "decommissionbookie", victim.bookie_id,
                   "--autorecovery", "--auditor-wait", "1")
        out, err = p.communicate(timeout=60)
        assert p.returncode != 0 and "no auditor is elected" in err, err
        assert c.store.read_cookie(victim.bookie_id)[0] is not None
        # by default: at once, from the shell's process, paced
        p = _shell(c.metadata_uri, "decommissionbookie", victim.bookie_id, "--json",
                   "--rate-bytes", "200000")
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        assert "no process runs auto-recovery" in err and "paced to 200000 bytes/s" in err, err
        assert "waiting for an auditor" not in err, err
        report = json.loads(out)
        assert report["by_autorecovery"] is False and report["failed"] == {}, report
        assert report["entries_copied"] == len(held), (held, report)
        assert sorted(report["ledger_ids"]) == sorted({lid for lid, _ in held}), report
        _retired(c, client, lids, victim)


def test_a_worker_acts_on_the_mark_as_it_is_under_the_lock_not_as_listed(cluster_factory):
    """A worker walks a listing of the marks that can be seconds old. Under the
    ledger's lock it reads the mark again: gone (another worker repaired the
    ledger since) it leaves the ledger alone; marked again since, it repairs for
    the current record and removes it. (It repaired for the listed record: a
    repair in place leaves the ensembles as they were, so every worker whose
    listing held the mark repaired the ledger again and then failed to unmark the
    old version; a 6-bookie hosts soak logged 2,906 such repeats for 1,216
    repairs.)"""
    c = cluster_factory(3)
    from bk.autorecovery.service import AutoRecovery
    from bk.config import Config
    UR.update_settings(c.store, enabled=False)      # its own loops stay idle
    ar = AutoRecovery(Config.load(overrides={"metadataServiceUri": c.metadata_uri}),
                      "stale-worker").start()
    try:
        repaired = []
        repair = ar._replicator.repair_in_place
        ar._replicator.repair_in_place = lambda lid, b, *a: (repaired.append((lid, b)),
                                                              repair(lid, b, *a))[1]
        with bk.BookKeeper(c.metadata_uri) as client:
            lid = closed_ledger(client, [b"s%d" % e for e in range(30)], ensemble=3,
                                write_quorum=3, password=PW)
            first, second = client.ledger_metadata(lid).ensembles[0][1][:2]
            assert UR.mark(c.store, lid, [first])
            [(_, listed, version)] = [r for r in UR.list_marked(c.store) if r[0] == lid]

            # repaired by another worker since the listing: left alone
            assert UR.unmark(c.store, lid, version)
            assert ar._take(lid, listed, version) is True
            assert repaired == [] and UR.marked(c.store, lid) == (None, None)

            # marked again since (for another bookie): repaired for the current record
            assert UR.mark(c.store, lid, [second])
            assert ar._take(lid, listed, version) is True
            assert repaired == [(lid, second)]
            assert UR.marked(c.store, lid) == (None, None)
            assert fully_replicated(c, client.ledger_metadata(lid))
    finally:
        ar.stop()
