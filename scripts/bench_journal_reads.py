#!/usr/bin/env python
"""What a read of a journal record costs with direct writes, from the window and
from the file, and what the window's slides cost the appends.

    python scripts/bench_journal_reads.py                  # 64 MiB segment, 48 MiB written
    python scripts/bench_journal_reads.py --memory-mb 16 --write-mb 48 --group 45

One journal (``journalDirectWrites``) in a temp directory on the disk of /tmp,
``--segment-mb`` segments, 1 KiB ADD records appended and committed every
``--group`` records (each group's direct write run on this thread: the loop's
CPU, not its latency, is what is measured). Then every record is read back with
``read_add``, newest first, in order of age: the records the active window holds
(memory) and the older ones (through the file: direct writes leave none of it
in the page cache, so these read the disk, a page and the kernel's read-ahead
at a time, as a catch-up reader of entries not yet flushed does). Prints the
appends' CPU per record and the reads' wall and CPU per record, by where they
came from. It measures the bk on PYTHONPATH (it adds no path of its own), so
that trees are compared with this one script, alternating; a tree whose journal
keeps whole-segment images (before ``journalDirectMemoryMB``) reads every record
of the segment from memory.
"""

import argparse
import inspect
import os
import tempfile
import time

from bk.bookie import journal as J     # the tree on PYTHONPATH (no path of its own: see above)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--segment-mb", type=int, default=64)
    p.add_argument("--memory-mb", type=int, default=16, help="journalDirectMemoryMB")
    p.add_argument("--write-mb", type=int, default=48, help="MiB of records appended")
    p.add_argument("--group", type=int, default=45, help="records per group commit")
    p.add_argument("--dir", default="/tmp", help="where the journal's temp directory goes")
    a = p.parse_args()
    kw = {}
    if "direct_memory" in inspect.signature(J.Journal.__init__).parameters:
        kw["direct_memory"] = a.memory_mb << 20
    payload = bytes(range(256)) * 4
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        j = J.Journal(d, a.segment_mb << 20, True, J.ROLL_STAGGER, True, **kw)
        assert j.direct, "no direct writes here"
        list(j.replay())
        pos = []
        n = (a.write_mb << 20) // (len(payload) + J.ADD_OVERHEAD + 2)
        c0 = time.process_time()
        for i in range(n):
            pos.append(j.append_add(1, i, i - 1, b"dg", payload))
            if i % a.group == a.group - 1:
                j.sync()
        j.sync()
        append_cpu = (time.process_time() - c0) / n
        seq = j.active_seq
        seg = j._segs[seq]
        wbase = getattr(seg, "wbase", 0) if seg.image is not None else 1 << 62
        where = {"window": [], "file": []}
        for p_ in reversed(pos):
            if p_ >> 32 != seq:
                continue
            where["window" if (p_ & 0xFFFFFFFF) >= wbase else "file"].append(p_)
        print(f"appends: {n} records of {len(payload)} B, {a.group} a group: "
              f"{append_cpu * 1e6:.2f} us CPU per record; slides {getattr(j, 'slides', 0)} "
              f"(waited {getattr(j, 'slide_waits', 0)})")
        for name, ps in where.items():
            if not ps:
                print(f"reads from the {name}: none")
                continue
            w0, c0 = time.perf_counter(), time.process_time()
            for p_ in ps:
                assert j.read_add(p_)[4] == payload
            w, c = time.perf_counter() - w0, time.process_time() - c0
            print(f"reads from the {name}: {len(ps)} records, {w / len(ps) * 1e6:.2f} us wall, "
                  f"{c / len(ps) * 1e6:.2f} us CPU per record "
                  f"({len(ps) * (len(payload) + 40) / w / 1e6:.0f} MB/s)")
        j.close()
        os.sync()


if __name__ == "__main__":
    main()
