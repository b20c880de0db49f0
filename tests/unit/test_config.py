"""The settings registry: one definition per key, strict parsing, documented conf files."""

import importlib.util
import os

import pytest

from bk.config import SETTINGS, Config
from bk.errors import ConfigError

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_defaults_and_derived_values():
    c = Config.load(env={})
    assert c.bookiePort == 3181 and c.journalSyncData is True
    assert c.bookie_id == "127.0.0.1:3181"
    assert c.bind_address == "127.0.0.1"
    assert c.pid_file == "/tmp/bk-data/bookie.pid"
    assert c.num_shards == (os.cpu_count() or 1)


def test_precedence_file_env_overrides(tmp_path):
    f = tmp_path / "a.conf"
    f.write_text("# comment\nbookiePort = 4000\njournalDirectories=/a, /b\nnumShards=3\n")
    c = Config.load(str(f), overrides={"numShards": 5}, env={"BK_bookiePort": "4001"})
    assert c.bookiePort == 4001
    assert c.journalDirectories == ["/a", "/b"]
    assert c.numShards == 5
    assert c.source == str(f)


@pytest.mark.parametrize("line,match", [
    ("journalDirectorys=/x", "unknown configuration key 'journalDirectorys'"),
    ("bookiePort=abc", "bookiePort"),
    ("bookiePort=70000", "bookiePort"),
    ("journalSyncData=maybe", "journalSyncData"),
    ("ledgerDirectories=", "ledgerDirectories"),
    ("no equals sign", "expected key=value"),
])
def test_bad_conf_lines_name_the_key(tmp_path, line, match):
    f = tmp_path / "bad.conf"
    f.write_text(line + "\n")
    with pytest.raises(ConfigError, match=match):
        Config.load(str(f), env={})


def test_bad_env_and_override_values_name_the_key():
    with pytest.raises(ConfigError, match="numShards"):
        Config.load(env={"BK_numShards": "many"})
    with pytest.raises(ConfigError, match="unknown configuration key 'bogus'"):
        Config.load(overrides={"bogus": 1}, env={})


def test_missing_conf_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read configuration file"):
        Config.load(str(tmp_path / "nope.conf"), env={})


def test_config_is_read_only():
    c = Config.load(env={})
    with pytest.raises(AttributeError):
        c.bookiePort = 1
    assert c.with_overrides(bookiePort=5).bookiePort == 5 and c.bookiePort == 3181


def test_conf_files_document_every_key_and_parse():
    spec = importlib.util.spec_from_file_location("gen_conf", os.path.join(ROOT, "scripts",
                                                                          "gen_conf.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for name, text in gen.expected_files().items():
        path = os.path.join(ROOT, "conf", name)
        with open(path) as f:
            assert f.read() == text, f"conf/{name} is stale: run scripts/gen_conf.py"
        Config.load(path, env={})      # every shipped value parses
    server = open(os.path.join(ROOT, "conf", "bk_server.conf")).read()
    for key in ("bookieId", "bookiePort", "advertisedAddress", "metadataServiceUri",
                "journalDirectories", "ledgerDirectories", "numShards",
                "journalMaxGroupWaitMSec", "journalBufferedWritesThreshold",
                "journalPreAllocSizeMB", "journalSyncData", "nettyMaxFrameSizeBytes",
                "diskUsageThreshold", "readOnlyModeEnabled", "gcWaitTime",
                "registrationTtlSeconds", "pidFile", "logFile"):
        assert f"\n{key}=" in server and key in SETTINGS


def test_forced_checkpoints_are_staggered_below_the_limit():
    from bk.bookie.worker import staggered_checkpoint_bytes
    limit = 256 << 20
    got = [staggered_checkpoint_bytes(limit) for _ in range(2000)]
    # never above the limit (it bounds a restart's replay), never below 3/4 of it,
    # and spread out (bookies that write the same bytes must not pause together)
    assert all(limit * 3 // 4 <= v <= limit for v in got)
    assert max(got) - min(got) > limit // 8
    assert len(set(got)) > 1000
