"""A bookie's over-replicated claim whose lock is lost before the drop (soak19).

The over-replicated scan (:func:`bk.autorecovery.checker.claim_overreplicated`)
takes a ledger's under-replication lock, checks that the bookie may drop its
copy, and the arbiter sends the shard ``gc_drop`` later, after the scan's other
groups; the lock is what keeps a replication worker from copying the ledger
back to this bookie meanwhile. The lock is a lease of 3-4 s (the registration
TTL): an etcd that answers late for a few seconds (a soak on a loaded machine
logged 'refresh the lease of lock ...: etcd did not answer within 5s' dozens of
times) lets it expire while the bookie runs on and registers again at once, and
a worker may then take the lock, copy the ledger to this bookie and put it in
the ensemble. A drop sent after that empties a bookie its ledger now counts on.

The test holds the scan once it claimed the ledger (site hook), revokes the
lock's lease (what an expiry does), and does what such a worker does under the
lock: recovery adds of the ledger's entries to the bookie, then the metadata
with the bookie back in the ensemble. Then it lets the scan go on: the copy the
ledger's metadata names must survive. The arbiter asks etcd for each claim's lock
just before the drop (:meth:`bk.meta.recipes.LeaseLock.confirm`) and keeps the
copies whose lock is gone."""

from __future__ import annotations

import json


import bk
from bk import protocol as P
from bk.client.digest import master_key
from bk.errors import EOK
from bk.meta import underreplication as UR
from bk.meta.recipes import LeaseLock
from bk.testing import BookieConnection, closed_ledger, hook_env, site_hook, wait_until

PW = b"overlease"
ENTRIES = [b"l%d" % i for i in range(12)]
# a full round with the over-replicated scan about every 0.3 s; nobody repairs
CONF = {"gcWaitTime": 300, "gcOverreplicatedLedgerWaitTime": 300,
        "autoRecoveryDaemonEnabled": False, "registrationTtlSeconds": 4}

# Every scan is written down (per process); a scan that claimed the ledger named
# in the file "<out>.target" reports and waits for "<out>.go" before it returns
# its claims to the arbiter (which then sends gc_drop).
HOOK = r'''
import json, os, time
from bk.testing import hook_report, hook_setting

OUT = hook_setting("out")
if OUT:
    import bk.autorecovery.checker as C
    _claim = C.claim_overreplicated

    def claim(store, pool, bookie_id, ledger_ids, **kw):
        got = _claim(store, pool, bookie_id, ledger_ids, **kw)
        ids = [lid for lid, _ in got]
        with open(OUT + ".%d.jsonl" % os.getpid(), "a") as f:
            f.write(json.dumps({"claimed": ids}) + "\n")
        try:
            with open(OUT + ".target") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = None
        if target in ids and not os.path.exists(OUT + ".go"):
            hook_report({"claimed": ids, "bookie": bookie_id})
            deadline = time.monotonic() + 120
            while not os.path.exists(OUT + ".go") and time.monotonic() < deadline:
                time.sleep(0.02)
        return got

    C.claim_overreplicated = claim    # before bk.bookie.arbiter imports it
'''


def scans(out, bookie) -> int:
    try:
        with open(f"{out}.{bookie.pid}.jsonl") as f:
            return sum(line.endswith("\n") for line in f)
    except FileNotFoundError:
        return 0


def copy(src, dst, lid, e) -> int:
    got = src.call(P.read(src.next_rid(), lid, e))
    assert got[2] == EOK, got
    return dst.call(P.add(dst.next_rid(), lid, e, got[5], master_key(PW), got[6], got[7],
                          True))[2]


def test_a_claim_whose_lock_was_lost_does_not_drop_a_copy_taken_back(cluster_factory,
                                                                    tmp_path):
    out = tmp_path / "report"
    with site_hook(tmp_path, HOOK, hook_env(out)):
        c = cluster_factory(4, num_shards=1, conf_overrides=CONF)
    with bk.BookKeeper(c.metadata_uri) as client:
        lid = closed_ledger(client, ENTRIES, 3, 2, 2, password=PW)
        md, version = c.store.read_ledger(lid)
        ens = md.ensembles[0][1]
        victim = ens[0]
        spare = next(b.bookie_id for b in c.bookies if b.bookie_id not in ens)
        b = c.bookie(victim)
        held = c.entries_on(victim, lid)
        assert held                                 # the victim holds part of it
        # a ledger on every bookie: the victim's scans go on after a drop (a bookie
        # whose held ledgers are all settled has nothing to offer a scan)
        live = closed_ledger(client, ENTRIES, 4, 2, 2, password=PW)
        live_held = c.entries_on(victim, live)
        (tmp_path / "report.target").write_text(str(lid))

        # re-replicated away from the victim (copies on the spare, then the metadata):
        # the victim's copy is over-replicated, and its scan claims it
        moved = md.replace(ensembles=[(0, [spare if x == victim else x for x in ens])])
        with BookieConnection(victim, shard=0) as src, \
                BookieConnection(spare, shard=0) as dst:
            for e in range(len(ENTRIES)):
                if spare in moved.write_set(e):
                    assert copy(src, dst, lid, e) == EOK
        c.store.write_ledger(moved, version)
        wait_until(out.exists, timeout=60, what="the victim's scan claiming the ledger")
        report = json.loads(out.read_text())
        assert report["bookie"] == victim and lid in report["claimed"]
        n_scans = scans(out, b)

        # the claim's lease expires (an etcd late for a few seconds) ...
        etcd = c.store._client()
        value, meta = etcd.get(c.store._key(UR.lock_rel(lid)))
        assert json.loads(value)["owner"] == victim
        etcd.revoke_lease(meta.lease_id)
        assert c.store.get_json(UR.lock_rel(lid))[0] is None

        # ... and a worker takes the lock and copies the ledger back to the victim,
        # which is in the ensemble again when it lets the lock go
        worker = LeaseLock(c.store, UR.lock_rel(lid), {"owner": "a worker"}, ttl=10)
        assert worker.try_acquire()
        try:
            md2, version2 = c.store.read_ledger(lid)
            back = md2.replace(ensembles=[(0, ens)])
            with BookieConnection(victim, shard=0) as dst:
                for e in range(len(ENTRIES)):
                    if victim in back.write_set(e):
                        with BookieConnection(md2.write_set(e)[0], shard=0) as src:
                            assert copy(src, dst, lid, e) == EOK
            c.store.write_ledger(back, version2)
        finally:
            worker.release()
        assert c.entries_on(victim, lid) == held

        (tmp_path / "report.go").touch()
        # the scan after the held one began: the held one's drop (if any) is done
        wait_until(lambda: scans(out, b) > n_scans, timeout=60,
                   what="the victim's next over-replicated scan")
        assert c.entries_on(victim, lid) == held
        assert c.entries_on(victim, live) == live_held
        for x in (lid, live):
            rh = client.open_ledger(x, password=PW)
            assert [e.data for e in rh.read_entries(0, len(ENTRIES) - 1)] == ENTRIES
