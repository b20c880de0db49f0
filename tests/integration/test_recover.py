"""Bookie recovery (``bkshell recover``) against real etcd and real bookies: kill -9 a
bookie holding fragments of closed ledgers and of one still-open ledger, add a new
bookie, recover, and check every entry is on a full write quorum of live bookies."""

import json

import pytest

import bk
from bk import protocol as P
from bk.admin import Admin
from bk.client.recovery import recover_ledger
from bk.errors import BadPasswordError, LedgerFencedError, BKError
from bk.meta.ledger import LedgerState
from bk.testing import entries_held, shell, wait_until

PW = b"recover-test"


def assert_fully_replicated(store, lid, live):
    md, _ = store.read_ledger(lid)
    assert md.state == LedgerState.CLOSED
    held = {}
    for first, ens in md.ensembles:
        for b in ens:
            assert b in live, f"ledger {lid}: {b} still in an ensemble"
            if b not in held:
                held[b] = entries_held(store, b, lid)
    for e in range(md.last_entry_id + 1):
        ws = md.write_set(e)
        missing = [b for b in ws if e not in held[b]]
        assert not missing, f"ledger {lid} entry {e} missing on {missing}"
    return md


def test_recover_dead_bookie(cluster_factory):
    cluster = cluster_factory(4)
    uri = cluster.metadata_uri
    client = bk.BookKeeper(uri)
    victim = cluster.bookies[0].bookie_id
    data = {}
    closed = []
    # Closed ledgers of different shapes; all on 3 or 4 of the 4 bookies.
    for i, (e, qw, qa, n) in enumerate([(3, 2, 2, 40), (3, 3, 2, 25), (4, 2, 1, 60),
                                        (4, 3, 2, 0), (3, 2, 2, 300)]):
        lh = client.create_ledger(e, qw, qa, password=PW, digest_type="crc32c")
        payloads = [b"ledger %d entry %d " % (i, j) * (j % 7 + 1) for j in range(n)]
        if payloads:
            lh.add_entries(payloads)
        lh.close()
        data[lh.ledger_id] = payloads
        closed.append(lh.ledger_id)
    # Make sure the victim holds a fragment of most of them (ensembles are random).
    mds = [client.ledger_metadata(lid) for lid in closed]
    holding = [md.ledger_id for md in mds if any(victim in ens for _, ens in md.ensembles)]
    assert len(holding) >= 2, "the victim holds too few ledgers for a meaningful test"
    # One open ledger on the victim; its writer never closes.
    while True:
        w = client.create_ledger(3, 3, 2, password=PW)
        if victim in w.metadata.ensembles[-1][1]:
            break
        w.close()
        client.delete_ledger(w.ledger_id)
    open_payloads = [b"open entry %d" % j for j in range(30)]
    w.add_entries(open_payloads)
    data[w.ledger_id] = open_payloads
    # Every bookie confirmed every entry: a writer replaces a bookie that dies
    # holding acknowledged entries it had not confirmed (addEntryTimeoutSec), and
    # this test wants the victim to stay in the open ledger's last ensemble.
    wait_until(lambda: not w._unconfirmed, timeout=10,
               what="the victim to confirm every entry of the open ledger")

    cluster.bookies[0].kill()
    new = cluster.add_bookie()
    live = {b.bookie_id for b in cluster.bookies if b.alive}
    assert new.bookie_id in live and victim not in live

    # dry run: nothing changes
    r = shell("--metadata", uri, "recover", victim, "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["dry_run"] and w.ledger_id in plan["closed"]
    assert client.ledger_metadata(w.ledger_id).state == LedgerState.OPEN

    r = shell("--metadata", uri, "recover", victim, "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["closed"] == [w.ledger_id]
    assert rep["entries_copied"] > 0 and not rep["failed"]
    assert set(rep["ledger_ids"]) == set(holding) | {w.ledger_id}

    store = cluster.store
    for lid, payloads in data.items():
        md = assert_fully_replicated(store, lid, live)
        assert md.last_entry_id == len(payloads) - 1
        assert md.length == sum(map(len, payloads))
        rh = client.open_ledger_no_recovery(lid, password=PW)
        if payloads:
            got = [e.data for e in rh.read_entries(0, len(payloads) - 1)]
            assert got == payloads

    # the old writer of the open ledger is fenced out
    with pytest.raises((LedgerFencedError, BKError)):
        w.add_entry(b"too late")

    # a second run copies nothing
    r = shell("--metadata", uri, "recover", victim, "--json")
    assert r.exit_code == 0, r.output
    again = json.loads(r.stdout)
    assert again["entries_copied"] == 0 and again["ledgers"] == 0

    # decommission: once the victim's registration has expired, its cookie goes
    assert store.read_cookie(victim)[0] is not None
    wait_until(lambda: store.bookie_info(victim) is None, timeout=20, step=0.2,
               what="the victim's registration to expire")
    r = shell("--metadata", uri, "decommissionbookie", victim)
    assert r.exit_code == 0, r.output
    assert store.read_cookie(victim)[0] is None
    # ... but a live bookie is refused
    r = shell("--metadata", uri, "decommissionbookie", new.bookie_id)
    assert r.exit_code != 0 and "registered" in r.stderr
    client.close()


def test_recover_resumes_after_interruption_and_skip_open(cluster_factory):
    """An interrupted recovery (entries copied, ensemble not yet swapped) resumes
    without copying again; --skip-open leaves open ledgers alone."""
    cluster = cluster_factory(4)
    uri = cluster.metadata_uri
    client = bk.BookKeeper(uri)
    victim = cluster.bookies[1].bookie_id
    while True:
        lh = client.create_ledger(3, 2, 2, password=PW)
        if victim in lh.metadata.ensembles[0][1]:
            break
        lh.close()
    payloads = [b"x%d" % j for j in range(100)]
    lh.add_entries(payloads)
    lh.close()
    while True:
        w = client.create_ledger(3, 2, 2, password=PW)
        if victim in w.metadata.ensembles[0][1]:
            break
        w.close()
    w.add_entries([b"o%d" % j for j in range(10)])
    cluster.bookies[1].kill()
    cluster.add_bookie()
    live = {b.bookie_id for b in cluster.bookies if b.alive}

    with Admin(uri) as admin:
        # Simulate an interruption: copy the fragment without swapping the ensemble.
        orig = admin.replicator._swap_bookie
        admin.replicator._swap_bookie = lambda *a: None
        rep = admin.recover_bookie(victim, skip_open=True, ledger_ids=[lh.ledger_id])
        admin.replicator._swap_bookie = orig
        first_copy = rep.entries_copied
        assert first_copy > 0
        assert victim in client.ledger_metadata(lh.ledger_id).ensembles[0][1]
        rep = admin.recover_bookie(victim, skip_open=True)
        assert rep.skipped_open == [w.ledger_id]
        assert rep.entries_copied == 0
        assert sum(f.already for f in rep.fragments) == first_copy
    assert_fully_replicated(cluster.store, lh.ledger_id, live)
    assert client.ledger_metadata(w.ledger_id).state == LedgerState.OPEN
    assert victim in client.ledger_metadata(w.ledger_id).ensembles[-1][1]

    r = shell("--metadata", uri, "recover", victim, "--skip-open")
    assert r.exit_code == 0, r.output
    assert "1 open ledgers skipped" in r.stdout
    client.close()


def test_recoverledger_writer_alive_one_bookie_dead(cluster_factory):
    """``bkshell recoverledger`` (the client's recovery, with the master key from the
    metadata, no password) on an open mac ledger whose writer is alive but one bookie
    of whose ensemble is dead: closed at the last acknowledged entry, every entry
    readable and verifying under the writer's MAC, and the recovered tail written to
    a full write set (the dead bookie replaced), not left on the survivors only."""
    cluster = cluster_factory(4)
    uri = cluster.metadata_uri
    # No explicit LAC: the last entries lie beyond the LAC the bookies know, so that
    # recovery has a tail to read forward and write back.
    client = bk.BookKeeper(uri, explicitLacInterval=0)
    w = client.create_ledger(3, 3, 2, password=PW, digest_type="mac")
    lid = w.ledger_id
    payloads = [b"alive writer entry %d " % i * (i % 5 + 1) for i in range(50)]
    assert w.add_entries(payloads) == 49
    victim = w.metadata.last_ensemble[1]
    next(b for b in cluster.bookies if b.bookie_id == victim).kill()
    live = {b.bookie_id for b in cluster.bookies if b.alive}

    # A wrong key (or password) is refused before anything changes.
    with pytest.raises(BadPasswordError):
        recover_ledger(client, lid, master_key=b"\0" * 20)
    with pytest.raises(BadPasswordError):
        recover_ledger(client, lid, password=b"wrong")
    assert client.ledger_metadata(lid).state == LedgerState.OPEN

    r = shell("--metadata", uri, "recoverledger", str(lid), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"ledger": lid, "state": "CLOSED", "last_entry_id": 49,
                                    "length": sum(map(len, payloads))}
    md = client.ledger_metadata(lid)
    assert md.state == LedgerState.CLOSED and md.last_entry_id == 49
    # The tail found past the bookies' LAC went to a new fragment without the dead bookie,
    # on every bookie of each entry's write set.
    first, ens = md.ensembles[-1]
    assert 0 <= first <= 49 and victim not in ens and set(ens) <= live
    held = {b: entries_held(client._store, b, lid) for b in ens}
    for e in range(first, 50):
        assert all(e in held[b] for b in md.write_set(e)), (e, md.write_set(e), held)
    # The writer is fenced out.
    with pytest.raises(LedgerFencedError):
        w.add_entry(b"too late")
    # Written back with their original digests: they verify under the password.
    rh = client.open_ledger_no_recovery(lid, password=PW)
    assert [e.data for e in rh.read_entries(0, 49)] == payloads
    client.close()


@pytest.mark.parametrize("batching", [True, False])
def test_recover_copies_with_and_without_batched_frames(cluster_factory, batching):
    """Re-replication uses READ_RANGE / ADD_BATCH with bookies that announce them,
    single READs and ADDs with bookies that do not (frameBatching=false), with
    entries larger than a READ_RANGE answer's budget (a follow-up per entry)."""
    cluster = cluster_factory(4, conf_overrides={"frameBatching": batching,
                                                 "nettyMaxFrameSizeBytes": 256 * 1024})
    uri = cluster.metadata_uri
    with bk.BookKeeper(uri, nettyMaxFrameSizeBytes=256 * 1024) as client:
        data = {}
        for shape, size, n in (((3, 2, 2), 100, 600), ((3, 3, 2), 60_000, 12)):
            lh = client.create_ledger(*shape, password=PW)
            data[lh.ledger_id] = [bytes([e % 251]) * size for e in range(n)]
            lh.add_entries(data[lh.ledger_id])
            lh.close()
        first = client.ledger_metadata(next(iter(data)))
        victim = cluster.bookie(first.ensembles[0][1][0])
        victim.kill()
        with Admin(uri, max_frame=256 * 1024) as admin:
            report = admin.recover_bookie(victim.bookie_id)
            assert report.ok, report.failed
            assert report.entries_copied > 0, report
            other = next(b for b in cluster.bookies if b is not victim).bookie_id
            assert bool(admin.bookies.features(other, 0) & P.FEATURE_ADD_BATCH) == batching
        live = {b.bookie_id for b in cluster.bookies if b is not victim}
        for lid, entries in data.items():
            assert_fully_replicated(cluster.store, lid, live)
            rh = client.open_ledger(lid, password=PW)
            assert [e.data for e in rh.read_entries(0, len(entries) - 1)] == entries


def test_recover_shows_progress_on_stderr_and_none_under_json(cluster_factory):
    """``bkshell recover``: with --json, stdout is one JSON document (the ledgers
    recovered) and stderr holds no progress line; without it, stderr shows the
    ledgers done, "recovering <bookie>: ledgers: n/total", from the first to the
    last, and stdout the summary."""
    cluster = cluster_factory(4)
    uri = cluster.metadata_uri
    with bk.BookKeeper(uri) as client:
        first = cluster.bookies[0].bookie_id
        lids = []
        while len(lids) < 3:
            lh = client.create_ledger(3, 2, 2, password=PW)
            lh.add_entries([b"p%d" % i for i in range(10)])
            lh.close()
            if first in lh.metadata.ensembles[0][1]:
                lids.append(lh.ledger_id)
            else:
                client.delete_ledger(lh.ledger_id)
        cluster.bookies[0].kill()
        # lost, not merely killed: a registered bookie's recovery warns on stderr
        wait_until(lambda: cluster.store.bookie_info(first) is None, timeout=20,
                   what="the killed bookie's registration expired")
        r = shell("--metadata", uri, "recover", first, "--json")
        assert r.exit_code == 0, r.output
        rep = json.loads(r.stdout)
        assert sorted(rep["ledger_ids"]) == sorted(lids) and not rep["failed"]
        assert r.stderr == ""
        # every ledger is on the three live bookies now: lose one more, add one
        second = cluster.bookies[1]
        second.kill()
        cluster.add_bookie()
        wait_until(lambda: cluster.store.bookie_info(second.bookie_id) is None, timeout=20,
                   what="the second killed bookie's registration expired")
        live = {b.bookie_id for b in cluster.bookies if b.alive}
        r = shell("--metadata", uri, "recover", second.bookie_id)
        assert r.exit_code == 0, r.output
        lines = r.stderr.splitlines()
        prefix = f"recovering {second.bookie_id}: ledgers: "
        assert lines and all(line.startswith(prefix) for line in lines), lines
        done = [line[len(prefix):] for line in lines]
        assert done[0] == "1/3" and done[-1] == "3/3", done
        assert [int(d.split("/")[0]) for d in done] == \
            sorted({int(d.split("/")[0]) for d in done}), done
        assert r.stdout.startswith(f"recovered bookie {second.bookie_id}: 3 ledgers, "), \
            r.stdout
        for lid in lids:
            assert_fully_replicated(cluster.store, lid, live)
