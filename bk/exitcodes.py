"""Exit codes of bk's daemons (``bookie start``, ``bookie autorecovery``) and of
the ``bookie`` command: one table, a contract that init scripts and tests rely on."""

EXIT_OK = 0            # stopped on request
EXIT_ERROR = 1         # an error while serving (the message says which)
EXIT_CONFIG = 2        # a bad setting; the message names the key
EXIT_WORKER_BOOT = 3   # a shard worker could not start (journal replay, directories)
EXIT_COOKIE = 4        # the directories or the metadata store belong to another bookie/cluster
EXIT_METADATA = 5      # the metadata store is unreachable or holds no cluster
EXIT_BIND = 6          # a port (bookiePort, httpServerPort) could not be bound
EXIT_NOT_RUNNING = 3   # ``bookie status``: not running (as an init script's status says)

# ``bkshell`` (bk.cli.shell): fewer codes, the same meaning where they overlap.
#   0  done (a check found nothing)
#   1  EXIT_ERROR: the command failed (one line on stderr says why), or a check
#      found problems (placementcheck, checkledgers, bookieinfo with a bookie
#      unreachable, bench recovery's verification, whoisauditor with none
#      elected), or a question was answered no
#   (--json changes only stdout: the code and the error line are the text form's)
#   2  EXIT_CONFIG: a bad option, argument, configuration key or value, or a
#      missing file the command needs (click's usage errors are 2 as well)
#   130 EXIT_INTERRUPTED: stopped by Ctrl-C (SIGINT) part-way; ``tail`` ends
#      with 0 on Ctrl-C, since that is how it is meant to end
#   141 EXIT_PIPE_CLOSED: the reader of stdout went away (``... | head``)
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141
