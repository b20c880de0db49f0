"""The Spark pipeline on a Spark standalone cluster on namespace hosts: a master and
two workers started with PySpark's own spark-class, bookies and etcd on their own
hosts, the driver on this process's end of the bridge. A log is read and another
written exactly once while a bookie host is cut off and comes back."""

import os
import subprocess
import sys
import threading

import pytest

import bk
from bk import netns
from bk.log import staging
from bk.testing import (SPARK_TEST_JAVA_OPTIONS, TEST_DEFAULTS, require_java,
                        spark_driver_jvm, wait_until)

pytestmark = [pytest.mark.skipif(netns.unavailable() is not None,
                                 reason=f"needs test hosts: {netns.unavailable()}"),
              pytest.mark.slow]
import pyspark  # noqa: E402,F401  (the spark extra: installed by scripts/setup.sh)

require_java()

import bk.spark  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _spark_env(tmp):
    env = dict(os.environ)
    env.update(SPARK_HOME=os.path.dirname(pyspark.__file__), PYSPARK_PYTHON=sys.executable,
               PYTHONPATH=ROOT, SPARK_LOG_DIR=str(tmp), SPARK_LOCAL_DIRS=str(tmp),
               SPARK_DAEMON_JAVA_OPTS=SPARK_TEST_JAVA_OPTIONS)      # the master and workers
    return env


def _start(host, args, log_path, env):
    spark_class = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")
    with open(log_path, "ab") as log:
        return host.popen([spark_class, *args], stdout=log, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, env=env)


def _tail(path, n=30):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


@pytest.mark.timeout(600)
def test_spark_standalone_pipeline_with_a_bookie_host_cut(tmp_path, no_local_spark):
    # The driver's session below reuses the JVM that the fixtures started before
    # this test's etcd channels opened: started here, by fork() while the client's
    # watches run, gRPC's fork handlers could abort it (JAVA_GATEWAY_EXITED)
    assert spark_driver_jvm() is not None, "no Spark JVM started before the cluster"
    with netns.Network() as net:
        bookies = [net.add_host(f"b{i}") for i in range(4)]
        meta = net.add_host("meta")
        master = net.add_host("sparkm")
        workers = [net.add_host(f"w{i}") for i in range(2)]
        env = _spark_env(tmp_path)
        with netns.HostCluster(net, str(tmp_path / "c"), bookies, meta, TEST_DEFAULTS) as cluster:
            uri = cluster.metadata_uri
            url = f"spark://{master.address}:7077"
            _start(master, ["org.apache.spark.deploy.master.Master", "--host", master.address,
                            "--port", "7077", "--webui-port", "8080"],
                   tmp_path / "master.log", env)
            for i, w in enumerate(workers):
                os.makedirs(tmp_path / f"work{i}", exist_ok=True)
                _start(w, ["org.apache.spark.deploy.worker.Worker", url, "--host", w.address,
                           "--cores", "1", "--memory", "1g", "--webui-port", "8081",
                           "--work-dir", str(tmp_path / f"work{i}")],
                       tmp_path / f"worker{i}.log", env)
            wait_until(lambda: _tail(tmp_path / "master.log").count("Registering worker") >= 2,
                       timeout=120, what="two Spark workers registered with the master:\n"
                       + _tail(tmp_path / "master.log"))

            with bk.BookKeeper(uri) as client:
                src = [b"rec-%05d" % i for i in range(1200)]
                with client.open_log_writer("src", logRollEntries=200) as w:
                    for r in src:
                        w.append(r)

                from pyspark.sql import SparkSession
                os.environ["PYSPARK_PYTHON"] = sys.executable
                spark = (SparkSession.builder.master(url).appName("bk-hosts")
                         .config("spark.driver.host", net.observer_address)
                         .config("spark.driver.bindAddress", net.observer_address)
                         .config("spark.executor.memory", "512m")
                         .config("spark.driver.extraJavaOptions", SPARK_TEST_JAVA_OPTIONS)
                         .config("spark.executor.extraJavaOptions", SPARK_TEST_JAVA_OPTIONS)
                         .config("spark.executorEnv.PYTHONPATH", ROOT)
                         .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
                         .config("spark.ui.enabled", "false")
                         .config("spark.python.authenticate.socketTimeout", "120s")
                         .config("spark.sql.shuffle.partitions", "4").getOrCreate())
                try:
                    assert spark.sparkContext.master == url, "a local session was reused"
                    bk.spark.register(spark)
                    hosts = spark.sparkContext.parallelize(range(4), 4).map(
                        lambda _: __import__("socket").gethostbyname(
                            __import__("socket").gethostname())).collect()
                    assert len(hosts) == 4
                    # a bookie host vanishes while the job reads src and writes dst
                    cut = cluster.bookies[1].host
                    net.isolate(cut)
                    healed, job_done = [], threading.Event()

                    def heal_when_writing():
                        # back once the sink's tasks have begun writing staging ledgers
                        try:
                            wait_until(lambda: job_done.is_set()
                                       or staging.pending(client, "dst"),
                                       timeout=300, what="the sink's tasks writing")
                        finally:
                            net.heal()
                            healed.append(not job_done.is_set())
                    t = threading.Thread(target=heal_when_writing, daemon=True)
                    t.start()
                    try:
                        # (on this thread: Spark's active session is per thread)
                        df = (spark.read.format("bookkeeper").option("metadataServiceUri", uri)
                              .option("log", "src").load().select("data").repartition(4))
                        (df.write.format("bookkeeper").option("metadataServiceUri", uri)
                         .option("log", "dst").mode("append").save())
                    finally:
                        job_done.set()
                        t.join(30)
                    assert healed == [True], "the cut should have healed while the job ran"
                    with client.open_log_reader("dst") as r:
                        got = []
                        while len(got) < client.log_info("dst").records:
                            got.extend(x.data for x in r.read_batch(1000, timeout=5))
                    # exactly once: every record of src once, nothing else
                    assert sorted(got) == src
                finally:
                    spark.stop()
