"""Bursts of asynchronous adds from several threads sharing three TLS
connections (each burst several 16 KiB records per connection and pass of the
client's I/O thread): every frame stays in order on each stream, and a bookie
killed (-9) in the middle of them loses nothing that was acknowledged."""

import signal
import threading

import pytest

from bk.meta.ledger import LedgerState
from bk.testing import wait_until

pytestmark = pytest.mark.timeout(180)

PW = b"bursts"
ENTRY = 8 << 10          # 40 entries of 8 KiB per burst: 320 KiB per connection


def _bursting_writers(client, n_threads, stop, acked, errors):
    """Threads each adding bursts of 40 entries to a ledger of its own with
    add_entry_async, then waiting for the burst; ``acked[lid]`` lists (entry id,
    payload) in the order the futures resolved them."""
    handles = []

    def run(k):
        try:
            lh = client.create_ledger(3, 3, 2, password=PW)
            handles.append(lh)
            acked[lh.ledger_id] = got = []
            i = 0
            while not stop.is_set():
                burst = []
                for _ in range(40):
                    data = (b"%d-%d-" % (k, i)).ljust(ENTRY, b"x")
                    burst.append((lh.add_entry_async(data), data))
                    i += 1
                for fut, data in burst:
                    got.append((fut.result(30), data))
            lh.close()
        except Exception as e:      # asserted by the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    return threads, handles


def test_tls_bursts_from_threads_survive_a_bookie_killed(cluster_factory):
    # one shard per bookie: every thread's ledger shares the same TLS connections
    cluster = cluster_factory(4, num_shards=1, secure=True)
    with cluster.client(timeout=5, addEntryTimeoutSec=2, **cluster.client_settings()) as client:
        stop = threading.Event()
        acked, errors = {}, []
        threads, handles = _bursting_writers(client, 4, stop, acked, errors)
        wait_until(lambda: len(acked) == 4 and all(len(v) >= 80 for v in acked.values()),
                   60, "every writer acknowledged two bursts")
        victim = cluster.bookie(handles[0].metadata.last_ensemble[0])
        marks = {lid: len(v) for lid, v in acked.items()}
        victim.kill(signal.SIGKILL)
        wait_until(lambda: all(len(acked[lid]) >= n + 80 for lid, n in marks.items()),
                   90, "every writer acknowledged two more bursts after the kill")
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors
        changed = 0
        for lh in handles:
            lid = lh.ledger_id
            got = acked[lid]
            ids = [e for e, _ in got]
            assert ids == list(range(len(ids))), f"ledger {lid}: acknowledged out of order"
            md = client.ledger_metadata(lid)
            assert md.state == LedgerState.CLOSED and md.last_entry_id == len(got) - 1
            if victim.bookie_id in md.ensembles[0][1]:
                assert victim.bookie_id not in md.last_ensemble
                changed += 1
            rh = client.open_ledger_no_recovery(lid, password=PW)
            read = [(e.entry_id, e.data) for e in rh.read_entries(0, len(got) - 1)]
            assert read == got, f"ledger {lid}: what was read differs from what was acked"
        assert changed >= 1, "no ledger replaced the killed bookie"
