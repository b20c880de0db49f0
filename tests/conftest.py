"""Suite-wide scheduling.

``scripts/test.sh`` runs the suite on several pytest-xdist workers. Each test
module is one unit of work given to one worker, so that a module's shared cluster
is made once; the modules on the process's local Spark session (the ``spark``
fixture, tests/integration/conftest.py) form one unit, so that one JVM serves
them all. Units are handed out in collection order; modules marked ``slow`` are
put first, so that no worker starts one of them while the others are running out
of work. The order inside a module, and of everything else, stays as collected.
"""

from xdist.scheduler import LoadScopeScheduling

# Modules whose tests use the ``spark`` fixture. (xdist's own ``loadgroup`` cannot
# group them: with pytest 9 the group it appends to a test's id is lost.)
LOCAL_SPARK_MODULES = {"tests/integration/test_spark.py",
                       "tests/integration/test_security_spark.py"}


class ModuleScheduling(LoadScopeScheduling):
    """``--dist loadfile`` with the local-Spark modules as one unit."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return "local-spark" if module in LOCAL_SPARK_MODULES else module


def pytest_xdist_make_scheduler(config, log):
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
