"""A bookie whose etcd goes silent between its cookie check and its registration
waits for etcd (metadataServiceStartTimeoutSeconds) instead of exiting: the
partition soak (--secure --hosts, seed 1506) restarted a bookie just as the
nemesis cut it from etcd; it said it was serving, then exited 1 on its
registration's timeout."""

from __future__ import annotations

import os
import signal

from bk.testing import hook_env, hooked_stop, sigstop, site_hook, wait_until

# In the bookie's arbiter: stop the whole process the first time it is about to
# register, so that the test can silence etcd at that exact point.
HOOK = r'''
from bk.meta.store import MetadataStore
from bk.testing import stop_here

_register = MetadataStore.register_bookie
_stopped = []


def register_bookie(self, *args, **kwargs):
    if not _stopped:
        _stopped.append(1)
        stop_here({"at": "register"})
    return _register(self, *args, **kwargs)


MetadataStore.register_bookie = register_bookie
'''


def test_a_bookie_waits_for_etcd_silent_at_its_registration(cluster_factory, tmp_path):
    c = cluster_factory(3, conf_overrides={"metadataTimeoutMillis": 1000})
    b = c.bookies[0]
    assert b.stop() == 0
    wait_until(lambda: b.bookie_id not in c.store.list_bookies(), what="deregistered")
    out = tmp_path / "register.json"
    with site_hook(tmp_path, HOOK, hook_env(out)):
        b.start(wait=False)
    stopped = hooked_stop(out, what="the bookie about to register")
    assert stopped["pid"] == b.pid
    sigstop(c.etcd.pid)                        # silent: requests time out
    etcd_stopped = True
    try:
        os.kill(b.pid, signal.SIGCONT)
        # its first registration times out (1 s); it says it waits, or (the bug) exits
        wait_until(lambda: not b.alive or "registering again" in open(b.log_file).read(),
                   timeout=30, what="the bookie's registration timing out")
        assert b.alive, f"the bookie exited {b.proc.returncode} while etcd was silent"
        os.kill(c.etcd.pid, signal.SIGCONT)
        etcd_stopped = False
        wait_until(lambda: b.bookie_id in c.store.list_bookies(), timeout=30,
                   what="the bookie registered once etcd answers")
        assert b.alive
    finally:
        if etcd_stopped:
            os.kill(c.etcd.pid, signal.SIGCONT)
