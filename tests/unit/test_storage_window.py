"""The shard storage's tests with direct journal writes through windows of a few
blocks (``journalDirectMemoryMB``): flushes, replays after crashes, GC and
reads of the write cache while the journal's windows slide every few records
(reads of records before a window's base go through the journal file)."""

from __future__ import annotations

import pytest

import test_storage_direct as sdirect
from bk.bookie import journal as J
from bk.bookie import storage as S

for _name in dir(sdirect):
    if _name.startswith("test_"):
        globals()[_name] = getattr(sdirect, _name)
flush_mode = sdirect.flush_mode
direct_by_default = sdirect.direct_by_default     # (autouse: direct writes, checked)


@pytest.fixture(autouse=True)
def small_windows(monkeypatch, direct_by_default):
    """Two windows of 8 KiB per journal (a test that writes more slides them);
    each test checks that its journals' windows had that size."""
    monkeypatch.setattr(J, "MIN_WINDOW", 4096)
    kw = dict(S.ShardStorage.__init__.__kwdefaults__, direct_journal_memory=16384)
    monkeypatch.setattr(S.ShardStorage.__init__, "__kwdefaults__", kw)
    sizes = []
    real = J.Journal._take_image

    def take(self, seg, off):
        real(self, seg, off)
        sizes.append(len(self._image.mm))
    monkeypatch.setattr(J.Journal, "_take_image", take)
    yield
    assert set(sizes) <= {8192}, sizes
