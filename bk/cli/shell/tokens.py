"""Signed tokens for ``authProvider=token`` (``bkshell tokens ...``)."""

from __future__ import annotations

import os

import click

from bk.cli.common import fail
from bk.cli.shell.base import cli, handled, json_opt, json_out, PROG
from bk.exitcodes import EXIT_CONFIG


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
@json_opt
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
        json_out([{"kid": k, "signs": i == 0} for i, k in enumerate(kids)])
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
    json_out(describe_token(token))


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
