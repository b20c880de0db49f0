"""Pytest-facing helpers on top of :mod:`bk.localcluster` and :mod:`bk.rawclient`:
a local cluster tuned for quick tests, for bk's own tests and users' tests.

    from bk.testing import LocalCluster
    with LocalCluster(num_bookies=3) as cluster:
        client = bk.BookKeeper(cluster.metadata_uri)
        cluster.bookies[0].kill()          # kill -9 the whole bookie (arbiter + shards)
        cluster.bookies[0].start()         # same directories: replays its journals

Production code never imports this module.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

from bk import localcluster
from bk import protocol as P
from bk.config import SETTINGS
from bk.client.bookkeeper import BookKeeper
from bk.errors import EOK
from bk.localcluster import BookieProcess  # noqa: F401  (re-exported for tests)
from bk.rawclient import BookieConnection  # noqa: F401  (re-exported for tests)

# Settings that keep tests quick; every one is an ordinary configuration key.
TEST_DEFAULTS = {
    "registrationTtlSeconds": 3,
    "journalPreAllocSizeMB": 8,
    "diskCheckInterval": 1000,
    "journalMaxGroupWaitMSec": 1,
}


def production_settings() -> dict:
    """The registry defaults of the keys TEST_DEFAULTS changes (for tests that
    want one bookie to run as a deployed one does)."""
    return {k: SETTINGS[k].default for k in TEST_DEFAULTS}


class LocalCluster(localcluster.LocalCluster):
    """:class:`bk.localcluster.LocalCluster` with :data:`TEST_DEFAULTS` under the
    caller's ``conf_overrides``."""

    def __init__(self, *args, conf_overrides: dict | None = None, **kw):
        super().__init__(*args, conf_overrides={**TEST_DEFAULTS, **(conf_overrides or {})}, **kw)

    def client(self, timeout: float = 3.0, **settings) -> BookKeeper:
        """A client of this cluster whose adds and reads time out after ``timeout``
        seconds (so a test about a dead bookie does not wait out the defaults)."""
        settings.setdefault("addEntryTimeoutSec", timeout)
        settings.setdefault("readEntryTimeoutSec", timeout)
        return BookKeeper(self.metadata_uri, **settings)

    def entries_on(self, bookie_id: str, ledger_id: int) -> set[int]:
        """The entry ids of ``ledger_id`` that ``bookie_id`` holds."""
        return entries_held(self.store, bookie_id, ledger_id)


def wait_until(pred, timeout: float = 30.0, what: str = "condition", step: float = 0.05):
    """Poll ``pred()`` until it is true: a test waits for a condition with a
    deadline, never a bare sleep. AssertionError naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def entries_held(store, bookie_id: str, ledger_id: int) -> set[int]:
    """The entry ids of ``ledger_id`` that ``bookie_id`` holds (GET_LIST_OF_ENTRIES on
    the shard that owns the ledger); empty if it has none."""
    n = store.bookie_info(bookie_id)["numShards"]
    with BookieConnection(bookie_id, shard=P.shard_of(ledger_id, n)) as c:
        r = c.call(P.get_list_of_entries(c.next_rid(), ledger_id))
    return set(P.ranges_to_ids(r[4])) if r[2] == EOK and r[4] else set()


def bkshell(uri: str, *args, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run ``bkshell --metadata uri ARGS`` as a process, as an operator would."""
    return subprocess.run([sys.executable, "-m", "bk.cli.shell", "--metadata", uri, *args],
                          capture_output=True, text=True, timeout=timeout)


def bkshell_ok(uri: str, *args, timeout: float = 120.0):
    """``bkshell`` that must succeed: its output, parsed when ``--json`` is among ``args``."""
    r = bkshell(uri, *args, timeout=timeout)
    assert r.returncode == 0, f"bkshell {' '.join(args)} failed ({r.returncode}): {r.stderr}"
    return json.loads(r.stdout) if "--json" in args else r.stdout


def http_get(port: int, path: str, method: str = "GET", host: str = "127.0.0.1",
             timeout: float = 10.0):
    """``(status, body text, content type)`` of one HTTP request; ``(None, "", None)``
    when nothing answers on the port."""
    req = urllib.request.Request(f"http://{host}:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(), r.headers.get("Content-Type")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers.get("Content-Type")
    except OSError:
        return None, "", None

