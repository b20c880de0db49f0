#!/usr/bin/env bash
# The README's second command: set up (if needed) and run the whole test suite
# (unit tests, then integration tests against real etcd and bookie processes).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@" tests
