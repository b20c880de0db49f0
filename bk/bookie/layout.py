"""Where a bookie keeps things on disk, how full the disks are, and its cookie.

Shard ``i`` keeps its journal segments in ``journalDirectories[i % n]/shard-i``,
its index and tombstones in ``ledgerDirectories[i % m]/shard-i``, and its
entry logs in ``<every ledger directory>/shard-i/entrylogs`` (new logs go to
the directories round-robin).

The cookie binds directories to one bookie of one cluster: its id, the
cluster's instanceId, its directories and its shard count. It is written into
every directory (``bk-cookie.json``) and under ``cookies/<id>`` in the metadata
store when the bookie is first formatted, and checked at every start. A
mismatch refuses to start with a message that names what differs, because
starting anyway could serve another bookie's data or lose track of entries (a
different shard count maps ledgers to other shards).

Cluster identity: a bookie never creates a cluster (only ``bkshell metaformat``
does). A bookie with data starts only against the cluster its cookie names and
only while that cluster still holds its cookie; otherwise (a typo in the
prefix, a wiped or re-formatted etcd, a decommissioned bookie) it refuses,
because its garbage collection would compare its ledgers with a listing that
does not know them and drop them all.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

from bk.config import Config
from bk.errors import ClusterIdentityError, ClusterNotFormattedError, CookieMismatchError

log = logging.getLogger("bk.bookie")

COOKIE_FILE = "bk-cookie.json"
# 2: carries instanceId; ledgers map to shards by protocol.shard_of (version 1 used
# ledger_id % shards, so a version-1 bookie's ledgers sit in other shards).
COOKIE_VERSION = 2
# What garbage collection remembers (bk.bookie.gc): the etcd revision up to which it
# applied every deletion. It belongs to the cookie's cluster: a format removes it.
GC_STATE_FILE = "gc-state.json"
# The deletions it verified lately (bk.bookie.gc.DeletionLog), bounded: honoured again
# after a restart. Also the cookie's cluster's.
GC_RECENT_FILE = "gc-recent.bin"
_GC_FILES = (GC_STATE_FILE, GC_STATE_FILE + ".tmp", GC_RECENT_FILE, GC_RECENT_FILE + ".tmp")


def _abs(paths) -> list[str]:
    return [os.path.abspath(p) for p in paths]


def shard_dirs(conf: Config, shard: int) -> tuple[str, str]:
    """(journal dir, index dir) of one shard."""
    jd = _abs(conf.journalDirectories)
    ld = _abs(conf.ledgerDirectories)
    return (os.path.join(jd[shard % len(jd)], f"shard-{shard}"),
            os.path.join(ld[shard % len(ld)], f"shard-{shard}"))


def shard_ledger_dirs(conf: Config, shard: int) -> list[str]:
    """Where a shard's entry logs go: its directory on every ledger directory,
    its own index directory first (BookKeeper spreads entry logs over disks)."""
    ld = _abs(conf.ledgerDirectories)
    first = shard % len(ld)
    return [os.path.join(ld[(first + k) % len(ld)], f"shard-{shard}") for k in range(len(ld))]


def local_shards(conf: Config) -> list[int]:
    """The shard numbers that have a directory under the journal or ledger dirs."""
    found = set()
    for d in _abs(conf.journalDirectories) + _abs(conf.ledgerDirectories):
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            continue
        for name in names:
            if name.startswith("shard-") and name[6:].isdigit():
                found.add(int(name[6:]))
    return sorted(found)


def all_dirs(conf: Config) -> list[str]:
    out: list[str] = []
    for d in _abs(conf.journalDirectories) + _abs(conf.ledgerDirectories):
        if d not in out:
            out.append(d)
    return out


def disk_space(conf: Config) -> dict:
    """Free and total bytes over the distinct filesystems of the bookie's dirs,
    and the highest usage fraction among them (what read-only mode watches)."""
    seen = set()
    free = total = 0
    usage = 0.0
    for d in all_dirs(conf):
        probe = d
        while not os.path.exists(probe):
            probe = os.path.dirname(probe) or "/"
        st = os.statvfs(probe)
        if st.f_fsid in seen and st.f_fsid:
            continue
        seen.add(st.f_fsid)
        t = st.f_blocks * st.f_frsize
        f = st.f_bavail * st.f_frsize
        free += f
        total += t
        if t:
            usage = max(usage, 1.0 - f / t)
    return {"free_bytes": free, "total_bytes": total, "usage": usage}


# --- cookies -------------------------------------------------------------------

def make_cookie(conf: Config, num_shards: int, instance_id: str) -> dict:
    return {
        "version": COOKIE_VERSION,
        "instanceId": instance_id,
        "bookieId": conf.bookie_id,
        "journalDirectories": _abs(conf.journalDirectories),
        "ledgerDirectories": _abs(conf.ledgerDirectories),
        "numShards": num_shards,
        "createdAt": time.time(),
    }


def _comparable(cookie: dict) -> dict:
    return {k: v for k, v in cookie.items() if k != "createdAt"}


def read_local_cookie(directory: str) -> dict | None:
    path = os.path.join(directory, COOKIE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CookieMismatchError(f"cannot read cookie {path}: {e}") from None


def write_local_cookie(directory: str, cookie: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, COOKIE_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(cookie, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _has_data(directory: str) -> bool:
    try:
        # The default pid and log files live in the first ledger directory too.
        return any(name not in ("lost+found", COOKIE_FILE, "bookie.pid", "bookie.log",
                                "bookie.pid.tmp", *_GC_FILES)
                   for name in os.listdir(directory))
    except FileNotFoundError:
        return False


def check_cookie(conf: Config, store) -> int:
    """Verify the cookie against the directories and the cluster (or, on empty
    directories of a formatted cluster, create it); return the shard count.
    CookieMismatchError, with a message naming what differs, when the bookie must
    not start."""
    dirs = all_dirs(conf)
    local = {d: read_local_cookie(d) for d in dirs}
    present = {d: c for d, c in local.items() if c is not None}
    first = next(iter(present.values()), None)
    first_dir = next(iter(present), None)
    if first is not None and first.get("version") != COOKIE_VERSION:
        raise CookieMismatchError(
            f"the cookie in {first_dir} has format version {first.get('version')}; this bk "
            f"reads version {COOKIE_VERSION} (its ledgers are laid out differently). Move "
            f"the data off with the bk version that wrote it, or wipe the bookie with "
            f"'bookie format --force'")
    busy = [d for d in dirs if _has_data(d)]
    where = f"prefix {store.prefix} at {store.uri}"
    try:
        cluster = store.cluster()
    except ClusterNotFormattedError:
        if first is not None or busy:
            theirs = first.get("instanceId") if first else None
            raise CookieMismatchError(
                f"no bk cluster under {where}, but this bookie holds data"
                + (f" of cluster {theirs}" if theirs else "")
                + ": is the prefix of metadataServiceUri mistyped, or was etcd wiped? "
                  "Refusing to start (nothing was changed)") from None
        raise CookieMismatchError(
            f"no bk cluster under {where}: create it with 'bkshell --metadata "
            f"{store.uri} metaformat' before starting bookies (or fix a typo in the "
            f"prefix)") from None
    except ClusterIdentityError as e:
        raise CookieMismatchError(str(e)) from None
    instance = cluster["instanceId"]
    remote, _version = store.read_cookie(conf.bookie_id)

    if not present:
        if busy:
            raise CookieMismatchError(
                f"directory {busy[0]} holds data but no bookie cookie; refusing to use it "
                f"(run 'bookie format --force' to wipe it)")
        if remote is not None:
            raise CookieMismatchError(
                f"bookie {conf.bookie_id} is known to the cluster under {where} (cookie "
                f"created {time.ctime(remote.get('createdAt', 0))}) but its directories "
                f"{dirs} are empty: its data was lost. Re-replicate it with 'bkshell "
                f"recover {conf.bookie_id}', then run 'bookie format --force' to start it "
                f"empty")
        cookie = make_cookie(conf, conf.num_shards, instance)
        for d in dirs:
            write_local_cookie(d, cookie)
        store.write_cookie(conf.bookie_id, cookie)    # create-if-absent
        log.info("formatted new bookie %s of cluster %s: %d shards in %s", conf.bookie_id,
                 instance, cookie["numShards"], ", ".join(dirs))
        return cookie["numShards"]

    missing = [d for d in dirs if local[d] is None]
    if missing:
        raise CookieMismatchError(
            f"directory {missing[0]} has no cookie while {first_dir} has one: "
            f"a directory was added, replaced or wiped; the bookie refuses to start")
    for d, c in present.items():
        if _comparable(c) != _comparable(first):
            raise CookieMismatchError(f"the cookies in {first_dir} and {d} differ")
    if first.get("instanceId") != instance:
        raise CookieMismatchError(
            f"this bookie belongs to cluster {first.get('instanceId')}, but the cluster "
            f"under {where} is {instance} (re-formatted, or another cluster): refusing to "
            f"start (nothing was changed). Point metadataServiceUri at the bookie's "
            f"cluster, or wipe the bookie with 'bookie format --force' to join this one")
    num_shards = first.get("numShards")
    if conf.numShards and conf.numShards != num_shards:
        raise CookieMismatchError(
            f"numShards is {conf.numShards} in the configuration but this bookie was "
            f"formatted with {num_shards}: ledgers would map to other shards. Keep "
            f"numShards={num_shards} (or 0), or wipe it with 'bookie format --force'")
    expected = make_cookie(conf, num_shards, instance)
    for key in ("bookieId", "journalDirectories", "ledgerDirectories"):
        if first.get(key) != expected[key]:
            raise CookieMismatchError(
                f"cookie mismatch on {key}: the directories belong to {first.get(key)!r} "
                f"but the configuration says {expected[key]!r}")
    if remote is None:
        if busy:
            raise CookieMismatchError(
                f"the cluster under {where} has no cookie for bookie {conf.bookie_id}, "
                f"which holds data (it was decommissioned, or its cookie deleted): "
                f"refusing to start (nothing was changed). Wipe it with 'bookie format "
                f"--force' to join again empty")
        # Cookies written, data not yet: nothing to lose, register it again.
        log.warning("cookie of %s missing from the cluster; the bookie holds no data yet, "
                    "writing it again", conf.bookie_id)
        store.write_cookie(conf.bookie_id, first)
    elif _comparable(remote) != _comparable(first):
        raise CookieMismatchError(
            f"the cookie of {conf.bookie_id} in the cluster under {where} differs from the "
            f"one in {first_dir}: another bookie uses this id, or the directories were "
            f"copied from another bookie")
    return num_shards


def verify_local_cookies(conf: Config) -> None:
    """Raise CookieMismatchError unless every directory still holds the cookie.

    A running bookie checks this before restarting a shard and on every disk
    check: directories that vanished or were wiped under it must stop it, never
    be recreated empty while it stays registered."""
    for d in all_dirs(conf):
        if read_local_cookie(d) is None:
            raise CookieMismatchError(
                f"the cookie in {d} is gone: the directory was removed or wiped while the "
                f"bookie ran; stopping rather than serving empty storage")


def wipe(conf: Config) -> list[str]:
    """Remove every shard directory and cookie of this bookie (``bookie format``)."""
    removed = []
    for d in all_dirs(conf):
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            if name.startswith("shard-") or name in (COOKIE_FILE, COOKIE_FILE + ".tmp",
                                                     *_GC_FILES):
                p = os.path.join(d, name)
                if os.path.isdir(p):
                    shutil.rmtree(p)
                else:
                    os.unlink(p)
                removed.append(p)
    return removed
