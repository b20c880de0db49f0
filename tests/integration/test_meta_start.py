"""A bookie started while etcd is unreachable waits for it (retrying) up to
metadataServiceStartTimeoutSeconds, then exits with EXIT_METADATA; SIGTERM stops
the wait."""

import pytest

from bk.exitcodes import EXIT_METADATA, EXIT_OK
from bk.testing import wait_until

pytestmark = pytest.mark.timeout(180)


def _log(b):
    with open(b.log_file, errors="replace") as f:
        return f.read()


def test_bookie_started_during_an_etcd_outage_waits_for_it(cluster_factory):
    # an attempt on an unreachable etcd takes metadataTimeoutMillis: 2 s, not 5, so
    # that the retries this test waits for come sooner
    cluster = cluster_factory(1, conf_overrides={"metadataTimeoutMillis": 2000})
    b = cluster.bookies[0]
    b.stop()
    cluster.etcd.stop()
    retries = _log(b).count("metadata store unreachable")
    b.start(wait=False)
    wait_until(lambda: _log(b).count("metadata store unreachable") >= retries + 2,
               timeout=60, what="the bookie retrying")
    assert b.alive
    cluster.etcd.start()
    b.wait_registered(60)                      # the same process, once etcd is back

    # SIGTERM while waiting: it stops (not an error)
    b.stop()
    cluster.etcd.stop()
    b.start(wait=False)
    wait_until(lambda: _log(b).count("metadata store unreachable") >= retries + 3,
               timeout=60, what="the bookie retrying")
    assert b.stop() == EXIT_OK and "stop requested while waiting" in _log(b)

    # a bounded wait: exit 5 once it is over, and after one attempt with 0
    for seconds in (4, 0):      # (one attempt takes metadataTimeoutMillis, 2 s)
        b.write_conf(metadataServiceStartTimeoutSeconds=seconds)
        before = _log(b).count("metadata store unreachable")
        b.start(wait=False)
        wait_until(lambda: not b.alive, timeout=60, what="the bookie giving up")
        assert b.proc.returncode == EXIT_METADATA
        assert (_log(b).count("metadata store unreachable") > before) == (seconds > 0)
    cluster.etcd.start()
