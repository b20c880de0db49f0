"""Ledger commands: list, show metadata, read, delete, and a write-read test."""

from __future__ import annotations

import base64
import sys
import time

import click

from bk.cli.common import fail
from bk.cli.shell.base import (
    cli, confirm, Counting, handled, json_opt, json_out, LEDGER_ID, pass_ctx,
    printable, PROG
)


def _md_dict(md) -> dict:
    d = md.to_dict()
    d.pop("passwordDigest", None)    # secrets stay out of listings
    d.pop("masterKey", None)
    d["customMetadata"] = {k: _show_bytes(v) for k, v in md.custom_metadata.items()}
    return d


def _show_bytes(b: bytes) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(b).decode("ascii")


def _md_line(md) -> str:
    ens = " ".join(f"{first}:[{','.join(b)}]" for first, b in md.ensembles)
    return (f"{md.ledger_id}\t{md.state.value}\tE={md.ensemble_size} Qw={md.write_quorum_size} "
            f"Qa={md.ack_quorum_size}\tlast={md.last_entry_id}\tlength={md.length}\t{ens}")


@cli.command()
@click.option("--meta", is_flag=True, help="Show each ledger's metadata on its line.")
@json_opt
@pass_ctx
@handled
def listledgers(c, meta, as_json):
    """List ledger ids (decimal, ascending), optionally with their metadata.

    Over many ledgers it counts on stderr (every 1000 ledgers and every second).

    \b
    Examples:
      bkshell listledgers
      bkshell listledgers --meta
    """
    count = Counting("listledgers", "ledgers read")
    rows = []
    with c.admin() as a:
        # text is printed as it is read (a million ledgers need not fit in memory);
        # --json is one document, printed at the end
        for item in count.over(a.list_ledger_metadata() if meta else a.list_ledgers()):
            if as_json:
                rows.append(_md_dict(item) if meta else item)
            else:
                click.echo(_md_line(item) if meta else item)
    count.done()
    if as_json:
        json_out(rows)


@cli.command()
@click.argument("ledger_id", type=LEDGER_ID)
@json_opt
@pass_ctx
@handled
def ledgermetadata(c, ledger_id, as_json):
    """Show one ledger's metadata (state, quorums, ensembles, ...).

    \b
    Example:
      bkshell ledgermetadata 42 --json
    """
    with c.admin() as a:
        md = a.ledger_metadata(ledger_id)
    d = _md_dict(md)
    if as_json:
        return json_out(d)
    click.echo(f"ledger {md.ledger_id}")
    click.echo(f"  state            {md.state.value}")
    click.echo(f"  quorums          E={md.ensemble_size} Qw={md.write_quorum_size} "
               f"Qa={md.ack_quorum_size}")
    click.echo(f"  last entry       {md.last_entry_id}")
    click.echo(f"  length           {md.length}")
    click.echo(f"  digest type      {md.digest_type}")
    click.echo(f"  created          {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(md.ctime))}")
    click.echo("  ensembles")
    for first, bookies in md.ensembles:
        click.echo(f"    from entry {first}: {', '.join(bookies)}")
    for k, v in sorted(d["customMetadata"].items()):
        click.echo(f"  custom {k} = {v}")


@cli.command()
@click.argument("ledger_id", type=LEDGER_ID)
@click.option("--from", "first", default=0, show_default=True, type=click.IntRange(min=0),
              help="First entry id.")
@click.option("--to", "last", default=None, type=int,
              help="Last entry id (inclusive). Default: the last entry.")
@click.option("--format", "fmt", type=click.Choice(["text", "hex", "raw"]), default="text",
              show_default=True, help="text: one line per entry; hex: hex dump; raw: payload "
                                      "bytes only, concatenated.")
@json_opt
@pass_ctx
@handled
def readledger(c, ledger_id, first, last, fmt, as_json):
    """Print entries of a ledger, read straight from its bookies (no fencing).

    Checksums of crc32/crc32c ledgers are verified. For a ledger that is not
    closed, reading stops at the first entry no replica has.

    \b
    Examples:
      bkshell readledger 42
      bkshell readledger 42 --from 10 --to 19 --format hex
      bkshell readledger 42 --format raw > ledger42.bin
    """
    if last is not None and last < first:
        raise click.BadParameter(f"--to {last} is before --from {first}")
    out = sys.stdout.buffer
    rows = []
    with c.admin() as a:
        for eid, data in a.read_entries(ledger_id, first, last):
            if as_json:
                rows.append({"entry_id": eid, "length": len(data),
                             "data": base64.b64encode(data).decode("ascii")})
            elif fmt == "raw":
                out.write(data)
            elif fmt == "hex":
                click.echo(f"--- ledger {ledger_id} entry {eid} ({len(data)} bytes) ---")
                for off in range(0, len(data), 16):
                    chunk = data[off:off + 16]
                    text = "".join(chr(ch) if 32 <= ch < 127 else "." for ch in chunk)
                    click.echo(f"{off:08x}  {chunk.hex(' '):<47}  {text}")
            else:
                text = data.decode("utf-8", "backslashreplace")
                click.echo(f"{eid}\t{printable(text)}")
    if as_json:
        json_out(rows)
    elif fmt == "raw":
        out.flush()


@cli.command()
@click.argument("ledger_id", type=LEDGER_ID)
@click.option("--force", "-f", "--yes", "-y", "yes", is_flag=True,
              help="Do not ask for confirmation (on a terminal).")
@json_opt
@pass_ctx
@handled
def deleteledger(c, ledger_id, yes, as_json):
    """Delete a ledger (its metadata; bookies garbage-collect its entries).

    On a terminal it shows the ledger and asks first, unless --force/--yes;
    without a terminal on stdin (a script) it deletes without asking.

    \b
    --json: the ledger deleted, with the state, last entry and length it had.

    \b
    Examples:
      bkshell deleteledger 42
      bkshell deleteledger 42 --force          # no question
      bkshell deleteledger 42 --yes --json
    """
    with c.admin() as a:
        md = a.ledger_metadata(ledger_id)           # a missing ledger fails before asking
        confirm(f"Delete ledger {ledger_id} ({md.state.value}, last entry "
                 f"{md.last_entry_id}, {md.length} bytes)?", yes)
        a.delete_ledger(ledger_id)
    if as_json:
        return json_out({"ledger": ledger_id, "deleted": True, "state": md.state.value,
                          "last_entry_id": md.last_entry_id, "length": md.length})
    click.echo(f"deleted ledger {ledger_id}")


@cli.command()
@click.option("--entries", "-n", default=100, show_default=True, type=click.IntRange(min=1))
@click.option("--ensemble", "-e", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--write-quorum", "-w", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--ack-quorum", "-a", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--entry-size", default=100, show_default=True, type=click.IntRange(min=1))
@click.option("--keep", is_flag=True, help="Keep the ledger (default: delete it at the end).")
@json_opt
@pass_ctx
@handled
def simpletest(c, entries, ensemble, write_quorum, ack_quorum, entry_size, keep, as_json):
    """Write N entries to a new ledger through the client, read them back, verify.

    \b
    Example:
      bkshell simpletest --entries 1000 --ensemble 3 --write-quorum 3 --ack-quorum 2
    """
    pw = b"bkshell-simpletest"
    t0 = time.monotonic()
    with c.client() as client:
        lh = client.create_ledger(ensemble, write_quorum, ack_quorum, password=pw,
                                  custom_metadata={"application": b"bkshell-simpletest"})
        lid = lh.ledger_id
        payloads = [(b"entry %d of bkshell simpletest " % i * (entry_size // 30 + 1))
                    [:entry_size] for i in range(entries)]
        try:
            last = lh.add_entries(payloads)
            lh.close()
        except (KeyboardInterrupt, Exception):
            # the test ledger stays: say which, so that it can be deleted
            click.echo(f"simpletest: ledger {lid} is left behind (delete it: bkshell "
                       f"deleteledger {lid} --yes)", err=True)
            raise
        t_write = time.monotonic() - t0
        if not as_json:
            click.echo(f"{entries} entries written to ledger {lid}")
        rh = client.open_ledger_no_recovery(lid, password=pw)
        got = [e.data for e in rh.read_entries(0, last)]
        if got != payloads:
            bad = next(i for i, (g, p) in enumerate(zip(got + [None] * entries, payloads))
                       if g != p)
            fail(PROG, f"simpletest: entry {bad} of ledger {lid} read back differs from what "
                       f"was written")
        if not keep:
            client.delete_ledger(lid)
    res = {"ledger": lid, "entries": entries, "write_seconds": round(t_write, 3),
           "seconds": round(time.monotonic() - t0, 3), "verified": True, "deleted": not keep}
    if as_json:
        return json_out(res)
    click.echo(f"{entries} entries read back and verified"
               + ("" if keep else f"; ledger {lid} deleted"))
