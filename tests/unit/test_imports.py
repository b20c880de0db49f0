"""The module graph: light modules stay light, no upward imports hide in functions."""
import ast
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def loaded_after(statement: str) -> set:
    code = f"import sys; {statement}; print(' '.join(sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def test_the_codec_loads_nothing_heavier_than_msgpack():
    mods = loaded_after("import bk.protocol")
    heavy = {m for m in mods if m.split(".")[0] in ("grpc", "pyetcd", "prometheus_client",
                                                    "pyspark", "click")}
    assert not heavy, heavy
    assert {m for m in mods if m.startswith("bk")} <= {"bk", "bk.protocol", "bk.errors"}


def test_bk_names_load_on_first_use():
    mods = loaded_after("import bk; bk.errors.BKError; bk.LedgerState")
    assert "bk.meta.ledger" in mods and "grpc" not in mods and "bk.client" not in mods
    mods = loaded_after("import bk.bookie.worker")
    assert not {m for m in mods if m.split(".")[0] in ("grpc", "pyetcd")}


def test_a_bookie_loads_auto_recovery_only_when_it_hosts_it():
    # bookie start imports the arbiter; the client stack that auto-recovery copies
    # with comes with bk.autorecovery.service, which `bookie start` imports only
    # when autoRecoveryDaemonEnabled is set.
    mods = loaded_after("import bk.bookie.arbiter")
    assert not {m for m in mods if m.startswith(("bk.client", "bk.autorecovery.service",
                                                 "bk.autorecovery.replicator"))}
    assert "bk.autorecovery.replicator" in loaded_after("import bk.autorecovery.service")


def test_a_bookie_loads_prometheus_and_http_only_when_it_serves_http():
    # ~0.1 CPU-s of imports at every bookie start; bookie start imports bk.bookie.http
    # (and hands it to the arbiter) only with httpServerEnabled.
    mods = loaded_after("import bk.cli.bookie, bk.bookie.arbiter, bk.bookie.worker")
    assert not {m for m in mods if m.split(".")[0] == "prometheus_client"
                or m in ("http.server", "bk.http", "bk.bookie.http", "bk.exposition")}
    assert {"prometheus_client", "http.server"} <= loaded_after("import bk.bookie.http")


def test_a_bookie_loads_the_jwt_machinery_only_with_token_auth():
    # PyJWT and cryptography: ~65 ms of CPU at every bookie start. The arbiter and
    # shard workers check connections with bk.security.auth; it loads the verifier
    # module (bk.security.tokens) by name only for authProvider=token.
    start = ("import bk.cli.bookie, bk.bookie.arbiter, bk.bookie.worker; "
             "from bk.config import Config; from bk.security import auth; ")
    mods = loaded_after(start + "auth.Authenticator(Config.load(None, {}))")
    assert not {m for m in mods if m.split(".")[0] in ("jwt", "cryptography")
                or m == "bk.security.tokens"}
    mods = loaded_after(start + "import os, tempfile; k = tempfile.mktemp(); "
                        "auth.write_secret_key(k, auth.create_secret_key()); "
                        "auth.Authenticator(Config.load(None, {'authProvider': 'token', "
                        "'tokenSecretKeyFile': k, 'clientRoles': 'app'})); os.unlink(k)")
    assert {"jwt", "bk.security.tokens"} <= mods


# Packages whose functions may import bk modules: the CLI defers its imports so that
# `bkshell --help` stays quick. Everything else imports at the top: an import
# inside a function is for an optional dependency (pyspark), never to hide an
# upward arrow or a cycle.
LAZY_OK = ("bk/cli/",)


def function_level_bk_imports() -> list[str]:
    out = []
    pkg = os.path.join(ROOT, "bk")
    for dirpath, _dirs, files in os.walk(pkg):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            if rel.startswith(LAZY_OK):
                continue
            tree = ast.parse(open(path).read())
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    mods = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                            else [a.name for a in node.names] if isinstance(node, ast.Import)
                            else [])
                    if any(m.split(".")[0] == "bk" for m in mods):
                        out.append(f"{rel}:{node.lineno} ({fn.name})")
    return sorted(set(out))


def test_no_function_level_imports_of_bk_modules():
    found = function_level_bk_imports()
    assert not found, f"import these at the top of their module: {found}"
