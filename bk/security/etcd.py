"""How bk components reach etcd: TLS (the CA of etcd's certificate, a client
certificate) and etcd's user/password authentication.

Every component builds its :class:`EtcdCredentials` from its configuration
(``etcdTrustStore``, ``etcdCertificatePath`` + ``etcdKeyStore``, ``etcdUser`` +
``etcdPasswordFile``) and hands it to :class:`bk.meta.store.MetadataStore`.
The password is read from its file, kept in memory only, and never appears
in a repr, a log line or an error message.
"""

from __future__ import annotations

import grpc

from bk.errors import ConfigError
from bk.security import ETCD_KEYS


def _read(path: str, key: str, binary: bool = True):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {key}={path}: {e.strerror}") from None
    return data if binary else data.decode("utf-8").strip()


class EtcdCredentials:
    """TLS material and user/password for etcd (all optional)."""

    def __init__(self, trust: bytes | None = None, cert: bytes | None = None,
                 key: bytes | None = None, user: str | None = None,
                 password: str | None = None):
        if (cert is None) != (key is None):
            raise ConfigError("etcdCertificatePath and etcdKeyStore go together")
        if (user is None) != (password is None):
            raise ConfigError("etcdUser needs etcdPasswordFile (and the other way round)")
        self.trust, self.cert, self.key = trust, cert, key
        self.user, self.password = user, password

    @classmethod
    def from_conf(cls, conf) -> "EtcdCredentials":
        def opt(key, binary=True):
            path = conf[key]
            return _read(path, key, binary) if path else None
        return cls(trust=opt("etcdTrustStore"), cert=opt("etcdCertificatePath"),
                   key=opt("etcdKeyStore"), user=conf.etcdUser or None,
                   password=opt("etcdPasswordFile", binary=False))

    @property
    def secure(self) -> bool:
        """TLS to etcd (a trust store or a client certificate is set)."""
        return self.trust is not None or self.cert is not None

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.secure:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.trust,
                                            private_key=self.key, certificate_chain=self.cert)

    def __repr__(self):              # never the password
        return (f"EtcdCredentials(tls={self.secure}, client_cert={self.cert is not None}, "
                f"user={self.user!r})")


NONE = EtcdCredentials()


def settings(conf) -> dict:
    """The etcd settings of ``conf`` (file paths and the user name, no secret)."""
    return {k: conf[k] for k in ETCD_KEYS}
