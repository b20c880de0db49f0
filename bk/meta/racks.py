"""Which rack each bookie is in, kept in etcd (BookKeeper asks a DNS-to-switch
script; bk keeps the mapping in the metadata store, where every client and the
auditor read the same one).

A rack is a path ``/region/rack``. ``racks/<bookie id>`` holds ``{"rack": path}``;
``bkshell setrack`` writes it, and a bookie with ``bookieRack`` in its conf
writes its own at start when etcd has none (an operator's ``setrack`` wins).
A bookie with no entry is in :data:`DEFAULT_RACK`.
"""

from __future__ import annotations

import re

from bk.errors import ConfigError, MetadataVersionError

DEFAULT_REGION = "/default-region"
DEFAULT_RACK = "/default-region/default-rack"
_PATH = re.compile(r"^(/[A-Za-z0-9][A-Za-z0-9_.\-]*){1,2}$")


def check_rack(path: str) -> str:
    """``path`` normalised to ``/region/rack`` (a bare ``/rack`` is put in the
    default region); ConfigError naming it if it is not a rack path."""
    if not isinstance(path, str) or not _PATH.match(path.strip()):
        raise ConfigError(f"bad rack {path!r}: expected /region/rack (letters, digits, "
                          f"'.', '_', '-')")
    path = path.strip()
    return path if path.count("/") == 2 else DEFAULT_REGION + path


def region_of(rack: str) -> str:
    return "/" + rack.split("/")[1]


def _rel(bookie_id: str) -> str:
    return f"racks/{bookie_id}"


def set_rack(store, bookie_id: str, rack: str) -> str:
    """Put ``bookie_id`` in ``rack`` (overwriting); returns the normalised path."""
    rack = check_rack(rack)
    store.put_json(_rel(bookie_id), {"rack": rack})
    return rack


def set_rack_if_absent(store, bookie_id: str, rack: str) -> bool:
    """A bookie's own ``bookieRack``: written only when etcd has no rack for it."""
    try:
        store.cas_json(_rel(bookie_id), {"rack": check_rack(rack)}, None)
        return True
    except MetadataVersionError:
        return False


def get_rack(store, bookie_id: str) -> str | None:
    """The rack stored for ``bookie_id``, or None (it is then in DEFAULT_RACK)."""
    value, _ = store.get_json(_rel(bookie_id))
    return value.get("rack") if isinstance(value, dict) else None


def delete_rack(store, bookie_id: str) -> bool:
    return store.delete_json(_rel(bookie_id))


def all_racks(store) -> dict[str, str]:
    """bookie id -> rack of every bookie with a stored rack."""
    out = {}
    for rel, value, _ in store.list_json("racks/"):
        if isinstance(value, dict) and isinstance(value.get("rack"), str):
            out[rel[len("racks/"):]] = value["rack"]
    return out
