"""The metadata benchmark has one default thread count: ``scripts/bench_metadata.py``,
``bkshell bench metadata`` and the library functions agree (bkshell spells it
out, so as not to import the benchmark at start-up)."""

import inspect

from bk.bench import metadata
from bk.cli.shell import bench


def test_bkshell_bench_metadata_uses_the_benchmarks_thread_count():
    opt = next(p for p in bench.commands["metadata"].params if p.name == "threads")
    assert opt.default == metadata.THREADS
    for fn in (metadata.bench_metadata, metadata.bench_breakdown):
        assert inspect.signature(fn).parameters["threads"].default == metadata.THREADS
