"""Identities and roles: signed tokens (HS256 JWT), and what each role may send.

A bookie with ``authProvider=token`` checks the token a connection presents in
AUTH against the keys of ``tokenSecretKeyFile``; its subject is the role. With
``authProvider=tls`` the role is the subject CN of the client's certificate.
The role maps, once per connection, to the set of ops it may send
(:meth:`Authenticator.grant`): the worker checks an op against that set per
frame (a set lookup, nothing per entry of a batch), and a connection whose
role may do everything skips even that. Refusals are :class:`AuthError` with a
reason that never contains the token or the key.

Key rotation and revocation: the key file holds one key per line; the first
signs (``bkshell tokens create``), all of them verify. A token names the key
that signed it (``kid``, a digest of the key, never the key) so that a bookie
verifies with that key only; tokens without one are tried against each key.
Each token has an id (``jti``; a digest of the token for tokens made without
one). ``tokenRevocationFile`` lists refused token ids and subjects. Both
files are looked at every ``tokenFilesRefreshDurationSeconds`` and loaded
again when they changed, without a restart: a token signed by a removed key or
revoked is refused at its next connection, and :meth:`Authenticator.recheck`
tells a bookie which open connections to close.

The JWT machinery (PyJWT, and the cryptography package it loads: ~65 ms of CPU
at every process start) lives in :mod:`bk.security.tokens`, which
:class:`Authenticator` loads by name only with ``authProvider=token`` (the
provider picks its verifier module, as BookKeeper's configuration names an
auth provider's class): a bookie without token auth never imports it.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import importlib
import logging
import os
import threading

from bk import protocol as P
from bk.errors import AuthError, ConfigError
from bk.security.watch import FileWatch

log = logging.getLogger("bk.security")

PROVIDERS = ("none", "token", "tls")
# The module that verifies a provider's credentials, imported when it is configured.
VERIFIERS = {"token": "bk.security.tokens"}
# What a read-only role may send (and never with the fence flag).
READ_ONLY_OPS = frozenset({P.READ, P.READ_RANGE, P.READ_LAC, P.GET_BOOKIE_INFO,
                           P.GET_LIST_OF_ENTRIES, P.PING, P.AUTH})
FENCING_OPS = frozenset({P.READ, P.READ_RANGE, P.READ_LAC})
AUTH_ONLY = frozenset({P.AUTH})       # a connection whose identity is not known yet

# Who a connection is: its role, and for a token, the token's id and the id of the
# key that verified it (what a refresh checks again).
Identity = collections.namedtuple("Identity", "role token_id key_id")


def create_secret_key() -> bytes:
    """A new random 256-bit HS256 key."""
    return os.urandom(32)


def key_id(key: bytes) -> str:
    """A key's public name (``kid``): a digest, from which the key cannot be found."""
    return hashlib.sha256(b"bk-token-key:" + key).hexdigest()[:16]


def _replace_file(path: str, text: str, mode: int = 0o600) -> None:
    """Replace ``path`` with ``text`` atomically (write, then rename): a bookie that
    reads it meanwhile sees the old file or the new one, never half of it."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_secret_key(path: str, key: bytes) -> None:
    """Write ``key`` base64-encoded to ``path``, readable by its owner only."""
    write_secret_keys(path, [key])


def write_secret_keys(path: str, keys) -> None:
    """Write ``keys`` (the first signs) to ``path``, one per line, mode 0600."""
    _replace_file(path, "".join(base64.b64encode(k).decode() + "\n" for k in keys))


def read_secret_keys(path: str, key_name: str = "tokenSecretKeyFile") -> list:
    """The keys of a key file, the signing key first (ConfigError if it has none)."""
    try:
        with open(path, encoding="ascii") as f:
            lines = [ln.strip() for ln in f]
        keys = [base64.b64decode(ln, validate=True) for ln in lines
                if ln and not ln.startswith("#")]
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) else "not base64 keys, one per line"
        raise ConfigError(f"cannot read {key_name}={path}: {why}") from None
    if not keys:
        raise ConfigError(f"cannot read {key_name}={path}: it holds no key")
    return keys


def read_secret_key(path: str, key_name: str = "tokenSecretKeyFile") -> bytes:
    """The signing key (the first) of a key file."""
    return read_secret_keys(path, key_name)[0]


def looks_like_token(text: str) -> bool:
    parts = text.split(".")
    return len(parts) == 3 and all(parts[:2])


def _read_token_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError as e:
        raise ConfigError(f"cannot read authTokenFile={path}: {e.strerror}") from None


def check_client_token(token: str | None, key: str) -> str | None:
    """``token`` if it is a signed token (None if empty). A value that is not one is
    the retired plaintext shared secret: refused with a ConfigError that says what
    to do (never echoing the value)."""
    if not token:
        return None
    if not looks_like_token(token):
        raise ConfigError(f"{key} is not a signed token: the plaintext shared secret of "
                          f"earlier versions is no longer accepted; make a token with "
                          f"`bkshell tokens create` (see docs/security.md)")
    return token


def client_token(conf) -> str | None:
    """The token to present: ``authToken``, or the content of ``authTokenFile``."""
    if conf.authTokenFile:
        return check_client_token(_read_token_file(conf.authTokenFile), "authTokenFile")
    return check_client_token(conf.authToken, "authToken")


class TokenFile:
    """A client's ``authTokenFile``, read again when it changed (a token re-issued
    after a key rotation is presented from the next connection on)."""

    def __init__(self, path: str, interval: float = 1.0):
        self.path = path
        self._watch = FileWatch([path], interval)
        self.token = check_client_token(_read_token_file(path), "authTokenFile")

    def current(self) -> str | None:
        if self._watch.changed():
            try:
                self.token = check_client_token(_read_token_file(self.path), "authTokenFile")
                self._watch.accept()
            except ConfigError as e:        # being replaced: keep the one we have
                log.warning("authTokenFile changed but cannot be used yet: %s", e)
        return self.token


def read_revocations(path: str) -> tuple:
    """``(token ids, subjects)`` refused by a revocation file: lines ``jti ID`` or
    ``sub ROLE``; ``#`` starts a comment."""
    ids, subs = set(), set()
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read tokenRevocationFile={path}: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        kind, _, value = line.partition(" ")
        value = value.strip()
        if kind not in ("jti", "sub") or not value:
            raise ConfigError(f"tokenRevocationFile={path} line {n}: expected 'jti ID' or "
                              f"'sub ROLE'")
        (ids if kind == "jti" else subs).add(value)
    return frozenset(ids), frozenset(subs)


def add_revocation(path: str, kind: str, value: str) -> bool:
    """Add ``kind value`` to a revocation file (made if missing); False if already
    there. Replaced atomically, so a bookie never reads half of it."""
    assert kind in ("jti", "sub")
    text = ""
    if os.path.exists(path):
        ids, subs = read_revocations(path)
        if value in (ids if kind == "jti" else subs):
            return False
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if text and not text.endswith("\n"):
            text += "\n"
    _replace_file(path, f"{text}{kind} {value}\n", 0o644)
    return True


def _roles(text: str) -> frozenset:
    return frozenset(r.strip() for r in text.split(",") if r.strip())


class Authenticator:
    """A bookie's view of identities: who a connection is and what it may send.
    Thread-safe (the HTTP server asks from its request threads)."""

    def __init__(self, conf):
        self.provider = conf.authProvider
        if self.provider not in PROVIDERS:
            raise ConfigError(f"bad value {self.provider!r} for authProvider: one of "
                              f"{', '.join(PROVIDERS)}")
        self.keys = {}                       # kid -> key
        self.revoked = (frozenset(), frozenset())     # token ids, subjects
        self._key_file = conf.tokenSecretKeyFile
        self._revocation_file = conf.tokenRevocationFile
        self._watch = None
        self._lock = threading.Lock()
        self.generation = 0                  # loads of the token files so far
        self._tokens = (importlib.import_module(VERIFIERS[self.provider])
                        if self.provider in VERIFIERS else None)
        if self.provider == "token":
            if not self._key_file:
                raise ConfigError("authProvider=token needs tokenSecretKeyFile")
            self._load()
            self._watch = FileWatch((self._key_file, self._revocation_file),
                                    conf.tokenFilesRefreshDurationSeconds)
        if self.provider == "tls" and not conf.tlsTrustStore:
            raise ConfigError("authProvider=tls needs tlsTrustStore (the CAs of client "
                              "certificates)")
        self.super_users = _roles(conf.superUserRoles)
        self.clients = _roles(conf.clientRoles)
        self.read_only = _roles(conf.readOnlyRoles)
        if self.provider != "none" and not (self.super_users or self.clients or self.read_only):
            raise ConfigError(f"authProvider={self.provider} with no roles: set "
                              f"superUserRoles, clientRoles or readOnlyRoles")

    def _load(self):
        keys = {key_id(k): k for k in read_secret_keys(self._key_file)}
        revoked = (read_revocations(self._revocation_file) if self._revocation_file
                   else (frozenset(), frozenset()))
        self.keys, self.revoked = keys, revoked
        self.generation += 1
    def refresh(self, now: float | None = None) -> bool:
        """Load the key and revocation files again if they changed (looked at every
        tokenFilesRefreshDurationSeconds at most); True if this call loaded them
        (``generation`` counts the loads, whoever made them).
        A file that does not load (half written) is logged and tried again later;
        the keys and revocations already loaded stay in force meanwhile."""
        watch = self._watch
        if watch is None or not watch.interval:
            return False
        with self._lock:
            if not watch.changed(now):
                return False
            try:
                self._load()
            except ConfigError as e:
                log.warning("token files changed but do not load yet: %s", e)
                return False
            watch.accept()
        log.info("token key or revocation files changed: loaded them again (%d keys, "
                 "%d revoked tokens, %d revoked roles)", len(self.keys),
                 len(self.revoked[0]), len(self.revoked[1]))
        return True

    @property
    def enabled(self) -> bool:
        return self.provider != "none"

    def identify(self, token, peer_cn: str | None) -> str | None:
        """The role of a connection (None with authProvider=none); AuthError if refused."""
        ident = self.authenticate(token, peer_cn)
        return None if ident is None else ident.role

    def authenticate(self, token, peer_cn: str | None) -> Identity | None:
        """Who a connection is (None with authProvider=none); AuthError if refused."""
        if self.provider == "none":
            return None
        if self.provider == "token":
            self.refresh()
            tokens = self._tokens
            claims, kid = tokens.decode(self.keys, token)
            ident = Identity(tokens.subject(claims), tokens.token_id(token, claims), kid)
            why = self.refused(ident)
            if why:
                raise AuthError(why)
        else:
            if not peer_cn:
                raise AuthError("authProvider=tls: no client certificate was presented")
            ident = Identity(peer_cn, None, None)
        role = ident.role
        if role not in self.super_users and role not in self.clients \
                and role not in self.read_only:
            raise AuthError(f"role {role!r} is in none of superUserRoles, clientRoles, "
                            f"readOnlyRoles")
        return ident

    def refused(self, ident: Identity | None) -> str | None:
        """Why an identity accepted earlier is no longer (a revocation or a removed
        key, after :meth:`refresh`), or None."""
        if ident is None or ident.token_id is None:
            return None
        ids, subs = self.revoked
        if ident.token_id in ids:
            return "the token was revoked (tokenRevocationFile)"
        if ident.role in subs:
            return f"the tokens of role {ident.role!r} were revoked (tokenRevocationFile)"
        if ident.key_id not in self.keys:
            return ("the token's signature does not verify: its key is not (or no longer) "
                    "one of this bookie's keys (tokenSecretKeyFile)")
        return None

    def grant(self, role: str | None):
        """``(ops, may_fence)``: the op codes the role may send (None: all of them)
        and whether it may fence."""
        if role is None or role in self.super_users or role in self.clients:
            return None, True
        return READ_ONLY_OPS, False

    def is_super_user(self, role: str | None) -> bool:
        return role is not None and role in self.super_users


# The HTTP paths that stay open unless httpServerAuthMetrics=true.
OPEN_PATHS = frozenset({"/heartbeat", "/metrics"})


class HttpGuard:
    """Who may see an HTTP view: with authProvider set, a super-user role, from a
    bearer token (``token``) or the client certificate's CN (``tls``).
    ``check(path, authorization, peer_cn)`` is None (allowed) or ``(status, reason)``:
    401 without a valid identity, 403 for a role that is not a super user."""

    def __init__(self, conf):
        self.auth = Authenticator(conf)
        self.open = frozenset() if conf.httpServerAuthMetrics else OPEN_PATHS

    def check(self, path: str, authorization: str | None, peer_cn: str | None):
        if not self.auth.enabled or path in self.open:
            return None
        token = None
        if authorization and authorization[:7].lower() == "bearer ":
            token = authorization[7:].strip()
        if self.auth.provider == "token" and not token:
            return 401, "a bearer token of a super-user role is required"
        try:
            role = self.auth.identify(token, peer_cn)
        except AuthError as e:
            return 401, str(e)
        if not self.auth.is_super_user(role):
            return 403, f"role {role!r} is not a super-user role"
        return None
