"""Local inspection of a bookie's directories (no cluster needed): the journal's
mark and records."""

from __future__ import annotations

import json
import time

import click

from bk.cli.shell.base import cli, handled, json_opt, json_out, pass_ctx


@cli.command()
@json_opt
@pass_ctx
@handled
def lastmark(c, as_json):
    """Journal mark (segment:offset) of each shard's last checkpoint (needs --conf).

    A restart replays each shard's journal from this mark.

    \b
    Example:
      bkshell --conf conf/bk_server.conf lastmark
    """
    from bk.bookie.inspect import last_marks
    conf = c.need_conf("lastmark")
    rows = last_marks(conf)
    if as_json:
        return json_out(rows)
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["checkpoint_time"])) \
            if r["checkpoint_time"] else "-"
        click.echo(f"shard {r['shard']}\t{r['mark'] or 'no checkpoint'}\t{when}\t"
                   f"{r['journal_dir']}")


@cli.command()
@click.option("--shard", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--limit", "-l", default=None, type=click.IntRange(min=0),
              help="At most this many records.")
@click.option("--from", "start", default=None, metavar="SEQ:OFFSET",
              help="Start at this mark (see lastmark). Default: the oldest segment.")
@json_opt
@pass_ctx
@handled
def readjournal(c, shard, limit, start, as_json):
    """Decode the records of one shard's journal, read-only (needs --conf).

    Safe while the bookie runs: nothing is written or truncated.

    \b
    Example:
      bkshell --conf conf/bk_server.conf readjournal --shard 1 --limit 20
    """
    from bk.bookie.inspect import describe_record, read_journal
    conf = c.need_conf("readjournal")
    if start is not None:
        from bk.bookie.journal import parse_mark
        parse_mark(start)
    n = 0
    for rec in read_journal(conf, shard, start, limit):
        d = describe_record(rec)
        n += 1
        if as_json:
            click.echo(json.dumps(d))
            continue
        extra = " ".join(f"{k}={v}" for k, v in d.items() if k not in ("mark", "type", "length"))
        click.echo(f"{d['mark']}\t{d['type']}\t{extra}")
    if not as_json:
        click.echo(f"{n} records", err=True)
