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


# Plaintext bytes per SSLObject.write: whole TLS records (16 KiB each) come out of
# it, and a larger piece only means a larger join of small buffers.
WRITE_PIECE = 1 << 16
# Plaintext of one TLS record, at most (2**14): what one SSLObject.read returns.
RECORD = 1 << 14
_IOV = 512


class TLSStream:
    """TLS on a non-blocking socket through memory BIOs, for the event loops of the
    client (``bk.client.connection``) and the shard worker.

    An ``SSLSocket`` reads each record with two ``read`` syscalls (its header, then
    its body) and writes each record with one ``write``; at 30,000 entries/s that is
    a syscall per 16 KiB each way plus an exception per drained socket. Here the
    socket is read in large chunks (one ``recv_into`` per readiness event) that
    the SSL object decrypts from memory, and what it encrypts (any number of
    records) leaves with one ``sendmsg``. Ciphertext the socket does not take waits
    in ``backlog``, so a write never has to be retried with the same bytes.

    What it costs (docs/performance-log.md, TLS; ``scripts/bench_tls.py``): OpenSSL
    spends about 1.1 µs per record and 0.3-0.4 µs per KiB each way, and the Python
    around it is paid per readiness event, not per entry; at the batches of a
    quiet 30,000 entries/s that fixed part is most of what TLS adds. So the hot
    calls go to the C object under ``ssl.SSLObject`` (``_ssl``: the same methods
    without the wrapper's Python frame), a send of one buffer takes no loop, and a
    backlog of one piece leaves with ``send``.
    """

    __slots__ = ("sock", "obj", "_ssl", "_in", "_out", "backlog", "backlog_bytes", "eof",
                 "_scratch", "_view")

    def __init__(self, ctx: ssl.SSLContext, sock, server_side: bool,
                 server_hostname: str | None = None):
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self._in, self._out, server_side=server_side,
                                server_hostname=server_hostname)
        # The C-level object ssl.SSLObject wraps (same read/write/pending; without
        # it, the wrapper itself).
        self._ssl = getattr(self.obj, "_sslobj", None) or self.obj
        self.sock = sock
        self.backlog = []          # ciphertext the socket has not taken (bytes, views)
        self.backlog_bytes = 0
        self.eof = False           # the peer closed its side
        self._scratch = self._view = None    # the caller's scratch buffer, and a view of it

    def handshake(self) -> bool:
        """Advance the handshake (after :meth:`feed`); True once it is done.
        ssl.SSLError if it failed (its alert, if any, is in the backlog)."""
        try:
            self.obj.do_handshake()
            return True
        except ssl.SSLWantReadError:
            return False
        finally:
            self._pull()

    def feed(self, scratch: bytearray) -> int:
        """Move what the socket holds (one read, at most ``len(scratch)``) into the
        SSL object; the bytes read (0: none; sets ``eof`` if the peer closed).
        OSError if the socket broke."""
        try:
            n = self.sock.recv_into(scratch)
        except (BlockingIOError, InterruptedError):
            return 0
        if not n:
            self.eof = True
            self._in.write_eof()
            return 0
        if scratch is not self._scratch:
            self._scratch, self._view = scratch, memoryview(scratch)
        self._in.write(self._view[:n])
        return n

    def recv_into(self, fb, scratch: bytearray) -> int:
        """Read the socket once and decrypt every whole record into the FrameBuffer
        ``fb``; the plaintext bytes it got (0 with ``eof`` set: the peer closed).
        ssl.SSLError on a TLS error (an alert of the peer), OSError if the socket
        broke."""
        # feed(), inline: this runs once per readiness event of every connection
        try:
            n = self.sock.recv_into(scratch)
        except (BlockingIOError, InterruptedError):
            n = -1
        inbuf = self._in
        if n > 0:
            if scratch is not self._scratch:
                self._scratch, self._view = scratch, memoryview(scratch)
            inbuf.write(self._view[:n])
        elif not n:
            self.eof = True
            inbuf.write_eof()
        obj = self._ssl
        read = obj.read
        got = 0
        # Read while a whole record may be there: fewer than 5 bytes (a record's
        # header) cannot be one, and a read that finds none raises, which costs more
        # than this check (the usual case: the last record was taken whole). A read
        # returns one record's plaintext, so the SSL object can hold more only after
        # a read that filled what was asked. Each read asks ``fb`` for one record's
        # room, not a socket read's: 256 KiB asked for behind a record already taken
        # would make the buffer double (and copy itself) whenever one socket read
        # brings two records.
        more = inbuf.pending >= 5 or self.eof
        while more:
            try:
                n = read(RECORD, fb.recv_buffer(RECORD))
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:       # close_notify
                self.eof = True
                break
            except ssl.SSLEOFError:
                if not self.eof:
                    raise
                break
            if not n:                    # close_notify (Python reads it as 0 bytes)
                self.eof = True
                break
            fb.commit(n)
            got += n
            more = inbuf.pending >= 5 or self.eof or n == RECORD and obj.pending()
        if self._out.pending:        # TLS 1.3 may answer (a key update)
            self._pull()
        return got

    def encrypt(self, bufs) -> None:
        """Encrypt the buffers ``bufs`` (small ones joined up to WRITE_PIECE, so that
        records are full) into the backlog; send it with :meth:`flush`."""
        write = self._ssl.write
        if len(bufs) == 1:               # an answer, a lone request: no loop
            write(bufs[0])
        else:
            i, k = 0, len(bufs)
            while i < k:
                j, size = i + 1, len(bufs[i])
                while j < k and size < WRITE_PIECE:
                    size += len(bufs[j])
                    j += 1
                write(bufs[i] if j == i + 1 else b"".join(bufs[i:j]))
                i = j
        out = self._out                  # _pull(), inline
        if out.pending:
            data = out.read()
            self.backlog.append(data)
            self.backlog_bytes += len(data)

    def _pull(self) -> None:
        out = self._out
        if out.pending:
            data = out.read()
            self.backlog.append(data)
            self.backlog_bytes += len(data)

    def flush(self) -> int:
        """Send the backlog (sendmsg, as much as the socket takes); the bytes left.
        OSError if the socket broke."""
        q = self.backlog
        if len(q) == 1:                  # the usual case: one pull's ciphertext
            data = q[0]
            try:
                n = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                return self.backlog_bytes
            if n == len(data):
                q.clear()
                self.backlog_bytes = 0
                return 0
            q[0] = memoryview(data)[n:]
            self.backlog_bytes -= n
            return self.backlog_bytes
        while q:
            chunk = q[:_IOV] if len(q) > _IOV else q
            k = len(chunk)
            try:
                n = self.sock.sendmsg(chunk)
            except (BlockingIOError, InterruptedError):
                break
            self.backlog_bytes -= n
            i = 0
            while i < k and n >= len(q[i]):
                n -= len(q[i])
                i += 1
            if i < k and n:
                q[i] = memoryview(q[i])[n:]
            del q[:i]
            if i < k:                    # the socket took less than offered: full
                break
        return self.backlog_bytes

    def peer_identity(self) -> str | None:
        return peer_identity(self.obj)
