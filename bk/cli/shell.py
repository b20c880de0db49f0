"""``bkshell``: the admin shell of a bk cluster (BookKeeper's ``bookkeeper shell``).

Every command is a thin layer over :mod:`bk.admin` (or the client): parse,
call, print. Data goes to stdout (``--json`` where the output is data: one
document), progress and errors to stderr; an error is one line and a non-zero
exit (the codes are in :mod:`bk.exitcodes`: 1 failed or a check found
problems, 2 a bad option, setting or file, 130 Ctrl-C, 141 stdout closed).
``--json`` changes only what stdout holds, never the exit code: a check that
finds problems, a missing auditor, a benchmark whose adds failed print their
document and then exit 1 with the same error line as the text form. A walk
over every ledger (``listledgers``, ``placementcheck``) counts on stderr
(:class:`_Counting`), with ``--json`` too. Commands that go
through the metadata store first check that the prefix holds a cluster.
Commands that destroy something ask on a terminal unless ``--yes``
(:func:`_confirm`); scripts (no terminal on stdin) are not asked.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time

import click

from bk.cli.common import fail, one_line_errors, setup_logging, until_interrupted
from bk.exitcodes import EXIT_CONFIG, EXIT_PIPE_CLOSED

PROG = "bkshell"
ENV_URI = "BK_METADATA_URI"


class Ctx:
    def __init__(self, metadata, conf_file, timeout, password):
        self.metadata = metadata
        self.conf_file = conf_file
        self.timeout = timeout
        self.password = password
        self._conf = None

    @property
    def conf(self):
        """The Config of --conf (defaults if none), loaded once."""
        if self._conf is None:
            from bk.config import Config
            self._conf = Config.load(self.conf_file)
        return self._conf

    def uri(self) -> str:
        uri = self.metadata
        if not uri and self.conf_file:
            uri = self.conf.metadataServiceUri
        if not uri:
            uri = os.environ.get(ENV_URI) or os.environ.get("BK_metadataServiceUri")
        if not uri:
            fail(PROG, f"no metadata service URI: pass --metadata etcd://host:port/ledgers, "
                       f"--conf FILE (with metadataServiceUri), or set {ENV_URI}", EXIT_CONFIG)
        from bk.meta.store import parse_metadata_uri
        parse_metadata_uri(uri)          # ValueError naming the URI
        return uri

    def etcd(self):
        """etcd's TLS and user of --conf (bk.security.etcd)."""
        from bk.security.etcd import EtcdCredentials
        return EtcdCredentials.from_conf(self.conf)

    def admin(self, rate_bytes: int = -1, formatted: bool = True):
        """An Admin of the cluster. ``formatted``: first check that the prefix holds a
        cluster (ClusterNotFormattedError naming metaformat otherwise). Without the
        check a typo in the prefix listed nothing and exited 0, and the commands that
        write a key (setrack, triggeraudit, autorecovery --disable, ...) wrote it
        under a prefix no bookie reads."""
        from bk.admin import Admin
        from bk.client.placement import PlacementPolicy
        # re-replication (recover, decommissionbookie) places by the conf's policy; TLS
        # and the token towards bookies come from the conf too
        a = Admin(self.uri(), timeout=self.timeout, password=self.password,
                  placement=PlacementPolicy.from_conf(self.conf), conf=self.conf,
                  rate_bytes=rate_bytes)
        if formatted:
            try:
                a.store.cluster()
            except BaseException:
                a.close()
                raise
        return a

    def client(self, **overrides):
        import bk
        return bk.BookKeeper(self.uri(), conf=self.conf,
                             metadataTimeoutMillis=int(self.timeout * 1000), **overrides)

    def need_conf(self, what: str):
        if not self.conf_file:
            fail(PROG, f"{what} inspects a bookie's own directories: pass --conf "
                       f"conf/bk_server.conf (the bookie's configuration file)", EXIT_CONFIG)
        return self.conf


pass_ctx = click.make_pass_decorator(Ctx)


class _PipeClosed(BaseException):
    """stdout was closed by the reader (``bkshell listledgers | head``): not an error."""


def handled(fn):
    """One-line errors (bk.cli.common), but a closed stdout pipe ends quietly."""
    import functools

    @functools.wraps(fn)
    def guard(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:
            raise _PipeClosed() from None
    return one_line_errors(PROG)(guard)


def _json_out(data) -> None:
    click.echo(json.dumps(data, indent=1, sort_keys=False, default=str))


def _json_opt(fn):
    return click.option("--json", "as_json", is_flag=True, help="Print JSON.")(fn)


def _ledger_id(value: str) -> int:
    try:
        lid = int(value, 10)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a ledger id (a decimal integer)")
    if not 0 <= lid < 2 ** 63:
        raise click.BadParameter(f"{value!r} is not a ledger id (0 <= id < 2**63)")
    return lid


class LedgerId(click.ParamType):
    name = "LEDGER_ID"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return _ledger_id(value)
        except click.BadParameter as e:
            self.fail(str(e), param, ctx)


LEDGER_ID = LedgerId()


def _size(n) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024.0


# Items (ledgers) between two progress lines of a walk over many of them; a line
# also comes at least every second while the walk goes on.
PROGRESS_EVERY = 1000


class _Counting:
    """Progress of a walk over many items, on stderr (stdout holds the data, and
    ``--json``'s document stays whole): ``LABEL: N UNIT[EXTRA]`` every
    :data:`PROGRESS_EVERY` items and at least every second, as BookKeeper's and
    Kafka's tools count; once any line was printed, a last one when it ends. A walk
    of fewer items than that, done within a second, prints nothing.

    A listing of millions goes through :meth:`over`, which looks at the count and
    the clock every 64 items only, and ``extra`` (a callable) is called only for
    a line that is printed: a clock read, a call and a string per item cost
    ~0.4 us, a third of what listing an id costs the client. Items come in pages,
    so a second is not overshot by much."""

    def __init__(self, label: str, unit: str, extra=None, every: int = PROGRESS_EVERY):
        self.label, self.unit, self.every = label, unit, every
        self.extra = extra or (lambda: "")
        self.n = 0
        self.shown = False
        self._t = time.monotonic()

    def __call__(self, n: int) -> None:
        self.n = n
        if n % self.every == 0 or time.monotonic() - self._t >= 1.0:
            self._t = time.monotonic()
            self.shown = True
            click.echo(f"{self.label}: {n} {self.unit}{self.extra()}", err=True)

    def over(self, items):
        """Yield ``items``, counting them."""
        n, every = self.n, self.every
        nxt = min(n + 64, (n // every + 1) * every)
        for item in items:
            yield item
            n += 1
            if n == nxt:
                self(n)
                nxt = min(n + 64, (n // every + 1) * every)
        self.n = n

    def done(self) -> None:
        if self.shown:
            click.echo(f"{self.label}: {self.n} {self.unit}{self.extra()}, done", err=True)


def _progress(label):
    """A progress callback printing at most one line per second on stderr."""
    state = {"t": 0.0}

    def cb(done, total, *_):
        now = time.monotonic()
        if done == total or now - state["t"] >= 1.0:
            state["t"] = now
            click.echo(f"{label}: {done}/{total}", err=True)
    return cb


def _confirm(question: str, yes: bool) -> None:
    """Ask before a command changes or destroys something, on a terminal only.

    ``yes`` (--yes / --force) skips the question. Without a terminal on stdin (a
    script, cron, a pipe) the command goes ahead as it always did: scripts written
    against earlier bk rely on it. An answer other than yes ends the command with
    exit 1 and nothing done."""
    if yes or not sys.stdin.isatty():
        return
    if not click.confirm(question, default=False, err=True):
        fail(PROG, "not confirmed: nothing was changed (pass --yes to skip the question)")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--metadata", "-m", metavar="URI", default=None,
              help="Metadata service URI, etcd://host:port[,host:port]/ledgers "
                   f"(else metadataServiceUri of --conf, else ${ENV_URI}).")
@click.option("--conf", "-c", "conf_file", type=click.Path(dir_okay=False), default=None,
              help="A bk configuration file (bk_server.conf): metadataServiceUri, and the "
                   "bookie's directories for lastmark / readjournal.")
@click.option("--timeout", default=5.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds to wait for the metadata store.")
@click.option("--password", default=None, envvar="BK_LEDGER_PASSWORD",
              help="Ledger password, only needed for ledgers whose metadata has no master key "
                   "(older bk) or to verify 'mac' digests [env BK_LEDGER_PASSWORD].")
@click.option("--log-level", default="WARNING", show_default=True,
              help="DEBUG, INFO, WARNING or ERROR (logs go to stderr).")
@click.pass_context
def cli(ctx, metadata, conf_file, timeout, password, log_level):
    """Administer a bk cluster: bookies, ledgers, recovery, benchmarks.

    \b
    Examples:
      bkshell --metadata etcd://127.0.0.1:2379/ledgers listbookies --all
      export BK_METADATA_URI=etcd://127.0.0.1:2379/ledgers
      bkshell listledgers --meta
      bkshell simpletest --entries 100
      bkshell recover 127.0.0.1:3181 --dry-run
      bkshell --conf conf/bk_server.conf lastmark
    """
    try:
        setup_logging(log_level)
    except Exception as e:
        fail(PROG, str(e), EXIT_CONFIG)
    ctx.obj = Ctx(metadata, conf_file, timeout,
                  password.encode("utf-8") if password is not None else None)


# --- cluster -----------------------------------------------------------------------

@cli.command()
@click.option("--force", is_flag=True, help="Delete everything under the prefix first.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation with --force.")
@_json_opt
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
        return _json_out({"uri": uri, "instanceId": instance, "wiped": force})
    click.echo(f"formatted {uri}: cluster instanceId {instance}"
               + (" (previous content deleted)" if force else ""))


@cli.command()
@_json_opt
@pass_ctx
@handled
def metastatus(c, as_json):
    """etcd's state: per endpoint its version, db size, revision and leadership; the
    revision history was last compacted to; raised alarms (NOSPACE); bk's elected
    compactor and its last compaction.

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
        return _json_out(out)
    for r in rows:
        click.echo(f"{r['endpoint']}\tetcd {r['version']}\tdb {_size(r['dbSize'])}\t"
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
@_json_opt
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
        before = store.db_size()
        target = revision or store.revision()
        store.compact(target, physical=True)
        out = {"compactedTo": target, "dbSizeBefore": before}
        if defrag:
            store.defragment()
        out["dbSizeAfter"] = store.db_size()
        out["disarmed"] = store.disarm_alarms() if disarm else []
        out["alarms"] = store.alarms()
    if as_json:
        return _json_out(out)
    click.echo(f"compacted to revision {target}; db {_size(before)} -> "
               f"{_size(out['dbSizeAfter'])}" + ("" if defrag else " (defragment to give the "
                                                  "space back: --defrag)"))
    if out["disarmed"]:
        click.echo("disarmed: " + ", ".join(out["disarmed"]))
    if out["alarms"]:
        click.echo("alarms still raised: " + ", ".join(out["alarms"]), err=True)


@cli.command()
@click.option("--readonly", "-ro", "mode", flag_value="readonly", help="Read-only bookies only.")
@click.option("--all", "-a", "mode", flag_value="all", help="Writable and read-only bookies.")
@_json_opt
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
        return _json_out(rows)
    if not rows:
        click.echo("no bookies", err=True)
    for r in rows:
        http = f"\thttp://{r['address'].rsplit(':', 1)[0]}:{r['httpPort']}" \
            if r.get("httpPort") else ""
        click.echo(f"{r['id']}\t{r['address']}\t{r['rack']}\t{r['state']}{http}")


@cli.command()
@click.argument("bookie_id")
@click.argument("rack")
@_json_opt
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
        return _json_out({"id": bookie_id, "rack": path, "known": known})
    click.echo(f"{bookie_id}\t{path}")


@cli.command()
@click.option("--min-racks", type=click.IntRange(min=1), default=None,
              help="Racks each write quorum should span [minNumRacksPerWriteQuorum of --conf, "
                   "else 2].")
@click.option("--regions", is_flag=True, help="Check regions instead of racks (regionaware).")
@_json_opt
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
    count = _Counting("placementcheck", "ledgers checked",
                      lambda: f", {found[0]} fragments not adhering")

    def progress(n, bad):
        found[0] = bad
        count(n)
    with c.admin() as a:
        rows = a.placement_check(policy, progress=progress)
    count.done()
    what = "regions" if regions else "racks"
    if as_json:
        _json_out(rows)
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
@_json_opt
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
        return _json_out(r)
    click.echo(f"{r['id']}\t{r['rack']}" + ("" if r["stored"] else "\t(default)"))


@cli.command()
@click.argument("bookie_id", required=False)
@_json_opt
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
        _json_out(rows)
    else:
        for r in rows:
            if "error" in r:
                click.echo(f"{r['id']}\tunreachable: {r['error']}")
            else:
                click.echo(f"{r['id']}\tfree {_size(r['free_bytes'])}\ttotal "
                           f"{_size(r['total_bytes'])}\tused {r['usage'] * 100:.1f}%\t"
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
@_json_opt
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
        return _json_out(res)
    click.echo(f"bookie sanity test succeeded on {bookie_id}: wrote and read back "
               f"{res['entries']} entries (ledger {res['ledger']}, deleted) in "
               f"{res['seconds']:.3f}s")


# --- ledgers -------------------------------------------------------------------------

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
@_json_opt
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
    count = _Counting("listledgers", "ledgers read")
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
        _json_out(rows)


@cli.command()
@click.argument("ledger_id", type=LEDGER_ID)
@_json_opt
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
        return _json_out(d)
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
@_json_opt
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
                click.echo(f"{eid}\t{_printable(text)}")
    if as_json:
        _json_out(rows)
    elif fmt == "raw":
        out.flush()


def _printable(text: str) -> str:
    return "".join(ch if ch.isprintable() or ch == " " else repr(ch)[1:-1] for ch in text)


@cli.command()
@click.argument("ledger_id", type=LEDGER_ID)
@click.option("--force", "-f", "--yes", "-y", "yes", is_flag=True,
              help="Do not ask for confirmation (on a terminal).")
@_json_opt
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
        _confirm(f"Delete ledger {ledger_id} ({md.state.value}, last entry "
                 f"{md.last_entry_id}, {md.length} bytes)?", yes)
        a.delete_ledger(ledger_id)
    if as_json:
        return _json_out({"ledger": ledger_id, "deleted": True, "state": md.state.value,
                          "last_entry_id": md.last_entry_id, "length": md.length})
    click.echo(f"deleted ledger {ledger_id}")


@cli.command()
@click.option("--entries", "-n", default=100, show_default=True, type=click.IntRange(min=1))
@click.option("--ensemble", "-e", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--write-quorum", "-w", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--ack-quorum", "-a", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--entry-size", default=100, show_default=True, type=click.IntRange(min=1))
@click.option("--keep", is_flag=True, help="Keep the ledger (default: delete it at the end).")
@_json_opt
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
        return _json_out(res)
    click.echo(f"{entries} entries read back and verified"
               + ("" if keep else f"; ledger {lid} deleted"))


# --- fencing and recovery ------------------------------------------------------------------

def _recover_one(c, ledger_id, as_json, verb):
    with c.admin() as a:
        md = a.recover_ledger(ledger_id)
    if as_json:
        return _json_out({"ledger": ledger_id, "state": md.state.value,
                          "last_entry_id": md.last_entry_id, "length": md.length})
    click.echo(f"ledger {ledger_id} {verb} and closed: last entry {md.last_entry_id}, "
               f"length {md.length}")


@cli.command()
@click.argument("ledger_id", type=LEDGER_ID)
@_json_opt
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
@_json_opt
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
        cb = None if as_json else _progress(f"recovering {bookie_id}: ledgers")
        if decommission:
            report = a.decommission_bookie(
                bookie_id, progress=cb, use_autorecovery=use_autorecovery,
                auditor_wait=auditor_wait, on_path=lambda how: click.echo(how, err=True),
                on_wait=_waiting("waiting for an auditor"))
        else:
            report = a.recover_bookie(bookie_id, dry_run=dry_run, skip_open=skip_open,
                                      progress=cb)
    if as_json:
        _json_out(report.to_dict())
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
@_json_opt
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
        _confirm(f"Re-replicate every fragment that had bookie {bookie_id}"
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
@_json_opt
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
    _confirm(f"Decommission bookie {bookie_id}: copy its data to other bookies, then "
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


# --- local inspection ------------------------------------------------------------------------

@cli.command()
@_json_opt
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
        return _json_out(rows)
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
@_json_opt
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


# --- benchmarks ---------------------------------------------------------------------------

# --- logs (bk.log) -----------------------------------------------------------------
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
        click.echo(f"{rec.position}\t{_printable(rec.data.decode('utf-8', 'backslashreplace'))}")


# --- auto-recovery ---------------------------------------------------------------------

@cli.command()
@_json_opt
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
        return _json_out(rows)
    if not rows:
        click.echo("no under-replicated ledgers", err=True)
    for r in rows:
        line = f"{r['ledger_id']}\tmissing {','.join(r['missing'])}"
        if r["error"]:
            line += f"\tfailed: {r['error']}"
        click.echo(line)


@cli.command()
@_json_opt
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
        _json_out({"auditor": who, "epoch": version if who else None})
    if who is None:
        fail(PROG, "no auditor is elected (is auto-recovery running anywhere?)")
    if not as_json:
        click.echo(who)


@cli.command()
@_json_opt
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
        return _json_out({"triggered": True, "trigger": n, "auditor": auditor})
    click.echo("audit triggered" + ("" if auditor else
                                    " (no auditor is elected yet: it audits once one is)"))


@cli.command()
@click.option("--set", "seconds", type=click.IntRange(min=0), default=None,
              help="New delay in seconds for the whole cluster.")
@click.option("--clear", is_flag=True, help="Back to each process's lostBookieRecoveryDelay.")
@_json_opt
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
        return _json_out({"lostBookieRecoveryDelay": delay})
    click.echo(f"{delay}" if delay is not None else
               "not set cluster-wide (each process's lostBookieRecoveryDelay applies)")


@cli.command()
@click.option("--enable", "mode", flag_value="enable", help="Resume auditing and replication.")
@click.option("--disable", "mode", flag_value="disable", help="Pause auditing and replication.")
@click.option("--status", "mode", flag_value="status", default=True, help="Show (the default).")
@_json_opt
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
        return _json_out(out)
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


@cli.command()
@_json_opt
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
        return _json_out(names)
    for n in names:
        click.echo(n)


@cli.command()
@click.argument("name", callback=lambda ctx, p, v: _log_name(v))
@_json_opt
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
        return _json_out(info.to_dict())
    click.echo(f"log {info.name}: epoch {info.epoch}, {info.records} records, "
               f"{_size(info.bytes)}, first {info.first_position or '-'}, "
               f"last {info.last_position or '-'}"
               + (f", truncated before {info.truncated_before}" if info.truncated_before
                  else ""))
    for s in info.segments:
        click.echo(f"  segment {s['segment']}\tledger {s['ledger_id']}\t{s['state']}\t"
                   f"last entry {s['last_entry_id']}\t{s['records']} records\t"
                   f"{_size(s['bytes'])}")


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
@_json_opt
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
@_json_opt
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
@_json_opt
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
        _confirm(f"Drop the records of log {info.name} before {before} (of "
                 f"{info.records} records, first {info.first_position or '-'})?", yes)
        deleted = cl.truncate_log(name, before=before)
    if as_json:
        return _json_out({"name": name, "truncated_before": str(before),
                          "deleted_ledgers": deleted})
    click.echo(f"truncated log {name} before {before}; deleted "
               f"{len(deleted)} ledger(s){': ' if deleted else ''}"
               f"{' '.join(map(str, deleted))}")


@cli.command()
@click.argument("name", callback=lambda ctx, p, v: _log_name(v))
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (on a terminal).")
@_json_opt
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
        _confirm(f"Delete log {info.name}: {info.records} records in "
                 f"{len(info.segments)} ledgers?", yes)
        deleted = cl.delete_log(name)
    if as_json:
        return _json_out({"name": name, "deleted_ledgers": deleted})
    click.echo(f"deleted log {name} and {len(deleted)} ledger(s)")


@cli.command()
@click.option("--spark", "master", default="local[2]", show_default=True, metavar="MASTER",
              help="The Spark master to run the check on.")
@click.option("--partitions", type=click.IntRange(min=1), default=None,
              help="Parallel partitions of ledgers (default: twice Spark's parallelism).")
@_json_opt
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
        _json_out({"problems": len(rows), "rows": rows})
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
@_json_opt
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
        return _json_out({"dry_run": dry_run, "deleted": result, "still_pending": left})
    verb = "would delete" if dry_run else "deleted"
    for name, lids in result.items():
        if lids:
            click.echo(f"log {name}: {verb} {len(lids)} staging ledger(s): "
                       f"{', '.join(map(str, lids))}")
    total = sum(map(len, result.values()))
    click.echo(f"{verb} {total} staging ledger(s); {left} registered staging ledger(s) left "
               f"(in flight, or not old enough)")


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
@_json_opt
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
        _json_out(r)
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
@_json_opt
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
        return _json_out(runs if compare else runs[0])
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
@_json_opt
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
        return _json_out(r)
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
@_json_opt
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
        return _json_out(r)
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
@_json_opt
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
            return _json_out(r)
        click.echo(format_catchup(r))
        return None
    rows = bench_scale([parse_count(x) for x in steps.split(",")], entry_size=entry_size,
                       ledgers=ledgers, rate=rate, rate_seconds=rate_seconds,
                       catchup_entries=catchup_entries, base_dir=base_dir, conf=overrides,
                       report=lambda line: click.echo(line, err=as_json))
    if as_json:
        return _json_out(rows)


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
@_json_opt
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
        _json_out(r)
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


# --- security (bk.security) -----------------------------------------------------------

@cli.group()
def tokens():
    """Signed tokens (HS256) for authProvider=token: the secret key, then a token per role.

    \b
    Example:
      bkshell tokens create-secret-key -o /etc/bk/token.key
      bkshell tokens create -k /etc/bk/token.key --subject app1 --expiry-time 86400
    """


@tokens.command("create-secret-key")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False),
              help="File to write the key to (base64; created with mode 0600).")
@click.option("--rotate", is_flag=True,
              help="OUTPUT exists: put a new key first (it signs from now on) and keep "
                   "the others (they still verify until removed).")
@handled
def tokens_create_secret_key(output, rotate):
    """Make a new random 256-bit key (tokenSecretKeyFile of the bookies).

    \b
    Rotation: bkshell tokens create-secret-key --rotate -o token.key, copy the file
    to every bookie (picked up without a restart), issue new tokens, then
    bkshell tokens remove-secret-key --key-id OLD -k token.key and copy it again.

    \b
    Example:
      bkshell tokens create-secret-key --output /etc/bk/token.key
    """
    from bk.security import auth
    exists = os.path.exists(output)
    if exists and not rotate:
        fail(PROG, f"{output} exists: a new key would invalidate every token signed with it; "
                   f"use --rotate to add one, or remove the file first", EXIT_CONFIG)
    if rotate and not exists:
        fail(PROG, f"{output} does not exist: nothing to rotate", EXIT_CONFIG)
    old = auth.read_secret_keys(output, "--output") if exists else []
    key = auth.create_secret_key()
    auth.write_secret_keys(output, [key] + old)
    click.echo(f"wrote a new secret key {auth.key_id(key)} to {output}"
               + (f" (signs from now on; {len(old)} older keys still verify)" if old else ""),
               err=True)


@tokens.command("list-secret-keys")
@click.option("--secret-key-file", "-k", required=True, type=click.Path(dir_okay=False))
@_json_opt
@handled
def tokens_list_secret_keys(secret_key_file, as_json):
    """The ids (kid) of the keys of a key file; the first signs. Never the keys.

    \b
    Example:
      bkshell tokens list-secret-keys -k /etc/bk/token.key --json
    """
    from bk.security import auth
    kids = [auth.key_id(k) for k in auth.read_secret_keys(secret_key_file, "--secret-key-file")]
    if as_json:
        _json_out([{"kid": k, "signs": i == 0} for i, k in enumerate(kids)])
        return
    for i, k in enumerate(kids):
        click.echo(f"{k}  {'signs and verifies' if i == 0 else 'verifies'}")


@tokens.command("remove-secret-key")
@click.option("--secret-key-file", "-k", required=True, type=click.Path(dir_okay=False))
@click.option("--key-id", required=True, help="The kid (list-secret-keys) to remove.")
@handled
def tokens_remove_secret_key(secret_key_file, key_id):
    """Remove a key: the tokens it signed are refused once bookies load the file.

    \b
    Example:
      bkshell tokens remove-secret-key -k /etc/bk/token.key --key-id 3f9c0a1b
    """
    from bk.security import auth
    keys = auth.read_secret_keys(secret_key_file, "--secret-key-file")
    left = [k for k in keys if auth.key_id(k) != key_id]
    if len(left) == len(keys):
        fail(PROG, f"no key {key_id} in {secret_key_file}", EXIT_CONFIG)
    if not left:
        fail(PROG, f"{key_id} is the only key of {secret_key_file}: add one first "
                   f"(create-secret-key --rotate)", EXIT_CONFIG)
    auth.write_secret_keys(secret_key_file, left)
    click.echo(f"removed key {key_id} from {secret_key_file}; "
               f"{auth.key_id(left[0])} signs", err=True)


@tokens.command("create")
@click.option("--secret-key-file", "-k", required=True, type=click.Path(dir_okay=False),
              help="The key made by create-secret-key (its first key signs).")
@click.option("--subject", "-s", required=True, help="The role the token stands for.")
@click.option("--expiry-time", type=click.FloatRange(min=1), default=None,
              help="Seconds until the token expires (default: never).")
@handled
def tokens_create(secret_key_file, subject, expiry_time):
    """Print a token for role SUBJECT (give it to the client as authToken or in a file
    named by authTokenFile). Without --expiry-time it never expires.

    \b
    Example:
      bkshell tokens create -k /etc/bk/token.key -s app1 --expiry-time 86400 > app1.token
    """
    from bk.security import auth
    from bk.security.tokens import create_token
    key = auth.read_secret_key(secret_key_file, "--secret-key-file")
    click.echo(create_token(key, subject, expiry_time))


@tokens.command("show")
@click.argument("token")
@handled
def tokens_show(token):
    """What a token claims (subject, id, expiry, signing key id), as JSON; its
    signature is NOT checked.

    \b
    Example:
      bkshell tokens show "$(cat app1.token)"
    """
    from bk.security.tokens import describe_token
    _json_out(describe_token(token))


@tokens.command("revoke")
@click.option("--revocation-file", "-r", required=True, type=click.Path(dir_okay=False),
              help="The bookies' tokenRevocationFile (made if missing).")
@click.option("--token", "-t", help="Revoke this token.")
@click.option("--token-file", type=click.Path(dir_okay=False, exists=True),
              help="Revoke the token in this file.")
@click.option("--subject", "-s", help="Revoke every token of this role.")
@handled
def tokens_revoke(revocation_file, token, token_file, subject):
    """Add a token (or every token of a role) to a revocation file; bookies refuse it
    from its next connection once they loaded the file, and close its open ones.

    \b
    Examples:
      bkshell tokens revoke -r /etc/bk/revoked --token-file app1.token
      bkshell tokens revoke -r /etc/bk/revoked --subject app1
    """
    from bk.security import auth
    from bk.security.tokens import token_id, unverified_claims
    if sum(x is not None for x in (token, token_file, subject)) != 1:
        fail(PROG, "give one of --token, --token-file, --subject", EXIT_CONFIG)
    if token_file:
        with open(token_file, encoding="utf-8") as f:
            token = f.read().strip()
    if token is not None:
        kind, value = "jti", token_id(token, unverified_claims(token))
    else:
        kind, value = "sub", subject
    added = auth.add_revocation(revocation_file, kind, value)
    click.echo(f"{'revoked' if added else 'already revoked'}: {kind} {value} "
               f"({revocation_file})", err=True)


def main(argv=None):
    """Console entry point (``bkshell``); ``cli`` is the click group (for CliRunner)."""
    try:
        cli(args=argv, prog_name=PROG)
    except (BrokenPipeError, _PipeClosed):
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(EXIT_PIPE_CLOSED)


if __name__ == "__main__":
    main()
