"""Security: TLS on the bookie protocol (``tls``), identities and roles
(``auth``), and the credentials a client brings to bookies
(:class:`ClientSecurity`). See docs/security.md.
"""

from __future__ import annotations

import ssl

from bk.security import auth, tls


class ClientSecurity:
    """What a client (or a bookie talking to other bookies) brings to a bookie: a
    TLS context (None: plaintext) and a token (None: none), or a token file read
    again when it changes. Built once from the configuration and shared by every
    connection."""

    def __init__(self, context: ssl.SSLContext | None = None, token: str | None = None,
                 token_file: "auth.TokenFile | None" = None):
        self.context = context
        self._token = token
        self._token_file = token_file

    @classmethod
    def from_conf(cls, conf) -> "ClientSecurity":
        ctx = tls.client_context(conf)
        if conf.authTokenFile:
            return cls(ctx, token_file=auth.TokenFile(conf.authTokenFile))
        return cls(ctx, auth.client_token(conf))

    @property
    def token(self) -> str | None:
        """The token to present at a new connection (the file's current one)."""
        if self._token_file is not None:
            return self._token_file.current()
        return self._token

    def __repr__(self):          # never the token itself
        return (f"ClientSecurity(tls={self.context is not None}, "
                f"token={'set' if self.token else 'none'})")

    def wrap(self, sock, host: str):
        """``sock`` wrapped for a client handshake to ``host`` (not yet run)."""
        ctx = self.context
        return ctx.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)

    def stream(self, sock, host: str) -> "tls.TLSStream":
        """TLS to ``host`` over the non-blocking ``sock``, for an event loop."""
        return tls.TLSStream(self.context, sock, server_side=False, server_hostname=host)


PLAINTEXT = ClientSecurity()

# The settings a client brings to bookies (and etcd): what a component that makes a
# client out of its own configuration (auto-recovery's replicator) passes along.
# (bk.security.etcd is not imported here: it loads gRPC, which a shard worker never needs.)
ETCD_KEYS = ("etcdTrustStore", "etcdCertificatePath", "etcdKeyStore", "etcdUser",
             "etcdPasswordFile")
CLIENT_KEYS = ("tlsEnabled", "tlsTrustStore", "tlsCertificatePath", "tlsKeyStore",
               "tlsHostnameVerificationEnabled", "authToken", "authTokenFile") + ETCD_KEYS


def http_security(conf) -> dict:
    """The HTTP server's ``tls_context`` and ``guard`` from a daemon's conf."""
    return {"tls_context": tls.http_context(conf) if conf.httpServerTlsEnable else None,
            "guard": auth.HttpGuard(conf) if conf.authProvider != "none" else None}


def client_settings(conf) -> dict:
    """The client-side security settings of ``conf``, as overrides for a client."""
    return {k: conf[k] for k in CLIENT_KEYS}

__all__ = ["ClientSecurity", "PLAINTEXT", "CLIENT_KEYS", "ETCD_KEYS", "client_settings", "http_security", "auth",
           "tls"]
