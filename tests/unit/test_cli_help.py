"""Every command of ``bkshell`` and ``bookie`` explains itself: an example in its
--help, no secret in a default; and a malformed token is named as such."""

from __future__ import annotations

import click
from click.testing import CliRunner

from bk.cli.bookie import main as bookie_cli
from bk.cli.shell import cli as shell_cli


def _commands(group: click.Group, path=()):
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, path + (name,))
        else:
            yield path + (name,), cmd


def test_every_command_has_an_example_in_its_help():
    missing = []
    n = 0
    for top in (shell_cli, bookie_cli):
        for path, _cmd in _commands(top):
            r = CliRunner().invoke(top, [*path, "--help"])
            assert r.exit_code == 0, (path, r.output)
            n += 1
            if "Example" not in r.output:
                missing.append(" ".join(path))
    assert n > 50               # both groups walked, subgroups (bench, tokens) included
    assert missing == []


def test_no_secret_in_an_option_default():
    for top in (shell_cli, bookie_cli):
        for path, cmd in [((), top), *_commands(top)]:
            for p in cmd.params:
                if any(w in (p.name or "") for w in ("password", "token", "secret", "key")):
                    # (click's "no default" is a sentinel of its own, not a string)
                    assert not isinstance(p.default, (str, bytes)) or not p.default, \
                        (path, p.name, p.default)


def test_a_malformed_token_is_named_with_the_reason():
    r = CliRunner().invoke(shell_cli, ["tokens", "show", "not-a-jwt"])
    assert r.exit_code == 2
    assert r.stderr == ("bkshell: error: not a token (expected a JWT, HEADER.CLAIMS.SIGNATURE "
                        "as made by 'bkshell tokens create'): Not enough segments\n")
