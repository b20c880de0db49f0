"""A whole cluster with security on (LocalCluster(secure=True), `bookie localcluster
--secure`): etcd with TLS, client certificates, authentication and a role limited
to the cluster's prefix; bookies requiring TLS and tokens; auto-recovery over
all of it. Real etcd, real bookies, kill -9."""

import glob
import os
import signal
import subprocess
import sys
import time

import pytest

import bk
from bk import protocol as P
from bk.config import Config
from bk.errors import MetadataError, SecurityError
from bk.meta.store import MetadataStore
from bk.rawclient import BookieConnection
from bk.security import ClientSecurity
from bk.security.etcd import EtcdCredentials
from bk.testing import LocalCluster, wait_until

PASSWORD = b"pw"


def _secrets(c):
    """Every secret of the cluster: token key, tokens, etcd passwords."""
    out = []
    for pattern in ("*.token", "*.password", "token.key", "*.key"):
        for path in glob.glob(os.path.join(c.security_dir, pattern)):
            with open(path, errors="replace") as f:
                text = f.read().strip()
            if path.endswith(".key") and "PRIVATE KEY" in text:
                text = text.splitlines()[1]          # a line of the key's body
            out.append(text)
    return out


def _assert_no_secret_in_logs(c):
    secrets = _secrets(c)
    assert len(secrets) >= 6
    logs = glob.glob(os.path.join(c.base_dir, "**", "*.log"), recursive=True)
    logs = [p for p in logs if "entrylogs" not in p]
    assert logs
    for path in logs:
        with open(path, errors="replace") as f:
            text = f.read()
        for s in secrets:
            assert s not in text, f"a secret leaked into {path}"


@pytest.fixture(scope="module")
def secure_cluster(tmp_path_factory):
    """One secure cluster for the module: the first two tests disturb nothing (each
    makes its own ledgers), the third, the last to use it, kills a bookie."""
    c = LocalCluster(num_bookies=4, base_dir=str(tmp_path_factory.mktemp("secure")), num_shards=1,
                     secure=True, conf_overrides={
                         "autoRecoveryDaemonEnabled": True, "lostBookieRecoveryDelay": 1})
    c.start()
    yield c
    c.stop()
    _assert_no_secret_in_logs(c)


def test_etcd_needs_tls_a_client_certificate_and_a_user_limited_to_the_prefix(secure_cluster):
    c = secure_cluster
    s = c.client_settings()
    # plaintext etcd, or TLS without a client certificate: refused
    for creds in (None, EtcdCredentials(trust=open(s["etcdTrustStore"], "rb").read())):
        with pytest.raises(MetadataError):
            with MetadataStore(c.metadata_uri, timeout=2, credentials=creds) as store:
                store.is_formatted()
    conf = Config.load(overrides=s, env={})
    # the certificate alone (its CN is no etcd user with rights): refused
    no_user = EtcdCredentials.from_conf(conf.with_overrides(etcdUser="", etcdPasswordFile=""))
    with pytest.raises(MetadataError):
        with MetadataStore(c.metadata_uri, timeout=2, credentials=no_user) as store:
            store.is_formatted()
    # a wrong password: refused, and the error does not contain the password
    bad = str(c.base_dir) + "/bad.password"
    with open(bad, "w") as f:
        f.write("not-the-password\n")
    with pytest.raises(MetadataError) as e:
        with MetadataStore(c.metadata_uri, timeout=2, credentials=EtcdCredentials.from_conf(
                conf.with_overrides(etcdPasswordFile=bad))) as store:
            store.is_formatted()
    assert "not-the-password" not in str(e.value)
    # the user's role covers the cluster's prefix and nothing else
    good = EtcdCredentials.from_conf(conf)
    assert "password" not in repr(good).replace("etcdPasswordFile", "")
    with MetadataStore(c.metadata_uri, timeout=2, credentials=good) as store:
        assert store.is_formatted()
    other = c.metadata_uri.rsplit("/", 1)[0] + "/other"
    with pytest.raises(MetadataError, match="PERMISSION_DENIED|permission denied"):
        with MetadataStore(other, timeout=2, credentials=good) as store:
            store.is_formatted()


def test_read_only_identity_reads_and_cannot_add_fence_or_delete(secure_cluster):
    # A read-only role on the bookies and a read-only etcd user: every write of
    # either kind is refused with AuthError, and nothing changes.
    from bk.errors import AuthError
    from bk.meta.ledger import LedgerState
    c = secure_cluster
    with bk.BookKeeper(c.metadata_uri, **c.client_settings()) as client, \
            bk.BookKeeper(c.metadata_uri, **c.client_settings("reader")) as reader:
        lh = client.create_ledger(3, 3, 2, password=PASSWORD)       # left open
        for i in range(5):
            lh.add_entry(b"x%d" % i)
        lid = lh.ledger_id
        with reader.open_ledger_no_recovery(lid, password=PASSWORD) as rh:
            assert [e.data for e in rh.read_entries(0, 3)] == [b"x%d" % i for i in range(4)]
        with pytest.raises(AuthError):
            reader.open_ledger(lid, password=PASSWORD)              # recovery: fence + CAS
        with pytest.raises(AuthError):
            reader.delete_ledger(lid)
        with pytest.raises(AuthError):
            reader.create_ledger(3, 3, 2, password=PASSWORD)
        md, _ = c.store.read_ledger(lid)
        assert md.state == LedgerState.OPEN                         # nothing changed
        lh.add_entry(b"x5")
        lh.close()
        with client.open_ledger(lid, password=PASSWORD) as rh:
            assert rh.last_add_confirmed == 5


def test_auto_recovery_rereplicates_a_killed_bookie_over_tls_and_tokens(secure_cluster):
    c = secure_cluster
    with bk.BookKeeper(c.metadata_uri, **c.client_settings(), addEntryTimeoutSec=3,
                       readEntryTimeoutSec=3) as client:
        lh = client.create_ledger(3, 3, 2, password=PASSWORD)
        for i in range(50):
            lh.add_entry(b"entry %d" % i)
        lh.close()
        lid = lh.ledger_id
        md, _ = c.store.read_ledger(lid)
        ensemble = md.ensembles[0][1]
        victim = ensemble[0]
        c.bookie(victim).kill()

        def replaced():
            m, _ = c.store.read_ledger(lid)
            last = m.ensembles[-1][1]
            return victim not in last and last
        wait_until(replaced, timeout=60, what="the ledger re-replicated off the victim")
        new = replaced()
        target = [b for b in new if b not in ensemble][0]
        # the replacement holds every entry: asked over TLS with a super-user token
        sec = ClientSecurity.from_conf(Config.load(overrides={
            **c.client_settings(), "authTokenFile": c._sec("admin.token")}, env={}))
        with BookieConnection(target, P.shard_of(lid, 1), security=sec) as conn:
            r = conn.call(P.get_list_of_entries(conn.next_rid(), lid))
            assert P.ranges_to_ids(r[4]) == list(range(50))
        with client.open_ledger(lid, password=PASSWORD) as rh:
            assert [e.data for e in rh.read_entries(0, 49)] == [b"entry %d" % i
                                                                 for i in range(50)]
    # plaintext clients of the same cluster get nothing
    with pytest.raises(SecurityError):
        BookieConnection(target, 0)


def test_bookie_localcluster_secure_end_to_end(tmp_path):
    d = tmp_path / "lc"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bk.cli.bookie", "localcluster", "--secure", "--dir", str(d),
         "--bookies", "3", "--base-port", "0", "--http-port", "0", "--shards", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("Press Ctrl-C"):
                break
        out = "".join(lines)
        assert "smoke test: wrote and read back 10 entries" in out, out
        conf = str(d / "client.conf")
        assert f"bkshell --conf {conf}" in out
        text = open(conf).read()
        assert "tlsEnabled=true" in text and "etcdUser=bk" in text
        r = subprocess.run([sys.executable, "-m", "bk.cli.shell", "--conf", conf, "simpletest",
                            "--entries", "20"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        # without the conf: no etcd access (TLS and a client certificate are required)
        uri = [ln for ln in lines if ln.startswith("metadataServiceUri=")][0].split("=", 1)[1]
        r = subprocess.run([sys.executable, "-m", "bk.cli.shell", "--metadata", uri.strip(),
                            "--timeout", "2", "listbookies"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode != 0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    secrets = [open(p).read().strip() for p in glob.glob(str(d / "security" / "*.token"))
               + glob.glob(str(d / "security" / "*.password"))]
    printed = "".join(lines)
    for s in secrets:
        assert s not in printed
