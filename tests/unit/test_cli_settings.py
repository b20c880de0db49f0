"""``bookie``'s settings: defaults < conf file < BK_<key> environment < --set <
flags (API.md, "Configuration"), and an unknown key or a bad value names the key."""

from __future__ import annotations

import pytest

from bk.cli.bookie import load_conf
from bk.errors import ConfigError


def test_flags_beat_set_environment_and_file(tmp_path, monkeypatch):
    conf = tmp_path / "bk_server.conf"
    conf.write_text("bookiePort=3181\njournalDirectories=/data/j\nnumShards=2\n")
    assert load_conf(str(conf)).bookiePort == 3181
    monkeypatch.setenv("BK_bookiePort", "3999")
    monkeypatch.setenv("BK_numShards", "3")
    c = load_conf(str(conf))
    assert (c.bookiePort, c.numShards, c.journalDirectories) == (3999, 3, ["/data/j"])
    c = load_conf(str(conf), ("bookiePort=4001",))
    assert c.bookiePort == 4001
    c = load_conf(str(conf), ("bookiePort=4001",), port=4002, journal_dir="/fast/j", shards=None)
    assert (c.bookiePort, c.journalDirectories, c.numShards) == (4002, ["/fast/j"], 3)


def test_a_bad_flag_value_or_unknown_set_key_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="journalDirectorys"):
        load_conf(None, ("journalDirectorys=/tmp/x",))
    with pytest.raises(ConfigError, match="bookiePort"):
        load_conf(None, (), port="lots")
