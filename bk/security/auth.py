"""Identities and roles: signed tokens (HS256 JWT), and what each role may send.

A bookie with ``authProvider=token`` checks the token a connection presents in
AUTH against ``tokenSecretKeyFile``; its subject is the role. With
``authProvider=tls`` the role is the subject CN of the client's certificate.
The role maps, once per connection, to the set of ops it may send
(:meth:`Authenticator.grant`): the worker checks an op against that set per
frame (a set lookup, nothing per entry of a batch), and a connection whose
role may do everything skips even that. Refusals are :class:`AuthError` with a
reason that never contains the token or the key.
"""

from __future__ import annotations

import base64
import os
import time

import jwt

from bk import protocol as P
from bk.errors import AuthError, ConfigError

PROVIDERS = ("none", "token", "tls")
ALGORITHM = "HS256"
# What a read-only role may send (and never with the fence flag).
READ_ONLY_OPS = frozenset({P.READ, P.READ_RANGE, P.READ_LAC, P.GET_BOOKIE_INFO,
                           P.GET_LIST_OF_ENTRIES, P.PING, P.AUTH})
FENCING_OPS = frozenset({P.READ, P.READ_RANGE, P.READ_LAC})
AUTH_ONLY = frozenset({P.AUTH})       # a connection whose identity is not known yet


def create_secret_key() -> bytes:
    """A new random 256-bit HS256 key."""
    return os.urandom(32)


def write_secret_key(path: str, key: bytes) -> None:
    """Write ``key`` base64-encoded to ``path``, readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(base64.b64encode(key).decode() + "\n")


def read_secret_key(path: str, key_name: str = "tokenSecretKeyFile") -> bytes:
    try:
        with open(path, encoding="ascii") as f:
            return base64.b64decode(f.read().strip(), validate=True)
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) else "not a base64 key"
        raise ConfigError(f"cannot read {key_name}={path}: {why}") from None


def create_token(key: bytes, subject: str, expiry_seconds: float | None = None) -> str:
    """A token for role ``subject``, expiring after ``expiry_seconds`` (None: never)."""
    if not subject:
        raise ConfigError("a token needs a subject (the role)")
    claims = {"sub": subject, "iat": int(time.time())}
    if expiry_seconds is not None:
        claims["exp"] = int(time.time() + expiry_seconds)
    return jwt.encode(claims, key, algorithm=ALGORITHM)


def verify_token(key: bytes, token) -> str:
    """The subject (role) of a valid token; AuthError with the reason otherwise."""
    if not token:
        raise AuthError("no token presented (authToken / authTokenFile)")
    if type(token) is not str:
        raise AuthError("the token is not a string")
    try:
        claims = jwt.decode(token, key, algorithms=[ALGORITHM],
                            options={"require": ["sub"]})
    except jwt.ExpiredSignatureError:
        raise AuthError("the token has expired") from None
    except jwt.InvalidSignatureError:
        raise AuthError("the token's signature does not verify (another secret key)") from None
    except jwt.InvalidTokenError as e:
        raise AuthError(f"the token is invalid: {type(e).__name__}") from None
    sub = claims.get("sub")
    if type(sub) is not str or not sub:
        raise AuthError("the token has no subject")
    return sub


def looks_like_token(text: str) -> bool:
    parts = text.split(".")
    return len(parts) == 3 and all(parts[:2])


def client_token(conf) -> str | None:
    """The token to present: ``authToken``, or the content of ``authTokenFile``.
    A value that is not a signed token is the retired plaintext shared secret:
    refused with a ConfigError that says what to do (never echoing the value)."""
    token = conf.authToken
    key = "authToken"
    if conf.authTokenFile:
        key = "authTokenFile"
        try:
            with open(conf.authTokenFile, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise ConfigError(f"cannot read authTokenFile={conf.authTokenFile}: "
                              f"{e.strerror}") from None
    if not token:
        return None
    if not looks_like_token(token):
        raise ConfigError(f"{key} is not a signed token: the plaintext shared secret of "
                          f"earlier versions is no longer accepted; make a token with "
                          f"`bkshell tokens create` (see docs/security.md)")
    return token


def _roles(text: str) -> frozenset:
    return frozenset(r.strip() for r in text.split(",") if r.strip())


class Authenticator:
    """A bookie's view of identities: who a connection is and what it may send."""

    def __init__(self, conf):
        self.provider = conf.authProvider
        if self.provider not in PROVIDERS:
            raise ConfigError(f"bad value {self.provider!r} for authProvider: one of "
                              f"{', '.join(PROVIDERS)}")
        self.key = None
        if self.provider == "token":
            if not conf.tokenSecretKeyFile:
                raise ConfigError("authProvider=token needs tokenSecretKeyFile")
            self.key = read_secret_key(conf.tokenSecretKeyFile)
        if self.provider == "tls" and not conf.tlsTrustStore:
            raise ConfigError("authProvider=tls needs tlsTrustStore (the CAs of client "
                              "certificates)")
        self.super_users = _roles(conf.superUserRoles)
        self.clients = _roles(conf.clientRoles)
        self.read_only = _roles(conf.readOnlyRoles)
        if self.provider != "none" and not (self.super_users or self.clients or self.read_only):
            raise ConfigError(f"authProvider={self.provider} with no roles: set "
                              f"superUserRoles, clientRoles or readOnlyRoles")

    @property
    def enabled(self) -> bool:
        return self.provider != "none"

    def identify(self, token, peer_cn: str | None) -> str | None:
        """The role of a connection (None with authProvider=none); AuthError if refused."""
        if self.provider == "none":
            return None
        if self.provider == "token":
            role = verify_token(self.key, token)
        else:
            if not peer_cn:
                raise AuthError("authProvider=tls: no client certificate was presented")
            role = peer_cn
        if role not in self.super_users and role not in self.clients \
                and role not in self.read_only:
            raise AuthError(f"role {role!r} is in none of superUserRoles, clientRoles, "
                            f"readOnlyRoles")
        return role

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
