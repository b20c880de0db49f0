"""The bookie's HTTP views (``httpServerEnabled``), served by the arbiter.

``bookie start`` loads this module only when the bookie serves HTTP and hands it
to the arbiter (with prometheus_client and http.server behind it, ~0.1 CPU-s of
imports a bookie without HTTP does not pay).

:func:`routes` builds the route table that :class:`bk.http.HttpServer` serves
on a thread of the arbiter. The views read the arbiter's state and
:class:`bk.metrics.BookieMetrics` (under that object's lock) and never touch a
shard worker's loop, so a slow scrape cannot delay an add.

``/heartbeat``                   200 ``OK`` while the arbiter serves
``/metrics``                     Prometheus text format, summed over shard workers
``/api/v1/bookie/info``          JSON: identity, ports, shards, storage, disk
``/api/v1/bookie/state``         JSON: running / readOnly / shuttingDown
``/api/v1/autorecovery/status``  JSON read from the metadata store (blocking: etcd)
"""

from __future__ import annotations

import os

from bk import metrics as M
from bk import protocol as P
from bk.autorecovery.status import status as autorecovery_status
from bk.bookie import layout
from bk.exposition import registry_of
from bk.http import HttpServer, heartbeat, json_reply, metrics_view
from bk.security import http_security


def server(arbiter) -> HttpServer:
    """The HTTP server of ``arbiter``'s bookie, bound to httpServerPort (OSError if
    it cannot be) and not yet serving."""
    conf = arbiter.conf
    return HttpServer(routes(arbiter), conf.bind_address, conf.httpServerPort,
                      **http_security(conf))


def routes(arbiter) -> dict:
    """The route table of a bookie whose arbiter is ``arbiter``."""
    return {
        "/heartbeat": heartbeat,
        "/metrics": metrics_view(registry_of(arbiter.metrics), lambda: refresh_metrics(arbiter)),
        "/api/v1/bookie/info": lambda: json_reply(info(arbiter)),
        "/api/v1/bookie/state": lambda: json_reply(state(arbiter)),
        "/api/v1/autorecovery/status": lambda: json_reply(
            autorecovery_status(arbiter.store, arbiter.autorecovery is not None)),
    }


def refresh_metrics(arbiter) -> None:
    """Disk space and read-only state, read at scrape time (the loop does not keep them)."""
    try:
        disk = layout.disk_space(arbiter.conf)
    except OSError:
        disk = {}
    with arbiter.metrics.lock:
        arbiter.metrics.readonly = arbiter.readonly
        arbiter.metrics.disk = disk


def state(arbiter) -> dict:
    stopping, readonly = arbiter.stopping, arbiter.readonly
    return {"running": not stopping, "readOnly": readonly, "shuttingDown": stopping,
            "availableForHighPriorityWrites": not stopping,
            "state": "stopping" if stopping else "readonly" if readonly else "writable"}


def info(arbiter) -> dict:
    totals = arbiter.metrics.totals()

    def total(m):
        return sum(totals.get(m.name, {}).values())
    try:
        disk = layout.disk_space(arbiter.conf)
    except OSError as e:
        disk = {"error": str(e)}
    return {"bookieId": arbiter.conf.bookie_id, "address": arbiter.conf.advertisedAddress,
            "port": arbiter.port, "httpPort": arbiter.http_port, "pid": os.getpid(),
            "numShards": arbiter.num_shards, "protocolVersion": P.PROTOCOL_VERSION,
            "state": state(arbiter)["state"], "ledgers": total(M.LEDGERS),
            "entries": total(M.ENTRIES), "disk": disk,
            "shards": [{"shard": w.shard, "pid": w.pid, "ready": w.ready,
                        "restarts": arbiter.metrics.restarts[w.shard]}
                       for w in arbiter.workers],
            "lastGc": {str(k): v for k, v in arbiter.last_gc.items()},
            "gc": arbiter.gc.state() if arbiter.gc is not None else None,
            "lastOverreplicatedScan": {str(k): v for k, v in arbiter.last_overrep.items()}}
