"""Upgrade of v1 shards (entries in the journal, index in a checkpoint file): the
fixture made by the previous release's code (scripts/make_storage_fixture.py)
is served whole after the conversion, by the storage and by `bookie upgrade`."""

from __future__ import annotations

import json
import os
import shutil

from click.testing import CliRunner

from bk.bookie.storage import ShardStorage
from bk.bookie.upgrade import needs_upgrade
from bk.cli.bookie import main as bookie_main
from bk.errors import EFENCED, ENOLEDGER, EOK, EUA

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "storage-v1")


def payload(ledger: int, entry: int) -> bytes:
    return (b"%d:%d|" % (ledger, entry)) * (1 + (ledger * 31 + entry * 7) % 40)


def digest(ledger: int, entry: int) -> bytes:
    return b"dg-%d-%d" % (ledger, entry)


def expected() -> dict:
    with open(os.path.join(FIXTURE, "expected.json")) as f:
        return json.load(f)


def copy_fixture(journal_dir, index_dir) -> None:
    shutil.copytree(os.path.join(FIXTURE, "journal"), journal_dir)
    shutil.copytree(os.path.join(FIXTURE, "index"), index_dir)


def check_served(s: ShardStorage, exp: dict) -> None:
    assert s.ledgers() == sorted(int(k) for k in exp["ledgers"])
    for lid_s, want in exp["ledgers"].items():
        lid = int(lid_s)
        key = want["key"].encode()
        assert s.read_lac(lid) == (EOK, want["lac"], want["last"])
        assert s.is_fenced(lid) == want["fenced"]
        assert s.check_master_key(lid, key) == EOK and s.check_master_key(lid, b"x") == EUA
        ids = sorted(int(e) for e in want["entries"])
        got = []
        status, ranges = s.list_entries(lid)
        for a, b in zip(ranges[0::2], ranges[1::2]):
            got += range(a, b + 1)
        assert status == EOK and got == ids
        for e in ids:
            if (lid, e) == (1, 120):                  # written after the upgrade
                continue
            assert s.read_entry(lid, e) == (EOK, want["entries"][str(e)], digest(lid, e),
                                            payload(lid, e))
    for lid in exp["deleted"]:
        assert s.read_entry(lid, 0)[0] == ENOLEDGER
        assert s.add_entry(lid, 100, 99, b"k" * 20, b"", b"x", True) == EFENCED


def test_storage_converts_a_v1_shard_at_open(tmp_path):
    jdir, idir = str(tmp_path / "journal"), str(tmp_path / "index")
    copy_fixture(jdir, idir)
    exp = expected()
    assert needs_upgrade(jdir, idir)
    reports = []
    s = ShardStorage(jdir, idir, segment_size=exp["segment_size"],
                     progress=lambda done, total: reports.append((done, total)))
    assert not needs_upgrade(jdir, idir)
    assert not os.path.exists(os.path.join(idir, "checkpoint"))
    assert reports and reports[-1][0] == reports[-1][1] > 0
    st = s.stats()
    assert st["replayed_records"] == 0 and st["entry_logs"] >= 1
    assert st["segments"] == 1                         # the old segments are gone
    check_served(s, exp)
    # and it goes on: writes, a flush, a restart
    key = b"k" * 20
    assert s.add_entry(1, 120, 119, key, b"d", b"after", False) == EOK
    assert s.add_entry(2, 61, 60, key, b"d", b"x", False) == EFENCED
    s.close()
    s = ShardStorage(jdir, idir, segment_size=exp["segment_size"])
    assert s.read_entry(1, 120) == (EOK, 119, b"d", b"after")
    one = exp["ledgers"]["1"]
    one["entries"]["120"] = 119
    one["lac"], one["last"] = 119, 120
    check_served(s, exp)
    s.close()


def test_bookie_upgrade_converts_every_shard_with_progress(tmp_path):
    exp = expected()
    jroot, lroot = tmp_path / "journal", tmp_path / "ledgers"
    copy_fixture(str(jroot / "shard-0"), str(lroot / "shard-0"))
    args = ["upgrade", "--journal-dir", str(jroot), "--ledger-dir", str(lroot),
            "--set", "journalPreAllocSizeMB=1"]
    r = CliRunner().invoke(bookie_main, args)
    assert r.exit_code == 0, r.output
    assert "shard 0: 100%" in r.output and "shard 0: upgraded 5 ledgers" in r.output
    r = CliRunner().invoke(bookie_main, args)
    assert r.exit_code == 0 and "shard 0: already in the current format" in r.output
    s = ShardStorage(str(jroot / "shard-0"), str(lroot / "shard-0"),
                     segment_size=exp["segment_size"])
    check_served(s, exp)
    s.close()


def test_an_interrupted_upgrade_starts_over(tmp_path, monkeypatch):
    """A conversion that dies before its final rename leaves the v1 data as it was;
    the next open discards its leftovers and converts again."""
    from bk.bookie import upgrade as U
    jdir, idir = str(tmp_path / "journal"), str(tmp_path / "index")
    copy_fixture(jdir, idir)
    exp = expected()

    def die(*a, **k):
        raise KeyboardInterrupt("simulated crash before the rename")
    monkeypatch.setattr(U.os, "rename", die)
    try:
        ShardStorage(jdir, idir, segment_size=exp["segment_size"])
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    assert os.path.isdir(os.path.join(idir, U.UPGRADING)) and needs_upgrade(jdir, idir)
    s = ShardStorage(jdir, idir, segment_size=exp["segment_size"])
    assert not os.path.exists(os.path.join(idir, U.UPGRADING))
    check_served(s, exp)
    s.close()
