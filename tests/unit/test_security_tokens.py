"""bk.security without processes: tokens, roles, the HTTP guard, credentials that
never show their secrets, and the TLS handshake of the codec's HELLO/AUTH."""

import os

import pytest

from bk import protocol as P
from bk.config import Config
from bk.errors import AuthError, ConfigError
from bk.security import ClientSecurity, auth, pki, tls
from bk.security.etcd import EtcdCredentials
from bk.security.tokens import create_token, verify_token

from test_tls_stream import stream_pair


def conf(**kw):
    return Config.load(overrides=kw, env={})


@pytest.fixture
def key_file(tmp_path):
    path = str(tmp_path / "key")
    auth.write_secret_key(path, auth.create_secret_key())
    return path


def test_tokens_carry_the_role_and_are_refused_with_a_reason(key_file):
    key = auth.read_secret_key(key_file)
    assert os.stat(key_file).st_mode & 0o777 == 0o600
    assert verify_token(key, create_token(key, "app", 60)) == "app"
    with pytest.raises(AuthError, match="expired"):
        verify_token(key, create_token(key, "app", -1))
    with pytest.raises(AuthError, match="signature"):
        verify_token(auth.create_secret_key(), create_token(key, "app"))
    with pytest.raises(AuthError, match="no token"):
        verify_token(key, None)
    with pytest.raises(AuthError, match="invalid"):
        verify_token(key, "a.b.c")


def test_roles_map_to_op_sets_once(key_file):
    a = auth.Authenticator(conf(authProvider="token", tokenSecretKeyFile=key_file,
                                superUserRoles="admin", clientRoles="app",
                                readOnlyRoles="dash"))
    key = auth.read_secret_key(key_file)
    assert a.identify(create_token(key, "dash"), None) == "dash"
    with pytest.raises(AuthError, match="in none of"):
        a.identify(create_token(key, "nobody"), None)
    assert a.grant("admin") == (None, True) and a.grant("app") == (None, True)
    ops, may_fence = a.grant("dash")
    assert not may_fence and P.READ in ops and P.ADD not in ops and P.ADD_BATCH not in ops
    assert P.WRITE_LAC not in ops
    assert a.is_super_user("admin") and not a.is_super_user("app")
    none = auth.Authenticator(conf())
    assert not none.enabled and none.identify(None, None) is None


def test_bad_security_configurations_name_the_key(key_file, tmp_path):
    with pytest.raises(ConfigError, match="authProvider"):
        auth.Authenticator(conf(authProvider="kerberos"))
    with pytest.raises(ConfigError, match="tokenSecretKeyFile"):
        auth.Authenticator(conf(authProvider="token", clientRoles="x"))
    with pytest.raises(ConfigError, match="no roles"):
        auth.Authenticator(conf(authProvider="token", tokenSecretKeyFile=key_file))
    with pytest.raises(ConfigError, match="not a signed token"):
        ClientSecurity.from_conf(conf(authToken="s3cret"))
    with pytest.raises(ConfigError, match="tlsCertificatePath"):
        tls.server_context(conf(tlsCertificatePath=str(tmp_path / "none.crt")))
    # the message never echoes the retired shared secret
    try:
        ClientSecurity.from_conf(conf(authToken="hunter2"))
    except ConfigError as e:
        assert "hunter2" not in str(e)


def test_http_guard_401_403_and_open_paths(key_file):
    c = conf(authProvider="token", tokenSecretKeyFile=key_file, superUserRoles="admin",
             clientRoles="app")
    key = auth.read_secret_key(key_file)
    g = auth.HttpGuard(c)
    admin, app = create_token(key, "admin"), create_token(key, "app")
    assert g.check("/heartbeat", None, None) is None
    assert g.check("/metrics", None, None) is None
    assert g.check("/api/v1/bookie/info", None, None)[0] == 401
    assert g.check("/api/v1/bookie/info", "Bearer " + app, None)[0] == 403
    assert g.check("/api/v1/bookie/info", "Bearer " + admin, None) is None
    g = auth.HttpGuard(c.with_overrides(httpServerAuthMetrics=True))
    assert g.check("/metrics", None, None)[0] == 401


def test_secrets_stay_out_of_reprs(tmp_path, key_file):
    pw = tmp_path / "pw"
    pw.write_text("correct horse\n")
    creds = EtcdCredentials.from_conf(conf(etcdUser="bk", etcdPasswordFile=str(pw)))
    assert creds.password == "correct horse" and "correct horse" not in repr(creds)
    token = create_token(auth.read_secret_key(key_file), "app")
    assert token not in repr(ClientSecurity(None, token))
    assert token not in repr(conf(authToken=token))
    with pytest.raises(ConfigError, match="etcdPasswordFile"):
        EtcdCredentials.from_conf(conf(etcdUser="bk"))


def test_local_ca_certificates_verify(tmp_path):
    import socket
    import ssl
    import threading
    ca = pki.make_ca(str(tmp_path))
    crt, key = ca.issue("bookie", ["127.0.0.1"], common_name="bookie")
    server = tls.server_context(conf(tlsCertificatePath=crt, tlsKeyStore=key))
    client = tls.client_context(conf(tlsEnabled=True, tlsTrustStore=ca.cert_path))
    a, b = socket.socketpair()
    out = {}

    def serve():
        with server.wrap_socket(a, server_side=True) as s:
            out["got"] = s.recv(5)
    t = threading.Thread(target=serve)
    t.start()
    with client.wrap_socket(b, server_hostname="127.0.0.1") as c:
        c.sendall(b"hello")
    t.join(10)
    assert out["got"] == b"hello"
    assert ssl.PEM_cert_to_DER_cert(open(crt).read().split("-----END CERTIFICATE-----")[0]
                                    + "-----END CERTIFICATE-----\n")


def _bump(path):
    """Make a rewrite visible to a FileWatch even within one mtime tick."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000))


def test_key_rotation_several_keys_verify_the_first_signs(key_file, tmp_path):
    old = auth.read_secret_key(key_file)
    new = auth.create_secret_key()
    auth.write_secret_keys(key_file, [new, old])
    assert os.stat(key_file).st_mode & 0o777 == 0o600
    assert auth.read_secret_key(key_file) == new
    a = auth.Authenticator(conf(authProvider="token", tokenSecretKeyFile=key_file,
                                clientRoles="app", tokenFilesRefreshDurationSeconds=0))
    t_old, t_new = create_token(old, "app"), create_token(new, "app")
    ident = a.authenticate(t_old, None)
    assert ident.role == "app" and ident.key_id == auth.key_id(old)
    assert a.authenticate(t_new, None).key_id == auth.key_id(new)
    # a token made before tokens named their key (no kid, no jti) is tried on each key
    import jwt
    legacy = jwt.encode({"sub": "app"}, old, algorithm="HS256")
    legacy_ident = a.authenticate(legacy, None)
    assert legacy_ident.key_id == auth.key_id(old)
    assert legacy_ident.token_id.startswith("sha256:")
    # the key leaves the file: its tokens are refused
    auth.write_secret_keys(key_file, [new])
    b = auth.Authenticator(conf(authProvider="token", tokenSecretKeyFile=key_file,
                                clientRoles="app", tokenFilesRefreshDurationSeconds=1))
    with pytest.raises(AuthError, match="no longer"):
        b.authenticate(t_old, None)
    with pytest.raises(AuthError, match="signature does not verify"):
        b.authenticate(legacy, None)
    assert b.identify(t_new, None) == "app"
    assert auth.key_id(new) not in open(key_file).read()     # a digest, not the key


def test_refresh_picks_up_a_removed_key_and_revocations(key_file, tmp_path):
    old = auth.read_secret_key(key_file)
    new = auth.create_secret_key()
    auth.write_secret_keys(key_file, [new, old])
    revoked = str(tmp_path / "revoked")
    with pytest.raises(ConfigError, match="tokenRevocationFile"):
        auth.Authenticator(conf(authProvider="token", tokenSecretKeyFile=key_file,
                                tokenRevocationFile=revoked, clientRoles="app"))
    open(revoked, "w").close()
    a = auth.Authenticator(conf(authProvider="token", tokenSecretKeyFile=key_file,
                                tokenRevocationFile=revoked, clientRoles="app,batch",
                                tokenFilesRefreshDurationSeconds=1))
    t_old, t_new, t_batch = (create_token(old, "app"), create_token(new, "app"),
                             create_token(new, "batch"))
    ids = {t: a.authenticate(t, None) for t in (t_old, t_new, t_batch)}
    assert not a.refresh()                     # nothing changed
    auth.write_secret_keys(key_file, [new])
    assert auth.add_revocation(revoked, "jti", ids[t_new].token_id)
    assert not auth.add_revocation(revoked, "jti", ids[t_new].token_id)
    _bump(key_file)
    import time
    assert a.refresh(time.monotonic() + 2)
    assert "no longer" in a.refused(ids[t_old])
    assert "revoked" in a.refused(ids[t_new])
    assert a.refused(ids[t_batch]) is None
    with pytest.raises(AuthError, match="revoked"):
        a.authenticate(t_new, None)
    auth.add_revocation(revoked, "sub", "batch")
    _bump(revoked)
    assert a.refresh(time.monotonic() + 4)
    with pytest.raises(AuthError, match="role 'batch' were revoked"):
        a.authenticate(create_token(new, "batch"), None)
    # a half-written file keeps what was loaded, and is retried
    with open(revoked, "a") as f:
        f.write("nonsense\n")
    _bump(revoked)
    assert not a.refresh(time.monotonic() + 6)
    assert a.refused(ids[t_batch])
    with pytest.raises(ConfigError, match="line"):
        auth.read_revocations(revoked)


def test_client_token_file_is_read_again_when_it_changes(key_file, tmp_path):
    key = auth.read_secret_key(key_file)
    path = tmp_path / "app.token"
    first, second = create_token(key, "app"), create_token(key, "app")
    path.write_text(first + "\n")
    sec = ClientSecurity.from_conf(conf(authTokenFile=str(path)))
    assert sec.token == first
    path.write_text(second + "\n")
    _bump(str(path))
    from bk.testing import wait_until
    wait_until(lambda: sec.token == second, timeout=5, what="the new token")
    assert second not in repr(sec)


def test_tls_stream_carries_frames_through_a_full_socket_in_both_directions(tmp_path):
    """TLSStream (the event loops' TLS) over a non-blocking socket pair with small
    buffers: the handshake, then thousands of frames each way that the sockets
    take in pieces (partial sendmsg, backlog), every frame arriving whole and in
    order, and a close seen as EOF."""
    client, server, a, b = stream_pair(tmp_path, sndbuf=8192)
    scratch = bytearray(1 << 16)
    assert server.peer_identity() is None and client.obj.version() in ("TLSv1.2", "TLSv1.3")
    frames = [P.encode_frame([P.PING, i, b"x" * (i % 3000)]) for i in range(2000)]
    want = sum(map(len, frames))
    got = {client: P.FrameBuffer(1 << 20), server: P.FrameBuffer(1 << 20)}
    seen = {client: [], server: []}
    client.encrypt(frames)
    server.encrypt(frames)
    assert client.backlog_bytes > want       # all of it encrypted, nothing sent yet
    partial = 0
    for _ in range(100_000):
        for t, peer in ((client, server), (server, client)):
            partial += t.flush() > 0
            peer.recv_into(got[peer], scratch)
            seen[peer] += [m[1] for m in got[peer].frames()]
        if len(seen[client]) == len(seen[server]) == len(frames):
            break
    assert seen[client] == seen[server] == list(range(2000))
    assert partial > 10                      # the sockets did take it in pieces
    assert client.backlog_bytes == server.backlog_bytes == 0 and not client.backlog
    a.close()
    for _ in range(10):
        if server.recv_into(got[server], scratch) == 0 and server.eof:
            break
    assert server.eof
