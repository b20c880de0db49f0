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
(:class:`Counting`), with ``--json`` too. Commands that go
through the metadata store first check that the prefix holds a cluster.
Commands that destroy something ask on a terminal unless ``--yes``
(:func:`confirm`); scripts (no terminal on stdin) are not asked.

Layout: :mod:`bk.cli.shell.base` holds the ``cli`` group and what every command
shares; each topic is a module that adds its commands to the group when
imported: ``cluster`` (metadata store, bookies, racks, placement), ``ledgers``,
``recovery`` (fencing, recovering and decommissioning bookies), ``inspection``
(a bookie's directories, offline), ``autorecovery``, ``logs`` (``bk.log`` and the
Spark sink's tools), ``bench`` and ``tokens``. This module imports them all, so
``cli`` is complete once :mod:`bk.cli.shell` is imported.
"""

from bk.cli.shell.base import cli, main
# Each topic module registers its commands on ``cli`` when imported.
from bk.cli.shell import autorecovery, cluster, inspection, ledgers, logs, recovery, tokens
from bk.cli.shell.bench import bench      # the ``bench`` group (a name tests use)

__all__ = ["cli", "main", "bench", "autorecovery", "cluster", "inspection", "ledgers",
           "logs", "recovery", "tokens"]
