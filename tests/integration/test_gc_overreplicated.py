"""A bookie's over-replicated GC against real etcd and bookie processes: a ledger
whose entries it dropped is not claimed again (its cost follows the ledgers that
hold entries), a kill -9 at the drop's two moments loses nothing live and leaves
nothing to drop unclaimed, and a SIGTERM during a claim stops cleanly (no
warning, no lock left in etcd).

Each bookie runs a site hook: every call of the scan
(:func:`bk.autorecovery.checker.claim_overreplicated`) is written down, per
process, with the ledgers offered to it and those it claimed, so the tests
count claims exactly."""

from __future__ import annotations

import json
import signal

import pytest
from prometheus_client.parser import text_string_to_metric_families

import bk
from bk import protocol as P
from bk.client.digest import master_key
from bk.errors import ENOENTRY, ENOLEDGER, EOK
from bk.meta import underreplication as UR
from bk.testing import BookieConnection, closed_ledger, hook_env, hooked_stop, http_get, \
    site_hook, wait_until

PW = b"overrep"
ENTRIES = [b"o%d" % i for i in range(12)]
# a full round with the over-replicated scan about every 0.3 s; nobody repairs
CONF = {"gcWaitTime": 300, "gcOverreplicatedLedgerWaitTime": 300,
        "autoRecoveryDaemonEnabled": False, "registrationTtlSeconds": 4}

SCAN_HOOK = r'''
import json, os
DIR = os.environ.get("GC_SCAN_DIR")

if DIR:
    import bk.autorecovery.checker as C
    _claim = C.claim_overreplicated

    def claim(store, pool, bookie_id, ledger_ids, **kw):
        ids = sorted(ledger_ids)
        got = _claim(store, pool, bookie_id, ids, **kw)
        with open(os.path.join(DIR, "%d.jsonl" % os.getpid()), "a") as f:
            f.write(json.dumps({"offered": ids, "claimed": [lid for lid, _ in got]}) + "\n")
        return got

    C.claim_overreplicated = claim    # before bk.bookie.arbiter imports it
'''


def scans(d, bookie) -> list[dict]:
    """Every over-replicated scan the running ``bookie`` made, in order."""
    try:
        with open(d / f"{bookie.pid}.jsonl") as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def claims(d, bookie, lid) -> int:
    return sum(lid in s["claimed"] for s in scans(d, bookie))


HTTP = {"httpServerEnabled": True, "httpServerPort": 0}
OVERREP = ("bookie_gc_OVERREPLICATED_CLAIMS_total", "bookie_gc_OVERREPLICATED_DROPPED_total")


def overrep_metrics(c, bookie) -> tuple:
    """(claims, dropped) as the bookie's /metrics serves them."""
    status, text, _ = http_get(c.store.bookie_info(bookie.bookie_id)["httpPort"], "/metrics")
    assert status == 200
    got = {s.name: s.value for fam in text_string_to_metric_families(text)
           for s in fam.samples if s.name in OVERREP}
    return tuple(got[n] for n in OVERREP)


def three_ledgers_on_one_bookie(c, client):
    """A bookie and three closed ledgers it holds entries of (ensembles of 3 among 4
    bookies: of six ledgers, some bookie is in five)."""
    lids = [closed_ledger(client, ENTRIES, 3, 2, 2, password=PW) for _ in range(6)]
    ens = {lid: client.ledger_metadata(lid).ensembles[0][1] for lid in lids}
    victim = max((b.bookie_id for b in c.bookies),
                 key=lambda b: sum(b in e for e in ens.values()))
    mine = [lid for lid in lids if victim in ens[lid]]
    assert len(mine) >= 3
    return victim, mine[:3]


def replace(c, lid, victim, fill):
    """Replace ``victim`` in ``lid``'s ensemble by the one bookie outside it, as a
    re-replication does: first (``fill``) copy to that bookie the entries its
    write sets give it (recovery adds), then the metadata. Without ``fill`` the
    new bookie holds nothing: the victim's copy must stay."""
    md, version = c.store.read_ledger(lid)
    ens = md.ensembles[0][1]
    spare = next(b.bookie_id for b in c.bookies if b.bookie_id not in ens)
    new = md.replace(ensembles=[(0, [spare if b == victim else b for b in ens])])
    if fill:
        n_src, n_dst = c.bookie(victim).num_shards, c.bookie(spare).num_shards
        with BookieConnection(victim, shard=P.shard_of(lid, n_src)) as src, \
                BookieConnection(spare, shard=P.shard_of(lid, n_dst)) as dst:
            for e in range(len(ENTRIES)):
                if spare in new.write_set(e):
                    assert copy(src, dst, lid, e) == EOK
    c.store.write_ledger(new, version)


def copy(src, dst, lid, e) -> int:
    got = src.call(P.read(src.next_rid(), lid, e))
    assert got[2] == EOK, got
    return dst.call(P.add(dst.next_rid(), lid, e, got[5], master_key(PW), got[6], got[7],
                          True))[2]


def assert_readable(client, *lids):
    for lid in lids:
        rh = client.open_ledger(lid, password=PW)
        assert [e.data for e in rh.read_entries(0, len(ENTRIES) - 1)] == ENTRIES, lid


def test_a_dropped_ledger_is_never_claimed_again_until_it_holds_entries(cluster_factory,
                                                                        tmp_path):
    """Of three ledgers on one bookie: one re-replicated (its copy is dropped, once,
    and then offered to no later scan), one whose replacement lacks entries (kept,
    offered to every scan), one the bookie still belongs to (offered to every
    scan). A recovery add gives the dropped one an entry again: it is offered and
    dropped again, exactly once more. The bookie's /metrics counts each claim and
    each drop (bookie_gc_OVERREPLICATED_CLAIMS, _DROPPED) exactly."""
    d = tmp_path / "scans"
    d.mkdir()
    with site_hook(tmp_path, SCAN_HOOK, {"GC_SCAN_DIR": d}):
        c = cluster_factory(4, num_shards=1, conf_overrides={**CONF, **HTTP})
    with bk.BookKeeper(c.metadata_uri) as client:
        victim, (moved, kept, live) = three_ledgers_on_one_bookie(c, client)
        b = c.bookie(victim)
        held = {lid: c.entries_on(victim, lid) for lid in (moved, kept, live)}
        assert overrep_metrics(c, b) == (0, 0)
        replace(c, kept, victim, fill=False)
        replace(c, moved, victim, fill=True)
        wait_until(lambda: not c.entries_on(victim, moved), timeout=60,
                   what="the re-replicated ledger's copy dropped")
        first = next(i for i, s in enumerate(scans(d, b)) if moved in s["claimed"])
        wait_until(lambda: len(scans(d, b)) >= first + 1 + 8, timeout=60,
                   what="eight more over-replicated scans")
        done = scans(d, b)
        assert [i for i, s in enumerate(done) if moved in s["claimed"]] == [first]
        for s in done[first + 1:]:
            assert moved not in s["offered"], s
            assert kept in s["offered"] and live in s["offered"], s
        assert not any(kept in s["claimed"] or live in s["claimed"] for s in done)
        assert c.entries_on(victim, kept) == held[kept]
        assert c.entries_on(victim, live) == held[live]
        # counted once the drop is answered; eight scans later, still once
        wait_until(lambda: overrep_metrics(c, b) == (1, 1), timeout=30,
                   what="the claim and the drop counted")
        n = len(scans(d, b))
        wait_until(lambda: len(scans(d, b)) >= n + 8, timeout=60, what="eight more scans")
        assert overrep_metrics(c, b) == (1, 1)

        # Picked to hold it again (a recovery add): it holds an entry, so a scan
        # sees it again, and drops it again.
        md = client.ledger_metadata(moved)
        e = next(e for e in sorted(held[moved]))
        holder = md.write_set(e)[0]
        with BookieConnection(holder, shard=P.shard_of(moved, c.bookie(holder).num_shards)) \
                as src, BookieConnection(victim, shard=P.shard_of(moved, b.num_shards)) as dst:
            assert copy(src, dst, moved, e) == EOK
        wait_until(lambda: claims(d, b, moved) == 2 and not c.entries_on(victim, moved),
                   timeout=60, what="the copy taken again dropped again")
        n = len(scans(d, b))
        wait_until(lambda: len(scans(d, b)) >= n + 4, timeout=60, what="four more scans")
        assert claims(d, b, moved) == 2
        assert overrep_metrics(c, b) == (2, 2)
        assert c.entries_on(victim, kept) == held[kept]
        assert_readable(client, moved, kept, live)

        # Settled, it is still among the ledgers a full round checks for deletion:
        # deleted, its state goes (ENOENTRY from a state without entries, then
        # ENOLEDGER).
        assert read_status(victim, b, moved) == ENOENTRY
        client.delete_ledger(moved)
        wait_until(lambda: read_status(victim, b, moved) == ENOLEDGER, timeout=60,
                   what="the settled ledger's state deleted")


def read_status(bookie_id, b, lid) -> int:
    with BookieConnection(bookie_id, shard=P.shard_of(lid, b.num_shards)) as conn:
        return conn.call(P.read(conn.next_rid(), lid, 0))[2]


# Stops a shard worker (SIGSTOP) at one of the two moments of a drop, reported to
# the test: before its DROP record ("record"), or after the record was synced and
# before the index forgot the entries ("index").
KILL_HOOK = r'''
import os
from bk.testing import hook_setting, stop_here

if hook_setting("at"):
    from bk.bookie.storage import ShardStorage
    _drop, _forget = ShardStorage.drop_ledgers, ShardStorage._forget

    def drop_ledgers(self, ids):
        ids = list(ids)
        if hook_setting("at") == "record":
            stop_here({"at": "record", "ids": ids})
        return _drop(self, ids)

    def forget(self, lid, st):
        if hook_setting("at") == "index":
            stop_here({"at": "index", "ledger": lid})
        return _forget(self, lid, st)

    ShardStorage.drop_ledgers, ShardStorage._forget = drop_ledgers, forget
'''


@pytest.mark.parametrize("at", ["record", "index"])
def test_killed_during_a_drop_loses_nothing_and_leaves_nothing_unclaimed(cluster_factory,
                                                                         tmp_path, at):
    """kill -9 of the bookie while its shard drops an over-replicated ledger: before
    the DROP record is durable (the restarted bookie still holds the copy, a scan
    claims it again and drops it), or after it and before the index forgot (the
    replay drops it; no scan offers it again). What the bookie still belongs to is
    whole, and the ledger readable."""
    out = tmp_path / "report"
    with site_hook(tmp_path / "kill", KILL_HOOK, hook_env(out, at=at, how="stop")):
        c = cluster_factory(4, num_shards=1, conf_overrides=CONF)
    with bk.BookKeeper(c.metadata_uri) as client:
        victim, (moved, kept, live) = three_ledgers_on_one_bookie(c, client)
        b = c.bookie(victim)
        held = {lid: c.entries_on(victim, lid) for lid in (moved, kept, live)}
        replace(c, moved, victim, fill=True)
        stopped = hooked_stop(out, "stop", what=f"the shard stopped at the drop ({at})")
        assert stopped.get("ledger", moved) == moved and stopped.get("ids", [moved]) == [moved]
        b.kill()
        d = tmp_path / "scans"
        d.mkdir()
        with site_hook(tmp_path / "count", SCAN_HOOK, {"GC_SCAN_DIR": d}):
            b.start()
        # before any scan of the restarted bookie: what the journal says
        assert c.entries_on(victim, moved) == (held[moved] if at == "record" else set())
        assert c.entries_on(victim, kept) == held[kept]
        assert c.entries_on(victim, live) == held[live]
        wait_until(lambda: not c.entries_on(victim, moved) and len(scans(d, b)) >= 6,
                   timeout=90, what="six scans of the restarted bookie, the copy dropped")
        assert claims(d, b, moved) == (1 if at == "record" else 0)
        if at == "index":
            assert not any(moved in s["offered"] for s in scans(d, b))
        assert c.entries_on(victim, kept) == held[kept]
        assert c.entries_on(victim, live) == held[live]
        assert_readable(client, moved, kept, live)


# Holds the bookie's over-replicated claim, its lock taken, until the test creates
# "go": in the scan's replica check ("checking", the arbiter) or in the shard's
# drop ("dropping", the worker).
HOLD_HOOK = r'''
import os, time
from bk.testing import hook_report, hook_setting

AT = hook_setting("at")


def hold(what):
    hook_report({"at": what})
    go = os.environ["BK_TEST_HOOK_OUT"] + ".go"
    deadline = time.monotonic() + 120
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)


if AT:
    from bk.meta.recipes import LeaseLock
    _release = LeaseLock.release

    def release(self):
        time.sleep(0.5)       # a slow etcd: the store must still be open after this
        return _release(self)

    LeaseLock.release = release

if AT == "checking":
    import bk.autorecovery.checker as C
    _check = C.replica_problems

    def replica_problems(pool, md, last=None):
        hold("checking")
        return _check(pool, md, last)

    C.replica_problems = replica_problems
elif AT == "dropping":
    from bk.bookie.worker import ShardWorker
    _handle = ShardWorker.handle_gc_drop

    def handle_gc_drop(self, ids):
        hold("dropping")
        return _handle(self, ids)

    ShardWorker.handle_gc_drop = handle_gc_drop
'''


@pytest.mark.parametrize("at", ["checking", "dropping"])
def test_sigterm_during_a_claim_releases_its_lock_and_logs_no_warning(cluster_factory,
                                                                     tmp_path, at):
    """SIGTERM while the over-replicated claim holds the ledger's lock (its replica
    check, or its shard's drop, held by the hook until the stop has begun): the
    bookie exits 0, logs no WARNING or ERROR from the signal on, and leaves no
    under-replication lock in etcd; the claim's drop was done."""
    out = tmp_path / "report"
    with site_hook(tmp_path, HOLD_HOOK, hook_env(out, at=at)):
        # a lock outlives a bookie that leaves it for 10 s: seen here if left
        c = cluster_factory(4, num_shards=1, conf_overrides={**CONF,
                                                             "registrationTtlSeconds": 10})
    with bk.BookKeeper(c.metadata_uri) as client:
        victim, (moved, kept, live) = three_ledgers_on_one_bookie(c, client)
        b = c.bookie(victim)
        held = {lid: c.entries_on(victim, lid) for lid in (kept, live)}
        replace(c, moved, victim, fill=True)
        wait_until(out.exists, timeout=60, what=f"the claim held ({at})")
        assert json.loads(out.read_text())["at"] == at
        assert c.store.get_json(UR.lock_rel(moved))[0] is not None    # held meanwhile
        with open(b.log_file, "rb") as f:
            mark = len(f.read())

        def since():
            with open(b.log_file, "rb") as f:
                return f.read()[mark:].decode(errors="replace")
        b.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "received SIGTERM: stopping" in since(), timeout=30,
                   what="the bookie stopping")
        (tmp_path / "report.go").touch()
        assert b.proc.wait(60) == 0
        noisy = [line for line in since().splitlines()
                 if " WARNING [" in line or " ERROR [" in line or "Traceback" in line]
        assert noisy == []
        assert list(c.store.list_json(UR.LOCKS)) == []
        b.start()
        assert c.entries_on(victim, moved) == set()        # the claim's drop was done
        for lid, entries in held.items():
            assert c.entries_on(victim, lid) == entries
        assert_readable(client, moved, kept, live)


# Until the test creates "<out>.ready" every replica check of the over-replicated
# scan finds a problem (nothing is claimed). From then on, the first check of a
# scan that has two candidates is held until "<out>.go", reported to the test; every
# check of a scan is written down ("<out>.calls"), with the scan's candidates.
STOP_HOOK = r'''
import json, os, time
from bk.testing import hook_report

OUT = os.environ.get("BK_TEST_HOOK_OUT")

if OUT:
    import bk.autorecovery.checker as C
    _claim, _check = C.claim_overreplicated, C.replica_problems
    scan = {}

    def claim(*a, **kw):
        scan["stats"] = kw.get("stats")
        return _claim(*a, **kw)

    def replica_problems(pool, md, last=None):
        candidates = (scan.get("stats") or {}).get("candidates", 0)
        if not os.path.exists(OUT + ".ready") or candidates != 2:
            res = C.CheckResult(md.ledger_id)
            res.unreachable["hook"] = "not yet"
            return res
        with open(OUT + ".calls", "a") as f:
            f.write(json.dumps({"ledger": md.ledger_id, "candidates": candidates}) + "\n")
        if not os.path.exists(OUT):
            hook_report({"ledger": md.ledger_id})
            deadline = time.monotonic() + 120
            while not os.path.exists(OUT + ".go") and time.monotonic() < deadline:
                time.sleep(0.02)
        return _check(pool, md, last)

    C.claim_overreplicated, C.replica_problems = claim, replica_problems
'''


def test_a_stop_waits_for_one_candidate_not_the_rest(cluster_factory, tmp_path):
    """SIGTERM while the over-replicated scan checks the first of two candidates:
    the scan looks at the stop before the next one, so only the one it was checking
    is claimed and dropped; the other keeps its copy, its replicas never checked,
    and no lock is left in etcd."""
    out = tmp_path / "report"
    with site_hook(tmp_path, STOP_HOOK, hook_env(out)):
        c = cluster_factory(4, num_shards=1, conf_overrides=CONF)
    with bk.BookKeeper(c.metadata_uri) as client:
        victim, (one, two, live) = three_ledgers_on_one_bookie(c, client)
        b = c.bookie(victim)
        held = {lid: c.entries_on(victim, lid) for lid in (one, two, live)}
        replace(c, one, victim, fill=True)
        replace(c, two, victim, fill=True)
        (tmp_path / "report.ready").touch()
        wait_until(out.exists, timeout=60, what="the scan checking its first candidate")
        first = json.loads(out.read_text())["ledger"]
        assert first in (one, two)
        other = two if first == one else one
        b.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "received SIGTERM: stopping" in open(b.log_file).read(),
                   timeout=30, what="the bookie stopping")
        (tmp_path / "report.go").touch()
        assert b.proc.wait(60) == 0
        calls = [json.loads(line) for line in open(f"{out}.calls")]
        assert calls == [{"ledger": first, "candidates": 2}]
        assert list(c.store.list_json(UR.LOCKS)) == []
        b.start()
        assert c.entries_on(victim, first) == set()         # claimed before the stop
        assert c.entries_on(victim, other) == held[other]   # not looked at after it
        assert c.entries_on(victim, live) == held[live]
        assert_readable(client, one, two, live)


# Kills the shard worker (-9) once, before its DROP record of an over-replicated drop.
KILL_ONCE_HOOK = r'''
import os
from bk.testing import hook_setting, stop_here

if hook_setting("at"):
    from bk.bookie.storage import ShardStorage
    _drop = ShardStorage.drop_ledgers

    def drop_ledgers(self, ids):
        ids = list(ids)
        if not os.path.exists(os.environ["BK_TEST_HOOK_OUT"]):
            stop_here({"ids": ids}, how="kill")
        return _drop(self, ids)

    ShardStorage.drop_ledgers = drop_ledgers
'''


def test_a_shard_killed_before_confirming_a_drop_is_not_counted_as_dropped(cluster_factory,
                                                                           tmp_path):
    """The shard worker dies (kill -9) before it records the drop of a claimed ledger:
    the arbiter says so (not "dropped"), the restarted shard still holds the copy, the
    next scan claims it again and the shard drops it. Two claims, one drop, in
    /metrics and in the log."""
    out = tmp_path / "report"
    with site_hook(tmp_path, KILL_ONCE_HOOK, hook_env(out, at="record")):
        c = cluster_factory(4, num_shards=1, conf_overrides={**CONF, **HTTP})
    with bk.BookKeeper(c.metadata_uri) as client:
        victim, (moved, kept, live) = three_ledgers_on_one_bookie(c, client)
        b = c.bookie(victim)
        held = {lid: c.entries_on(victim, lid) for lid in (kept, live)}
        replace(c, moved, victim, fill=True)
        wait_until(out.exists, timeout=60, what="the shard killed at the drop")
        assert json.loads(out.read_text())["ids"] == [moved]
        wait_until(lambda: overrep_metrics(c, b) == (2, 1), timeout=60,
                   what="claimed twice, dropped once")
        assert c.entries_on(victim, moved) == set()
        with open(b.log_file) as f:
            log = f.read()
        assert log.count("died before confirming the drop of 1 claimed over-replicated") == 1
        assert log.count(f"claimed 1 over-replicated ledgers (e.g. {moved}), dropped the "
                         f"entries of 1") == 1
        for lid, entries in held.items():
            assert c.entries_on(victim, lid) == entries
        assert_readable(client, moved, kept, live)
