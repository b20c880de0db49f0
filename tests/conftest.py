"""Suite-wide scheduling.

``scripts/test.sh`` runs the suite on several pytest-xdist workers. Each test
module is one unit of work given to one worker, so that a module's shared cluster
is made once; the modules on the process's local Spark session (the ``spark``
fixture, tests/integration/conftest.py) form one unit, so that one JVM serves
them all. Units are handed out longest first, so that no worker starts a long
one while the others are running out of work: modules marked ``slow`` first,
then by how many of their tests start a cluster of their own (what most of an
integration test's time goes to), the unit tests last; ties by the number of
tests. The order inside a module stays as collected.

With ``BK_TEST_TIMELINE=FILE`` every test appends one JSON line to FILE: its
worker, node id, start and end (wall clock, setup and teardown included) and the
CPU its worker process and reaped children used meanwhile;
``scripts/suite_timeline.py FILE`` shows each worker's modules in time, to find
the suite's critical path.
"""

import json
import os
import time
from collections import Counter

import pytest
from xdist.scheduler import LoadScopeScheduling

# Modules whose tests use the ``spark`` fixture. (xdist's own ``loadgroup`` cannot
# group them: with pytest 9 the group it appends to a test's id is lost.)
LOCAL_SPARK_MODULES = {"tests/integration/test_spark.py",
                       "tests/integration/test_security_spark.py"}

# Fixtures that start a cluster (etcd and bookie processes) for one test.
OWN_CLUSTER = {"cluster", "cluster_factory"}


class ModuleScheduling(LoadScopeScheduling):
    """``--dist loadfile`` with the local-Spark modules as one unit."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return "local-spark" if module in LOCAL_SPARK_MODULES else module


def pytest_xdist_make_scheduler(config, log):
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(session, config, items):
    def module(item):
        return item.nodeid.split("::", 1)[0]
    own = Counter(module(i) for i in items if OWN_CLUSTER & set(i.fixturenames))
    count = Counter(module(i) for i in items)
    slow = {module(i) for i in items if i.get_closest_marker("slow") is not None}
    # a stable sort: the tests of a module keep their order and stay together
    items.sort(key=lambda i: (module(i) not in slow, -own[module(i)],
                              not module(i).startswith("tests/integration/"), -count[module(i)]))


_TIMELINE = os.environ.get("BK_TEST_TIMELINE")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _TIMELINE:
        yield
        return
    start, t0 = time.time(), os.times()
    yield
    t1 = os.times()
    line = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "test": item.nodeid,
            "start": start, "end": time.time(),
            "cpu": round(t1.user + t1.system - t0.user - t0.system, 3),
            "children_cpu": round(t1.children_user + t1.children_system
                                  - t0.children_user - t0.children_system, 3)}
    with open(_TIMELINE, "a") as f:        # one short write: lines of workers do not mix
        f.write(json.dumps(line) + "\n")
