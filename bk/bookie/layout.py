"""Where a bookie keeps things on disk, how full the disks are, and its cookie.

Shard ``i`` keeps its journal segments in ``journalDirectories[i % n]/shard-i``
and its index checkpoints in ``ledgerDirectories[i % m]/shard-i``.

The cookie binds directories to one bookie: its id, its directories and its
shard count. It is written into every directory (``bk-cookie.json``) and under
``cookies/<id>`` in the metadata store when the bookie is first formatted, and
checked at every start. A mismatch refuses to start with a message that names
what differs, because starting anyway could serve another bookie's data or
lose track of entries (a different shard count maps ledgers to other shards).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

from bk.config import Config
from bk.errors import CookieMismatchError

log = logging.getLogger("bk.bookie")

COOKIE_FILE = "bk-cookie.json"
COOKIE_VERSION = 1


def _abs(paths) -> list[str]:
    return [os.path.abspath(p) for p in paths]


def shard_dirs(conf: Config, shard: int) -> tuple[str, str]:
    """(journal dir, index dir) of one shard."""
    jd = _abs(conf.journalDirectories)
    ld = _abs(conf.ledgerDirectories)
    return (os.path.join(jd[shard % len(jd)], f"shard-{shard}"),
            os.path.join(ld[shard % len(ld)], f"shard-{shard}"))


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

def make_cookie(conf: Config, num_shards: int) -> dict:
    return {
        "version": COOKIE_VERSION,
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
                                "bookie.pid.tmp") for name in os.listdir(directory))
    except FileNotFoundError:
        return False


def check_cookie(conf: Config, store) -> int:
    """Verify (or, on empty directories, create) the cookie; return the shard count.

    ``store`` is a MetadataStore, or None to check the local cookies only.
    """
    dirs = all_dirs(conf)
    local = {d: read_local_cookie(d) for d in dirs}
    present = {d: c for d, c in local.items() if c is not None}
    remote = None
    if store is not None:
        remote, _version = store.read_cookie(conf.bookie_id)

    if not present:
        busy = [d for d in dirs if _has_data(d)]
        if busy:
            raise CookieMismatchError(
                f"directory {busy[0]} holds data but no bookie cookie; refusing to use it "
                f"(run 'bookie format --force' to wipe it)")
        if remote is not None:
            raise CookieMismatchError(
                f"bookie {conf.bookie_id} is known to the metadata store (cookie created "
                f"{time.ctime(remote.get('createdAt', 0))}) but its directories {dirs} are "
                f"empty: its data was lost. Re-replicate it with 'bkshell recover "
                f"{conf.bookie_id}', then run 'bookie format --force' to start it empty")
        cookie = make_cookie(conf, conf.num_shards)
        for d in dirs:
            write_local_cookie(d, cookie)
        if store is not None:
            store.write_cookie(conf.bookie_id, cookie)
        log.info("formatted new bookie %s: %d shards in %s", conf.bookie_id,
                 cookie["numShards"], ", ".join(dirs))
        return cookie["numShards"]

    missing = [d for d in dirs if local[d] is None]
    if missing:
        raise CookieMismatchError(
            f"directory {missing[0]} has no cookie while {next(iter(present))} has one: "
            f"a directory was added, replaced or wiped; the bookie refuses to start")
    first = next(iter(present.values()))
    for d, c in present.items():
        if _comparable(c) != _comparable(first):
            raise CookieMismatchError(f"the cookies in {next(iter(present))} and {d} differ")
    num_shards = first.get("numShards")
    if conf.numShards and conf.numShards != num_shards:
        raise CookieMismatchError(
            f"numShards is {conf.numShards} in the configuration but this bookie was "
            f"formatted with {num_shards}: ledgers would map to other shards. Keep "
            f"numShards={num_shards} (or 0), or wipe it with 'bookie format --force'")
    expected = make_cookie(conf, num_shards)
    for key in ("bookieId", "journalDirectories", "ledgerDirectories"):
        if first.get(key) != expected[key]:
            raise CookieMismatchError(
                f"cookie mismatch on {key}: the directories belong to {first.get(key)!r} "
                f"but the configuration says {expected[key]!r}")
    if store is not None:
        if remote is None:
            log.warning("cookie of %s missing from the metadata store; writing it again",
                        conf.bookie_id)
            store.write_cookie(conf.bookie_id, first)
        elif _comparable(remote) != _comparable(first):
            raise CookieMismatchError(
                f"the cookie of {conf.bookie_id} in the metadata store differs from the one "
                f"in {next(iter(present))}: another bookie uses this id, or the directories "
                f"were copied from another bookie")
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
            if name.startswith("shard-") or name in (COOKIE_FILE, COOKIE_FILE + ".tmp"):
                p = os.path.join(d, name)
                if os.path.isdir(p):
                    shutil.rmtree(p)
                else:
                    os.unlink(p)
                removed.append(p)
    return removed
