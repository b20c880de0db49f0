#!/usr/bin/env python3
"""Make the v1 storage fixture: one shard's data directories written by the
storage of the release before entry logs (entries in the journal, the index in a
checkpoint file), and what it must serve (expected.json).

It must run against THAT code, e.g. from a checkout of the older release:

    git worktree add --detach /tmp/bk-v1 <commit before entry logs>
    PYTHONPATH=/tmp/bk-v1 .venv/bin/python scripts/make_storage_fixture.py tests/fixtures/storage-v1

The shard holds: a plain ledger written across segment rolls (a checkpoint in
the middle, so a restart replays a tail after it), a striped ledger (every third
entry) that is fenced and had recovery adds, a deleted ledger (tombstone), an
over-replicated ledger whose entries were dropped, a ledger with an explicit
LAC, a fenced ledger without entries, and a compaction that rewrote state
records. tests/unit/test_upgrade.py checks that the new storage serves exactly
that after converting it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from bk.bookie import storage as S

SEGMENT = 16 * 1024


def payload(ledger: int, entry: int) -> bytes:
    """Deterministic payloads of varying size (tests/unit/test_upgrade.py has the same)."""
    return (b"%d:%d|" % (ledger, entry)) * (1 + (ledger * 31 + entry * 7) % 40)


def digest(ledger: int, entry: int) -> bytes:
    return b"dg-%d-%d" % (ledger, entry)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="directory to (re)create, e.g. tests/fixtures/storage-v1")
    args = ap.parse_args()
    if not hasattr(S, "CHECKPOINT_FILE"):
        sys.exit("this bk is not the v1 storage (no checkpoint file): run it with "
                 "PYTHONPATH pointing at a checkout of the older release")
    shutil.rmtree(args.out, ignore_errors=True)
    jdir, idir = os.path.join(args.out, "journal"), os.path.join(args.out, "index")
    s = S.ShardStorage(jdir, idir, segment_size=SEGMENT)
    key = b"k" * 20

    def add(lid, e, recovery=False, lac=None):
        st = s.add_entry(lid, e, e - 1 if lac is None else lac, key, digest(lid, e),
                         payload(lid, e), recovery)
        assert st == 0, (lid, e, st)

    for e in range(60):
        add(1, e)
        if e % 3 == 0:
            add(2, e)
        add(3, e)
    add(4, 0)
    add(4, 1)
    s.sync()
    s.checkpoint()
    assert s.delete_ledgers([3]) == 1
    s.compact(0.9)                     # rewrites STATE records, moves live entries
    for e in range(60, 120):           # after the last checkpoint: replayed at open
        add(1, e)
    assert s.fence(2, key) == 0
    add(2, 60, recovery=True)
    assert s.drop_ledgers([4]) == 1
    add(5, 0)
    assert s.write_lac(5, key, 7) == 0
    assert s.fence(6, key) == 0
    s.sync()
    # No close(): the tail after the last checkpoint stays to be replayed.
    expected = {"segment_size": SEGMENT, "deleted": [3], "ledgers": {}}
    for lid in s.ledgers():
        status, ranges = s.list_entries(lid)
        ids = []
        for a, b in zip(ranges[0::2], ranges[1::2]):
            ids += range(a, b + 1)
        _, lac, last = s.read_lac(lid)
        entries = {}
        for e in ids:
            _, elac, dg, pl = s.read_entry(lid, e)
            assert pl == payload(lid, e) and dg == digest(lid, e)
            entries[e] = elac
        expected["ledgers"][lid] = {"fenced": s.is_fenced(lid), "key": key.decode(),
                                    "lac": lac, "last": last, "entries": entries}
    s._journal.sync()
    with open(os.path.join(args.out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
    print(f"wrote {args.out}: {len(expected['ledgers'])} ledgers, "
          f"{sum(len(v['entries']) for v in expected['ledgers'].values())} entries")
    os._exit(0)                        # like a crash: no final checkpoint


if __name__ == "__main__":
    main()
