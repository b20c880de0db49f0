"""``python -m bk.cli.shell``: the same as the ``bkshell`` command."""

from bk.cli.shell import main

main()
