"""What every ``bkshell`` command shares: the ``cli`` group and its options, the
context (:class:`Ctx`: the URI, the metadata store, the admin facade, opened
once per command), one-line errors (:func:`handled`), ``--json`` (:func:`json_opt`,
:func:`json_out`), progress on stderr (:class:`Counting`, :func:`progress`) and the
question before destroying something (:func:`confirm`). The commands are in the
package's other modules, one per topic; :mod:`bk.cli.shell` imports them all."""


from __future__ import annotations

import json
import os
import sys
import time

import click

from bk.cli.common import fail, one_line_errors, setup_logging
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


def json_out(data) -> None:
    click.echo(json.dumps(data, indent=1, sort_keys=False, default=str))


def json_opt(fn):
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


def human_size(n) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024.0


# Items (ledgers) between two progress lines of a walk over many of them; a line
# also comes at least every second while the walk goes on.
PROGRESS_EVERY = 1000


class Counting:
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


def progress(label):
    """A progress callback printing at most one line per second on stderr."""
    state = {"t": 0.0}

    def cb(done, total, *_):
        now = time.monotonic()
        if done == total or now - state["t"] >= 1.0:
            state["t"] = now
            click.echo(f"{label}: {done}/{total}", err=True)
    return cb


def printable(text: str) -> str:
    """``text`` with control characters escaped, for one line of a terminal."""
    return "".join(ch if ch.isprintable() or ch == " " else repr(ch)[1:-1] for ch in text)


def confirm(question: str, yes: bool) -> None:
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




def main(argv=None):
    """Console entry point (``bkshell``); ``cli`` is the click group (for CliRunner)."""
    try:
        cli(args=argv, prog_name=PROG)
    except (BrokenPipeError, _PipeClosed):
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(EXIT_PIPE_CLOSED)

