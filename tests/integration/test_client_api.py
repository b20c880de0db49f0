"""Promises of API.md's "Python client" and "Details users rely on" that no other
test pinned: a writer closed by ``with``, the shapes of ``ledger_metadata``,
bookie ids, every add path refused on a closed handle, and messages that name
what was asked (the ledger, the entry) and why it failed."""

from __future__ import annotations

import re

import pytest

import bk
from bk.errors import (BadPasswordError, LedgerClosedError, LedgerFencedError, NoSuchEntryError,
                       NoSuchLedgerError)

PW = b"api"


@pytest.fixture(scope="module")
def client(shared_cluster):
    with shared_cluster.client() as c:
        yield c


def test_with_closes_the_writer(client):
    with client.create_ledger(3, 2, 2, password=PW) as lh:
        lh.add_entries([b"a", b"bc"])
    md = client.ledger_metadata(lh.ledger_id)
    assert md.state == "CLOSED" and md.last_entry_id == 1 and md.length == 3
    assert lh.is_closed


def test_ledger_metadata_has_the_fields_and_shapes_api_md_gives(client, shared_cluster):
    lh = client.create_ledger(3, 2, 2, digest_type="crc32", password=PW,
                              custom_metadata={"app": b"x", "k": b"\x00\xff"})
    md = client.ledger_metadata(lh.ledger_id)
    assert md.ledger_id == lh.ledger_id and isinstance(md.ledger_id, int)
    assert (md.ensemble_size, md.write_quorum_size, md.ack_quorum_size) == (3, 2, 2)
    assert md.state == "OPEN" and isinstance(md.state, str)
    assert md.last_entry_id == -1 and md.length == 0
    assert md.digest_type == "crc32"
    assert md.custom_metadata == {"app": b"x", "k": b"\x00\xff"}
    assert isinstance(md.ctime, float) and md.ctime > 1.7e9     # seconds since the epoch
    [(first, ids)] = md.ensembles
    assert first == 0 and isinstance(ids, list) and len(ids) == 3
    assert set(ids) <= set(client.bookies())
    lh.add_entries([b"x" * 10] * 4)
    lh.close()
    md = client.ledger_metadata(lh.ledger_id)
    assert md.state == "CLOSED" and md.last_entry_id == 3 and md.length == 40
    assert lh.metadata.state == "CLOSED"


def test_bookie_ids_are_advertised_address_and_port(client, shared_cluster):
    ids = client.bookies()
    expected = sorted(f"127.0.0.1:{b.port}" for b in shared_cluster.bookies)
    assert sorted(ids) == expected
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", i) for i in ids)


def test_every_add_path_on_a_closed_handle_raises_ledger_closed(client):
    lh = client.create_ledger(3, 2, 2, password=PW)
    lh.add_entry(b"x")
    lh.close()
    for add in (lambda: lh.add_entry(b"y"), lambda: lh.add_entries([b"y", b"z"]),
                lambda: lh.add_entry_async(b"y").result(10)):
        with pytest.raises(LedgerClosedError) as ei:
            add()
        assert str(lh.ledger_id) in str(ei.value) and "closed" in str(ei.value)
    assert client.ledger_metadata(lh.ledger_id).last_entry_id == 0     # nothing consumed
    rh = client.open_ledger_no_recovery(lh.ledger_id, password=PW)
    with pytest.raises(LedgerClosedError) as ei:
        rh.add_entry(b"y")
    assert "read-only" in str(ei.value)


def test_messages_say_what_was_asked_and_why(client):
    lh = client.create_ledger(3, 2, 2, password=PW)
    lid = lh.ledger_id
    lh.add_entry(b"x")
    lh.add_entry(b"y")
    rh = client.open_ledger_no_recovery(lid, password=PW)
    with pytest.raises(NoSuchEntryError) as ei:
        rh.read_entries(0, 1)                    # past the LAC (0)
    assert f"ledger {lid}" in str(ei.value) and "last add confirmed" in str(ei.value)
    with pytest.raises(BadPasswordError) as ei:
        client.open_ledger(lid, password=b"nope")
    assert f"ledger {lid}" in str(ei.value) and "password" in str(ei.value)
    with pytest.raises(NoSuchLedgerError) as ei:
        client.ledger_metadata(lid + 1_000_000)
    assert str(lid + 1_000_000) in str(ei.value)
    client.open_ledger(lid, password=PW)        # fences the writer
    with pytest.raises(LedgerFencedError) as ei:
        lh.add_entry(b"z")
    assert f"add entry 2 to ledger {lid}" in str(ei.value) and "fenced" in str(ei.value)
    assert isinstance(ei.value, bk.errors.BookieError)


def test_log_writer_options_are_conf_keys_too_and_keywords_win(shared_cluster):
    """API.md: writer options are keyword arguments *and* conf keys."""
    from bk.testing import wait_until
    with shared_cluster.client(logRollEntries=2) as c:
        w = c.open_log_writer("api-conf-roll")                  # the client's conf
        for i in range(6):
            w.append(b"r%d" % i)
        wait_until(lambda: len(c.log_info("api-conf-roll").segments) >= 3,
                   what="rolls every 2 entries from the conf key")
        w.close()
        w = c.open_log_writer("api-kw-roll", logRollEntries=0)  # the keyword wins: no rolls
        for i in range(6):
            w.append(b"r%d" % i)
        w.close()
        assert len(c.log_info("api-kw-roll").segments) == 1
        assert c.log_info("api-kw-roll").records == 6
