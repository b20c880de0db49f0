"""Benchmarks behind ``bkshell bench`` and ``scripts/bench_*.py``: they print numbers."""
