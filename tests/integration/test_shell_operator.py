"""bkshell as an operator's script meets it: a prefix with no cluster, an etcd that
is not there, a bookie id nobody registered, bookies that do not answer, a
question on a terminal before something is destroyed, Ctrl-C part-way."""

import json
import os
import pty
import signal
import subprocess
import sys

import bk
from bk.exitcodes import EXIT_ERROR, EXIT_INTERRUPTED
from bk.meta.store import MetadataStore
from bk.testing import shell, shell_err, shell_ok, wait_until
from bk.util import free_port


def _one_error(stderr: str) -> str:
    """The error line at the end of stderr (after a question, which the typed
    answer ends on a terminal, not in the stderr pipe of the test)."""
    lines = stderr.strip().replace("[y/N]: ", "[y/N]:\n").splitlines()
    assert lines and lines[-1].startswith("bkshell: error: "), stderr
    assert "Traceback" not in stderr
    return lines[-1]


def test_a_prefix_without_a_cluster_fails_and_writes_nothing(shared_cluster):
    """A typo in the prefix: reads used to list nothing and exit 0, and writes
    (setrack, triggeraudit, autorecovery --disable, ...) put keys under a prefix
    no bookie reads."""
    uri = shared_cluster.metadata_uri.rsplit("/", 1)[0] + "/ledgerz"
    for cmd in (["listledgers"], ["listbookies"], ["listunderreplicated"], ["bookieinfo"],
                ["setrack", shared_cluster.bookies[0].bookie_id, "/r/a"], ["triggeraudit"],
                ["autorecovery", "--disable"], ["lostbookierecoverydelay", "--set", "5"]):
        line = _one_error(shell_err("--metadata", uri, *cmd, code=EXIT_ERROR))
        assert f"no bk cluster under prefix /ledgerz at {uri}" in line, (cmd, line)
        assert "metaformat" in line, (cmd, line)
    with MetadataStore(uri, timeout=5) as s:
        s.format()          # refuses when any key exists under the prefix: none was written


def test_an_unreachable_etcd_names_the_uri_and_how_long_it_was_tried():
    uri = f"etcd://127.0.0.1:{free_port()}/ledgers"
    for cmd in (["listledgers"], ["triggeraudit"], ["ledgermetadata", "1"]):
        line = _one_error(shell_err("--metadata", uri, "--timeout", "1", *cmd, code=EXIT_ERROR))
        assert "etcd is unreachable, tried for 1." in line and uri in line, (cmd, line)


def test_setrack_warns_for_a_bookie_never_seen(shared_cluster):
    uri = shared_cluster.metadata_uri
    ghost = "10.99.99.99:3181"
    r = shell_ok("--metadata", uri, "setrack", ghost, "/r/ghost")
    assert r.stdout == f"{ghost}\t/r/ghost\n"
    assert r.stderr.startswith(f"warning: bookie {ghost} is not registered and has no cookie")
    for b in shared_cluster.bookies:
        assert b.bookie_id in r.stderr            # the ids it may have meant
    # the rack is stored all the same (a bookie may get its rack before its first start)
    got = json.loads(shell_ok("--metadata", uri, "getrack", ghost, "--json").stdout)
    assert got == {"id": ghost, "rack": "/r/ghost", "stored": True}
    # a registered bookie: no warning
    b0 = shared_cluster.bookies[0].bookie_id
    before = json.loads(shell_ok("--metadata", uri, "getrack", b0, "--json").stdout)
    r = shell_ok("--metadata", uri, "setrack", b0, before["rack"])
    assert r.stderr == ""


def test_bookieinfo_exits_1_when_bookies_do_not_answer(shared_cluster, tmp_path):
    """A client conf asking TLS of bookies that offer none: every bookie refuses.
    The rows are printed (JSON on stdout), and the exit code says it failed."""
    conf = tmp_path / "tls-client.conf"
    conf.write_text(f"metadataServiceUri={shared_cluster.metadata_uri}\ntlsEnabled=true\n")
    r = shell("--conf", str(conf), "bookieinfo", "--json")
    assert r.exit_code == EXIT_ERROR, (r.stdout, r.stderr)
    rows = json.loads(r.stdout)
    ids = sorted(b.bookie_id for b in shared_cluster.bookies)
    assert sorted(x["id"] for x in rows) == ids and all("TLS" in x["error"] for x in rows)
    line = _one_error(r.stderr)
    assert "3 of 3 bookies did not answer" in line and "TLS" in line
    # and with TLS as the bookies serve it, exit 0 (the control)
    ok = json.loads(shell_ok("--metadata", shared_cluster.metadata_uri, "bookieinfo",
                             "--json").stdout)
    assert sorted(x["id"] for x in ok) == ids and not any("error" in x for x in ok)


def _on_terminal(uri, *args, answer: bytes | None):
    """``bkshell --metadata uri ARGS`` with a terminal on stdin (as an operator types
    it), ``answer`` typed at its question; stdout and stderr are pipes."""
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen([sys.executable, "-m", "bk.cli.shell", "--metadata", uri, *args],
                             stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={k: v for k, v in os.environ.items() if not k.startswith("BK_")})
        if answer is not None:
            os.write(master, answer)
        out, err = p.communicate(timeout=120)
    finally:
        os.close(slave)
        os.close(master)
    return p.returncode, out.decode(), err.decode()


def test_destructive_commands_ask_on_a_terminal(shared_cluster):
    uri = shared_cluster.metadata_uri
    with bk.BookKeeper(uri) as c:
        h = c.create_ledger(3, 3, 2)
        h.add_entries([b"a", b"b"])
        h.close()
        lid = h.ledger_id
        w = c.open_log_writer("asked-orders")
        w.append(b"order-0")
        w.close()

    # no: nothing is deleted, exit 1, and the question showed what it would delete
    rc, out, err = _on_terminal(uri, "deleteledger", str(lid), answer=b"n\n")
    assert rc == EXIT_ERROR and out == ""
    assert f"Delete ledger {lid} (CLOSED, last entry 1, 2 bytes)?" in err
    assert "not confirmed: nothing was changed" in _one_error(err)
    assert lid in json.loads(shell_ok("--metadata", uri, "listledgers", "--json").stdout)
    rc, out, err = _on_terminal(uri, "deletelog", "asked-orders", answer=b"\n")   # default: no
    assert rc == EXIT_ERROR and "Delete log asked-orders: 1 records" in err
    assert "asked-orders" in json.loads(shell_ok("--metadata", uri, "listlogs", "--json").stdout)
    rc, out, err = _on_terminal(uri, "recover", shared_cluster.bookies[0].bookie_id,
                                answer=b"n\n")
    assert rc == EXIT_ERROR and "fencing and closing the open ledgers" in err
    assert "not confirmed" in _one_error(err)

    # yes: deleted
    rc, out, err = _on_terminal(uri, "deleteledger", str(lid), answer=b"y\n")
    assert rc == 0 and out == f"deleted ledger {lid}\n", err
    assert lid not in json.loads(shell_ok("--metadata", uri, "listledgers", "--json").stdout)
    # --yes: no question at all (nothing is typed: a question would wait for its answer)
    rc, out, err = _on_terminal(uri, "deletelog", "asked-orders", "--yes", answer=None)
    assert rc == 0 and "deleted log asked-orders" in out and "?" not in err, err
    # without a terminal (a script): no question, as before (test_shell's deletes)


def test_ctrl_c_in_simpletest_names_the_ledger_it_leaves(shared_cluster):
    uri = shared_cluster.metadata_uri
    with bk.BookKeeper(uri) as c:
        before = set(c.list_ledgers())
    p = subprocess.Popen([sys.executable, "-m", "bk.cli.shell", "--metadata", uri,
                          "simpletest", "--entries", "5000000", "--entry-size", "10"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith("BK_")},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        with bk.BookKeeper(uri) as c:
            def created():
                return set(c.list_ledgers()) - before
            wait_until(lambda: created(), timeout=60, what="simpletest's ledger")
            (lid,) = created()
            # writing 5M entries takes far longer than this wait: it is still writing
            rh = c.open_ledger_no_recovery(lid, password=b"bkshell-simpletest")
            wait_until(lambda: rh.read_last_add_confirmed() >= 0, timeout=60,
                       what="simpletest's first entries")
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == EXIT_INTERRUPTED, err
    assert out == ""
    assert f"simpletest: ledger {lid} is left behind (delete it: bkshell deleteledger " \
           f"{lid} --yes)" in err
    assert _one_error(err) == "bkshell: error: interrupted (Ctrl-C): stopped part-way"
    shell_ok("--metadata", uri, "deleteledger", str(lid))
