#!/usr/bin/env bash
# The README's second command: set up (if needed) and run the whole test suite
# (unit tests, then integration tests against real etcd and bookie processes).
#
# The suite runs on BK_TEST_WORKERS pytest-xdist workers (default 4, even on 2
# cores: most of a test's time is spent waiting on processes, leases and timeouts;
# 3 workers kept ~1.4 cores busy and took 5m07s, 4 took 4m12s), one test module at
# a time per worker, so that a module's shared cluster is made once, and the
# modules on the local Spark session together on one worker; the longest modules
# start first (tests/conftest.py). BK_TEST_WORKERS=0 runs everything in this one
# process.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# bk's bytecode, compiled once here: the suite starts hundreds of Python processes
# (every bookie start, bkshell runs), and where PYTHONDONTWRITEBYTECODE is set (as on
# CI) each would otherwise compile bk from source, ~0.2 CPU-s a bookie start (an
# editable install writes no bytecode). Stale files are recompiled (mtime check).
.venv/bin/python -m compileall -q bk
workers=${BK_TEST_WORKERS:-4}
if [ "$workers" = 0 ]; then
  parallel=()
else
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "${parallel[@]}" "$@" tests
