"""TLS and identities on the bookie protocol, with real bookie processes.

Certificates come from trustme (a throwaway CA per test module); tokens from
bk.security.tokens, as `bkshell tokens` makes them.
"""

import glob
import json
import os
import shutil

import pytest
import trustme

import bk
from bk import protocol as P
from bk.errors import EAUTH, EOK, AuthError, ConfigError, SecurityError
from bk.rawclient import BookieConnection
from bk.security import ClientSecurity, auth
from bk.security.tokens import create_token, verify_token
from bk.config import Config
from bk.testing import LocalCluster, wait_until

PASSWORD = b"pw"


class Pki:
    """A CA and the files of certificates it issued, under ``root``."""

    def __init__(self, root, name="ca"):
        self.root = root
        self.ca = trustme.CA()
        self.trust = os.path.join(root, f"{name}.pem")
        self.ca.cert_pem.write_to_path(self.trust)
        self.name = name

    def issue(self, label, *hosts, common_name=None, **validity):
        cert = self.ca.issue_cert(*hosts, common_name=common_name, **validity)
        crt = os.path.join(self.root, f"{self.name}-{label}.crt")
        key = os.path.join(self.root, f"{self.name}-{label}.key")
        with open(crt, "wb") as f:
            for blob in cert.cert_chain_pems:
                f.write(blob.bytes())
        cert.private_key_pem.write_to_path(key)
        return crt, key


def client_security(trust=None, cert=None, key=None, token=None, verify_host=True):
    conf = Config.load(overrides={"tlsEnabled": trust is not None, "tlsTrustStore": trust or "",
                                  "tlsCertificatePath": cert or "", "tlsKeyStore": key or "",
                                  "tlsHostnameVerificationEnabled": verify_host,
                                  "authToken": token or ""}, env={})
    return ClientSecurity.from_conf(conf)


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """Three bookies requiring TLS and tokens; roles bookie (super user), app
    (client) and reader (read-only)."""
    root = str(tmp_path_factory.mktemp("pki"))
    pki = Pki(root)
    crt, key = pki.issue("bookie", "127.0.0.1", "localhost")
    secret = os.path.join(root, "secret.key")
    auth.write_secret_key(secret, auth.create_secret_key())
    k = auth.read_secret_key(secret)
    tokens = {r: create_token(k, r) for r in ("bookie", "app", "reader", "stranger")}
    conf = {"tlsCertificatePath": crt, "tlsKeyStore": key, "tlsTrustStore": pki.trust,
            "tlsEnabled": True, "authProvider": "token", "tokenSecretKeyFile": secret,
            "superUserRoles": "bookie", "clientRoles": "app", "readOnlyRoles": "reader",
            "authToken": tokens["bookie"]}
    c = LocalCluster(num_bookies=3, base_dir=str(tmp_path_factory.mktemp("secure")),
                     num_shards=2, conf_overrides=conf)
    c.start()
    c.pki, c.tokens, c.secret = pki, tokens, secret
    c.crt, c.key = crt, key
    yield c
    c.stop()
    # no token and no key in any log of the run
    key_text = open(secret).read().strip()
    for path in glob.glob(os.path.join(c.base_dir, "**", "*.log"), recursive=True):
        text = open(path, errors="replace").read()
        for t in tokens.values():
            assert t not in text, f"a token leaked into {path}"
        assert key_text not in text, f"the secret key leaked into {path}"


def sec_client(c, role, **kw):
    return c.client(tlsEnabled=True, tlsTrustStore=c.pki.trust, authToken=c.tokens[role], **kw)


def test_tls_required_refuses_plaintext_while_tls_clients_go_on(secure):
    b = secure.bookies[0].bookie_id
    with pytest.raises(SecurityError, match="requires TLS"):
        BookieConnection(b, 0)
    with sec_client(secure, "app") as client:
        with client.create_ledger(3, 3, 2, password=PASSWORD) as lh:
            for i in range(20):
                lh.add_entry(b"e%d" % i)
            lid = lh.ledger_id
        # the plaintext attempt above changed nothing for TLS clients
        with pytest.raises(SecurityError, match="requires TLS"):
            BookieConnection(b, 0)
        with client.open_ledger(lid, password=PASSWORD) as rh:
            assert [e.data for e in rh.read_entries(0, 19)] == [b"e%d" % i for i in range(20)]
    # a plaintext client fails with the reason, never hangs or falls back
    with secure.client(timeout=2.0) as plain:
        with pytest.raises(bk.errors.BKError):
            with plain.open_ledger(lid, password=PASSWORD) as rh:
                rh.read_entries(0, 0)


def test_client_trusting_another_ca_is_refused(secure, tmp_path):
    other = Pki(str(tmp_path), "other")
    with pytest.raises(SecurityError, match="certificate verify failed|unable to get local"):
        BookieConnection(secure.bookies[0].bookie_id, 0,
                         security=client_security(other.trust, token=secure.tokens["app"]))
    with BookieConnection(secure.bookies[0].bookie_id, 0,
                          security=client_security(secure.pki.trust,
                                                   token=secure.tokens["app"])) as c:
        assert c.role == "app"


def test_tokens_wrong_key_expired_missing_and_unknown_role_are_refused(secure, tmp_path):
    b = secure.bookies[1].bookie_id
    other_key = auth.create_secret_key()
    cases = {
        "signature does not verify": create_token(other_key, "app"),
        "expired": create_token(auth.read_secret_key(secure.secret), "app", -10),
        "no token": None,
        "in none of": secure.tokens["stranger"],
    }
    for why, token in cases.items():
        with pytest.raises(AuthError, match=why):
            BookieConnection(b, 0, security=client_security(secure.pki.trust, token=token))
    # a client with a bad token: the error names the reason
    with pytest.raises(bk.errors.BKError):
        with secure.client(timeout=2.0, tlsEnabled=True, tlsTrustStore=secure.pki.trust,
                           authToken=cases["expired"]) as client:
            with client.create_ledger(3, 3, 2, password=PASSWORD) as lh:
                lh.add_entry(b"x")
    # the old plaintext shared secret is a clear configuration error
    with pytest.raises(ConfigError, match="not a signed token"):
        bk.BookKeeper(secure.metadata_uri, authToken="s3cret")


def test_read_only_role_reads_but_cannot_add_or_fence(secure):
    with sec_client(secure, "app") as client, sec_client(secure, "reader") as reader:
        lh = client.create_ledger(3, 3, 2, password=PASSWORD)     # left open
        for i in range(5):
            lh.add_entry(b"r%d" % i)
        lid = lh.ledger_id
        with reader.open_ledger_no_recovery(lid, password=PASSWORD) as rh:
            assert [e.data for e in rh.read_entries(0, 3)] == [b"r%d" % i for i in range(4)]
        with pytest.raises(AuthError):
            reader.open_ledger(lid, password=PASSWORD)            # recovery fences
        lh.add_entry(b"r5")                                        # not fenced: goes on
        with pytest.raises(AuthError):
            with reader.create_ledger(3, 3, 2, password=PASSWORD) as wh:
                wh.add_entry(b"nope")
        # The refused recovery did mark the ledger IN_RECOVERY in etcd (metadata
        # writes are etcd's to refuse, with RBAC): a client role finishes it.
        with client.open_ledger(lid, password=PASSWORD) as rh:
            assert rh.last_add_confirmed == 5
    # the raw ops, one by one, on one connection that stays up
    b = secure.bookies[0].bookie_id
    sec = client_security(secure.pki.trust, token=secure.tokens["reader"])
    n = 2
    with BookieConnection(b, P.shard_of(lid, n), security=sec) as c:
        assert c.role == "reader"
        r = c.call(P.read(c.next_rid(), lid, 0))
        assert r[2] == EOK and r[7] == b"r0"
        mk = b"\0" * 20
        assert c.call(P.add(c.next_rid(), lid, 99, -1, mk, b"", b"x"))[2] == EAUTH
        assert c.call(P.read(c.next_rid(), lid, 0, fence=True, master_key=mk))[2] == EAUTH
        assert c.call(P.read_lac(c.next_rid(), lid, fence=True, master_key=mk))[2] == EAUTH
        assert c.call(P.read_lac(c.next_rid(), lid))[2] == EOK


def test_mutual_tls_without_a_client_certificate_is_refused(cluster_factory, tmp_path):
    pki = Pki(str(tmp_path))
    crt, key = pki.issue("bookie", "127.0.0.1")
    ccrt, ckey = pki.issue("client", "client.example", common_name="app")
    c = cluster_factory(0)
    b = c.add_bookie(tlsCertificatePath=crt, tlsKeyStore=key, tlsTrustStore=pki.trust,
                     tlsClientAuthentication=True, authProvider="tls", clientRoles="app",
                     tlsEnabled=True)
    with pytest.raises(SecurityError):
        BookieConnection(b.bookie_id, 0, security=client_security(pki.trust))
    with BookieConnection(b.bookie_id, 0,
                          security=client_security(pki.trust, ccrt, ckey)) as cc:
        assert cc.role == "app"          # the certificate's CN is the role
        assert cc.call(P.ping(cc.next_rid()))[2] == EOK


def test_wrong_host_certificate_is_refused_with_hostname_verification(cluster_factory,
                                                                     tmp_path):
    pki = Pki(str(tmp_path))
    crt, key = pki.issue("bookie", "elsewhere.example")
    c = cluster_factory(0)
    b = c.add_bookie(tlsCertificatePath=crt, tlsKeyStore=key)
    with pytest.raises(SecurityError, match="[Hh]ostname mismatch|doesn't match|not valid for"):
        BookieConnection(b.bookie_id, 0, security=client_security(pki.trust))
    with BookieConnection(b.bookie_id, 0,
                          security=client_security(pki.trust, verify_host=False)) as cc:
        assert cc.call(P.ping(cc.next_rid()))[2] == EOK


def test_renewed_certificate_is_picked_up_without_a_restart(cluster_factory, tmp_path):
    old, new = Pki(str(tmp_path), "old"), Pki(str(tmp_path), "new")
    crt, key = old.issue("bookie", "127.0.0.1")
    live_crt, live_key = str(tmp_path / "bookie.crt"), str(tmp_path / "bookie.key")
    shutil.copy(crt, live_crt)
    shutil.copy(key, live_key)
    c = cluster_factory(0)
    b = c.add_bookie(tlsCertificatePath=live_crt, tlsKeyStore=live_key,
                     tlsCertFilesRefreshDurationSeconds=1)
    pid = b.pid
    with BookieConnection(b.bookie_id, 0, security=client_security(old.trust)) as cc:
        assert cc.call(P.ping(cc.next_rid()))[2] == EOK
    with pytest.raises(SecurityError):
        BookieConnection(b.bookie_id, 0, security=client_security(new.trust))
    ncrt, nkey = new.issue("bookie", "127.0.0.1")
    # the key first, then the certificate (as a renewal tool would replace them)
    shutil.copy(nkey, live_key + ".tmp")
    os.replace(live_key + ".tmp", live_key)
    shutil.copy(ncrt, live_crt + ".tmp")
    os.replace(live_crt + ".tmp", live_crt)

    def renewed():
        try:
            with BookieConnection(b.bookie_id, 0, security=client_security(new.trust)) as cc:
                return cc.call(P.ping(cc.next_rid()))[2] == EOK
        except SecurityError:
            return False
    wait_until(renewed, timeout=20, what="the renewed certificate served")
    assert b.pid == pid


def test_bkshell_tokens_make_a_key_and_tokens_a_bookie_accepts(secure, tmp_path):
    import subprocess
    import sys

    def shell(*args):
        return subprocess.run([sys.executable, "-m", "bk.cli.shell", *args],
                              capture_output=True, text=True, timeout=60)
    key = str(tmp_path / "key")
    assert shell("tokens", "create-secret-key", "--output", key).returncode == 0
    assert os.stat(key).st_mode & 0o077 == 0
    again = shell("tokens", "create-secret-key", "--output", key)
    assert again.returncode != 0 and "exists" in again.stderr
    r = shell("tokens", "create", "--secret-key-file", key, "--subject", "app",
              "--expiry-time", "60")
    assert r.returncode == 0
    token = r.stdout.strip()
    assert verify_token(auth.read_secret_key(key), token) == "app"
    # a token made with the cluster's key by the command is accepted by the bookies
    r = shell("tokens", "create", "--secret-key-file", secure.secret, "--subject", "app")
    with BookieConnection(secure.bookies[2].bookie_id, 0,
                          security=client_security(secure.pki.trust,
                                                   token=r.stdout.strip())) as c:
        assert c.role == "app"


def _https(port, path, trust, token=None):
    import json
    import ssl
    import urllib.error
    import urllib.request
    ctx = ssl.create_default_context(cafile=trust)
    req = urllib.request.Request(f"https://127.0.0.1:{port}{path}")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        body = e.read().decode()
        return e.code, json.loads(body)["error"]


@pytest.mark.parametrize("auth_metrics", [False, True])
def test_https_admin_views_need_a_super_user_token(cluster_factory, tmp_path, auth_metrics):
    from bk.util import free_port
    pki = Pki(str(tmp_path))
    crt, key = pki.issue("bookie", "127.0.0.1")
    secret = str(tmp_path / "secret.key")
    auth.write_secret_key(secret, auth.create_secret_key())
    k = auth.read_secret_key(secret)
    admin, app = create_token(k, "admin"), create_token(k, "app")
    port = free_port()
    c = cluster_factory(0)
    c.add_bookie(tlsCertificatePath=crt, tlsKeyStore=key, httpServerEnabled=True,
                 httpServerPort=port, httpServerTlsEnable=True, authProvider="token",
                 tokenSecretKeyFile=secret, superUserRoles="admin", clientRoles="app",
                 httpServerAuthMetrics=auth_metrics)
    # admin views: 401 without a token or with a bad one, 403 for another role
    assert _https(port, "/api/v1/bookie/state", pki.trust)[0] == 401
    assert _https(port, "/api/v1/bookie/state", pki.trust, "not.a.token")[0] == 401
    code, why = _https(port, "/api/v1/bookie/state", pki.trust, app)
    assert code == 403 and "not a super-user" in why
    code, body = _https(port, "/api/v1/bookie/state", pki.trust, admin)
    assert code == 200 and "running" in body.lower()
    # heartbeat and metrics: open unless httpServerAuthMetrics
    for path in ("/heartbeat", "/metrics"):
        assert _https(port, path, pki.trust)[0] == (401 if auth_metrics else 200)
        assert _https(port, path, pki.trust, admin)[0] == 200
    # plain HTTP is not served on an HTTPS port
    from bk.testing import http_get
    assert http_get(port, "/heartbeat")[0] != 200


def test_expired_bookie_certificate_is_refused(cluster_factory, tmp_path):
    import datetime
    pki = Pki(str(tmp_path))
    now = datetime.datetime.now(datetime.timezone.utc)
    crt, key = pki.issue("bookie", "127.0.0.1", not_before=now - datetime.timedelta(days=10),
                         not_after=now - datetime.timedelta(days=1))
    c = cluster_factory(0)
    b = c.add_bookie(tlsCertificatePath=crt, tlsKeyStore=key)
    with pytest.raises(SecurityError, match="expired"):
        BookieConnection(b.bookie_id, 0, security=client_security(pki.trust))


def test_a_tailing_reader_long_polls_over_tls_while_a_writer_adds(secure):
    import threading
    with sec_client(secure, "app") as writer, sec_client(secure, "reader") as reader:
        lh = writer.create_ledger(3, 3, 2, password=PASSWORD)
        lh.add_entry(b"t0")
        rh = reader.open_ledger_no_recovery(lh.ledger_id, password=PASSWORD)
        got = []

        def tail():
            next_id = 0
            while next_id < 30:
                _lac, entry = rh.read_last_add_confirmed_and_entry(next_id, timeout=2.0)
                if entry is not None:
                    got.append(entry.data)
                    next_id += 1
        t = threading.Thread(target=tail)
        t.start()
        for i in range(1, 31):
            lh.add_entry(b"t%d" % i)
        t.join(60)
        assert not t.is_alive()
        assert got == [b"t%d" % i for i in range(30)]
        lh.close()
        rh.close()


def _bkshell(*args):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "bk.cli.shell", *args], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _connects(bookie_id, token):
    """The role a new connection presenting ``token`` gets, or the AuthError's text."""
    try:
        with BookieConnection(bookie_id, 0, security=ClientSecurity(None, token)) as c:
            return c.role
    except AuthError as e:
        return str(e)


def test_token_key_rotation_and_revocation_without_a_restart(cluster_factory, tmp_path):
    key, revoked = str(tmp_path / "token.key"), str(tmp_path / "revoked")
    _bkshell("tokens", "create-secret-key", "--output", key)
    open(revoked, "w").close()
    t_old = _bkshell("tokens", "create", "-k", key, "--subject", "app")
    c = cluster_factory(0)
    b = c.add_bookie(authProvider="token", tokenSecretKeyFile=key, tokenRevocationFile=revoked,
                     tokenFilesRefreshDurationSeconds=1, clientRoles="app",
                     superUserRoles="bookie", numShards=1)
    pid = b.pid
    held_old = BookieConnection(b.bookie_id, 0, security=ClientSecurity(None, t_old))
    assert held_old.role == "app"
    # a client reading its token from a file, writing a ledger on this one bookie
    token_file = tmp_path / "app.token"
    token_file.write_text(t_old + "\n")
    client = c.client(authTokenFile=str(token_file))
    lh = client.create_ledger(1, 1, 1, password=PASSWORD)
    lh.add_entry(b"before")

    # rotate: a new key signs, the old one still verifies
    _bkshell("tokens", "create-secret-key", "--rotate", "--output", key)
    kids = json.loads(_bkshell("tokens", "list-secret-keys", "-k", key, "--json"))
    assert [k["signs"] for k in kids] == [True, False]
    t_new = _bkshell("tokens", "create", "-k", key, "--subject", "app")
    assert json.loads(_bkshell("tokens", "show", t_new))["kid"] == kids[0]["kid"]
    wait_until(lambda: _connects(b.bookie_id, t_new) == "app", timeout=20,
               what="a token of the rotated-in key accepted")
    assert _connects(b.bookie_id, t_old) == "app"
    held_new = BookieConnection(b.bookie_id, 0, security=ClientSecurity(None, t_new))

    # the client gets its new token; the old key is removed: its tokens are refused,
    # its open connections closed, and the client goes on with the new token
    token_file.write_text(t_new + "\n")
    _bkshell("tokens", "remove-secret-key", "-k", key, "--key-id", kids[1]["kid"])
    wait_until(lambda: "no longer" in _connects(b.bookie_id, t_old), timeout=20,
               what="a token of the removed key refused")
    assert held_old.closed_by_peer(timeout=10)
    held_old.close()
    lh.close()

    def writes():
        try:
            with client.create_ledger(1, 1, 1, password=PASSWORD) as again:
                again.add_entry(b"after")
            return True
        except bk.errors.BKError:      # its connection closed under that add: again
            return False
    wait_until(writes, timeout=20, what="the client writing with its new token")
    assert held_new.call(P.ping(held_new.next_rid()))[2] == EOK

    # revoke the new token: refused at its next connection, its open one closed;
    # another token of the same role still works
    _bkshell("tokens", "revoke", "--revocation-file", revoked, "--token", t_new)
    wait_until(lambda: "revoked" in _connects(b.bookie_id, t_new), timeout=20,
               what="the revoked token refused")
    assert held_new.closed_by_peer(timeout=10)
    held_new.close()
    t_other = _bkshell("tokens", "create", "-k", key, "--subject", "app")
    assert _connects(b.bookie_id, t_other) == "app"
    with pytest.raises(bk.errors.BKError, match="revoked"):
        with c.client(authTokenFile=str(token_file), timeout=2.0) as revoked_client:
            with revoked_client.open_ledger(lh.ledger_id, password=PASSWORD) as rh:
                rh.read_entries(0, 0)
    client.close()
    assert b.pid == pid
    with c.client(authToken=t_other) as reader:
        with reader.open_ledger(lh.ledger_id, password=PASSWORD) as rh:
            assert [e.data for e in rh.read_entries(0, 0)] == [b"before"]


def test_autorecovery_daemon_serves_https_admin_views_to_super_users(cluster_factory,
                                                                      tmp_path):
    import signal
    import subprocess
    import sys
    from bk.util import free_port
    pki = Pki(str(tmp_path))
    crt, key = pki.issue("autorecovery", "127.0.0.1")
    secret = str(tmp_path / "secret.key")
    auth.write_secret_key(secret, auth.create_secret_key())
    k = auth.read_secret_key(secret)
    admin, app = create_token(k, "admin"), create_token(k, "app")
    c = cluster_factory(1)
    port = free_port()
    settings = {"httpServerEnabled": "true", "httpServerPort": port,
                "httpServerTlsEnable": "true", "tlsCertificatePath": crt, "tlsKeyStore": key,
                "authProvider": "token", "tokenSecretKeyFile": secret,
                "superUserRoles": "admin", "clientRoles": "app"}
    args = [sys.executable, "-m", "bk.cli.bookie", "autorecovery", "--metadata",
            c.metadata_uri, "--log-file", str(tmp_path / "autorecovery.log")]
    for name, value in settings.items():
        args += ["--set", f"{name}={value}"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        def up():
            try:
                return _https(port, "/heartbeat", pki.trust)[0] == 200
            except OSError:
                assert proc.poll() is None, "bookie autorecovery exited"
                return False
        wait_until(up, timeout=30, what="bookie autorecovery serving HTTPS")
        status = "/api/v1/autorecovery/status"
        assert _https(port, status, pki.trust)[0] == 401
        code, why = _https(port, status, pki.trust, app)
        assert code == 403 and "not a super-user" in why
        code, body = _https(port, status, pki.trust, admin)
        assert code == 200 and json.loads(body)["here"] is True
        assert _https(port, "/metrics", pki.trust)[0] == 200
        from bk.testing import http_get
        assert http_get(port, "/heartbeat")[0] != 200      # no plaintext on that port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    text = open(tmp_path / "autorecovery.log").read()
    assert admin not in text and app not in text and open(secret).read().strip() not in text


def _auth_failures(port) -> dict:
    """{kind: count} of bookie_AUTH_FAILURES from one /metrics scrape."""
    from prometheus_client.parser import text_string_to_metric_families
    from bk.testing import http_get
    status, text, _ = http_get(port, "/metrics")
    assert status == 200
    return {s.labels["kind"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "bookie_AUTH_FAILURES_total"}


def test_auth_failures_metric_counts_exactly_the_refusals(cluster_factory, tmp_path):
    pki = Pki(str(tmp_path))
    crt, key = pki.issue("bookie", "127.0.0.1")
    secret = str(tmp_path / "secret.key")
    auth.write_secret_key(secret, auth.create_secret_key())
    k = auth.read_secret_key(secret)
    c = cluster_factory(0)
    b = c.add_bookie(tlsCertificatePath=crt, tlsKeyStore=key, authProvider="token",
                     tokenSecretKeyFile=secret, clientRoles="app", readOnlyRoles="reader",
                     httpServerEnabled=True, httpServerPort=0, numShards=2)
    port = c.store.bookie_info(b.bookie_id)["httpPort"]
    assert _auth_failures(port) == {}
    for _ in range(2):                                            # tls_required
        with pytest.raises(SecurityError, match="requires TLS"):
            BookieConnection(b.bookie_id, 0)
    for token in (None, create_token(k, "app", -5),          # auth
                  create_token(auth.create_secret_key(), "app")):
        with pytest.raises(AuthError):
            BookieConnection(b.bookie_id, 1, security=client_security(pki.trust, token=token))
    reader = create_token(k, "reader")
    with BookieConnection(b.bookie_id, 0, security=client_security(pki.trust,
                                                                 token=reader)) as conn:
        for eid in range(4):                                      # op
            r = conn.call(P.add(conn.next_rid(), 5, eid, -1, b"k" * 20, b"", b"x"))
            assert r[2] == EAUTH
        assert conn.call(P.read_lac(conn.next_rid(), 5))[2] != EAUTH
    expected = {"tls_required": 2, "auth": 3, "op": 4}
    wait_until(lambda: _auth_failures(port) == expected, timeout=20,
               what=f"bookie_AUTH_FAILURES == {expected}")
    # nothing else counted afterwards: one more refusal moves it by exactly one
    with pytest.raises(SecurityError):
        BookieConnection(b.bookie_id, 1)
    expected["tls_required"] += 1
    wait_until(lambda: _auth_failures(port) == expected, timeout=20,
               what=f"bookie_AUTH_FAILURES == {expected}")


def test_slow_tls_reader_of_big_entries_keeps_the_bookie_bounded(cluster_factory, tmp_path):
    """A TLS connection's output is bounded as a plaintext one's (OUT_HIGH): a TLS
    reader that asks for 500 MiB of answers and reads nothing for a while does not
    make the worker encrypt and hold them all."""
    import socket
    import time
    import psutil
    pki = Pki(str(tmp_path))
    crt, key = pki.issue("bookie", "127.0.0.1")
    c = cluster_factory(0)
    b = c.add_bookie(tlsCertificatePath=crt, tlsKeyStore=key, numShards=1,
                     nettyMaxFrameSizeBytes=6 << 20, journalPreAllocSizeMB=16)
    sec = client_security(pki.trust)
    lid, big = 1 << 50, 5 << 20
    entries = [os.urandom(16) * (big // 16) for _ in range(4)]
    with BookieConnection(b.bookie_id, 0, security=sec) as conn:
        for eid, data in enumerate(entries):
            r = conn.call(P.add(conn.next_rid(), lid, eid, eid - 1, b"k" * 20, b"", data))
            assert r[2] == EOK
    worker = psutil.Process(b.worker_pids()[0])
    base = worker.memory_info().rss
    with BookieConnection(b.bookie_id, 0, security=sec) as conn:
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        rids = []
        for i in range(100):
            rids.append(conn.next_rid())
            conn.send(P.read(rids[-1], lid, i % len(entries)))
        peak = base
        deadline = time.monotonic() + 2.0          # the reader reads nothing meanwhile
        while time.monotonic() < deadline:
            peak = max(peak, worker.memory_info().rss)
            time.sleep(0.05)
        assert peak - base < 150 << 20, (base, peak)
        for i, rid in enumerate(rids):
            r = conn.recv()
            assert r[1] == rid and r[2] == EOK and r[7] == entries[i % len(entries)]
            peak = max(peak, worker.memory_info().rss)
    assert peak - base < 150 << 20, (base, peak)
