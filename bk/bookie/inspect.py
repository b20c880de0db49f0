"""Inspection of a bookie's own directories, without the bookie running: the
shard count from the cookies, each shard's checkpoint mark, and the journal's
records decoded (``bkshell lastmark`` / ``readjournal``). Read-only: nothing
here truncates or writes.
"""

from __future__ import annotations

import os

from bk.bookie import journal as J
from bk.bookie import layout
from bk.bookie.index import read_mark as read_index_mark
from bk.errors import BKError


def local_num_shards(conf) -> int:
    """The shard count recorded in the bookie's local cookies (else ``numShards``)."""
    for d in layout.all_dirs(conf):
        cookie = layout.read_local_cookie(d)
        if cookie and cookie.get("numShards"):
            return int(cookie["numShards"])
    return conf.num_shards


def read_checkpoint_mark(index_dir: str):
    """The journal mark ("seq:offset") of a shard's last flush, and its time, or None."""
    return read_index_mark(index_dir)


def last_marks(conf) -> list[dict]:
    """Checkpoint mark of each shard of the bookie described by ``conf``."""
    out = []
    for shard in range(local_num_shards(conf)):
        jd, idx = layout.shard_dirs(conf, shard)
        mark, mtime = read_checkpoint_mark(idx)
        out.append({"shard": shard, "mark": J.format_mark(mark) if mark else None,
                    "checkpoint_time": mtime, "journal_dir": jd, "index_dir": idx})
    return out


def read_journal(conf, shard: int = 0, start=None, limit: int | None = None):
    """Decoded records of one shard's journal, read-only (never truncating)."""
    n = local_num_shards(conf)
    if not 0 <= shard < n:
        raise ValueError(f"shard {shard} does not exist: the bookie has {n} shards (0..{n - 1})")
    jd, _ = layout.shard_dirs(conf, shard)
    if not os.path.isdir(jd):
        raise BKError(f"journal directory {jd} of shard {shard} does not exist")
    for i, rec in enumerate(J.iter_records(jd, start)):
        if limit is not None and i >= limit:
            return
        yield rec


def describe_record(rec) -> dict:
    """A journal record as a JSON-able dict (payloads and keys by their size only)."""
    d = {"mark": J.format_mark((rec.seq, rec.offset)), "type": rec.type_name,
         "length": rec.length}
    f = rec.fields
    t = rec.type
    if t == J.ADD:
        ledger, entry, lac, digest, payload = f[:5]
        d.update(ledger=ledger, entry=entry, lac=lac, digest_bytes=len(digest),
                 payload_bytes=len(payload))
    elif t in (J.FENCE, J.DELETE, J.DROP):
        d.update(ledger=f[0])
    elif t == J.MASTER_KEY:
        d.update(ledger=f[0], key_bytes=len(f[1]))
    elif t == J.WRITE_LAC:
        d.update(ledger=f[0], lac=f[1])
    elif t == J.STATE:
        d.update(ledger=f[0], fenced=bool(f[1]), lac=f[2])
    else:
        d.update(fields=[x if not isinstance(x, (bytes, memoryview)) else f"<{len(x)} bytes>"
                         for x in f])
    return d
