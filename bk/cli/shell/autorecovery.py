"""Auto-recovery: under-replicated ledgers, the auditor, the lost-bookie delay,
and turning auto-recovery on and off."""

from __future__ import annotations

import time

import click

from bk.cli.common import fail
from bk.cli.shell.base import cli, handled, json_opt, json_out, pass_ctx, PROG


@cli.command()
@json_opt
@pass_ctx
@handled
def listunderreplicated(c, as_json):
    """List the ledgers marked under-replicated: the lost bookies they had, since
    when, and why a repair failed (it is retried later).

    \b
    Examples:
      bkshell listunderreplicated
      bkshell listunderreplicated --json
    """
    from bk.meta import underreplication as UR
    with c.admin() as a:
        rows = [{"ledger_id": lid, "missing": rec.get("missing", []), "ctime": rec.get("ctime"),
                 "error": rec.get("error"), "retryAt": rec.get("retryAt")}
                for lid, rec, _v in UR.list_marked(a.store)]
    if as_json:
        return json_out(rows)
    if not rows:
        click.echo("no under-replicated ledgers", err=True)
    for r in rows:
        line = f"{r['ledger_id']}\tmissing {','.join(r['missing'])}"
        if r["error"]:
            line += f"\tfailed: {r['error']}"
        click.echo(line)


@cli.command()
@json_opt
@pass_ctx
@handled
def whoisauditor(c, as_json):
    """Name the elected auditor (a bookie id, or a standalone autorecovery's id).

    Exits 1 when none is elected, with --json too (which then prints
    {"auditor": null, "epoch": null} before the error).

    \b
    Example:
      bkshell whoisauditor
    """
    from bk.meta import underreplication as UR
    with c.admin() as a:
        value, version = a.store.get_json(UR.AUDITOR)
    who = value.get("id") if isinstance(value, dict) else None
    if as_json:
        json_out({"auditor": who, "epoch": version if who else None})
    if who is None:
        fail(PROG, "no auditor is elected (is auto-recovery running anywhere?)")
    if not as_json:
        click.echo(who)


@cli.command()
@json_opt
@pass_ctx
@handled
def triggeraudit(c, as_json):
    """Audit now: the auditor marks the ledgers of every missing bookie at once,
    without waiting out lostBookieRecoveryDelay.

    \b
    Examples:
      bkshell triggeraudit
      bkshell triggeraudit --json
    """
    from bk.autorecovery.status import auditor_id
    from bk.meta import underreplication as UR
    with c.admin() as a:
        n = UR.settings(a.store).get("trigger", 0) + 1
        UR.update_settings(a.store, trigger=n)
        auditor = auditor_id(a.store)
    if as_json:
        return json_out({"triggered": True, "trigger": n, "auditor": auditor})
    click.echo("audit triggered" + ("" if auditor else
                                    " (no auditor is elected yet: it audits once one is)"))


@cli.command()
@click.option("--set", "seconds", type=click.IntRange(min=0), default=None,
              help="New delay in seconds for the whole cluster.")
@click.option("--clear", is_flag=True, help="Back to each process's lostBookieRecoveryDelay.")
@json_opt
@pass_ctx
@handled
def lostbookierecoverydelay(c, seconds, clear, as_json):
    """Show or set how long a bookie may be gone before its ledgers are marked
    under-replicated (cluster-wide; overrides lostBookieRecoveryDelay).

    \b
    Examples:
      bkshell lostbookierecoverydelay
      bkshell lostbookierecoverydelay --set 300
    """
    from bk.meta import underreplication as UR
    with c.admin() as a:
        if seconds is not None or clear:
            s = UR.update_settings(a.store, lostBookieRecoveryDelay=None if clear else seconds)
        else:
            s = UR.settings(a.store)
    delay = s.get("lostBookieRecoveryDelay")
    if as_json:
        return json_out({"lostBookieRecoveryDelay": delay})
    click.echo(f"{delay}" if delay is not None else
               "not set cluster-wide (each process's lostBookieRecoveryDelay applies)")


@cli.command()
@click.option("--enable", "mode", flag_value="enable", help="Resume auditing and replication.")
@click.option("--disable", "mode", flag_value="disable", help="Pause auditing and replication.")
@click.option("--status", "mode", flag_value="status", default=True, help="Show (the default).")
@json_opt
@pass_ctx
@handled
def autorecovery(c, mode, as_json):
    """Pause or resume auto-recovery for the whole cluster, or show its state.

    \b
    Examples:
      bkshell autorecovery --status
      bkshell autorecovery --disable      # e.g. during planned maintenance
    """
    from bk.autorecovery.status import status
    from bk.meta import underreplication as UR
    with c.admin() as a:
        if mode in ("enable", "disable"):
            UR.update_settings(a.store, enabled=mode == "enable")
        out = status(a.store)
    marked, checks = out["underReplicatedLedgers"], out["checks"]
    if as_json:
        return json_out(out)
    click.echo(f"auto-recovery {'enabled' if out['enabled'] else 'DISABLED'}; auditor "
               f"{out['auditor'] or 'none'}; {marked} under-replicated ledgers")
    for name in ("ledgers", "replicas"):
        r = checks.get(name)
        if r:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["at"]))
            click.echo(f"last {name} check: {when}, {r['ledgers']} ledgers in "
                       f"{r['seconds']:.1f}s, {r['marked']} marked")
        else:
            click.echo(f"last {name} check: never")
    r = checks.get("bookies")       # auditorPeriodicBookieCheckInterval
    if r:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["at"]))
        click.echo(f"last bookies check: {when}, {len(r['lost'])} lost "
                   f"({', '.join(r['lost']) or 'none'}), {r['marked']} marked")
    else:
        click.echo("last bookies check: never")
