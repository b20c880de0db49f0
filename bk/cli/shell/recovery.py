"""Fencing and recovery: recover or fence a ledger, recover or decommission a bookie."""

from __future__ import annotations

import click

from bk.cli.common import fail
from bk.cli.shell.base import (
    cli, confirm, handled, json_opt, json_out, LEDGER_ID, pass_ctx, PROG, progress
)


def _recover_one(c, ledger_id, as_json, verb):
    with c.admin() as a:
        md = a.recover_ledger(ledger_id)
    if as_json:
        return json_out({"ledger": ledger_id, "state": md.state.value,
                          "last_entry_id": md.last_entry_id, "length": md.length})
    click.echo(f"ledger {ledger_id} {verb} and closed: last entry {md.last_entry_id}, "
               f"length {md.length}")


@cli.command()
@click.argument("ledger_id", type=LEDGER_ID)
@json_opt
@pass_ctx
@handled
def recoverledger(c, ledger_id, as_json):
    """Recovery open: fence the ledger, recover its tail, close it; print the last entry.

    The writer (if any) fails on its next add. A closed ledger is left as is.

    \b
    Example:
      bkshell recoverledger 42
    """
    _recover_one(c, ledger_id, as_json, "recovered")


@cli.command()
@click.argument("ledger_id", type=LEDGER_ID)
@json_opt
@pass_ctx
@handled
def fenceledger(c, ledger_id, as_json):
    """Fence a ledger so its writer can add no more, then close it (= recoverledger).

    \b
    Example:
      bkshell fenceledger 42
    """
    _recover_one(c, ledger_id, as_json, "fenced")


def _print_plan(report):
    for f in report.fragments:
        click.echo(f"ledger {f.ledger_id} entries {f.first_entry}..{f.last_entry}: "
                   f"{f.entries} entries -> {f.replacement or 'NO REPLACEMENT'}"
                   + (f" (error: {f.error})" if f.error else ""))
    for lid in report.closed:
        click.echo(f"ledger {lid}: open, would be fenced and closed first")
    for lid in report.skipped_open:
        click.echo(f"ledger {lid}: open, skipped (--skip-open)")


def _waiting(label):
    """An on_wait callback printing at most one line per second on stderr."""
    state = {"t": -1.0}

    def cb(waited, bound, why):
        if waited - state["t"] >= 1.0 or waited >= bound:
            state["t"] = waited
            click.echo(f"{label} ({why}): {waited:.0f} of at most {bound:g} s", err=True)
    return cb


def _run_recover(c, bookie_id, dry_run, skip_open, as_json, decommission=False,
                 use_autorecovery=None, auditor_wait=0.0, rate_bytes=-1):
    with c.admin(rate_bytes=rate_bytes) as a:
        cb = None if as_json else progress(f"recovering {bookie_id}: ledgers")
        if decommission:
            report = a.decommission_bookie(
                bookie_id, progress=cb, use_autorecovery=use_autorecovery,
                auditor_wait=auditor_wait, on_path=lambda how: click.echo(how, err=True),
                on_wait=_waiting("waiting for an auditor"))
        else:
            report = a.recover_bookie(bookie_id, dry_run=dry_run, skip_open=skip_open,
                                      progress=cb)
    if as_json:
        json_out(report.to_dict())
    else:
        if dry_run:
            _print_plan(report)
        for lid in report.skipped_open:
            if not dry_run:
                click.echo(f"ledger {lid}: open, skipped (--skip-open)")
        for lid, err in report.failed.items():
            click.echo(f"ledger {lid}: FAILED: {err}", err=True)
        click.echo(report.summary())
    if report.failed:
        fail(PROG, f"recover {bookie_id}: {len(report.failed)} ledgers failed "
                   f"(first: {next(iter(report.failed.values()))}); re-run to retry")
    return report


@cli.command()
@click.argument("bookie_id")
@click.option("--dry-run", "-n", is_flag=True, help="Only list what would be done.")
@click.option("--skip-open", is_flag=True,
              help="Leave alone open ledgers whose last ensemble holds the bookie "
                   "(instead of fencing and closing them).")
@click.option("--yes", "-y", "--force", "-f", "yes", is_flag=True,
              help="Do not ask for confirmation (on a terminal).")
@json_opt
@pass_ctx
@handled
def recover(c, bookie_id, dry_run, skip_open, yes, as_json):
    """Re-replicate every ledger fragment that had BOOKIE_ID onto other bookies.

    Open ledgers whose last ensemble holds the bookie are fenced and closed
    first. Each entry the bookie held is copied from a surviving replica to a
    replacement bookie, then the fragment's ensemble is updated. Safe to
    interrupt and re-run; a second run finds nothing to do. Progress goes to
    stderr; Ctrl-C stops it (exit 130) and a re-run goes on from there.

    On a terminal it asks first (fencing ends the writers of open ledgers),
    unless --yes or --dry-run; a script is not asked.

    \b
    Examples:
      bkshell recover 127.0.0.1:3181 --dry-run
      bkshell recover 127.0.0.1:3181 --yes
    """
    if not dry_run:
        confirm(f"Re-replicate every fragment that had bookie {bookie_id}"
                 + ("" if skip_open else ", fencing and closing the open ledgers whose last "
                    "ensemble holds it (their writers fail)") + "?", yes)
    _run_recover(c, bookie_id, dry_run, skip_open, as_json)


# Bytes/s the shell copies a decommissioned bookie's data at when it copies itself
# and the conf sets no replicationRateByBytes: one process moving a whole bookie's
# data, unpaced, competes with the clients for the other bookies' disks and network
# (auto-recovery spreads the same work over its workers, each paced by that key).
DECOMMISSION_RATE = 32 << 20


@cli.command()
@click.argument("bookie_id")
@click.option("--autorecovery/--no-autorecovery", "use_ar", default=None,
              help="Let the cluster's replication workers copy (default when an auditor "
                   "is elected, or processes run auto-recovery and one is elected within "
                   "--auditor-wait), or copy from this process.")
@click.option("--auditor-wait", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds to wait for an auditor when processes run auto-recovery but none "
                   "is elected at that instant (a hand-over).")
@click.option("--rate-bytes", type=int, default=None,
              help="Bytes/s this process copies at when it copies itself (default: "
                   f"replicationRateByBytes of --conf if set, else {DECOMMISSION_RATE}; "
                   "<= 0: no limit).")
@click.option("--yes", "-y", "--force", "-f", "yes", is_flag=True,
              help="Do not ask for confirmation (on a terminal).")
@json_opt
@pass_ctx
@handled
def decommissionbookie(c, bookie_id, use_ar, auditor_wait, rate_bytes, yes, as_json):
    """Retire a stopped bookie: recover all its fragments, then delete its cookie.

    Refuses while the bookie is registered (running). When auto-recovery runs,
    its ledgers are marked under-replicated and the replication workers copy
    them (open ledgers after openLedgerRereplicationGracePeriod); this waits,
    showing progress, until none is left. A ledger the workers cannot repair
    ends it with an error; the cookie is then kept. When processes run
    auto-recovery but no auditor is elected at that instant (one stopped, the
    next not yet elected) it waits for one, up to --auditor-wait seconds. With
    no auto-recovery (or none elected by then, or --no-autorecovery) this
    process copies, paced to --rate-bytes. It says on stderr which it does.

    On a terminal it asks first, unless --yes; a script is not asked.

    \b
    Example:
      bookie stop --conf /etc/bk/bk_server.conf
      bkshell decommissionbookie 127.0.0.1:3181 --yes
    """
    confirm(f"Decommission bookie {bookie_id}: copy its data to other bookies, then "
             f"delete its cookie (it cannot rejoin with its data)?", yes)
    if rate_bytes is None:
        conf_rate = c.conf.replicationRateByBytes if c.conf_file else -1
        rate_bytes = conf_rate if conf_rate > 0 else DECOMMISSION_RATE
    report = _run_recover(c, bookie_id, False, False, as_json, decommission=True,
                          use_autorecovery=use_ar, auditor_wait=auditor_wait,
                          rate_bytes=rate_bytes)
    if not as_json:
        click.echo(f"bookie {bookie_id} decommissioned (cookie deleted)")
    return report
