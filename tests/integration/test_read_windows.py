"""read_entries over many windows: the next window's READ_RANGEs go out before
the current one ended (two in flight), and every entry comes back once, in
order, with its data and length, also from a striped ensemble and across an
ensemble change."""

import bk

PW = b"windows"


def _check(got, first, data):
    assert [e.entry_id for e in got] == list(range(first, first + len(got)))
    assert [e.data for e in got] == data[first:first + len(got)]
    lengths = [sum(map(len, data[:i + 1])) for i in range(len(data))]
    assert [e.length for e in got] == lengths[first:first + len(got)]


def test_a_read_of_many_windows_returns_every_entry_in_order(shared_cluster):
    # Entries of 100..1,099 bytes; windows of ~2 KiB of entries (readWindowBytes
    # 4 KiB, halved), so a read of 3,000 entries is ~1,000 windows, each begun
    # while the one before is answered.
    data = [bytes([i % 251]) * (100 + i % 1000) for i in range(3000)]
    with bk.BookKeeper(shared_cluster.metadata_uri) as w:
        lh = w.create_ledger(3, 2, 2, password=PW)
        lh.add_entries(data)
        lh.close()
    with bk.BookKeeper(shared_cluster.metadata_uri, readWindowBytes=4096) as r:
        rh = r.open_ledger(lh.ledger_id, password=PW)
        _check(rh.read_entries(0, 2999), 0, data)
        _check(rh.read_entries(1234, 2345), 1234, data)
        _check(rh.read_entries(2999, 2999), 2999, data)
        assert rh.length == sum(map(len, data))


def test_windows_over_an_ensemble_change(cluster_factory):
    # The write set changes at entry 500 (a bookie of the first ensemble is
    # killed while adding): windows that straddle it ask each fragment's bookies.
    cluster = cluster_factory(4)
    data = [b"%06d" % i * 20 for i in range(1000)]
    with bk.BookKeeper(cluster.metadata_uri) as w:
        lh = w.create_ledger(3, 2, 2, password=PW)
        lh.add_entries(data[:500])
        victim = lh.metadata.last_ensemble[0]
        cluster.bookie(victim).kill()
        lh.add_entries(data[500:])
        lh.close()
        assert len(lh.metadata.ensembles) >= 2
    with bk.BookKeeper(cluster.metadata_uri, readWindowBytes=64 << 10) as r:
        rh = r.open_ledger(lh.ledger_id, password=PW)
        _check(rh.read_entries(0, 999), 0, data)
