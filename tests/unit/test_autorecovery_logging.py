"""How auto-recovery's loops report a failure: an etcd outage (MetadataError) is
part of running and says one WARNING line; anything else is a bug and logs its
trace at ERROR. Both retry. (The hosts soak's etcd cuts logged a trace at ERROR
for every auditor and worker loop of a cut bookie.)"""

import logging

from bk.autorecovery.service import AutoRecovery
from bk.config import Config
from bk.errors import MetadataError


def _run(caplog, exc):
    ar = AutoRecovery(Config({}), "b1")
    calls = []

    def loop():
        calls.append(1)
        if len(calls) == 1:
            raise exc
    ar._stop.wait = lambda timeout=None: False       # no back-off in a unit test
    with caplog.at_level(logging.INFO, logger="bk.autorecovery"):
        ar._guarded(loop)
    assert len(calls) == 2                            # retried, then returned
    return [r for r in caplog.records if r.name == "bk.autorecovery"]


def test_an_etcd_outage_is_one_warning(caplog):
    recs = _run(caplog, MetadataError("check lock auditor: etcd did not answer within 5s"))
    assert [(r.levelname, r.getMessage(), r.exc_info) for r in recs] == [
        ("WARNING", "auto-recovery loop: check lock auditor: etcd did not answer within 5s; "
                    "retrying", None)]


def test_an_unexpected_error_logs_its_trace(caplog):
    recs = _run(caplog, KeyError(40))
    assert [(r.levelname, r.getMessage()) for r in recs] == [
        ("ERROR", "auto-recovery loop failed; retrying")]
    assert recs[0].exc_info[0] is KeyError
