"""The Spark source and sink on a secure cluster: TLS and tokens to the bookies,
TLS, a client certificate and a user to etcd, all given as options (file paths)."""

import pytest

import bk
import bk.spark
from bk.testing import LocalCluster


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    c = LocalCluster(num_bookies=3, base_dir=str(tmp_path_factory.mktemp("spark-secure")),
                     num_shards=1, secure=True)
    c.start()
    yield c
    c.stop()


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
