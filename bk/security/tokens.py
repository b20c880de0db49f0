"""Signed tokens: HS256 JWTs made, verified and inspected (``authProvider=token``).

Loaded only where tokens are used (:data:`bk.security.auth.VERIFIERS`, ``bkshell
tokens``, a secure local cluster): PyJWT brings the cryptography package, which
a bookie without token auth need not load. Keys, key files and revocation lists
are :mod:`bk.security.auth`'s.
"""

from __future__ import annotations

import hashlib
import time
import uuid

import jwt

from bk.errors import AuthError, ConfigError
from bk.security.auth import key_id

ALGORITHM = "HS256"


def create_token(key: bytes, subject: str, expiry_seconds: float | None = None) -> str:
    """A token for role ``subject``, expiring after ``expiry_seconds`` (None: never)."""
    if not subject:
        raise ConfigError("a token needs a subject (the role)")
    claims = {"sub": subject, "iat": int(time.time()), "jti": uuid.uuid4().hex}
    if expiry_seconds is not None:
        claims["exp"] = int(time.time() + expiry_seconds)
    return jwt.encode(claims, key, algorithm=ALGORITHM, headers={"kid": key_id(key)})


def token_id(token: str, claims: dict) -> str:
    """A token's id: its ``jti``, or a digest of the token for one made without it."""
    jti = claims.get("jti")
    if type(jti) is str and jti:
        return jti
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()[:32]


def unverified_claims(token: str) -> dict:
    """The claims of a token, its signature NOT checked (for revoking and showing)."""
    try:
        return jwt.decode(token, options={"verify_signature": False})
    except jwt.InvalidTokenError as e:
        # jwt's own words ("Not enough segments", ...) say what is wrong; never the token
        raise ConfigError(f"not a token (expected a JWT, HEADER.CLAIMS.SIGNATURE as made by "
                          f"'bkshell tokens create'): {e or type(e).__name__}") from None


def describe_token(token: str) -> dict:
    """Subject, id, signing key id, issue and expiry times of a token (unverified)."""
    claims = unverified_claims(token)
    return {"sub": claims.get("sub"), "jti": token_id(token, claims),
            "kid": jwt.get_unverified_header(token).get("kid"),
            "iat": claims.get("iat"), "exp": claims.get("exp")}


def decode(keys, token):
    """``(claims, kid)`` of a token that verifies with one of ``keys`` (bytes, or a
    list or {kid: key}); AuthError with the reason otherwise."""
    if not token:
        raise AuthError("no token presented (authToken / authTokenFile)")
    if type(token) is not str:
        raise AuthError("the token is not a string")
    if type(keys) is bytes:
        keys = [keys]
    if type(keys) is not dict:
        keys = {key_id(k): k for k in keys}
    try:
        kid = jwt.get_unverified_header(token).get("kid")
    except jwt.InvalidTokenError as e:
        raise AuthError(f"the token is invalid: {type(e).__name__}") from None
    if kid is not None:
        if kid not in keys:
            raise AuthError("the token's signature does not verify: its key is not (or no "
                            "longer) one of this bookie's keys (tokenSecretKeyFile)")
        candidates = [(kid, keys[kid])]
    else:
        candidates = list(keys.items())
    for i, (kid, key) in enumerate(candidates):
        try:
            return jwt.decode(token, key, algorithms=[ALGORITHM],
                              options={"require": ["sub"]}), kid
        except jwt.ExpiredSignatureError:
            raise AuthError("the token has expired") from None
        except jwt.InvalidSignatureError:
            if i == len(candidates) - 1:
                raise AuthError("the token's signature does not verify (another secret "
                                "key)") from None
        except jwt.InvalidTokenError as e:
            raise AuthError(f"the token is invalid: {type(e).__name__}") from None
    raise AuthError("no key to verify the token with")


def verify_token(keys, token) -> str:
    """The subject (role) of a valid token; AuthError with the reason otherwise.
    ``keys``: a key, or several (any of them may have signed it)."""
    claims, _kid = decode(keys, token)
    return subject(claims)


def subject(claims: dict) -> str:
    sub = claims.get("sub")
    if type(sub) is not str or not sub:
        raise AuthError("the token has no subject")
    return sub
