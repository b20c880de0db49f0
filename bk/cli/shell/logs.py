"""Log commands (:mod:`bk.log`): list, show, read, tail, truncate and delete logs;
the Spark sink's replica check and staging clean-up."""

from __future__ import annotations

import base64
import json
import os
import sys

import click

from bk.cli.common import fail, until_interrupted
from bk.cli.shell.base import (
    cli, confirm, handled, human_size, json_opt, json_out, pass_ctx, printable, PROG
)
from bk.exitcodes import EXIT_CONFIG


class LogPosition(click.ParamType):
    name = "POS"

    def convert(self, value, param, ctx):
        from bk.log.records import Position
        try:
            return Position.parse(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


LOG_POSITION = LogPosition()


def _log_name(value: str) -> str:
    from bk.log.records import check_log_name
    try:
        return check_log_name(value)
    except ValueError as e:
        raise click.BadParameter(str(e))


def _record_out(rec, fmt, as_json):
    if as_json:
        click.echo(json.dumps({"position": str(rec.position), "length": len(rec.data),
                               "data": base64.b64encode(rec.data).decode("ascii")}))
    elif fmt == "hex":
        click.echo(f"--- {rec.position} ({len(rec.data)} bytes) ---")
        for off in range(0, len(rec.data), 16):
            chunk = rec.data[off:off + 16]
            text = "".join(chr(ch) if 32 <= ch < 127 else "." for ch in chunk)
            click.echo(f"{off:08x}  {chunk.hex(' '):<47}  {text}")
    else:
        click.echo(f"{rec.position}\t{printable(rec.data.decode('utf-8', 'backslashreplace'))}")



@cli.command()
@json_opt
@pass_ctx
@handled
def listlogs(c, as_json):
    """List the names of the logs.

    \b
    Examples:
      bkshell listlogs
      bkshell listlogs --json
    """
    with c.client() as cl:
        names = cl.list_logs()
    if as_json:
        return json_out(names)
    for n in names:
        click.echo(n)


@cli.command()
@click.argument("name", callback=lambda ctx, p, v: _log_name(v))
@json_opt
@pass_ctx
@handled
def loginfo(c, name, as_json):
    """Show a log: its segments (ledgers), positions, records and bytes.

    \b
    Examples:
      bkshell loginfo orders
      bkshell loginfo orders --json
    """
    with c.client() as cl:
        info = cl.log_info(name)
    if as_json:
        return json_out(info.to_dict())
    click.echo(f"log {info.name}: epoch {info.epoch}, {info.records} records, "
               f"{human_size(info.bytes)}, first {info.first_position or '-'}, "
               f"last {info.last_position or '-'}"
               + (f", truncated before {info.truncated_before}" if info.truncated_before
                  else ""))
    for s in info.segments:
        click.echo(f"  segment {s['segment']}\tledger {s['ledger_id']}\t{s['state']}\t"
                   f"last entry {s['last_entry_id']}\t{s['records']} records\t"
                   f"{human_size(s['bytes'])}")


@cli.command()
@click.argument("name", callback=lambda ctx, p, v: _log_name(v))
@click.option("--from", "start", type=LOG_POSITION, default=None,
              help="First position (segment:entry:slot). Default: the earliest.")
@click.option("--to", "end", type=LOG_POSITION, default=None,
              help="Last position (inclusive). Default: the last record now.")
@click.option("--limit", "-n", type=click.IntRange(min=1), default=None,
              help="At most this many records.")
@click.option("--format", "fmt", type=click.Choice(["text", "hex"]), default="text",
              show_default=True, help="text: position and record on one line; hex: hex dump.")
@json_opt
@pass_ctx
@handled
def readlog(c, name, start, end, limit, fmt, as_json):
    """Print records of a log (never fences its writer); stops at the last record.

    With --json: one JSON object per line (position, length, base64 data).

    \b
    Examples:
      bkshell readlog orders
      bkshell readlog orders --from 2:0:0 --to 2:99:0 --format hex
      bkshell readlog orders --limit 10 --json
    """
    with c.client() as cl:
        last = cl.log_info(name).last_position
        if end is None or (last is not None and end > last):
            end = last
        n = 0
        if end is None:
            return
        with cl.open_log_reader(name, start=start or "earliest") as r:
            while limit is None or n < limit:
                if r.position > end:
                    break
                rec = r.read_next(timeout=c.timeout)
                if rec is None or rec.position > end:
                    break
                _record_out(rec, fmt, as_json)
                n += 1


@cli.command()
@click.argument("name", callback=lambda ctx, p, v: _log_name(v))
@click.option("--from", "start", type=LOG_POSITION, default=None,
              help="Start at this position. Default: records appended from now on.")
@click.option("--earliest", is_flag=True, help="Start at the earliest record.")
@click.option("--format", "fmt", type=click.Choice(["text", "hex"]), default="text",
              show_default=True)
@json_opt
@pass_ctx
@handled
def tail(c, name, start, earliest, fmt, as_json):
    """Follow a log: print records as they are appended, until Ctrl-C.

    \b
    Examples:
      bkshell tail orders
      bkshell tail orders --earliest --json
      bkshell tail orders --from 3:0:0
    """
    where = start or ("earliest" if earliest else "latest")
    with c.client() as cl:
        r = cl.open_log_reader(name, start=where)
        try:
            with until_interrupted() as stop:   # Ctrl-C is how tail ends: not an error
                while not stop.set:
                    for rec in r.read_batch(1000, timeout=1.0):
                        _record_out(rec, fmt, as_json)
                    sys.stdout.flush()
        finally:
            r.close()


@cli.command()
@click.argument("name", callback=lambda ctx, p, v: _log_name(v))
@click.option("--before", required=True, type=LOG_POSITION,
              help="Drop the records before this position (segment:entry:slot).")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (on a terminal).")
@json_opt
@pass_ctx
@handled
def truncatelog(c, name, before, yes, as_json):
    """Truncate a log: delete the whole ledgers that end before a position
    (never the open one) and record the truncation point.

    On a terminal it asks first, unless --yes; a script is not asked.

    \b
    Example:
      bkshell truncatelog orders --before 5:0:0 --yes
    """
    with c.client() as cl:
        info = cl.log_info(name)                 # a missing log fails before asking
        confirm(f"Drop the records of log {info.name} before {before} (of "
                 f"{info.records} records, first {info.first_position or '-'})?", yes)
        deleted = cl.truncate_log(name, before=before)
    if as_json:
        return json_out({"name": name, "truncated_before": str(before),
                          "deleted_ledgers": deleted})
    click.echo(f"truncated log {name} before {before}; deleted "
               f"{len(deleted)} ledger(s){': ' if deleted else ''}"
               f"{' '.join(map(str, deleted))}")


@cli.command()
@click.argument("name", callback=lambda ctx, p, v: _log_name(v))
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (on a terminal).")
@json_opt
@pass_ctx
@handled
def deletelog(c, name, yes, as_json):
    """Delete a log and its ledgers.

    On a terminal it asks first, unless --yes; a script is not asked.

    \b
    Example:
      bkshell deletelog orders --yes
    """
    with c.client() as cl:
        info = cl.log_info(name)                 # a missing log fails before asking
        confirm(f"Delete log {info.name}: {info.records} records in "
                 f"{len(info.segments)} ledgers?", yes)
        deleted = cl.delete_log(name)
    if as_json:
        return json_out({"name": name, "deleted_ledgers": deleted})
    click.echo(f"deleted log {name} and {len(deleted)} ledger(s)")


@cli.command()
@click.option("--spark", "master", default="local[2]", show_default=True, metavar="MASTER",
              help="The Spark master to run the check on.")
@click.option("--partitions", type=click.IntRange(min=1), default=None,
              help="Parallel partitions of ledgers (default: twice Spark's parallelism).")
@json_opt
@pass_ctx
@handled
def checkledgers(c, master, partitions, as_json):
    """Check, as a Spark job, that every entry of every ledger is on each bookie of
    its write set (closed ledgers to their last entry, open ones to their LAC).

    Prints a summary (with --json: every problem); exits 1 when a problem is
    found. Needs the 'spark' extra (PySpark, Java 17).

    \b
    Examples:
      bkshell checkledgers
      bkshell checkledgers --spark spark://master:7077 --json
    """
    uri = c.uri()
    try:
        from pyspark.sql import SparkSession
        import bk.spark
    except ImportError as e:
        fail(PROG, f"checkledgers needs PySpark (pip install 'bk[spark]'): {e}", EXIT_CONFIG)
    if master.startswith("local"):
        # Local Python workers: this interpreter (with bk and its dependencies).
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # Run in a process that has a session already (the command called in-process,
    # from a notebook or a test): the check runs on that one and leaves it running.
    ours = SparkSession.getActiveSession() is None
    spark = (SparkSession.builder.master(master).appName("bkshell checkledgers")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    try:
        if ours:             # (a session of the caller's keeps its log level)
            spark.sparkContext.setLogLevel("ERROR")
        from bk.security import client_settings
        rows = [r.asDict() for r in bk.spark.check_ledgers(
            spark, uri, partitions, security=client_settings(c.conf)).collect()]
    finally:
        if ours:
            spark.stop()
    rows.sort(key=lambda r: (r["ledger_id"], r["entry_id"], r["bookie"]))
    if as_json:
        json_out({"problems": len(rows), "rows": rows})
    else:
        ledgers = sorted({r["ledger_id"] for r in rows})
        for r in rows[:50]:
            click.echo(f"ledger {r['ledger_id']} entry {r['entry_id']} on {r['bookie']}: "
                       f"{r['problem']}")
        if len(rows) > 50:
            click.echo(f"... and {len(rows) - 50} more")
        click.echo(f"{len(rows)} problems in {len(ledgers)} ledgers" if rows
                   else "every ledger's entries are on every bookie of their write sets")
    if rows:
        fail(PROG, f"{len(rows)} entries missing or unreadable in "
                   f"{len({r['ledger_id'] for r in rows})} ledgers")


@cli.command()
@click.argument("names", nargs=-1, callback=lambda ctx, p, v: [_log_name(n) for n in v])
@click.option("--older-than", type=click.FloatRange(min=0), default=24 * 3600.0,
              show_default=True, metavar="SECONDS",
              help="Also delete staging ledgers registered this long ago (a batch job "
                   "still running after that long would lose its output).")
@click.option("--dry-run", is_flag=True, help="Only list what would be deleted.")
@json_opt
@pass_ctx
@handled
def cleanstaging(c, names, older_than, dry_run, as_json):
    """Delete the staging ledgers of exactly-once sinks (bk.spark) that no commit
    can take any more: not in their log, and of a streaming batch that its sink
    has committed since, or older than --older-than. A sink collects its own at
    each commit and abort; this is for those whose driver died too.

    \b
    Examples:
      bkshell cleanstaging --dry-run
      bkshell cleanstaging orders --older-than 3600
    """
    from bk.log import staging
    with c.client() as cl:
        logs = list(names) or sorted({e["log"] for e in staging.pending(cl)})
        result = {}
        for name in logs:
            result[name] = staging.collect(cl, name, older_than=older_than, dry_run=dry_run)
        left = len(staging.pending(cl)) if not names else \
            sum(len(staging.pending(cl, n)) for n in names)
    if as_json:
        return json_out({"dry_run": dry_run, "deleted": result, "still_pending": left})
    verb = "would delete" if dry_run else "deleted"
    for name, lids in result.items():
        if lids:
            click.echo(f"log {name}: {verb} {len(lids)} staging ledger(s): "
                       f"{', '.join(map(str, lids))}")
    total = sum(map(len, result.values()))
    click.echo(f"{verb} {total} staging ledger(s); {left} registered staging ledger(s) left "
               f"(in flight, or not old enough)")
