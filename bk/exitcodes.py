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
