"""The Spark source and sink on a secure cluster: TLS and tokens to the bookies,
TLS, a client certificate and a user to etcd, all given as options (file paths)."""

import os
import shutil
import sys

import pytest

import bk
from bk.testing import LocalCluster

pyspark = pytest.importorskip("pyspark")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Spark needs Java", allow_module_level=True)

import bk.spark  # noqa: E402


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    c = LocalCluster(num_bookies=3, base_dir=str(tmp_path_factory.mktemp("spark-secure")),
                     num_shards=1, secure=True)
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def spark(secure):
    from pyspark.sql import SparkSession
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    s = (SparkSession.builder.master("local[2]").appName("bk-test-secure")
         # on loopback: a JVM that ran test_spark_hosts (same xdist worker) keeps
         # that test's namespace address, gone since, as the driver's default
         .config("spark.driver.host", "127.0.0.1")
         .config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
         .config("spark.python.authenticate.socketTimeout", "120s").getOrCreate())
    bk.spark.register(s)
    yield s
    s.stop()


def _options(frame, secure, **extra):
    frame = frame.format("bookkeeper").option("metadataServiceUri", secure.metadata_uri)
    for k, v in {**secure.client_settings(), **extra}.items():
        frame = frame.option(k, "true" if v is True else str(v))
    return frame


def test_spark_writes_and_reads_a_log_over_tls(spark, secure):
    rows = [(f"s{i}".encode(),) for i in range(300)]
    df = spark.createDataFrame(rows, "data binary").repartition(2)
    _options(df.write, secure, log="secure-log").mode("append").save()
    got = sorted(bytes(r.data) for r in _options(spark.read, secure, log="secure-log")
                 .load().collect())
    assert got == sorted(r[0] for r in rows)
    # the same read without the security options fails (etcd wants TLS and a user)
    with pytest.raises(Exception):
        (spark.read.format("bookkeeper").option("metadataServiceUri", secure.metadata_uri)
         .option("log", "secure-log").load().collect())
    # a token given inline is refused: options show up in plans
    with pytest.raises(Exception, match="authTokenFile"):
        _options(spark.read, secure, log="secure-log", authToken="x.y.z").load().collect()
    with bk.BookKeeper(secure.metadata_uri, **secure.client_settings()) as client:
        assert client.log_info("secure-log").records == 300
        with client.open_log_reader("secure-log") as r:
            out = []
            while len(out) < 300:
                batch = r.read_batch(1000, timeout=5)
                assert batch
                out.extend(batch)
        assert sorted(rec.data for rec in out) == got


def test_the_distributed_check_runs_over_tls(spark, secure):
    with bk.BookKeeper(secure.metadata_uri, **secure.client_settings()) as client:
        with client.create_ledger(3, 2, 2, password=b"pw") as lh:
            for i in range(40):
                lh.add_entry(b"c%d" % i)
    rows = bk.spark.check_ledgers(spark, secure.metadata_uri, 2,
                                  security=secure.client_settings()).collect()
    assert rows == []
