#!/usr/bin/env bash
# The README's first command: set everything up, then run a local cluster
# (embedded etcd + 3 bookies) in the foreground. Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/bookie localcluster "$@"
