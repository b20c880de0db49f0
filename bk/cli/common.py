"""What every bk command shares: logging set-up and one-line errors.

Commands exit 0 on success and non-zero with one line on stderr otherwise (the
codes are in :mod:`bk.exitcodes`); a traceback is only shown with ``BK_DEBUG=1``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys

import click

from bk.errors import BKError, ConfigError
from bk.exitcodes import EXIT_CONFIG, EXIT_ERROR, EXIT_INTERRUPTED

LOG_FORMAT = "%(asctime)s %(levelname)s [%(name)s] %(message)s"


def setup_logging(level: str = "INFO", log_file: str | None = None) -> None:
    lvl = getattr(logging, str(level).upper(), None)
    if not isinstance(lvl, int):
        raise ConfigError(f"bad value {level!r} for logLevel: expected DEBUG, INFO, WARNING or ERROR")
    handler: logging.Handler
    if log_file:
        os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
        handler = logging.FileHandler(log_file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(lvl)
    # gRPC and friends are chatty at INFO.
    for noisy in ("grpc", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class Interrupted:
    """Set by the first Ctrl-C inside :func:`until_interrupted`."""

    def __init__(self):
        self.set = False


@contextlib.contextmanager
def until_interrupted():
    """Run a follow loop that ends on Ctrl-C: the first SIGINT only sets the flag
    the loop polls, the second interrupts as usual.

    Why not catch KeyboardInterrupt: it is raised wherever the main thread happens
    to be, e.g. inside the client between taking a lock and the ``try`` that
    releases it, and the close that follows then waits on that lock forever."""
    flag = Interrupted()
    before = signal.getsignal(signal.SIGINT)

    def first(signum, frame):
        flag.set = True
        signal.signal(signal.SIGINT, before)     # a second Ctrl-C is a plain interrupt

    signal.signal(signal.SIGINT, first)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, before)


def fail(prog: str, message: str, code: int = EXIT_ERROR):
    click.echo(f"{prog}: error: {message}", err=True)
    sys.exit(code)


def one_line_errors(prog: str):
    """Turn bk errors (and a few OS errors) into one stderr line and an exit code."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except (click.exceptions.Exit, click.ClickException, click.Abort, SystemExit):
                raise
            except ConfigError as e:
                if os.environ.get("BK_DEBUG"):
                    raise
                fail(prog, str(e), EXIT_CONFIG)
            except (BKError, ValueError, OSError) as e:
                if os.environ.get("BK_DEBUG"):
                    raise
                fail(prog, str(e) or type(e).__name__, EXIT_ERROR)
            except KeyboardInterrupt:
                fail(prog, "interrupted (Ctrl-C): stopped part-way", EXIT_INTERRUPTED)
        return wrapper
    return deco
