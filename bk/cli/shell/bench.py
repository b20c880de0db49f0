"""Benchmarks (``bkshell bench ...``): thin wrappers over :mod:`bk.bench`."""

from __future__ import annotations

import os

import click

from bk.cli.common import fail
from bk.cli.shell.base import cli, ENV_URI, handled, json_opt, json_out, pass_ctx, PROG


@cli.group()
def bench():
    """Benchmarks: the whole write path, one bookie, a log, recovery, storage at
    scale, metadata. Results on stdout (--json: one document), progress on stderr.

    \b
    Examples:
      bkshell bench writes --duration 10 --json
      bkshell bench bookie 127.0.0.1:3181
    """


@bench.command("writes")
@click.option("--ensemble", "-e", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--write-quorum", "-w", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--ack-quorum", "-a", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--entry-size", default=1024, show_default=True, type=click.IntRange(min=1))
@click.option("--duration", default=10.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds measured (after 1 s of warm-up).")
@click.option("--window", default=1000, show_default=True, type=click.IntRange(min=1),
              help="Most adds outstanding.")
@click.option("--ledgers", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--rate", default=None, type=click.FloatRange(min=1),
              help="Entries/s to submit (open loop); default: as fast as acknowledged.")
@click.option("--compare", is_flag=True, help="Run the old single-entry path "
              "(frameBatching=false), then batched frames, and print the ratios.")
@json_opt
@pass_ctx
@handled
def bench_writes_cmd(c, ensemble, write_quorum, ack_quorum, entry_size, duration, window,
                     ledgers, rate, compare, as_json):
    """Durable writes through the client: throughput and latency percentiles.

    \b
    Example:
      bkshell bench writes --ensemble 3 --write-quorum 3 --ack-quorum 2 --duration 10
    """
    from bk.bench.writes import bench_writes
    if not ensemble >= write_quorum >= ack_quorum:
        raise click.BadParameter("need --ensemble >= --write-quorum >= --ack-quorum")
    if not as_json:
        click.echo(f"writing {entry_size}-byte entries for {duration:g}s "
                   f"(E={ensemble} Qw={write_quorum} Qa={ack_quorum}, window {window}, "
                   f"{ledgers} ledgers)...", err=True)
    kw = dict(ensemble=ensemble, write_quorum=write_quorum, ack_quorum=ack_quorum,
              entry_size=entry_size, duration=duration, window=window, ledgers=ledgers,
              rate=rate, metadataTimeoutMillis=int(c.timeout * 1000))
    if compare:
        from bk.bench.writes import compare_writes
        r = compare_writes(c.uri(), **kw)
        runs = [("single ADD", r["single"]), ("batched", r["batched"])]
    else:
        r = bench_writes(c.uri(), **kw)
        runs = [(None, r)]
    errors = sum(x.get("errors") or 0 for _, x in runs)
    if as_json:
        json_out(r)
        if errors:
            fail(PROG, f"{errors} adds failed")
        return
    for name, x in runs:
        lat = x["latency_ms"]
        if name:
            click.echo(f"{name}:")
        click.echo(f"{x['entries']} entries in {x['seconds']}s: {x['entries_per_sec']:.0f} "
                   f"entries/s, {x['mb_per_sec']} MB/s, client CPU "
                   f"{x['client_cpu_us_per_entry']} us/entry")
        click.echo(f"latency ms: p50 {lat['p50']}  p95 {lat['p95']}  p99 {lat['p99']}  "
                   f"p99.9 {lat['p99.9']}  max {x['latency_max_ms']}")
    if compare:
        q = r["ratio"]
        click.echo(f"batched / single: {q['entries_per_sec']}x entries/s, "
                   f"{q['client_cpu_us_per_entry']}x client CPU per entry, {q['p99']}x p99")
    if errors:
        fail(PROG, f"{errors} adds failed")


@bench.command("bookie")
@click.argument("bookie_id")
@click.option("--entry-size", default=1024, show_default=True, type=click.IntRange(min=1))
@click.option("--count", default=100_000, show_default=True, type=click.IntRange(min=1))
@click.option("--window", default=2000, show_default=True, type=click.IntRange(min=1))
@click.option("--compare", is_flag=True, help="Single ADD frames, then ADD_BATCH, and "
              "the ratios.")
@json_opt
@pass_ctx
@handled
def bench_bookie_cmd(c, bookie_id, entry_size, count, window, compare, as_json):
    """Pipelined durable adds to one bookie over the raw protocol (no quorum).

    Needs no metadata store when BOOKIE_ID is host:port.

    \b
    Example:
      bkshell bench bookie 127.0.0.1:3181 --count 200000
    """
    from bk.bench.bookie import bench_bookie
    addr = bookie_id
    uri = c.metadata or (c.conf.metadataServiceUri if c.conf_file else None) \
        or os.environ.get(ENV_URI)
    if uri:   # resolve a registered bookie id to its address
        with c.admin() as a:
            addr = a.bookies.address(bookie_id)
    def progress(done, total, rate):
        click.echo(f"{done}/{total} adds, {rate:.0f}/s", err=True)
    runs = [bench_bookie(addr, entry_size=entry_size, count=count, window=window,
                         progress=None if as_json else progress, batched=b) for b in ((False, True) if compare else (True,))]
    if as_json:
        return json_out(runs if compare else runs[0])
    for r in runs:
        lat = r["latency_ms"]
        click.echo(f"{'ADD_BATCH' if r['batched'] else 'single ADD'}: {r['adds']} adds of "
                   f"{entry_size} bytes in {r['seconds']}s: "
                   f"{r['adds_per_sec']:.0f} adds/s, {r['mb_per_sec']} MB/s")
        click.echo(f"latency ms: p50 {lat['p50']}  p99 {lat['p99']}  p99.9 {lat['p999']}")
        click.echo(f"journal syncs: {r['journal_syncs']} ({r['adds_per_sync']} adds per "
                   f"sync), worker CPU {r['bookie_cpu_us_per_add']} us per add")
    if compare:
        s, b = runs
        click.echo(f"batched / single: {b['adds_per_sec'] / s['adds_per_sec']:.2f}x adds/s, "
                   f"{b['bookie_cpu_us_per_add'] / s['bookie_cpu_us_per_add']:.2f}x worker "
                   f"CPU per add")


def _bench_settings(settings) -> dict:
    """``--set KEY=VALUE`` of a benchmark: known bk settings only."""
    from bk.config import SETTINGS

    overrides = {}
    for kv in settings:
        key, sep, value = kv.partition("=")
        if not sep or key not in SETTINGS:
            raise click.BadParameter(f"{kv!r}: expected KEY=VALUE with a known key",
                                     param_hint="--set")
        overrides[key] = value
    return overrides


@bench.command("metadata")
@click.option("--ledgers", default=1_000_000, show_default=True, type=click.IntRange(min=100),
              help="Ledgers held at the last step (steps at 10k, 30k, 100k, ... below it).")
@click.option("--steps", default=None, help="Comma-separated ledger counts instead.")
@click.option("--async-inflight", default=256, show_default=True, type=click.IntRange(min=1),
              help="Ledgers in flight, created and closed with the asynchronous API."
              )  # = bk.bench.metadata.INFLIGHT
@click.option("--threads", default=None, type=click.IntRange(min=1),
              help="Create and close from this many blocking client threads instead.")
@click.option("--churn", default=None, type=click.IntRange(min=0),
              help="Ledgers deleted and created again at the end (default: min(last "
                   "step, 100k)).")
@click.option("--idle-seconds", default=20.0, show_default=True,
              type=click.FloatRange(min=1), help="Seconds of idle CPU measurement per step.")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Bookie setting; repeatable.")
@click.option("--compare/--no-compare", default=True, show_default=True,
              help="Also run the replaced paths (an id write per ledger, sorted listing pages).")
@json_opt
@handled
def bench_metadata_cmd(ledgers, steps, async_inflight, threads, churn, idle_seconds, settings,
                       compare, as_json):
    """A local cluster (3 bookies, etcd) taking ledgers in steps: per step the
    create+close rate, the time to list every id, etcd's db size (and after
    compaction and defragmentation), its RSS, and the CPU etcd and the bookies
    burn idle. Starts its own cluster; needs no --metadata.

    \b
    Example:
      bkshell bench metadata --ledgers 100000
    """
    from bk.bench.metadata import bench_metadata, format_row
    step_list = [int(x) for x in steps.split(",")] if steps else None

    def show(row):
        if not as_json:
            click.echo(format_row(row))
    blocking = {"threads": threads, "inflight": 0} if threads else {"inflight": async_inflight}
    r = bench_metadata(ledgers, steps=step_list, **blocking, churn=churn,
                       idle_seconds=idle_seconds, compare=compare,
                       conf=_bench_settings(settings), progress=show)
    if as_json:
        return json_out(r)
    for name, x in r["compare"].items():
        click.echo(f"compare {name}: {x}")


@bench.command("log")
@click.option("--record-size", default=100, show_default=True, type=click.IntRange(min=16))
@click.option("--duration", default=10.0, show_default=True, type=click.FloatRange(min=0.5),
              help="Seconds of each phase (throughput, then tailing latency).")
@click.option("--ensemble", "-e", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--write-quorum", "-w", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--ack-quorum", "-a", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--batch-bytes", default=None, type=click.IntRange(min=1),
              help="logBatchBytes of the writer (default: the registry's).")
@click.option("--linger-ms", default=None, type=click.IntRange(min=0),
              help="logBatchLingerMs of the writer (default: the registry's).")
@click.option("--tail-rate", default=None, type=click.FloatRange(min=1),
              help="Records/s of the latency phase. Default: half the measured throughput.")
@click.option("--gc-off", is_flag=True,
              help="Disable Python's cyclic GC in writer and reader during the latency "
                   "phase (shows its share of the tail).")
@json_opt
@pass_ctx
@handled
def bench_log_cmd(c, record_size, duration, ensemble, write_quorum, ack_quorum, batch_bytes,
                  linger_ms, tail_rate, gc_off, as_json):
    """A log: records/s appended by one writer, then a tailing reader's
    append-to-read latency at half that rate.

    \b
    Example:
      bkshell bench log --record-size 100 --duration 10
      bkshell bench log --tail-rate 100000
    """
    from bk.bench.log import bench_log
    if not ensemble >= write_quorum >= ack_quorum:
        raise click.BadParameter("need --ensemble >= --write-quorum >= --ack-quorum")
    opts = {}
    if batch_bytes is not None:
        opts["logBatchBytes"] = batch_bytes
    if linger_ms is not None:
        opts["logBatchLingerMs"] = linger_ms
    if not as_json:
        click.echo(f"appending {record_size}-byte records for {duration:g}s, then tailing "
                   f"(E={ensemble} Qw={write_quorum} Qa={ack_quorum})...", err=True)
    r = bench_log(c.uri(), record_size, duration, ensemble, write_quorum, ack_quorum,
                  tail_rate=tail_rate, gc_off=gc_off, **opts)
    if as_json:
        return json_out(r)
    t = r["tail"]
    lat = t["latency_ms"]
    click.echo(f"append: {r['records']} records in {r['seconds']}s: {r['records_per_sec']} "
               f"records/s, {r['mb_per_sec']} MB/s, {r['entries']} entries")
    click.echo(f"tail at {t['achieved_rate']} records/s ({t['records']} read): latency ms "
               f"p50 {lat['p50']}  p90 {lat['p90']}  p99 {lat['p99']}  p99.9 {lat['p99.9']}  "
               f"max {t['latency_max_ms']}")


class _Size(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        from bk.bench.recovery import parse_size
        try:
            n = parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        if n <= 0:
            self.fail(f"{value!r}: the size must be positive", param, ctx)
        return n


@bench.command("scale")
@click.option("--steps", default="1M,10M,100M", show_default=True,
              help="Entries held after each step (comma-separated; 1M, 500k or numbers).")
@click.option("--entry-size", default=100, show_default=True, type=click.IntRange(min=1))
@click.option("--ledgers", default=1000, show_default=True, type=click.IntRange(min=1))
@click.option("--rate", default=30_000, show_default=True, type=click.IntRange(min=1),
              help="Adds/s of the latency measurement after each step.")
@click.option("--rate-seconds", default=5.0, show_default=True, type=click.FloatRange(min=0.5))
@click.option("--catchup-entries", default=10_000, show_default=True,
              type=click.IntRange(min=0), help="1 KiB entries of each of the 100 "
              "interleaved catch-up ledgers (0: no catch-up measurement).")
@click.option("--catchup-only", is_flag=True,
              help="Measure only the cold catch-up read: the 100 ledgers written "
              "interleaved, then --read-ledgers of them read back, each cold.")
@click.option("--read-ledgers", default=10, show_default=True, type=click.IntRange(min=1),
              help="--catchup-only: ledgers read back.")
@click.option("--drop-all", is_flag=True,
              help="--catchup-only: drop the whole page cache (root) instead of evicting "
              "the bookie's files only.")
@click.option("--dir", "base_dir", default=None, type=click.Path(file_okay=False),
              help="Where the bookie's data goes (default: a temp dir, removed after).")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="A bookie setting for the run; repeatable.")
@json_opt
@handled
def bench_scale_cmd(steps, entry_size, ledgers, rate, rate_seconds, catchup_entries,
                    catchup_only, read_ledgers, drop_all, base_dir, settings, as_json):
    """Storage at scale: one bookie filled in steps, measured after each.

    Starts its own one-bookie, one-shard cluster (needs no --metadata), fills it at
    full speed with --entry-size entries over --ledgers interleaved ledgers and,
    after each step, prints: entries held, the worker's RSS and peak RSS, the last
    flush's size and time, add latency at --rate, restart after kill -9 until the
    last entry is served, random read p99 and catch-up read MB/s of one ledger
    written among 99 others, with the page cache dropped (as root; else warm).

    With --catchup-only, only the catch-up read (quick, repeatable): MB/s, CPU
    us per entry of the client and of the shard worker, and the MB the worker
    read from disk.

    \b
    Example:
      bkshell bench scale --steps 1M,10M
      bkshell bench scale --steps 1M,10M --entry-size 1024 --json
      bkshell bench scale --catchup-only
    """
    from bk.bench.scale import bench_catchup, bench_scale, format_catchup, parse_count
    from bk.config import SETTINGS

    overrides = {}
    for kv in settings:
        key, sep, value = kv.partition("=")
        if not sep or key not in SETTINGS:
            raise click.BadParameter(f"{kv!r}: expected KEY=VALUE with a known key",
                                     param_hint="--set")
        overrides[key] = value
    if catchup_only:
        if not catchup_entries:
            raise click.BadParameter("--catchup-only needs --catchup-entries above 0",
                                     param_hint="--catchup-entries")
        r = bench_catchup(catchup_entries, read_ledgers, drop_all=drop_all, base_dir=base_dir,
                          conf=overrides, report=lambda line: click.echo(line, err=True))
        if as_json:
            return json_out(r)
        click.echo(format_catchup(r))
        return None
    rows = bench_scale([parse_count(x) for x in steps.split(",")], entry_size=entry_size,
                       ledgers=ledgers, rate=rate, rate_seconds=rate_seconds,
                       catchup_entries=catchup_entries, base_dir=base_dir, conf=overrides,
                       report=lambda line: click.echo(line, err=as_json))
    if as_json:
        return json_out(rows)


@bench.command("recovery")
@click.option("--size", default="1G", show_default=True, type=_Size(),
              help="Bytes written before the kill (1G, 256M, 512K or bytes); the killed "
                   "bookie holds about half of them (E3 Qw2 over 4 bookies).")
@click.option("--entry-size", default=1024, show_default=True, type=click.IntRange(min=1))
@click.option("--ledgers", default=16, show_default=True, type=click.IntRange(min=1),
              help="Ledgers the data is spread over (written concurrently, then closed).")
@click.option("--writers", default=2, show_default=True, type=click.IntRange(min=0),
              help="Background writers adding to their own ledgers during the recovery.")
@click.option("--writer-rate", default=500.0, show_default=True,
              type=click.FloatRange(min=1), help="Entries/s of each background writer.")
@click.option("--registration-ttl", default=None, type=click.IntRange(min=1),
              help="registrationTtlSeconds of the bookies (how long the loss takes to be "
                   "noticed). Default: the registry's.")
@click.option("--dir", "base_dir", default=None, type=click.Path(file_okay=False),
              help="Where the cluster's data goes (default: a temp dir, removed after).")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="A bookie setting for the run, e.g. replicationRateByBytes=12000000 "
                   "(the copy's pace vs the writers' latency); repeatable.")
@json_opt
@handled
def bench_recovery_cmd(size, entry_size, ledgers, writers, writer_rate, registration_ttl,
                       base_dir, settings, as_json):
    """Auto-recovery: how fast a lost bookie is re-replicated, and writers' latency meanwhile.

    Starts its own local cluster (etcd + 4 bookies, production defaults, auto-recovery
    in every bookie with lostBookieRecoveryDelay=0; needs no --metadata), writes
    --size bytes of --entry-size entries E3 Qw2 Qa2 over --ledgers closed ledgers, starts
    --writers writers on other ledgers (their ensembles avoid the bookie to be killed)
    at --writer-rate entries/s each, kill -9s one bookie (not the auditor), and times:

    \b
      kill -> first ledger marked   noticing the loss (the registration lease expires)
      marked -> list empty          the re-replication; MB/s = what the lost bookie
                                    held / this time
    and the writers' add latency before the kill and during the re-replication. At the
    end every entry must be on every bookie of its write set (GET_LIST_OF_ENTRIES);
    exits 1 otherwise. Progress goes to stderr.

    \b
    Example:
      bkshell bench recovery                       # 1 GiB written, ~512 MiB re-replicated
      bkshell bench recovery --size 256M --json
      bkshell bench recovery --set replicationRateByBytes=12000000
    """
    from bk.bench.recovery import bench_recovery
    overrides = _bench_settings(settings)

    def say(msg):
        click.echo(msg, err=True)
    r = bench_recovery(size=size, entry_size=entry_size, ledgers=ledgers, writers=writers,
                       writer_rate=writer_rate, registration_ttl=registration_ttl,
                       base_dir=base_dir, progress=say, conf_overrides=overrides)
    if as_json:
        json_out(r)
    else:
        b, d = r["writer_latency_ms_before_kill"], r["writer_latency_ms_during_recovery"]
        click.echo(f"wrote {r['bytes_written'] / 2**20:.0f} MiB ({r['entries']} entries, "
                   f"{r['ledgers']} ledgers) at {r['write_mb_per_sec']} MB/s")
        click.echo(f"killed {r['killed']}: it held {r['lost_bytes'] / 2**20:.1f} MiB "
                   f"({r['lost_entries']} entries) of {r['affected_ledgers']} ledgers; "
                   f"the workers copied {r['rereplicated_bytes_by_workers'] / 2**20:.1f} MiB")
        click.echo(f"kill -> marked {r['seconds_kill_to_marked']}s, marked -> empty "
                   f"{r['seconds_marked_to_empty']}s: {r['mb_per_sec']} MB/s "
                   f"(kill -> empty {r['seconds_kill_to_empty']}s, "
                   f"{r['mb_per_sec_from_kill']} MB/s)")
        click.echo(f"surviving bookies' CPU meanwhile: {r['bookie_cpu_seconds_during_recovery']}s "
                   f"({r['bookie_cpu_us_per_lost_entry']} us per entry re-replicated)")
        if r["writers"]:
            click.echo(f"writers ({r['writers']} x {r['writer_rate']:g}/s) add latency ms: "
                       f"before the kill p50 {b['p50']} p99 {b['p99']}; during the "
                       f"re-replication p50 {d['p50']} p99 {d['p99']} max {d['max']} "
                       f"({d['count']} adds, {r['writer_errors']} errors)")
        click.echo("verified: every entry on every bookie of its write set" if r["verified"]
                   else f"VERIFICATION FAILED: {'; '.join(r['problems'][:5])}")
    if not r["verified"]:
        fail(PROG, f"bench recovery: not every entry is on every bookie of its write set "
                   f"(first: {r['problems'][0] if r['problems'] else '?'})")
