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
"""

from collections import Counter

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
