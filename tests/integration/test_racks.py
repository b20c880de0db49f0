"""Racks in etcd and rack-aware placement against real bookies: bkshell setrack /
getrack / listbookies, a bookie's own bookieRack, and new ensembles, ensemble
changes, recovery and re-replication that keep every write quorum over two racks."""

import json

import pytest

import bk
from bk.admin import Admin
from bk.client.placement import PlacementPolicy, write_quorum_racks
from bk.config import Config
from bk.errors import BKError, NotEnoughBookiesError
from bk.meta.racks import DEFAULT_RACK, all_racks
from bk.testing import shell, wait_until

RACKAWARE = {"ensemblePlacementPolicy": "rackaware", "minNumRacksPerWriteQuorum": 2,
             "enforceMinNumRacksPerWriteQuorum": True}


def spans(md, racks):
    return [min(write_quorum_racks(ens, md.write_quorum_size,
                                   lambda b: racks.get(b, DEFAULT_RACK)))
            for _, ens in md.ensembles]


@pytest.fixture
def racked(cluster_factory):
    """Six bookies in three racks: bookies 0,1 in /r/a, 2,3 in /r/b, 4,5 in /r/c."""
    c = cluster_factory(6, num_shards=1)
    uri = c.metadata_uri
    for i, b in enumerate(c.bookies):
        r = shell("--metadata", uri, "setrack", b.bookie_id, f"/r/{'abc'[i // 2]}")
        assert r.exit_code == 0, r.output
    return c


def test_setrack_getrack_listbookies(cluster_factory):
    c = cluster_factory(2, num_shards=1, conf_overrides={})
    uri = c.metadata_uri
    b0, b1 = (b.bookie_id for b in c.bookies)
    r = shell("--metadata", uri, "getrack", b0, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == {"id": b0, "rack": DEFAULT_RACK,
                                                         "stored": False}
    assert shell("--metadata", uri, "setrack", b0, "/eu/rack1").exit_code == 0
    assert shell("--metadata", uri, "setrack", b1, "/rack2").exit_code == 0        # default region
    got = json.loads(shell("--metadata", uri, "getrack", b0, "--json").stdout)
    assert got["rack"] == "/eu/rack1"
    rows = {r["id"]: r
            for r in json.loads(shell("--metadata", uri, "listbookies", "--json").stdout)}
    assert rows[b0]["rack"] == "/eu/rack1"
    assert rows[b1]["rack"] == "/default-region/rack2"
    assert "/eu/rack1" in shell("--metadata", uri, "listbookies").stdout
    bad = shell("--metadata", uri, "setrack", b0, "eu/rack1")
    assert bad.exit_code != 0 and "bad rack" in bad.stderr


def test_bookie_rack_from_conf_unless_set(cluster_factory):
    c = cluster_factory(1, num_shards=1)
    b = c.add_bookie(bookieRack="/dc1/r7")
    wait_until(lambda: all_racks(c.store).get(b.bookie_id) == "/dc1/r7",
               what="the bookie's own rack in etcd")
    # an operator's setrack wins over the conf at the next start
    assert shell("--metadata", c.metadata_uri, "setrack", b.bookie_id, "/dc1/r9").exit_code == 0
    b.restart()
    assert all_racks(c.store)[b.bookie_id] == "/dc1/r9"
    # a bad bookieRack refuses to start
    b.stop()
    b.write_conf(bookieRack="no-slash")
    with pytest.raises(BKError) as ei:
        b.start(timeout=20)
    assert "bookieRack" in str(ei.value)


def test_rackaware_ensembles_changes_and_rereplication(racked):
    c = racked
    racks = all_racks(c.store)
    assert len(set(racks.values())) == 3
    with bk.BookKeeper(c.metadata_uri, addEntryTimeoutSec=2, **RACKAWARE) as client:
        handles = [client.create_ledger(3, 2, 2) for _ in range(12)]
        for h in handles:
            assert min(spans(h.metadata, racks)) >= 2
            for i in range(5):
                h.add_entry(b"x%d" % i)
        # kill one bookie of the first ledger: ensemble changes keep two racks per quorum
        victim = c.bookie(handles[0].metadata.last_ensemble[0])
        victim.kill()
        for h in handles:
            for i in range(5, 10):
                h.add_entry(b"x%d" % i)
            assert victim.bookie_id not in h.metadata.last_ensemble
            assert min(spans(h.metadata, racks)) >= 2, h.metadata.ensembles
            h.close()
    # re-replication of the dead bookie (bkshell recover's library) follows the policy
    with Admin(c.metadata_uri, placement=PlacementPolicy.from_conf(
            Config.load(overrides=RACKAWARE))) as admin:
        report = admin.recover_bookie(victim.bookie_id)
        assert not report.failed, report.failed
    with bk.BookKeeper(c.metadata_uri) as client:
        for h in handles:
            md = client.ledger_metadata(h.ledger_id)
            assert all(victim.bookie_id not in ens for _, ens in md.ensembles)
            assert min(spans(md, racks)) >= 2, md.ensembles
            r = client.open_ledger(h.ledger_id)
            assert [e.data for e in r.read_entries(0, 9)] == [b"x%d" % i for i in range(10)]


def test_enforced_policy_names_the_racks(racked):
    c = racked
    # E3 Qw3 over 3 distinct racks, then lose a whole rack: cannot be met
    with bk.BookKeeper(c.metadata_uri, **{**RACKAWARE, "minNumRacksPerWriteQuorum": 3}) as client:
        client.create_ledger(3, 3, 2).close()
        for b in c.bookies[4:]:
            b.kill()
        # gone from etcd, and from the client's view (a watch: it follows etcd, a
        # moment later; seen on CI as a ledger placed on a dead bookie of rack c)
        wait_until(lambda: len(c.store.list_bookies()) == 4
                   and len(client._writable_view()) == 4, what="rack c gone from etcd")
        with pytest.raises(NotEnoughBookiesError) as ei:
            client.create_ledger(3, 3, 2)
        msg = str(ei.value)
        assert "/r/a" in msg and "/r/b" in msg and "minNumRacksPerWriteQuorum=3" in msg
    # not enforced: it falls back (and logs) instead
    with bk.BookKeeper(c.metadata_uri, ensemblePlacementPolicy="rackaware",
                       minNumRacksPerWriteQuorum=3) as client:
        h = client.create_ledger(3, 3, 2)
        h.add_entry(b"ok")
        h.close()


def test_placementcheck_lists_fragments_in_too_few_racks(racked):
    c = racked
    uri = c.metadata_uri
    with bk.BookKeeper(uri, **RACKAWARE) as client:
        good = client.create_ledger(3, 2, 2)
        good.add_entry(b"x")
        good.close()
    r = shell("--metadata", uri, "placementcheck", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == []
    # two bookies of the ledger's ensemble move into one rack: a write quorum
    # (consecutive slots, cyclic) now sits in a single rack
    ens = good.metadata.last_ensemble
    for b in ens[:2]:
        assert shell("--metadata", uri, "setrack", b, "/r/z").exit_code == 0
    r = shell("--metadata", uri, "placementcheck", "--json")
    assert r.exit_code == 1
    rows = json.loads(r.stdout)
    assert [(x["ledger"], x["first_entry"], x["racks"]) for x in rows] == \
        [(good.ledger_id, 0, 1)]
    assert shell("--metadata", uri, "placementcheck", "--min-racks", "1").exit_code == 0


def test_auditor_counts_ledgers_not_adhering(cluster_factory):
    from bk.meta import underreplication as UR
    c = cluster_factory(4, num_shards=1, conf_overrides={
        **RACKAWARE, "autoRecoveryDaemonEnabled": True,
        "auditorPeriodicPlacementPolicyCheckInterval": 1})
    uri = c.metadata_uri
    for i, b in enumerate(c.bookies):
        assert shell("--metadata", uri, "setrack", b.bookie_id, f"/r/{'abcd'[i]}").exit_code == 0

    def placement():
        done, _ = c.store.get_json(UR.CHECKS)
        return (done or {}).get("placement") or {}
    with bk.BookKeeper(uri, **RACKAWARE) as client:
        h = client.create_ledger(3, 3, 2)
        h.add_entry(b"x")
        h.close()
    wait_until(lambda: placement().get("not_adhering") == 0, what="a clean placement check")
    spare = next(b for b in c.bookies if b.bookie_id not in h.metadata.last_ensemble)
    for b in h.metadata.last_ensemble:
        assert shell("--metadata", uri, "setrack", b, "/r/z").exit_code == 0
    assert shell("--metadata", uri, "setrack", spare.bookie_id, "/r/y").exit_code == 0
    wait_until(lambda: placement().get("not_adhering") == 1, timeout=30,
               what="the auditor counting the ledger whose quorum sits in one rack")
