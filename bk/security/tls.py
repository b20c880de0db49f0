"""TLS contexts of bookies, clients and the HTTP server, and certificate refresh.

A bookie offers TLS once ``tlsCertificatePath`` is set; a client asks for it
with ``tlsEnabled``. Contexts are built from PEM files only (certificate chain,
key, CA bundle). :class:`ServerTLS` checks the files every
``tlsCertFilesRefreshDurationSeconds`` and builds a new context when one
changed: connections made after that use the renewed certificate, the ones
already open keep theirs (as a TLS session does anyway).
"""

from __future__ import annotations

import logging
import ssl

from bk.errors import ConfigError
from bk.security.watch import FileWatch

log = logging.getLogger("bk.security")


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str, what: str) -> None:
    try:
        ctx.load_cert_chain(cert, key or None)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"cannot load {what} certificate tlsCertificatePath={cert} "
                          f"tlsKeyStore={key}: {reason(e)}") from None


def _load_trust(ctx: ssl.SSLContext, trust: str, key: str = "tlsTrustStore") -> None:
    try:
        ctx.load_verify_locations(cafile=trust)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"cannot load {key}={trust}: {reason(e)}") from None


def server_context(conf) -> ssl.SSLContext | None:
    """The bookie's context, or None when it has no certificate (no TLS)."""
    if not conf.tlsCertificatePath:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, conf.tlsCertificatePath, conf.tlsKeyStore, "the bookie's")
    if conf.tlsTrustStore:
        _load_trust(ctx, conf.tlsTrustStore)
    if conf.tlsClientAuthentication:
        if not conf.tlsTrustStore:
            raise ConfigError("tlsClientAuthentication=true needs tlsTrustStore (the CAs of "
                              "client certificates)")
        ctx.verify_mode = ssl.CERT_REQUIRED
    elif conf.tlsTrustStore and conf.authProvider == "tls":
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def http_context(conf) -> ssl.SSLContext:
    """HTTPS with the bookie's certificate (httpServerTlsEnable). A client
    certificate is asked for, not required, so that curl reaches /heartbeat; with
    authProvider=tls it is the identity of admin requests."""
    if not conf.tlsCertificatePath:
        raise ConfigError("httpServerTlsEnable=true needs tlsCertificatePath and tlsKeyStore")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, conf.tlsCertificatePath, conf.tlsKeyStore, "the HTTP server's")
    if conf.tlsTrustStore and conf.authProvider == "tls":
        _load_trust(ctx, conf.tlsTrustStore)
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def client_context(conf) -> ssl.SSLContext | None:
    """A client's context (``tlsEnabled``), or None for plaintext."""
    if not conf.tlsEnabled:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if conf.tlsTrustStore:
        _load_trust(ctx, conf.tlsTrustStore)
    else:
        ctx.load_default_certs()
    ctx.check_hostname = bool(conf.tlsHostnameVerificationEnabled)
    if conf.tlsCertificatePath:
        _load_chain(ctx, conf.tlsCertificatePath, conf.tlsKeyStore, "the client's")
    return ctx


def peer_identity(sock: ssl.SSLSocket) -> str | None:
    """The subject CN of the peer's verified certificate, if it sent one."""
    cert = sock.getpeercert()
    for rdn in (cert or {}).get("subject", ()):
        for k, v in rdn:
            if k == "commonName":
                return v
    return None


def reason(e: BaseException) -> str:
    """A short reason for a TLS failure (the verification message when there is one);
    never the bytes of a key or a token."""
    if isinstance(e, ssl.SSLCertVerificationError) and e.verify_message:
        return f"certificate verify failed: {e.verify_message}"
    msg = getattr(e, "reason", None)
    if not msg and isinstance(e, OSError):
        msg = e.strerror
    return str(msg or e)


class ServerTLS:
    """The bookie's server context, built again when its files change."""

    def __init__(self, conf):
        self.conf = conf
        self.refresh = conf.tlsCertFilesRefreshDurationSeconds
        self._watch = FileWatch((conf.tlsCertificatePath, conf.tlsKeyStore,
                                 conf.tlsTrustStore), self.refresh)
        self.ctx = server_context(conf)

    def context(self) -> ssl.SSLContext | None:
        if self.refresh and self.ctx is not None and self._watch.changed():
            try:
                ctx = server_context(self.conf)
            except ConfigError as e:   # a half-written renewal: try next time
                log.warning("TLS files changed but do not load yet: %s", e)
            else:
                self.ctx = ctx
                self._watch.accept()
                log.info("TLS certificate files changed: loaded them again")
        return self.ctx
