"""bk.bench.goprofile: names from the stripped etcd binary's function table, perf's
call chains folded with them, and samples summed by what etcd does."""

from __future__ import annotations

import collections

from bk.bench.goprofile import GoSymbols, categorise, folded_stacks
from bk.meta.etcd_server import find_etcd_binary

APPLY = "go.etcd.io/etcd/server/v3/etcdserver.(*EtcdServer).apply"
NOTIFY = "go.etcd.io/etcd/server/v3/mvcc.(*watchableStore).notify"


def _symbols() -> GoSymbols:
    return GoSymbols(find_etcd_binary())


def test_the_function_table_names_etcd_functions_by_address():
    s = _symbols()
    assert len(s.names) > 10_000 and s.entries == sorted(s.entries)
    i = s.names.index(APPLY)
    entry, following = s.entries[i], s.entries[i + 1]
    assert s.name(entry) == APPLY and s.name(following - 1) == APPLY
    assert s.name(following) == s.names[i + 1] != APPLY
    assert s.name(0) is None and s.name(s.text_end) is None


def test_perf_script_chains_fold_with_names_leaf_last():
    s = _symbols()
    path = s.path

    def frame(name, offset=3):        # perf prints an address in the binary as an offset
        return f"\t{s.entries[s.names.index(name)] + offset - s.base:x} [unknown] ({path})"
    sample = ["etcd  4242 100.000001:    1001001 cpu-clock:pppH: ", frame(NOTIFY),
              frame(APPLY), "\tffffffff81000130 entry_SYSCALL_64+0x76 ([kernel.kallsyms])",
              ""]
    text = "\n".join(sample * 3 + [sample[0], frame(APPLY)])     # the last has no blank line
    stacks = folded_stacks(text, s)
    assert stacks == collections.Counter({f"entry_SYSCALL_64;{APPLY};{NOTIFY}": 3, APPLY: 1})


def test_samples_go_to_the_first_category_found_anywhere_on_the_stack():
    stacks = collections.Counter({
        "runtime.goexit;runtime.gcBgMarkWorker;runtime.scanobject": 2,
        "grpc.(*Server).processUnaryRPC;etcdserverpb._KV_Range_Handler;mvcc.Range": 3,
        "grpc.(*Server).processUnaryRPC;etcdserverpb._KV_Txn_Handler": 4,
        f"{APPLY};{NOTIFY};mvcc.newWatcherBatch": 1,
        "runtime.goexit;something.else": 5,
    })
    assert categorise(stacks) == {"other": 5, "gRPC unary handler": 4, "Range calls": 3,
                                  "Go GC": 2, "watch matching of the puts": 1}
