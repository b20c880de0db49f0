"""The metadata benchmark has one default thread count and one default number of
ledgers in flight: ``scripts/bench_metadata.py``, ``bkshell bench metadata`` and
the library functions agree (bkshell spells them out, so as not to import the
benchmark at start-up)."""

import inspect

from bk.bench import metadata
from bk.cli.shell import bench


def test_bkshell_bench_metadata_uses_the_benchmarks_defaults():
    opt = next(p for p in bench.commands["metadata"].params if p.name == "async_inflight")
    assert opt.default == metadata.INFLIGHT
    for fn in (metadata.bench_metadata, metadata.bench_breakdown):
        assert inspect.signature(fn).parameters["threads"].default == metadata.THREADS
        assert inspect.signature(fn).parameters["inflight"].default == metadata.INFLIGHT
