#!/usr/bin/env python
"""How long a journal's group commit waits for the disk, and what the kernel
spends on it, by way of writing.

Each of ``--streams`` processes plays one shard's journal: it appends a group
of ``--group-kb`` KiB to a preallocated file, makes it durable, sleeps
``--gap-ms`` (1 ms), and repeats for ``--duration`` seconds. The ways of
appending compared (``--mode``):

  mmap    stores into a shared mapping of the file, then fdatasync
  pwrite  one pwrite of the group, then fdatasync   (what bk's journal does)
  pad     pwrite of the group and zeros to the end of its last page, then
          fdatasync (what a journal in written blocks must do, see below)
  direct  one O_DIRECT | O_DSYNC pwrite of the group's whole pages (the last,
          partial one rewritten by the next group), no page cache at all

and of preallocating each file (``--prealloc``): ``fallocate`` (unwritten
extents, what the journal does), ``zeros`` (zeros written through the page
cache and fsync'd) or ``zeros-direct`` (zeros written with O_DIRECT, no page
cache). A pwrite covering part of a page the page cache lacks makes the
kernel read that page first in written blocks (``zeros-direct``), not in
unwritten ones: ``pad`` avoids it. ``direct`` into ``fallocate``'d blocks
converts their extents as it writes (with O_DSYNC that metadata is written
with the data: what bk's ``journalDirectWrites`` does).

It prints the latency of "append + make durable" per group, the streams'
own CPU per group (the sync runs on the calling thread here; bk runs it
through Linux AIO on a kworker) and the disk's completed reads and writes
per group (/sys/block/<dev>/stat, the whole disk: other work counts too).
On the 2-core VM of the project (ext4 on virtio, write-back cache) three
streams measured mmap p99 5-8 ms, pwrite p99 0.5-0.75 ms: this is why the
journal pwrites. For the kernel's work per sync, profile a run with
``perf record -a -g`` (the streams are named ``bench-sync``):
docs/performance-log.md, "The kernel's work per journal sync".

    python scripts/bench_sync.py                  # mmap and pwrite, 3 streams, in ./
    python scripts/bench_sync.py --dir /data --streams 6 --mode pwrite
    python scripts/bench_sync.py --mode pwrite,direct --prealloc zeros-direct --group-kb 64
"""

import argparse
import ctypes
import mmap
import multiprocessing as mp
import os
import resource
import sys
import time

SIZE = 64 << 20
PAGE = mmap.PAGESIZE
MODES = ("mmap", "pwrite", "pad", "direct")


def _name_thread():
    try:      # PR_SET_NAME: the streams are told apart in perf and top
        ctypes.CDLL(None).prctl(15, b"bench-sync", 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _preallocate(path, prealloc):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.posix_fallocate(fd, 0, SIZE)
    if prealloc == "zeros":
        zeros = bytes(1 << 20)
        for off in range(0, SIZE, len(zeros)):
            os.pwrite(fd, zeros, off)
    elif prealloc == "zeros-direct":
        dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        zeros = mmap.mmap(-1, 1 << 20)            # page-aligned, as O_DIRECT needs
        for off in range(0, SIZE, len(zeros)):
            os.pwrite(dfd, zeros, off)
        zeros.close()
        os.close(dfd)
    os.fsync(fd)
    return fd


def _stream(path, mode, prealloc, group, gap, duration, barrier, out):
    _name_thread()
    fd = _preallocate(path, prealloc)
    mm = mmap.mmap(fd, SIZE) if mode == "mmap" else None
    data = b"x" * group
    zeros = memoryview(bytes(PAGE))
    if mode == "direct":
        dfd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_DSYNC)
        abuf = mmap.mmap(-1, group + 2 * PAGE)
        abuf.write(b"x" * len(abuf))
        aview = memoryview(abuf)
    lat = []
    off = HEADER = 64             # as a journal segment: groups do not start on a page
    barrier.wait()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    end = time.monotonic() + duration
    while time.monotonic() < end:
        if off + group + PAGE > SIZE:
            off = HEADER
        t = time.perf_counter()
        e = off + group
        if mode == "direct":
            lo, hi = off & -PAGE, -(-e // PAGE) * PAGE
            os.pwrite(dfd, aview[:hi - lo], lo)
        else:
            if mm is not None:
                mm[off:e] = data
            elif mode == "pad" and e % PAGE:
                os.pwritev(fd, (data, zeros[:PAGE - e % PAGE]), off)
            else:
                os.pwrite(fd, data, off)
            os.fdatasync(fd)
        lat.append(time.perf_counter() - t)
        off = e
        time.sleep(gap)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    if mm is not None:
        mm.close()
    if mode == "direct":
        aview.release()
        abuf.close()
        os.close(dfd)
    os.close(fd)
    os.unlink(path)
    out.put((lat, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime))


def _disk_of(directory):
    """The /sys/block stat file of the disk holding ``directory`` (None if unknown)."""
    dev = os.stat(directory).st_dev
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for stat in (os.path.join(base, "stat"), os.path.join(base, "..", "stat")):
        if os.path.exists(stat) and os.path.exists(os.path.join(os.path.dirname(stat), "queue")):
            return stat
    return os.path.join(base, "stat") if os.path.exists(os.path.join(base, "stat")) else None


def _io(stat):
    if stat is None:
        return 0, 0
    f = open(stat).read().split()
    return int(f[0]), int(f[4])          # reads, writes completed


def run(directory, mode, prealloc, streams, group, gap, duration):
    barrier = mp.Barrier(streams + 1)
    out = mp.Queue()
    procs = [mp.Process(target=_stream, args=(os.path.join(directory, f".bench-sync-{os.getpid()}-{i}"),
                                              mode, prealloc, group, gap, duration, barrier, out))
             for i in range(streams)]
    for p in procs:
        p.start()
    stat = _disk_of(directory)
    barrier.wait()
    r0, w0 = _io(stat)
    res = [out.get() for _ in procs]
    r1, w1 = _io(stat)
    for p in procs:
        p.join()
    lat = sorted(x for r, _ in res for x in r)
    n = len(lat)
    cpu = sum(c for _, c in res)

    def pct(q):
        return lat[min(n - 1, int(q / 100 * n))] * 1000

    print(f"{mode:6s} {prealloc:12s} streams={streams} group={group >> 10}KiB syncs={n}: "
          f"p50 {pct(50):.2f} p95 {pct(95):.2f} p99 {pct(99):.2f} p99.9 {pct(99.9):.2f} "
          f"max {lat[-1] * 1000:.2f} ms; CPU {cpu / n * 1e6:.0f} us/group; disk per group: "
          f"{(w1 - w0) / n:.2f} writes, {(r1 - r0) / n:.2f} reads", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default=".", help="directory on the disk to measure (default: .)")
    p.add_argument("--mode", default="mmap,pwrite",
                   help=f"comma-separated, run in this order: {', '.join(MODES)} "
                   "(default: mmap,pwrite)")
    p.add_argument("--prealloc", choices=["fallocate", "zeros", "zeros-direct"], default="zeros",
                   help="how each file is preallocated (default: zeros; the journal uses "
                   "fallocate, whose unwritten extents make the first write of each block "
                   "a metadata change: compare them)")
    p.add_argument("--streams", type=int, default=3, help="concurrent journals")
    p.add_argument("--group-kb", type=int, default=15, help="bytes per group commit, KiB")
    p.add_argument("--gap-ms", type=float, default=1.0, help="pause after each group, ms")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per mode")
    a = p.parse_args()
    if not os.path.isdir(a.dir):
        sys.exit(f"bench_sync: {a.dir} is not a directory")
    modes = a.mode.split(",")
    for mode in modes:
        if mode not in MODES:
            sys.exit(f"bench_sync: unknown --mode {mode!r} (one of {', '.join(MODES)})")
    for mode in modes:
        run(a.dir, mode, a.prealloc, a.streams, a.group_kb << 10, a.gap_ms / 1000, a.duration)


if __name__ == "__main__":
    main()
