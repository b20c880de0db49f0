"""etcd's status fields that pyetcd's StatusResponse lacks, read from its wire form."""

from pyetcd import etcdrpc

from bk.meta.store import STATUS_DB_SIZE_IN_USE, _varint_field


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def test_db_size_in_use_is_read_after_the_fields_pyetcd_knows():
    resp = etcdrpc.StatusResponse(version="3.5.1", dbSize=9 << 20, leader=7, raftIndex=300)
    resp.header.revision = 12345
    raw = resp.SerializeToString()
    in_use = 3 << 20 | 5              # a varint of several bytes
    extra = (_varint(STATUS_DB_SIZE_IN_USE << 3) + _varint(in_use)
             + _varint(10 << 3) + _varint(1))           # isLearner after it
    assert _varint_field(raw, STATUS_DB_SIZE_IN_USE) is None
    assert _varint_field(raw + extra, STATUS_DB_SIZE_IN_USE) == in_use
    # the known fields around it (nested header, a string, varints) are skipped over
    assert _varint_field(raw + extra, 3) == 9 << 20
    parsed = etcdrpc.StatusResponse.FromString(raw + extra)
    assert parsed.dbSize == 9 << 20
    assert _varint_field(parsed.SerializeToString(), STATUS_DB_SIZE_IN_USE) == in_use
