"""Fixtures: real etcd and real bookie processes on loopback, in temp dirs, and one
local Spark per test process."""

import subprocess

import pytest

import bk.spark
from bk.meta.etcd_server import EtcdServer
from bk.meta.store import MetadataStore
from bk.testing import LocalCluster, local_spark


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """One etcd per test module (a module may define its own, e.g. with other flags)."""
    with EtcdServer(str(tmp_path_factory.mktemp("etcd"))) as server:
        yield server


@pytest.fixture
def store(etcd, request):
    """A formatted metadata store of the module's etcd, under a prefix of the test's
    own (tests of one module do not see each other's keys)."""
    with MetadataStore(etcd.uri(f"t-{request.node.name}"), timeout=5) as s:
        s.format()
        yield s


def _clusters(base_dir):
    """``(make, made)``: ``make(num_bookies=3, **kw)`` starts a cluster under
    ``base_dir``; the caller stops every cluster in ``made``."""
    made = []

    def make(num_bookies=3, **kw):
        c = LocalCluster(num_bookies=num_bookies, base_dir=str(base_dir / f"cluster{len(made)}"),
                         **kw)
        made.append(c)
        return c.start()
    return make, made


@pytest.fixture
def cluster_factory(tmp_path):
    """Make clusters: ``cluster_factory(num_bookies=4, num_shards=2, conf_overrides={...})``.
    Every cluster made is stopped (and its processes gone) after the test."""
    make, made = _clusters(tmp_path)
    yield make
    for c in made:
        c.stop()


@pytest.fixture(scope="module")
def module_cluster_factory(tmp_path_factory):
    """:func:`cluster_factory` for a module-scoped fixture: its clusters are stopped
    after the module's last test (for clusters shared by tests that do not disturb
    them)."""
    make, made = _clusters(tmp_path_factory.mktemp("module"))
    yield make
    for c in made:
        c.stop()


@pytest.fixture
def cluster(cluster_factory):
    """Three bookies with two shards each, for this test alone (it may kill, stop or
    reconfigure them)."""
    return cluster_factory(3)


@pytest.fixture(scope="module")
def shared_cluster(module_cluster_factory):
    """Three bookies with two shards each, shared by the tests of a module that do
    not disturb it: they kill, stop, reconfigure or wipe nothing, and name their
    own ledgers and logs (nothing asserts that the cluster is otherwise empty)."""
    return module_cluster_factory(3, num_shards=2)


@pytest.fixture
def small_fs(tmp_path):
    """A 64 MiB tmpfs, so that disk usage can be driven across thresholds."""
    mnt = tmp_path / "smallfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"this test needs to mount a tmpfs (as root): {r.stderr}"
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


class _LocalSpark:
    """The process's local SparkSession, kept for every Spark test after the first
    (a Spark JVM costs seconds of CPU to start); stopped for a test that needs a
    session of its own (the driver of a process has one SparkContext: a new session
    would quietly be this one, on the local master). Every later session of the
    process, local or not, reuses the JVM that the first one started."""

    def __init__(self):
        self.session = None

    def get(self):
        if self.session is None:
            self.session = local_spark("bk-test", **{"spark.python.worker.reuse": "true"})
            bk.spark.register(self.session)
        return self.session

    def stop(self):
        if self.session is not None:
            self.session.stop()
            self.session = None


@pytest.fixture(scope="session")
def _local_spark():
    # Start Spark's JVM now, before the test's clusters and clients: a session-scoped
    # fixture is set up before the module- and function-scoped ones of the same test.
    # PySpark starts the JVM with fork() (it passes a preexec_fn), and gRPC's fork
    # handlers, on in a process with an open etcd channel, now and then abort the
    # child before it execs (exit -6, "epoll_wait error: Bad file descriptor"):
    # JAVA_GATEWAY_EXITED. Later sessions reuse the JVM, without a fork.
    holder = _LocalSpark()
    holder.get()
    yield holder
    holder.stop()


@pytest.fixture
def spark(_local_spark):
    """A ``local[2]`` SparkSession with the ``bookkeeper`` source, shared by the Spark
    tests of this process: a test leaves no session configuration behind and uses its
    own logs."""
    return _local_spark.get()


@pytest.fixture
def no_local_spark(_local_spark):
    """No local SparkSession in this process (for a test that builds its own: its
    session reuses the JVM, started before the test's clusters)."""
    _local_spark.stop()
