"""A throwaway certificate authority for local clusters and benchmarks.

``bookie localcluster --secure`` and ``scripts/bench_*.py --tls`` need a CA
and certificates without an operator's PKI: :func:`make_ca` makes one and
:meth:`LocalCA.issue` signs certificates for hosts (subject alternative
names) with a chosen CN (a role for ``authProvider=tls``). Keys are written
with mode 0600. Production clusters use their own PKI.
"""

from __future__ import annotations

import datetime
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 365


def _write_key(path: str, key) -> None:
    data = key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _san(hosts) -> x509.SubjectAlternativeName:
    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


class LocalCA:
    """A CA whose certificate is ``cert_path`` (the trust store to give clients)."""

    def __init__(self, directory: str, key, cert):
        self.dir = directory
        self.key = key
        self.cert = cert
        self.cert_path = os.path.join(directory, "ca.pem")

    def issue(self, label: str, hosts, common_name: str | None = None,
              days: int = VALID_DAYS) -> tuple[str, str]:
        """Sign a certificate for ``hosts`` (IP addresses or names), valid for server and
        client use, CN ``common_name`` (default: the first host); returns the paths of
        the certificate (with the CA's after it) and of its key."""
        hosts = list(hosts)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder()
                   .subject_name(_name(common_name or hosts[0]))
                   .issuer_name(self.cert.subject)
                   .public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=days))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                  critical=True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]),
                                  critical=False))
        if hosts:
            builder = builder.add_extension(_san(hosts), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        crt = os.path.join(self.dir, f"{label}.crt")
        key_path = os.path.join(self.dir, f"{label}.key")
        with open(crt, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
            f.write(self.cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_path, key)
        return crt, key_path


def make_ca(directory: str, name: str = "bk local CA") -> LocalCA:
    """A new CA in ``directory`` (created): ``ca.pem`` and ``ca.key``."""
    os.makedirs(directory, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    ca = LocalCA(directory, key, cert)
    with open(ca.cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(os.path.join(directory, "ca.key"), key)
    return ca


def throwaway_ca(prefix: str = "bk-throwaway-ca-") -> LocalCA:
    """A CA in a new temporary directory that is removed when the process exits
    (benchmarks' TLS runs: its key and the certificates it issues go with it)."""
    import atexit
    import shutil
    import tempfile
    directory = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, directory, True)
    return make_ca(directory)
