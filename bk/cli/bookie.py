"""``bookie``: start, stop, inspect and format a bookie; run a local cluster."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

# The arbiter forks shard workers (and restarts them) while its etcd client's gRPC
# threads run. gRPC's own fork handlers then wait in fork() for those threads, which
# wait for the GIL that fork() holds: the bookie hung at start, seen with TLS to etcd.
# Workers never use gRPC, so they need none of its fork handling: turn it off before
# gRPC starts in this process.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import click  # noqa: E402

from bk.bookie import layout  # noqa: E402
from bk.bookie.storage import Tombstones  # noqa: E402
from bk.bookie.upgrade import needs_upgrade, upgrade_shard  # noqa: E402
from bk.cli.common import fail, one_line_errors, setup_logging  # noqa: E402
from bk.config import Config  # noqa: E402
from bk.exitcodes import EXIT_CONFIG, EXIT_NOT_RUNNING  # noqa: E402
from bk.util import pid_alive  # noqa: E402

PROG = "bookie"

# Command-line flags that override configuration keys (flag -> key).
_FLAG_KEYS = {
    "port": "bookiePort", "journal_dir": "journalDirectories",
    "ledger_dir": "ledgerDirectories", "metadata": "metadataServiceUri",
    "bookie_id": "bookieId", "shards": "numShards", "advertised_address": "advertisedAddress",
    "pid_file": "pidFile", "log_file": "logFile", "log_level": "logLevel",
}


def _conf_options(fn):
    fn = click.option("--conf", "-c", "conf_file", type=click.Path(dir_okay=False),
                      envvar="BK_CONF", help="Configuration file (key=value lines).")(fn)
    fn = click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
                      help="Override any configuration key; repeatable.")(fn)
    return fn


def _override_options(fn):
    for flag, key, typ in reversed([
        ("--port", "port", int), ("--journal-dir", "journal_dir", str),
        ("--ledger-dir", "ledger_dir", str), ("--metadata", "metadata", str),
        ("--bookie-id", "bookie_id", str), ("--shards", "shards", int),
        ("--advertised-address", "advertised_address", str), ("--pid-file", "pid_file", str),
        ("--log-file", "log_file", str), ("--log-level", "log_level", str),
    ]):
        fn = click.option(flag, key, type=typ, default=None,
                          help=f"Override {_FLAG_KEYS[key]}.")(fn)
    return fn


def parse_settings(settings) -> dict:
    """``--set KEY=VALUE`` options as a dict (values are validated by Config)."""
    overrides = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--set")
        overrides[key.strip()] = value
    return overrides


def load_conf(conf_file, settings=(), **flags) -> Config:
    overrides = parse_settings(settings)
    for name, value in flags.items():
        if value is not None and name in _FLAG_KEYS:
            overrides[_FLAG_KEYS[name]] = value
    return Config.load(conf_file, overrides)


def _read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def running_pid(conf: Config) -> int | None:
    pid = _read_pid(conf.pid_file)
    return pid if pid and pid_alive(pid) else None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Run and manage a bk bookie (a storage server of ledger entries).

    \b
    Examples:
      bookie localcluster                       # etcd + 3 bookies, in the foreground
      bookie start --conf conf/bk_server.conf --daemon
      bookie status --conf conf/bk_server.conf
      bookie stop --conf conf/bk_server.conf
    """


@main.command()
@_conf_options
@_override_options
@click.option("--daemon", "-d", is_flag=True, help="Detach from the terminal (logs to logFile).")
@click.option("--stop-with", type=click.IntRange(min=1), default=None, metavar="PID",
              help="Stop (as SIGTERM does) once process PID exits. bk's local clusters "
                   "(tests, benchmarks, bookie localcluster) pass their own pid, so that "
                   "no bookie outlives them; not for deployed bookies.")
@one_line_errors(PROG)
def start(conf_file, settings, daemon, stop_with, **flags):
    """Start a bookie (in the foreground unless --daemon).

    Empty directories are formatted on the first start. Exits non-zero with a
    message naming the problem when the configuration, the cookie or the
    metadata store is wrong.

    \b
    Example:
      bookie start --conf conf/bk_server.conf --port 3182 --journal-dir /data/j2
    """
    if daemon and stop_with is not None:
        fail(PROG, "--stop-with and --daemon exclude each other", EXIT_CONFIG)
    conf = load_conf(conf_file, settings, **flags)
    if not conf.metadataServiceUri:
        fail(PROG, "metadataServiceUri is not set (in the conf file, BK_metadataServiceUri "
                   "or --metadata)", EXIT_CONFIG)
    pid = running_pid(conf)
    if pid:
        fail(PROG, f"bookie already running with pid {pid} (pid file {conf.pid_file})")
    from bk.bookie.arbiter import Arbiter
    hosted = views = None
    if conf.autoRecoveryDaemonEnabled:     # only then is the client stack loaded
        from bk.autorecovery.service import AutoRecovery
        hosted = AutoRecovery
    if conf.httpServerEnabled:             # only then prometheus_client and http.server
        from bk.bookie import http as views

    if daemon:
        log_file = conf.logFile or os.path.join(os.path.abspath(conf.ledgerDirectories[0]),
                                                "bookie.log")
        r, w = os.pipe()
        if os.fork() > 0:
            os.close(w)
            with os.fdopen(r) as f:
                status = f.readline()   # not read(): shard workers inherit the pipe
            if status.startswith("ok"):
                click.echo(f"bookie {conf.bookie_id} started (pid {status.split()[1]}); "
                           f"log: {log_file}")
                sys.exit(0)
            fail(PROG, status.strip() or f"bookie failed to start; see {log_file}")
        os.close(r)
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        setup_logging(conf.logLevel, log_file)
        pipe = os.fdopen(w, "w")

        def ready(err):
            pipe.write(f"ok {os.getpid()}\n" if err is None else f"{err}\n")
            pipe.close()

        arbiter = Arbiter(conf, on_ready=ready, autorecovery=hosted, views=views)
        code = arbiter.run()
        if not pipe.closed:
            pipe.write(arbiter.exit_message or f"bookie exited with code {code}")
            pipe.close()
        os._exit(code)
    setup_logging(conf.logLevel, conf.logFile or None)
    arbiter = Arbiter(conf, autorecovery=hosted, views=views, stop_with=stop_with)
    code = arbiter.run()
    if code:
        click.echo(f"{PROG}: error: {arbiter.exit_message or f'bookie exited with code {code}'}",
                   err=True)
    # Everything is stopped and closed: leave without the interpreter's teardown, which
    # spent over a second collecting the etcd client's and metrics' objects.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@main.command()
@_conf_options
@click.option("--pid-file", default=None, help="Override pidFile.")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for it to stop.")
@one_line_errors(PROG)
def stop(conf_file, settings, pid_file, timeout):
    """Stop a running bookie gracefully (SIGTERM through its pid file).

    In-flight adds are made durable and answered before it exits. A bookie
    that is not running is not an error (exit 0). Exits 1 if it has not stopped
    within --timeout seconds.

    \b
    Example:
      bookie stop --conf conf/bk_server.conf --timeout 120
    """
    conf = load_conf(conf_file, settings, pid_file=pid_file)
    pid = _read_pid(conf.pid_file)
    if pid is None:
        click.echo(f"bookie not running (no pid file at {conf.pid_file})")
        return
    if not pid_alive(pid):
        click.echo(f"bookie not running (stale pid file {conf.pid_file} removed)")
        try:
            os.unlink(conf.pid_file)
        except OSError:
            pass
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            fail(PROG, f"bookie (pid {pid}) did not stop within {timeout:g}s")
        time.sleep(0.05)
    click.echo(f"bookie stopped (pid {pid})")


@main.command()
@_conf_options
@click.option("--pid-file", default=None, help="Override pidFile.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the exit code is the same).")
@one_line_errors(PROG)
def status(conf_file, settings, pid_file, as_json):
    """Exit 0 if the bookie runs, 3 if it does not (like an init script).

    Looks at the pid file (pidFile of --conf) and whether that process lives.
    --json: {"id", "running", "pid", "pidFile"}, with the same exit code.

    \b
    Examples:
      bookie status --conf conf/bk_server.conf || echo "not running"
      bookie status --conf conf/bk_server.conf --json
    """
    conf = load_conf(conf_file, settings, pid_file=pid_file)
    pid = running_pid(conf)
    if as_json:
        click.echo(json.dumps({"id": conf.bookie_id, "running": pid is not None, "pid": pid,
                               "pidFile": conf.pid_file}, indent=1))
        if pid is None:
            sys.exit(EXIT_NOT_RUNNING)
        return
    if pid:
        click.echo(f"bookie {conf.bookie_id} is running (pid {pid})")
        return
    click.echo(f"bookie {conf.bookie_id} is not running")
    sys.exit(EXIT_NOT_RUNNING)


@main.command()
@_conf_options
@_override_options
@click.option("--force", "-f", is_flag=True, help="Wipe without asking.")
@one_line_errors(PROG)
def format(conf_file, settings, force, **flags):  # noqa: A001 - the command's name
    """Wipe the bookie's directories and its cookie (all its data!).

    The next start formats them anew. Refuses while the bookie runs. Without
    --force it asks for confirmation (and fails when it cannot ask: no terminal).

    \b
    Example:
      bookie stop --conf conf/bk_server.conf
      bookie format --conf conf/bk_server.conf --force
    """
    conf = load_conf(conf_file, settings, **flags)
    pid = running_pid(conf)
    if pid:
        fail(PROG, f"bookie is running (pid {pid}); stop it first")
    dirs = layout.all_dirs(conf)
    if not force:
        if not sys.stdin.isatty():
            fail(PROG, f"this wipes {', '.join(dirs)}; pass --force to confirm")
        click.confirm(f"Wipe all data of bookie {conf.bookie_id} in {', '.join(dirs)}?",
                      abort=True)
    removed = layout.wipe(conf)
    click.echo(f"wiped {len(removed)} shard directories and cookies in {', '.join(dirs)}")
    if conf.metadataServiceUri:
        from bk.meta.store import MetadataStore
        try:
            from bk.security.etcd import EtcdCredentials
            with MetadataStore(conf.metadataServiceUri,
                               timeout=conf.metadataTimeoutMillis / 1000.0,
                               credentials=EtcdCredentials.from_conf(conf)) as store:
                cookie, _ = store.read_cookie(conf.bookie_id)
                if cookie is not None:
                    store.delete_cookie(conf.bookie_id)
                    click.echo(f"removed the cookie of {conf.bookie_id} from the metadata store")
        except Exception as e:
            click.echo(f"warning: could not remove the cookie from the metadata store: {e}",
                       err=True)


@main.command()
@_conf_options
@_override_options
@one_line_errors(PROG)
def upgrade(conf_file, settings, **flags):
    """Convert the bookie's data to the current storage format, in place.

    Shards written by the previous release (entries in the journal, the index
    in a checkpoint file) get their entries copied into entry logs and an
    index, showing progress; current shards are left alone. A bookie does the
    same by itself at start; this does it offline (refused while it runs). An
    interrupted upgrade starts over where the data is still the old format.

    \b
    Example:
      bookie upgrade --conf conf/bk_server.conf
    """
    conf = load_conf(conf_file, settings, **flags)
    pid = running_pid(conf)
    if pid:
        fail(PROG, f"bookie is running (pid {pid}); stop it first")
    shards = layout.local_shards(conf)
    if not shards:
        fail(PROG, f"no shard directories under {', '.join(layout.all_dirs(conf))}")
    for shard in shards:
        jdir, idir = layout.shard_dirs(conf, shard)
        if not needs_upgrade(jdir, idir):
            click.echo(f"shard {shard}: already in the current format")
            continue

        def progress(done, total, shard=shard):
            if not total:
                click.echo(f"shard {shard}: reading the old journal")
                return
            click.echo(f"shard {shard}: {100 * done // total}% ({done} of {total} entries)")
        stats = upgrade_shard(jdir, idir, layout.shard_ledger_dirs(conf, shard),
                              segment_size=conf.journalPreAllocSizeMB << 20,
                              log_size_limit=conf.logSizeLimit, progress=progress,
                              tombstones=Tombstones(os.path.join(idir, "tombstones")))
        click.echo(f"shard {shard}: upgraded {stats['ledgers']} ledgers, {stats['entries']} "
                   f"entries ({stats['bytes'] >> 20} MiB) in {stats['seconds']:.1f}s")


@main.command()
@click.option("--bookies", "-n", default=3, show_default=True, help="Number of bookies.")
@click.option("--dir", "base_dir", default="localcluster", show_default=True,
              type=click.Path(file_okay=False), help="Where etcd and the bookies keep data.")
@click.option("--base-port", default=3181, show_default=True,
              help="Port of the first bookie; the others follow. 0: any free ports.")
@click.option("--etcd-port", default=0, help="etcd client port (0: a free one).")
@click.option("--http-port", default=8000, show_default=True,
              help="HTTP port (metrics) of the first bookie; the others follow. 0: any "
                   "free ports.")
@click.option("--shards", default=2, show_default=True, help="Shards per bookie.")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Configuration override for every bookie; repeatable.")
@click.option("--smoke/--no-smoke", default=True, show_default=True,
              help="Write and read back a ledger once the cluster is up.")
@click.option("--etcd-quota-bytes", default=2 << 30, show_default=True,
              type=click.IntRange(min=1 << 20),
              help="etcd's backend quota: past it etcd raises NOSPACE and refuses writes "
                   "(bkshell metacompact --defrag --disarm recovers).")
@click.option("--secure", is_flag=True,
              help="TLS and tokens everywhere: a CA and certificates under DIR/security, "
                   "etcd with TLS, client certificates and a user limited to the prefix, "
                   "bookies requiring TLS and tokens, HTTPS; prints the client.conf to use.")
@one_line_errors(PROG)
def localcluster(bookies, base_dir, base_port, etcd_port, http_port, shards, settings, smoke,
                 etcd_quota_bytes, secure):
    """Run an embedded etcd and N bookies in the foreground; Ctrl-C stops all.

    The first line printed is the metadata URI
    (metadataServiceUri=etcd://127.0.0.1:PORT/ledgers). Data is kept in --dir,
    so a restart finds the ledgers again. Every bookie serves HTTP (/metrics,
    /heartbeat, /api/v1/...) on its own port; their metrics URLs are printed.
    The bookies run auto-recovery (--set autoRecoveryDaemonEnabled=false: not).
    etcd runs with a backend quota (--etcd-quota-bytes) and auto-compaction (an hour
    of history; the bookies compact more often, see metadataCompactionIntervalSeconds).

    \b
    Examples:
      bookie localcluster --bookies 3 --dir /tmp/bk
      bookie localcluster --base-port 0 --http-port 0 --set journalSyncData=false
    """
    from bk.localcluster import LocalCluster

    overrides = {"autoRecoveryDaemonEnabled": "true", **parse_settings(settings)}
    Config.load(None, overrides)         # a bad --set fails here, before anything starts
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    cluster = LocalCluster(num_bookies=bookies, base_dir=base_dir, num_shards=shards,
                           base_port=base_port, etcd_port=etcd_port,
                           conf_overrides=overrides, http_port=http_port,
                           etcd_quota_bytes=etcd_quota_bytes, secure=secure)
    cluster.start_etcd()
    click.echo(f"metadataServiceUri={cluster.metadata_uri}", color=False)
    client_conf = os.path.join(os.path.abspath(base_dir), "client.conf")
    if secure:
        click.echo(f"client configuration (TLS, token, etcd credentials): {client_conf}\n"
                   + "".join(f"  {line}\n" for line in cluster.client_conf().splitlines()),
                   nl=False)
    sys.stdout.flush()
    try:
        cluster.start_bookies()
        for b in cluster.bookies:
            click.echo(f"bookie {b.bookie_id} running (pid {b.pid}, data {b.dir})"
                       + (f", metrics {b.metrics_url}" if b.metrics_url else ""))
        if smoke:
            click.echo(_smoke(cluster.metadata_uri, cluster.client_settings()))
        if secure:
            click.echo(f"\nTry:\n  bkshell --conf {client_conf} listbookies\n"
                       f"  bkshell --conf {client_conf} simpletest --entries 100\n"
                       f"Press Ctrl-C to stop.")
        else:
            click.echo(f"\nTry:\n  bkshell --metadata {cluster.metadata_uri} listbookies\n"
                       f"  bkshell --metadata {cluster.metadata_uri} simpletest --entries 100\n"
                       f"  export BK_METADATA_URI={cluster.metadata_uri}\n"
                       f"Press Ctrl-C to stop.")
        sys.stdout.flush()
        while not stop:
            time.sleep(0.5)
            for b in cluster.bookies:
                if not b.alive:
                    click.echo(f"bookie {b.bookie_id} exited; see {b.log_file}", err=True)
                    stop.append(1)
    except KeyboardInterrupt:
        pass
    finally:
        # A second Ctrl-C must not abort the stop half way: the bookies run in
        # their own sessions and would be left running without their etcd.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        click.echo("stopping the local cluster (the bookies drain first)...", err=True)
        cluster.stop()


@main.command()
@_conf_options
@_override_options
@one_line_errors(PROG)
def autorecovery(conf_file, settings, **flags):
    """Run auto-recovery alone, in the foreground: an auditor candidate and a
    replication worker (as a bookie with autoRecoveryDaemonEnabled=true runs).
    SIGTERM or Ctrl-C stops it (exit 0).

    \b
    Example:
      bookie autorecovery --conf conf/bk_server.conf
    """
    from bk.autorecovery.daemon import AutoRecoveryDaemon, DaemonExit

    conf = load_conf(conf_file, settings, **flags)
    setup_logging(conf.logLevel, conf.logFile or None)
    try:
        AutoRecoveryDaemon(conf).run()
    except DaemonExit as e:
        fail(PROG, str(e), e.code)


def _smoke(uri: str, settings: dict | None = None) -> str:
    """Write and read back a small ledger: proof that the cluster does real work."""
    try:
        import bk
        with bk.BookKeeper(uri, **(settings or {})) as client:
            lh = client.create_ledger(ensemble_size=3, write_quorum_size=2, ack_quorum_size=2,
                                      password=b"localcluster")
            for i in range(10):
                lh.add_entry(b"hello %d" % i)
            lh.close()
            rh = client.open_ledger(lh.ledger_id, password=b"localcluster")
            got = [e.data for e in rh.read_entries(0, rh.last_add_confirmed)]
            ok = got == [b"hello %d" % i for i in range(10)]
            return (f"smoke test: wrote and read back 10 entries of ledger {lh.ledger_id}"
                    + ("" if ok else " -- MISMATCH"))
    except Exception as e:  # the cluster still runs; say what failed
        return f"smoke test failed: {e}"


if __name__ == "__main__":
    main()
