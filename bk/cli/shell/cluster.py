"""Cluster-wide commands: the metadata store, bookies, racks and placement."""

from __future__ import annotations

import sys
import time

import click

from bk.cli.common import fail
from bk.cli.shell.base import (
    cli, Counting, handled, human_size, json_opt, json_out, pass_ctx, PROG
)


@cli.command()
@click.option("--force", is_flag=True, help="Delete everything under the prefix first.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation with --force.")
@json_opt
@pass_ctx
@handled
def metaformat(c, force, yes, as_json):
    """Create a cluster under the prefix: its layout and a new instanceId.

    Run it once before the first bookie starts: bookies never create a
    cluster, and a bookie refuses to start against a prefix without one.
    Without --force it refuses when anything exists under the prefix. With
    --force it deletes every ledger's metadata, cookie and registration first
    (asks unless --yes) and makes a new instanceId: bookies with data of the
    old cluster then refuse to start until wiped ('bookie format --force').

    \b
    --json: the URI, the new instanceId, and whether the prefix was wiped.

    \b
    Example:
      bkshell --metadata etcd://127.0.0.1:2379/ledgers metaformat --force --yes
    """
    uri = c.uri()
    if force and not yes:
        if not sys.stdin.isatty():
            fail(PROG, f"metaformat --force deletes all metadata under {uri}; pass --yes "
                       f"to confirm")
        click.confirm(f"Delete ALL ledger metadata, cookies and registrations under {uri}?",
                      abort=True, err=True)
    with c.admin(formatted=False) as a:
        instance = a.metaformat(force)
    if as_json:
        return json_out({"uri": uri, "instanceId": instance, "wiped": force})
    click.echo(f"formatted {uri}: cluster instanceId {instance}"
               + (" (previous content deleted)" if force else ""))


@cli.command()
@json_opt
@pass_ctx
@handled
def metastatus(c, as_json):
    """etcd's state: per endpoint its version, db size (the file, and the part of it
    in use: compaction frees space inside the file, defragmentation gives it back),
    revision and leadership; the revision history was last compacted to; raised
    alarms (NOSPACE); bk's elected compactor and its last compaction.

    \b
    Example:
      bkshell metastatus
    """
    from bk.meta import compactor, etcdversion
    from bk.meta.store import MetadataStore
    with MetadataStore(c.uri(), timeout=c.timeout, credentials=c.etcd()) as store:
        rows = store.etcd_status()
        for r in rows:
            r["warning"] = etcdversion.advice(r["version"])
        rec, _ = store.get_json(compactor.RECORD)
        leader, _ = store.get_json(compactor.ELECTION)
    out = {"endpoints": rows, "alarms": rows[0]["alarms"] if rows else [],
           "compactRevision": rows[0]["compactRevision"] if rows else None,
           "compactor": (leader or {}).get("id"), "lastCompaction": rec}
    if as_json:
        return json_out(out)
    for r in rows:
        click.echo(f"{r['endpoint']}\tetcd {r['version']}\tdb {human_size(r['dbSize'])} "
                   f"({human_size(r['dbSizeInUse'])} in use)\t"
                   f"revision {r['revision']}\t{'leader' if r['isLeader'] else 'follower'}")
    for r in rows:
        if r["warning"]:
            click.echo(f"warning: {r['endpoint']}: {r['warning']}", err=True)
    if rows:
        r = rows[0]
        kept = r["revision"] - r["compactRevision"]
        click.echo(f"history compacted to revision {r['compactRevision']} "
                   f"({kept} revisions kept)" if r["compactRevision"]
                   else "history never compacted")
    click.echo("alarms: " + (", ".join(out["alarms"]) if out["alarms"] else "none"))
    if out["alarms"]:
        click.echo("etcd refuses writes: run 'bkshell metacompact --defrag --disarm'", err=True)
    last = ""
    if isinstance(rec, dict) and rec.get("compacted"):
        last = (f", last compacted to {rec['compacted']} "
                f"{time.time() - rec.get('at', time.time()):.0f}s ago")
    click.echo(f"compactor: {out['compactor'] or 'none elected'}{last}")


@cli.command()
@click.option("--revision", type=click.IntRange(min=1), default=None,
              help="Compact to this revision (default: the current one).")
@click.option("--defrag", is_flag=True, help="Then defragment every member (gives the "
              "space back to the file system; each member blocks while it runs).")
@click.option("--disarm", is_flag=True, help="Then disarm raised alarms (NOSPACE), so etcd "
              "accepts writes again.")
@json_opt
@pass_ctx
@handled
def metacompact(c, revision, defrag, disarm, as_json):
    """Compact etcd's history now (and defragment, and disarm NOSPACE).

    The way out of etcd's NOSPACE alarm: 'metacompact --defrag --disarm'. Readers
    and watchers of an older revision are told it was compacted and start over.

    \b
    Example:
      bkshell metacompact --defrag --disarm
    """
    from bk.meta.store import MetadataStore
    # compacting physically and defragmenting a large db take minutes, not --timeout
    with MetadataStore(c.uri(), timeout=max(c.timeout, 600.0), credentials=c.etcd()) as store:
        before, in_use = store.db_sizes()
        target = revision or store.revision()
        store.compact(target, physical=True)
        out = {"compactedTo": target, "dbSizeBefore": before, "dbSizeInUseBefore": in_use}
        if defrag:
            store.defragment()
        out["dbSizeAfter"], out["dbSizeInUseAfter"] = store.db_sizes()
        out["disarmed"] = store.disarm_alarms() if disarm else []
        out["alarms"] = store.alarms()
    if as_json:
        return json_out(out)
    click.echo(f"compacted to revision {target}; db {human_size(before)} "
               f"({human_size(in_use)} in use) -> {human_size(out['dbSizeAfter'])} "
               f"({human_size(out['dbSizeInUseAfter'])} in use)"
               + ("" if defrag else " (defragment to give the space back: --defrag)"))
    if out["disarmed"]:
        click.echo("disarmed: " + ", ".join(out["disarmed"]))
    if out["alarms"]:
        click.echo("alarms still raised: " + ", ".join(out["alarms"]), err=True)


@cli.command()
@click.option("--readonly", "-ro", "mode", flag_value="readonly", help="Read-only bookies only.")
@click.option("--all", "-a", "mode", flag_value="all", help="Writable and read-only bookies.")
@json_opt
@pass_ctx
@handled
def listbookies(c, mode, as_json):
    """List registered bookies (writable ones by default): id, address, rack, state,
    and the HTTP endpoint of a bookie that serves one (httpServerEnabled).

    \b
    Example:
      bkshell listbookies --all
    """
    with c.admin() as a:
        rows = a.list_bookies(readonly=mode == "readonly", all=mode == "all")
    if as_json:
        return json_out(rows)
    if not rows:
        click.echo("no bookies", err=True)
    for r in rows:
        http = f"\thttp://{r['address'].rsplit(':', 1)[0]}:{r['httpPort']}" \
            if r.get("httpPort") else ""
        click.echo(f"{r['id']}\t{r['address']}\t{r['rack']}\t{r['state']}{http}")


@cli.command()
@click.argument("bookie_id")
@click.argument("rack")
@json_opt
@pass_ctx
@handled
def setrack(c, bookie_id, rack, as_json):
    """Put a bookie in a rack, /region/rack (a bare /rack is in /default-region).

    Rack-aware placement (ensemblePlacementPolicy=rackaware|regionaware) spreads
    each write quorum over racks from the next ensemble it chooses; existing
    ensembles stay as they are. Overrides the bookie's own bookieRack.

    A bookie that never started (not registered, no cookie) may be given its rack
    before its first start; a warning on stderr says so, since a typo in
    BOOKIE_ID looks the same. --json: the id, the rack stored, and whether
    the bookie is known (registered, or has a cookie).

    \b
    Examples:
      bkshell setrack 10.0.1.5:3181 /eu-west/rack-a
      bkshell setrack 10.0.1.5:3181 /eu-west/rack-a --json
    """
    with c.admin() as a:
        path = a.set_rack(bookie_id, rack)
        known = a.store.bookie_info(bookie_id) is not None or \
            a.store.read_cookie(bookie_id)[0] is not None
        registered = sorted(a.store.all_bookies()) if not known else []
    if not known:
        click.echo(f"warning: bookie {bookie_id} is not registered and has no cookie "
                   f"(registered: {', '.join(registered) or 'none'}): its rack applies when "
                   f"a bookie with this id starts", err=True)
    if as_json:
        return json_out({"id": bookie_id, "rack": path, "known": known})
    click.echo(f"{bookie_id}\t{path}")


@cli.command()
@click.option("--min-racks", type=click.IntRange(min=1), default=None,
              help="Racks each write quorum should span [minNumRacksPerWriteQuorum of --conf, "
                   "else 2].")
@click.option("--regions", is_flag=True, help="Check regions instead of racks (regionaware).")
@json_opt
@pass_ctx
@handled
def placementcheck(c, min_racks, regions, as_json):
    """List ledger fragments whose write quorums span fewer racks than
    rack-aware placement asks (where the racks with writable bookies could
    meet it): ledgers written before racks were set, or while racks were down.
    Exits 1 when there are any (with --json too). `recover BOOKIE_ID` moves a
    bookie's copies under the placement policy of --conf. Reads every ledger's
    metadata: it counts on stderr (every 1000 ledgers and every second).

    \b
    Example:
      bkshell placementcheck --min-racks 2 --json
    """
    from bk.client.placement import PlacementPolicy
    policy = PlacementPolicy("regionaware" if regions else "rackaware",
                             min_racks or c.conf.minNumRacksPerWriteQuorum)
    found = [0]
    count = Counting("placementcheck", "ledgers checked",
                      lambda: f", {found[0]} fragments not adhering")

    def progress(n, bad):
        found[0] = bad
        count(n)
    with c.admin() as a:
        rows = a.placement_check(policy, progress=progress)
    count.done()
    what = "regions" if regions else "racks"
    if as_json:
        json_out(rows)
    else:
        for r in rows:
            click.echo(f"ledger {r['ledger']} from entry {r['first_entry']}: "
                       f"{' '.join(r['ensemble'])} spans {r['racks']} of {r['min_racks']} "
                       f"{what}")
    if rows:
        fail(PROG, f"{len(rows)} fragments of {len({r['ledger'] for r in rows})} ledgers "
                   f"span fewer than {policy.min_racks} {what} (of {count.n} ledgers checked)")
    if not as_json:
        click.echo(f"every fragment of {count.n} ledgers adheres to the placement policy",
                   err=True)


@cli.command()
@click.argument("bookie_id")
@json_opt
@pass_ctx
@handled
def getrack(c, bookie_id, as_json):
    """Show a bookie's rack (/default-region/default-rack when none is stored).

    \b
    Example:
      bkshell getrack 10.0.1.5:3181 --json
    """
    with c.admin() as a:
        r = a.get_rack(bookie_id)
    if as_json:
        return json_out(r)
    click.echo(f"{r['id']}\t{r['rack']}" + ("" if r["stored"] else "\t(default)"))


@cli.command()
@click.argument("bookie_id", required=False)
@json_opt
@pass_ctx
@handled
def bookieinfo(c, bookie_id, as_json):
    """Free and total disk space (and counters) of each bookie, asked with GET_BOOKIE_INFO.

    Exits 1 when a bookie does not answer (after printing the others).

    \b
    Examples:
      bkshell bookieinfo
      bkshell bookieinfo 127.0.0.1:3181 --json
    """
    with c.admin() as a:
        rows = a.bookie_info(bookie_id)
    if as_json:
        json_out(rows)
    else:
        for r in rows:
            if "error" in r:
                click.echo(f"{r['id']}\tunreachable: {r['error']}")
            else:
                click.echo(f"{r['id']}\tfree {human_size(r['free_bytes'])}\ttotal "
                           f"{human_size(r['total_bytes'])}\tused {r['usage'] * 100:.1f}%\t"
                           f"{'readonly' if r['readonly'] else 'writable'}\t"
                           f"{r['ledgers']} ledgers\t{r['entries']} entries")
    bad = [r for r in rows if "error" in r]
    if bad and bookie_id:
        fail(PROG, rows[0]["error"])
    if bad:     # a check that exits 0 with bookies down would pass a monitoring script
        fail(PROG, f"{len(bad)} of {len(rows)} bookies did not answer (first: "
                   f"{bad[0]['error']})")


@cli.command()
@click.argument("bookie_id")
@click.option("--entries", default=10, show_default=True, type=click.IntRange(min=1))
@json_opt
@pass_ctx
@handled
def bookiesanity(c, bookie_id, entries, as_json):
    """Check one bookie: a ledger E=Qw=Qa=1 on exactly it, write, read back, delete.

    \b
    Example:
      bkshell bookiesanity 127.0.0.1:3181
    """
    with c.admin() as a:
        res = a.bookie_sanity(bookie_id, entries=entries)
    if as_json:
        return json_out(res)
    click.echo(f"bookie sanity test succeeded on {bookie_id}: wrote and read back "
               f"{res['entries']} entries (ledger {res['ledger']}, deleted) in "
               f"{res['seconds']:.3f}s")
