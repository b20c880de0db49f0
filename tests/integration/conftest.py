"""Fixtures: real etcd and real bookie processes on loopback, in temp dirs."""

import subprocess

import pytest

from bk.testing import LocalCluster


@pytest.fixture
def cluster_factory(tmp_path):
    """Make clusters: ``cluster_factory(num_bookies=4, num_shards=2, conf_overrides={...})``.
    Every cluster made is stopped (and its processes gone) after the test."""
    made = []

    def make(num_bookies=3, **kw):
        c = LocalCluster(num_bookies=num_bookies, base_dir=str(tmp_path / f"cluster{len(made)}"),
                         **kw)
        made.append(c)
        return c.start()

    yield make
    for c in made:
        c.stop()


@pytest.fixture
def cluster(cluster_factory):
    """Three bookies with two shards each, for this test alone (it may kill, stop or
    reconfigure them)."""
    return cluster_factory(3)


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory):
    """Three bookies with two shards each, shared by the tests of a module that do
    not disturb it: they kill, stop, reconfigure or wipe nothing, and name their
    own ledgers and logs (nothing asserts that the cluster is otherwise empty)."""
    c = LocalCluster(num_bookies=3, base_dir=str(tmp_path_factory.mktemp("shared")),
                     num_shards=2)
    c.start()
    yield c
    c.stop()


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
