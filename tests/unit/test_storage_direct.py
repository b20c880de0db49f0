"""The shard storage's tests again with ``journalDirectWrites``: flushes that copy
and flushes that adopt journal segments, replays after crashes, GC, reads of the
write cache (served from the journal's images)."""

from __future__ import annotations

import pytest

import test_storage as sbase
from bk.bookie import journal as J
from bk.bookie import storage as S

# All of them but those that count the journal's pages in the page cache: direct
# writes leave none there.
_PAGE_CACHE = {"test_flushed_journal_leaves_the_page_cache_one_flush_later",
               "test_uncache_journal_false_keeps_the_pages"}
flush_mode = sbase.flush_mode
for _name in dir(sbase):
    if _name.startswith("test_") and _name not in _PAGE_CACHE:
        globals()[_name] = getattr(sbase, _name)


@pytest.fixture(autouse=True)
def direct_by_default(monkeypatch):
    """Shard storages opened by these tests write their journals directly unless
    told otherwise (with journalSyncData); each test checks that they did."""
    kw = dict(S.ShardStorage.__init__.__kwdefaults__, direct_journal=True)
    monkeypatch.setattr(S.ShardStorage.__init__, "__kwdefaults__", kw)
    seen = []
    real = J.Journal._probe_direct

    def probe(self):
        ok = real(self)
        seen.append(ok)
        return ok
    monkeypatch.setattr(J.Journal, "_probe_direct", probe)
    yield
    assert all(seen), "a journal of this test fell back to buffered writes"
