"""Network partitions between namespace hosts (bk.netns): a client cut off from
one bookie, reads whose bookie is unreachable, a writer cut off from etcd, a
rack lost. Every acknowledged entry is read back afterwards, and checked on
every bookie of its write set where the test says so."""

import pytest

from bk import netns
from bk.testing import TEST_DEFAULTS, closed_ledger, entries_held, wait_until

pytestmark = [pytest.mark.skipif(netns.unavailable() is not None,
                                 reason=f"needs test hosts: {netns.unavailable()}"),
              pytest.mark.slow]


@pytest.fixture
def net():
    with netns.Network() as n:
        yield n


@pytest.fixture
def hosts_cluster(net, tmp_path):
    """Four bookie hosts b0..b3, etcd on host meta, and a client host."""
    made = []

    def make(n=4, racks=None, conf=None, **kw):
        bookies = [net.add_host(f"b{i}") for i in range(n)]
        meta = net.add_host("meta")
        client = net.add_host("client")
        c = netns.HostCluster(net, str(tmp_path / "cluster"), bookies, meta,
                              {**TEST_DEFAULTS, **(conf or {})}, racks=racks, **kw)
        made.append(c)
        c.start()
        return c, bookies, client

    yield make
    # Heal first: a bookie still cut from etcd spends its whole drain timeout
    # (about 20 s) failing to deregister before it is killed.
    net.heal()
    for c in made:
        c.stop()


WRITER = """
import threading, bk
c = bk.BookKeeper({uri!r}, addEntryTimeoutSec={timeout}, clientConnectTimeoutMillis=2000)
lh = c.create_ledger({E}, {qw}, {qa})
acked = []
errors = []
stop = threading.Event()
def _write():
    i = 0
    while not stop.is_set():
        try:
            acked.append(lh.add_entry(b"entry-%d" % i + b"." * 4000))
        except Exception as e:
            errors.append(repr(e))
            return
        i += 1
writer = threading.Thread(target=_write, daemon=True)
"""


def start_writer(cluster, ch, timeout, qw, before=50, what="writes before the cut"):
    """A writer process on client host ``ch``: an E3 Qw``qw`` Qa2 ledger written in a
    loop (WRITER above) until ``before`` entries were acknowledged. Returns
    ``(its remote python, the ledger id)``."""
    py = ch.python()
    py.exec(WRITER.format(uri=cluster.metadata_uri, timeout=timeout, E=3, qw=qw, qa=2))
    py.exec("writer.start()")
    wait_until(lambda: py.eval("len(acked)") >= before, what=what)
    return py, py.eval("lh.ledger_id")


def test_client_cut_from_one_bookie_changes_ensemble(net, hosts_cluster):
    """E3 Qw3 Qa2 with a fourth bookie free; the client is silently cut from one
    bookie of its ensemble. Two bookies still answer, so every add reaches Qa:
    the third must still be replaced after addEntryTimeoutSec, the entries it
    never got resent, and its connection's entries let go."""
    cluster, bookies, ch = hosts_cluster(4)
    py, lid = start_writer(cluster, ch, 2, 3)
    victim = py.eval("lh.metadata.last_ensemble[1]")
    vhost = cluster.bookie(victim).host
    net.partition(ch, vhost)
    at_cut = py.eval("len(acked)")
    wait_until(lambda: victim not in py.eval("lh.metadata.last_ensemble"), timeout=30,
               what="the cut bookie replaced by an ensemble change")
    n = py.eval("len(acked)")
    wait_until(lambda: py.eval("len(acked)") >= n + 50, timeout=30,
               what="writes going on after the ensemble change")
    py.exec("stop.set(); writer.join(30); lh.close()")
    assert py.eval("errors") == []
    acked = py.eval("acked")
    assert acked == list(range(len(acked))) and len(acked) > at_cut
    # the client holds nothing more for the bookie it replaced
    assert py.eval(f"sum(len(cn.adds.get({lid}, ())) for cn in c._io._conns.values() "
                   f"if cn.bookie_id == {victim!r})") == 0

    # every acknowledged entry is on every bookie of its write set (Qw copies),
    # the ones acknowledged during the cut included
    md, _ = cluster.store.read_ledger(lid)
    assert md.last_entry_id == acked[-1]
    held = {b.bookie_id: entries_held(cluster.store, b.bookie_id, lid)
            for b in cluster.bookies}
    missing = [(e, b) for e in acked for b in md.write_set(e) if e not in held[b]]
    assert missing == [], f"{len(missing)} copies missing, first {missing[:5]}"
    # and read back, from another client on another host
    py2 = ch.python()
    py2.exec(f"import bk; c = bk.BookKeeper({cluster.metadata_uri!r})\n"
             f"h = c.open_ledger({lid})")
    assert py2.eval(f"all(e.data.startswith(b'entry-%d.' % e.entry_id) "
                    f"for e in h.read_entries(0, {acked[-1]}))")


def test_reads_skip_an_unreachable_bookie(net, hosts_cluster):
    """20 closed ledgers on three bookies; a new client cut off from one of them
    reads them all: it learns once that the bookie does not answer and reads
    from the others, instead of paying the connect timeout for every ledger."""
    cluster, bookies, ch = hosts_cluster(3)
    writer = ch.python()
    writer.exec(f"import bk; c = bk.BookKeeper({cluster.metadata_uri!r})\n"
                "lids = []\n"
                "for n in range(20):\n"
                "    lh = c.create_ledger(3, 3, 2)\n"
                "    lh.add_entries([b'%d-%d' % (n, i) for i in range(10)])\n"
                "    lh.close(); lids.append(lh.ledger_id)\n"
                "c.close()")
    lids = writer.eval("lids")
    net.partition(ch, bookies[0])
    before = net.dropped(ch)
    py = ch.python()
    py.exec(f"import bk; c = bk.BookKeeper({cluster.metadata_uri!r}, "
            f"clientConnectTimeoutMillis=2000, readEntryTimeoutSec=2)")
    # an application reading one ledger now and then (paced: a client that only
    # remembered a failure for a moment would pay the connect timeout each time)
    py.exec("import time\n"
            "def read_all(lids):\n"
            "    out = []\n"
            "    for l in lids:\n"
            "        out.append([e.data.decode() for e in\n"
            "                    c.open_ledger_no_recovery(l).read_entries(0, 9)])\n"
            "        time.sleep(0.3)\n"
            "    return out")
    got = py.eval(f"read_all({lids})", timeout=180)
    assert got == [[f"{n}-{i}" for i in range(10)] for n in range(20)]
    # Each connect attempt across the cut costs a SYN (and a retransmission a
    # second later); a client that forgot the failure would knock ~20 times.
    knocks = net.dropped(ch) - before
    assert knocks <= 6, f"{knocks} packets sent to the unreachable bookie"
    health = py.eval("c.bookie_health()")
    cut = bookies[0].address + ":3181"
    assert health[cut]["quarantined"] is True
    # new ensembles avoid the quarantined bookie while others are writable
    for _ in range(5):
        assert cut not in py.eval("c.create_ledger(2, 2, 2).metadata.last_ensemble")


def test_writer_cut_from_etcd_is_fenced_by_recovery(net, hosts_cluster):
    """The writer loses etcd but not its bookies: its adds go on (they need no
    metadata) until another client recovers the ledger; then the writer is fenced,
    its later adds fail, and nothing it had acknowledged is lost."""
    cluster, bookies, ch = hosts_cluster(3)
    py, lid = start_writer(cluster, ch, 3, 2)
    net.partition(ch, cluster.etcd_host)
    n = py.eval("len(acked)")
    wait_until(lambda: py.eval("len(acked)") >= n + 50, timeout=30,
               what="adds going on without etcd")
    import bk
    with bk.BookKeeper(cluster.metadata_uri) as other:
        recovered = other.open_ledger(lid)
        last = recovered.metadata.last_entry_id
        wait_until(lambda: py.eval("errors") != [], timeout=30,
                   what="the old writer's adds failing once fenced")
        assert "LedgerFencedError" in py.eval("errors")[0]
        acked = py.eval("acked")
        assert acked == list(range(len(acked)))
        assert acked[-1] <= last, f"acknowledged entry {acked[-1]} lost: recovered to {last}"
        entries = recovered.read_entries(0, last)
        assert all(e.data.startswith(b"entry-%d." % e.entry_id) for e in entries)
    # closing the cut-off writer fails (fenced, or etcd unreachable) within bounds
    with pytest.raises(netns.RemoteError) as ei:
        py.exec("lh.close()", timeout=60)
    assert ei.value.type in ("LedgerFencedError", "MetadataError"), ei.value


def test_rack_lost_with_rackaware_placement(net, hosts_cluster):
    """Six bookies in three racks, E3 Qw2 Qa2 placed rack-aware; a whole rack's
    hosts vanish (links down): writers replace its bookies and go on, auto-recovery
    re-replicates the closed ledgers within the two racks left, and every
    acknowledged entry reads back."""
    racks = {f"b{i}": f"/dc/rack{i // 2}" for i in range(6)}
    policy = {"ensemblePlacementPolicy": "rackaware", "minNumRacksPerWriteQuorum": 2}
    cluster, bookies, ch = hosts_cluster(6, racks=racks, conf={
        **policy, "autoRecoveryDaemonEnabled": True, "lostBookieRecoveryDelay": 0,
        "openLedgerRereplicationGracePeriod": 30000, "rwRereplicateBackoffMs": 200,
        # a repair may pick the rack's other bookie before its lease ran out: retry
        # soon rather than after the default 5 minutes
        "lockReleaseOfFailedLedgerGracePeriod": 2000})
    py = ch.python()
    py.exec(f"import bk; c = bk.BookKeeper({cluster.metadata_uri!r}, addEntryTimeoutSec=2, "
            f"clientConnectTimeoutMillis=2000, ensemblePlacementPolicy='rackaware')\n"
            "closed = []\n"
            "for n in range(6):\n"
            "    lh = c.create_ledger(3, 2, 2)\n"
            "    lh.add_entries([b'%d-%d' % (n, i) for i in range(30)])\n"
            "    lh.close(); closed.append(lh.ledger_id)\n"
            "open_h = c.create_ledger(3, 2, 2)\n"
            "open_h.add_entries([b'open-%d' % i for i in range(30)])")
    rack_of = {f"{h.address}:3181": racks[h.name] for h in bookies}
    for lid in py.eval("closed") + [py.eval("open_h.ledger_id")]:
        md, _ = cluster.store.read_ledger(lid)
        ens = md.last_ensemble
        assert all(rack_of[ens[i]] != rack_of[ens[(i + 1) % 3]] for i in range(3)), ens
    lost = [h for h in bookies if racks[h.name] == "/dc/rack0"]
    lost_ids = {f"{h.address}:3181" for h in lost}
    for h in lost:
        net.isolate(h)
    # the open ledger's writer replaces the lost bookies and goes on
    py.exec("open_h.add_entries([b'open-%d' % i for i in range(30, 60)]); open_h.close()",
            timeout=60)
    closed = py.eval("closed")

    def repaired():
        for lid in closed:
            md, _ = cluster.store.read_ledger(lid)
            if any(b in lost_ids for _, ens in md.ensembles for b in ens):
                return False
        return True
    wait_until(repaired, timeout=90, what="auto-recovery re-replicating the lost rack's copies")
    for lid in closed:
        md, _ = cluster.store.read_ledger(lid)
        for _, ens in md.ensembles:
            assert {rack_of[b] for b in ens} <= {"/dc/rack1", "/dc/rack2"}
    got = py.eval("[[e.data.decode() for e in c.open_ledger(l).read_entries(0, 29)] "
                  "for l in closed]", timeout=120)
    assert got == [[f"{n}-{i}" for i in range(30)] for n in range(6)]
    lid = py.eval("open_h.ledger_id")
    assert py.eval(f"[e.data.decode() for e in c.open_ledger({lid}).read_entries(0, 59)]",
                   timeout=60) == [f"open-{i}" for i in range(60)]


def test_writer_dies_after_moving_acknowledged_entries(net, hosts_cluster):
    """The moment that matters for the add timeout's ensemble change: it moves
    entries acknowledged by two bookies to a fragment whose third bookie never
    got them (the client is cut from it too), and the writer dies right then.
    Recovery by another client still finds every acknowledged entry."""
    cluster, bookies, ch = hosts_cluster(4)
    py, lid = start_writer(cluster, ch, 2, 3, before=30)
    ens = py.eval("lh.metadata.last_ensemble")
    free = next(b for b in cluster.bookies if b.bookie_id not in ens)
    net.partition(ch, cluster.bookie(ens[2]).host)
    net.partition(ch, free.host)
    wait_until(lambda: len(cluster.store.read_ledger(lid)[0].ensembles) > 1, timeout=30,
               what="the ensemble change to the bookie the client cannot reach")
    acked = py.eval("list(acked)")
    py.kill()
    md = cluster.store.read_ledger(lid)[0]
    start, new_ens = md.ensembles[-1]
    assert free.bookie_id in new_ens and start <= acked[-1] + 1
    assert start < acked[-1], "the change should have moved acknowledged entries"
    net.heal()
    import bk
    with bk.BookKeeper(cluster.metadata_uri) as other:
        h = other.open_ledger(lid)
        last = h.metadata.last_entry_id
        assert last >= acked[-1], f"acknowledged entry {acked[-1]} lost: recovered to {last}"
        assert all(e.data.startswith(b"entry-%d." % e.entry_id)
                   for e in h.read_entries(0, last))


def test_bookie_cut_from_etcd_keeps_serving(net, hosts_cluster):
    """A bookie that loses etcd but not its clients: its lease expires (clients
    and the auditor stop counting it), it still serves the ledgers it is in, and
    it registers again once the cut heals."""
    cluster, bookies, ch = hosts_cluster(3)
    b = cluster.bookies[0]
    py = ch.python()
    py.exec(f"import bk; c = bk.BookKeeper({cluster.metadata_uri!r}, addEntryTimeoutSec=2)\n"
            "lh = c.create_ledger(3, 3, 3)\n"
            "lh.add_entries([b'before-%d' % i for i in range(20)])")
    net.partition(b.host, cluster.etcd_host)
    wait_until(lambda: b.bookie_id not in cluster.store.list_bookies(), timeout=30,
               what="the cut bookie's registration lease to expire")
    # it still takes adds (Qa = 3: every add needs it) and serves reads
    py.exec("lh.add_entries([b'during-%d' % i for i in range(20)])", timeout=30)
    assert b.bookie_id in py.eval("lh.metadata.last_ensemble")
    net.heal()
    wait_until(lambda: b.bookie_id in cluster.store.list_bookies(), timeout=30,
               what="the bookie registering again after the heal")
    py.exec("lh.close()")
    assert py.eval("[e.data.decode() for e in c.open_ledger(lh.ledger_id).read_entries(0, 39)]") \
        == [f"before-{i}" for i in range(20)] + [f"during-{i}" for i in range(20)]


def test_isolated_host_detected_within_add_timeout(net, hosts_cluster):
    """A bookie host whose link goes down without a FIN leaves the writer's
    established connection half-open: the writer notices within
    addEntryTimeoutSec (the adds go unconfirmed), replaces the bookie and goes on."""
    cluster, bookies, ch = hosts_cluster(4)
    py, _ = start_writer(cluster, ch, 2, 2, before=30, what="writes before the isolation")
    victim = py.eval("lh.metadata.last_ensemble[0]")
    net.isolate(cluster.bookie(victim).host)
    wait_until(lambda: victim not in py.eval("lh.metadata.last_ensemble"), timeout=20,
               what="the isolated bookie replaced")
    n = py.eval("len(acked)")
    wait_until(lambda: py.eval("len(acked)") >= n + 30, timeout=20, what="writes going on")
    py.exec("stop.set(); writer.join(30); lh.close()")
    assert py.eval("errors") == []
    acked = py.eval("acked")
    assert py.eval(f"all(e.data.startswith(b'entry-%d.' % e.entry_id) for e in "
                   f"c.open_ledger(lh.ledger_id).read_entries(0, {acked[-1]}))")


def test_etcd_leader_host_isolated(net, tmp_path):
    """Three etcd members on three hosts; the leader's host vanishes. Adds to an
    open ledger go on (they need no metadata); metadata calls either fail with a
    MetadataError naming the store or succeed once a new leader is elected, and
    none hangs past its timeout; then close and read back everything."""
    bookies = [net.add_host(f"b{i}") for i in range(3)]
    etcds = [net.add_host(f"e{i}") for i in range(3)]
    ch = net.add_host("client")
    with netns.HostCluster(net, str(tmp_path / "c"), bookies, etcds, TEST_DEFAULTS) as cluster:
        py = ch.python()
        py.exec(f"import bk, time; c = bk.BookKeeper({cluster.metadata_uri!r}, "
                f"metadataTimeoutMillis=3000)\n"
                "lh = c.create_ledger(3, 2, 2)\n"
                "lh.add_entries([b'a-%d' % i for i in range(20)])\n"
                "def try_create():\n"
                "    t = time.monotonic()\n"
                "    try:\n"
                "        h = c.create_ledger(3, 2, 2); h.close()\n"
                "        return ['ok', time.monotonic() - t]\n"
                "    except bk.errors.MetadataError as e:\n"
                "        return ['MetadataError: ' + str(e), time.monotonic() - t]\n"
                # a bookie whose lease keep-alives went to the lost leader may drop
                # out of the registrations until it registers again: transient
                "    except bk.errors.NotEnoughBookiesError as e:\n"
                "        return ['NotEnoughBookiesError: ' + str(e), time.monotonic() - t]")
        wait_until(lambda: cluster.etcd.leader() is not None, what="an etcd leader")
        leader = cluster.etcd.leader()
        net.isolate(leader)
        # adds go on without etcd's leader
        py.exec("lh.add_entries([b'b-%d' % i for i in range(20)])", timeout=30)
        outcomes = []

        def created():
            outcomes.append(py.eval("try_create()", timeout=30))
            return outcomes[-1][0] == "ok"
        wait_until(created, timeout=60, what="a ledger created after the election")
        # none hung: each try_create returned within its eval's 30 s deadline
        # (the time each took is not asserted: timing belongs in benchmarks)
        for what, _took in outcomes:
            assert what == "ok" or ("MetadataError" in what and "etcd://" in what) \
                or what.startswith("NotEnoughBookiesError"), what
        py.exec("lh.close()", timeout=30)
        assert py.eval("[e.data.decode() for e in c.open_ledger(lh.ledger_id).read_entries(0, 39)]",
                       timeout=30) == [f"a-{i}" for i in range(20)] + [f"b-{i}" for i in range(20)]
        net.heal()


def test_bookie_cut_from_etcd_is_rereplicated_then_drops_its_copies(net, hosts_cluster):
    """A bookie cut from etcd but not from the others: its lease expires, the
    auditor counts it lost and the workers re-replicate its closed ledgers; when
    the cut heals it registers again and drops the copies nobody needs any more."""
    cluster, bookies, ch = hosts_cluster(4, conf={
        "autoRecoveryDaemonEnabled": True, "lostBookieRecoveryDelay": 0,
        "rwRereplicateBackoffMs": 200, "gcWaitTime": 1000,
        "lockReleaseOfFailedLedgerGracePeriod": 2000,
        "gcOverreplicatedLedgerWaitTime": 2000})
    victim = cluster.bookies[0]
    import bk
    with bk.BookKeeper(cluster.metadata_uri) as client:
        lids = [closed_ledger(client, [b"%d-%d" % (n, i) for i in range(20)], 3, 3, 2)
                for n in range(12)]
        mine = [lid for lid in lids
                if victim.bookie_id in client.ledger_metadata(lid).last_ensemble]
        assert mine
        net.partition(victim.host, cluster.etcd_host)
        wait_until(lambda: victim.bookie_id not in cluster.store.list_bookies(), timeout=30,
                   what="the cut bookie's lease to expire")

        def moved():
            return all(victim.bookie_id not in client.ledger_metadata(lid).last_ensemble
                       for lid in mine)
        wait_until(moved, timeout=90, what="its ledgers re-replicated elsewhere")
        net.heal()
        wait_until(lambda: victim.bookie_id in cluster.store.list_bookies(), timeout=30,
                   what="the bookie registering again")
        wait_until(lambda: all(not entries_held(cluster.store, victim.bookie_id, lid)
                               for lid in mine), timeout=90,
                   what="the bookie dropping its over-replicated copies")
        for n, lid in enumerate(lids):
            got = [e.data for e in client.open_ledger(lid).read_entries(0, 19)]
            assert got == [b"%d-%d" % (n, i) for i in range(20)]
