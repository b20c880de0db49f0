"""The one registry of settings, and the read-only :class:`Config` built from it.

Every key that bk reads is defined once in :data:`SETTINGS` with its type,
default and documentation; ``conf/bk_server.conf`` and ``conf/client.conf``
document the same keys. Values come, lowest precedence first, from the
registry defaults, a ``key=value`` conf file, environment variables
``BK_<key>`` and explicit overrides (command-line flags). An unknown key or a
value that does not parse raises :class:`bk.errors.ConfigError` naming the key:
a typo in a directory key must never fall back silently to a default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from bk.errors import ConfigError

SERVER, CLIENT, BOTH = "server", "client", "both"


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("true", "1", "yes", "on"):
        return True
    if t in ("false", "0", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _parse_list(text: str) -> list[str]:
    items = [p.strip() for p in text.split(",") if p.strip()]
    if not items:
        raise ValueError("expected a comma-separated list with at least one item")
    return items


def _parse_int(text: str) -> int:
    return int(text.strip(), 0)


def _parse_float(text: str) -> float:
    return float(text.strip())


def _parse_str(text: str) -> str:
    return text.strip()


_PARSERS: dict[type, Callable[[str], Any]] = {
    bool: _parse_bool, int: _parse_int, float: _parse_float, str: _parse_str, list: _parse_list,
}
_TYPE_WORDS = {bool: "a boolean (true/false)", int: "an integer", float: "a number",
               str: "a string", list: "a comma-separated list"}


@dataclass(frozen=True)
class Setting:
    name: str
    type: type
    default: Any
    doc: str
    scope: str = SERVER
    minimum: float | None = None
    maximum: float | None = None

    def parse(self, value: Any) -> Any:
        """Convert ``value`` (text or an already-typed value) or raise ConfigError."""
        try:
            if isinstance(value, str):
                v = _PARSERS[self.type](value)
            elif self.type is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                v = float(value)
            elif self.type is list and isinstance(value, (list, tuple)):
                v = [str(x) for x in value]
                if not v:
                    raise ValueError("expected at least one item")
            elif isinstance(value, self.type) and not (self.type is int and isinstance(value, bool)):
                v = value
            else:
                raise ValueError(f"expected {_TYPE_WORDS[self.type]}")
        except ValueError as e:
            raise ConfigError(f"bad value {value!r} for {self.name}: "
                              f"{_TYPE_WORDS[self.type]} is required ({e})") from None
        if self.minimum is not None and v < self.minimum:
            raise ConfigError(f"bad value {value!r} for {self.name}: must be >= {self.minimum}")
        if self.maximum is not None and v > self.maximum:
            raise ConfigError(f"bad value {value!r} for {self.name}: must be <= {self.maximum}")
        return v


_S = Setting
SETTINGS: dict[str, Setting] = {s.name: s for s in [
    # --- identity and network -------------------------------------------------
    _S("bookieId", str, "", "Bookie id registered in the metadata store. Empty: "
       "<advertisedAddress>:<bookiePort>."),
    _S("bookiePort", int, 3181, "TCP port the bookie listens on.", minimum=0, maximum=65535),
    _S("advertisedAddress", str, "127.0.0.1", "Address clients use to reach this bookie."),
    _S("bindAddress", str, "", "Address to bind. Empty: the advertisedAddress."),
    _S("bookieRack", str, "", "This bookie's rack, /region/rack, written to the metadata "
       "store at start when it has none for the bookie (bkshell setrack overrides it). "
       "Empty: none is written; a bookie without one is in /default-region/default-rack."),
    _S("metadataServiceUri", str, "", "etcd://host:port[,host:port...]/prefix of the "
       "metadata store.", scope=BOTH),
    _S("metadataServiceStartTimeoutSeconds", int, 30, "Seconds a starting bookie waits for an "
       "unreachable metadata store (retrying with back-off) before it exits with code 5; "
       "0: exit at once. A store that answers but holds no cluster, or another cookie, "
       "stops the start at once.", minimum=0),
    # --- storage ---------------------------------------------------------------
    _S("journalDirectories", list, ["/tmp/bk-txn"], "Directories of the journal segments "
       "(every write goes there first; put them on a fast device). Shards are spread over "
       "them round-robin."),
    _S("ledgerDirectories", list, ["/tmp/bk-data"], "Directories of the entry logs, the "
       "index, ledger state and cookie. Each shard keeps its index on one of them "
       "(round-robin) and writes its entry logs to all of them in turn."),
    _S("numShards", int, 0, "Shard worker processes. 0: one per CPU. Fixed when the bookie "
       "is formatted (recorded in its cookie).", minimum=0, maximum=256),
    _S("journalMaxGroupWaitMSec", int, 0, "Longest time (ms) an add waits for others to "
       "share its journal sync. 0: a sync starts as soon as a pass of the shard's loop "
       "holds answers and no sync is in flight; the adds that arrive during a sync form "
       "the next group (measured: no fewer adds/s at full speed, p50 2.5 -> 1.4 ms at "
       "30,000 entries/s, than with 2).", minimum=0),
    _S("journalBufferedWritesThreshold", int, 512 * 1024, "Bytes of unsynced journal "
       "writes that force a sync without waiting further.", minimum=0),
    _S("journalPreAllocSizeMB", int, 64, "Size (MiB) of each preallocated journal segment.",
       minimum=1, maximum=2048),
    _S("journalSyncData", bool, True, "fdatasync journal writes before acknowledging them. "
       "false: acknowledged adds survive a process crash but not a power loss."),
    _S("journalSyncThroughAio", bool, True, "Begin each group commit's fdatasync through "
       "Linux AIO, its completion signalled on an eventfd the shard's loop watches, instead "
       "of handing it to the shard's sync thread (fewer context switches and less CPU per "
       "group; the same durability). Where AIO is missing or refused the thread is used "
       "anyway; false: always the thread."),
    _S("journalDirectWrites", bool, True, "Write each group commit's journal blocks with "
       "O_DIRECT and RWF_DSYNC (durable when the write completes: no page cache, no "
       "writeback, no separate fdatasync) from a window of the active segment kept in "
       "memory (journalDirectMemoryMB), which also serves the reads of recent entries. "
       "Measured on the project's VM, quiet: add p99 at 30,000 entries/s 0.68x (TLS median "
       "6.25 -> 4.25 ms; shorter syncs), CPU per entry 1.07x there (smaller groups); less "
       "CPU per add with large groups (docs/performance-log.md). Only with journalSyncData; "
       "where the filesystem refuses O_DIRECT the journal writes through the page cache "
       "(logged). Turn it off on a device whose O_DIRECT writes are slower than buffered "
       "writes plus fdatasync (measure with scripts/bench_sync.py)."),
    _S("journalDirectMemoryMB", int, 16, "Memory (MiB) per shard for journalDirectWrites: "
       "two windows of half of it each (the active segment's, where records are built and "
       "written from, and the previous segment's tail), made and touched when the shard "
       "starts (logged then), whatever journalPreAllocSizeMB and numShards are (a window "
       "larger than a segment is cut to it). The entries a shard appended last are read "
       "from memory (at least the last eighth of a window, 1 MiB at the default, up to "
       "three quarters of one); older ones not yet flushed are read from the journal "
       "file, i.e. from the disk (direct writes leave none of it in the page cache). A record larger than a window (an entry near nettyMaxFrameSizeBytes with "
       "a smaller setting) makes that window grow, logged. See docs/operations.md, "
       "\"Storage: write cache, flushes, read-ahead\".", minimum=1, maximum=4096),
    _S("journalRemovePagesFromCache", bool, True, "After each flush, drop from the page "
       "cache the journal the flush before it took (posix_fadvise DONTNEED), so that the "
       "journal holds about two flushes and the write cache per shard there and new "
       "journal writes land on pages the kernel just freed rather than on new ones (on a "
       "VM that hands free memory back to its host, filling a new page cost 2-3 times as "
       "much). Entries older than that are read from the disk. false: the kernel decides."),
    _S("flushInterval", int, 60000, "Interval (ms) between flushes of the write cache into "
       "entry logs and the index (when anything was written); a restart replays the "
       "journal only from the last flush.", minimum=100),
    _S("flushIntervalBytes", int, 256 * 1024 * 1024, "Journal bytes written since the last "
       "flush after which one starts, if half of dbStorage_writeCacheMaxSizeMb did not come "
       "first: bounds what a restart after kill -9 replays. Each shard flushes at a random "
       "point of the last quarter below it, so that bookies sharing the same writes do not "
       "flush together.", minimum=1 << 20),
    _S("dbStorage_writeCacheMaxSizeMb", int, 64, "Size (MiB) of a shard's write cache: the "
       "journal bytes written since the last flush, whose locations the shard keeps in "
       "memory (8 bytes an entry). A flush starts at a random point of the last quarter "
       "below half of it (drawn anew each time, so that bookies receiving the same writes "
       "do not flush together), on the flusher thread; if the other half fills before it "
       "ends, the shard waits for it.", minimum=2),
    _S("dbStorage_readAheadCacheMaxSizeMb", int, 32, "Size (MiB) of a shard's read-ahead "
       "cache: entries read from entry logs ahead of a reader of one ledger. Also how far "
       "(at most 8 MiB) past a READ_RANGE's answer the disk is asked to read that "
       "ledger's next runs into the page cache; 0 turns both off.", minimum=0),
    _S("dbStorage_readAheadCacheBatchSize", int, 100, "Entries of the same ledger a read "
       "that misses the caches reads ahead with the same pread (at most 1 MiB).",
       minimum=1),
    _S("dbStorage_rocksDB_blockCacheSize", int, 16 * 1024 * 1024, "Bytes of a shard's "
       "index (LMDB, read through a mapping) kept in the worker's memory, as BookKeeper's "
       "index block cache: past it, checked every second, the mapped index pages are "
       "dropped from the process (they stay in the page cache, and a lookup maps them "
       "again), so RSS does not grow with the index.", minimum=64 * 1024),
    _S("logSizeLimit", int, 256 * 1024 * 1024, "Bytes after which a shard starts a new entry "
       "log. Smaller logs are compacted in finer steps (BookKeeper's default is 1 GiB).",
       minimum=1 << 20, maximum=1 << 40),
    _S("nettyMaxFrameSizeBytes", int, 5 * 1024 * 1024, "Largest frame accepted or sent.",
       scope=BOTH, minimum=1024),
    _S("frameBatching", bool, True, "Batched frames (ADD_BATCH with group acknowledgements, "
       "READ_RANGE). A bookie with false does not announce them at HELLO, so clients use "
       "single ADDs and READs with it; a client with false never sends them (the old "
       "single-entry path, e.g. for bkshell bench --compare).", scope=BOTH),
    # --- disk space, GC ----------------------------------------------------------
    _S("diskUsageThreshold", float, 0.95, "Disk usage fraction at which the bookie turns "
       "read-only.", minimum=0.0, maximum=1.0),
    _S("diskUsageLwmThreshold", float, 0.90, "Disk usage fraction under which a read-only "
       "bookie turns writable again.", minimum=0.0, maximum=1.0),
    _S("diskCheckInterval", int, 10000, "Interval (ms) between disk usage checks.", minimum=10),
    _S("readOnlyModeEnabled", bool, True, "Turn read-only when the disk fills. false: "
       "the bookie shuts down instead."),
    _S("gcWaitTime", int, 60000, "Interval (ms) between garbage collections of deleted "
       "ledgers (and compaction of entry logs, when due).", minimum=10),
    _S("compactionThreshold", float, 0.5, "0 turns compaction of entry logs off; any other "
       "value leaves it on, as minorCompactionThreshold and majorCompactionThreshold say "
       "(the key of earlier releases, whose journal segments were compacted).",
       minimum=0.0, maximum=1.0),
    _S("minorCompactionThreshold", float, 0.2, "A minor compaction copies the live entries "
       "of every entry log whose live fraction is under this and removes the log. 0 "
       "disables minor compaction.", minimum=0.0, maximum=1.0),
    _S("minorCompactionInterval", int, 3600, "Seconds between minor compactions (run by the "
       "garbage collection that follows).", minimum=0),
    _S("majorCompactionThreshold", float, 0.8, "A major compaction does the same for every "
       "entry log whose live fraction is under this. 0 disables major compaction.",
       minimum=0.0, maximum=1.0),
    _S("majorCompactionInterval", int, 86400, "Seconds between major compactions.",
       minimum=0),
    _S("gcFullReconcileIntervalSeconds", int, 3600, "Seconds between a bookie's full "
       "reconciles of the ledgers it holds with the metadata store (it asks only about its "
       "own ledgers, in ranges, at one revision); between them it learns of deletions by "
       "watching them from a revision it remembers across restarts. A reconcile also runs "
       "at start when that revision is gone (compacted) and on SIGUSR1.", minimum=1),
    _S("metadataCompactionIntervalSeconds", int, 300, "Seconds between compactions of etcd's "
       "history by the one bookie elected compactor (through an etcd lease): each compacts "
       "to the revision read one interval earlier, like the Kubernetes API server. 0 turns "
       "it off (etcd's own --auto-compaction then must do it).", minimum=0),
    # --- process ---------------------------------------------------------------
    _S("registrationTtlSeconds", int, 10, "TTL of the bookie's registration lease in etcd; "
       "a dead bookie disappears within it.", minimum=2),
    _S("autoRecoveryDaemonEnabled", bool, False, "Run auto-recovery in this bookie: an "
       "auditor candidate (the elected one marks the ledgers of lost bookies "
       "under-replicated) and a replication worker (re-replicates them)."),
    _S("lostBookieRecoveryDelay", int, 0, "Seconds a bookie may be gone before the auditor "
       "marks its ledgers (at once when more than one is gone); bkshell "
       "lostbookierecoverydelay overrides it cluster-wide.", minimum=0),
    _S("openLedgerRereplicationGracePeriod", int, 30000, "Milliseconds a replication worker "
       "leaves an open ledger whose last ensemble lost a bookie to its writer (which "
       "replaces the bookie itself) before it fences and closes it.", minimum=0),
    _S("lockReleaseOfFailedLedgerGracePeriod", int, 300000, "Milliseconds before a ledger "
       "that could not be re-replicated (no surviving replica, too few bookies) is tried "
       "again.", minimum=0),
    _S("auditorPeriodicCheckInterval", int, 604800, "Seconds between the auditor's checks "
       "of every ledger: the first and last entry each bookie of a fragment should hold "
       "are read; a bookie that answers without one gets the ledger marked. 0 disables.",
       minimum=0),
    _S("auditorPeriodicBookieCheckInterval", int, 86400, "Seconds between the auditor's "
       "re-audits of every lost bookie (its ledgers marked again, e.g. after a mark was "
       "removed by hand). 0 disables.", minimum=0),
    _S("auditorReplicasCheckInterval", int, 0, "Seconds between the auditor's replica "
       "checks: GET_LIST_OF_ENTRIES on every bookie of each write quorum of the closed "
       "ledgers; a bookie lacking an entry gets the ledger marked and a worker copies the "
       "entry back to it. 0 disables (BookKeeper's default).", minimum=0),
    _S("auditorPeriodicPlacementPolicyCheckInterval", int, 0, "Seconds between the "
       "auditor's checks that every ledger fragment's write quorums span the racks "
       "ensemblePlacementPolicy asks (metric auditor_NUM_LEDGERS_NOT_ADHERING_TO_PLACEMENT_"
       "POLICY; bkshell placementcheck lists them). 0 disables.", minimum=0),
    _S("auditorMaxNumberOfConcurrentOpenLedgerOperations", int, 8, "Ledgers the auditor's "
       "periodic checks examine at once (each a few bookie requests).", minimum=1),
    _S("replicationRateByBytes", int, -1, "Bytes per second a replication worker (and "
       "bkshell recover) copies at most; -1: no limit.", minimum=-1),
    _S("gcOverreplicatedLedgerWaitTime", int, 86400000, "Milliseconds between a bookie's "
       "scans for ledgers it holds but is no longer in any ensemble of (re-replicated "
       "elsewhere while it was away); such a closed ledger is dropped once every bookie of "
       "its write quorums is found to hold its entries. 0 disables.", minimum=0),
    _S("rwRereplicateBackoffMs", int, 5000, "Milliseconds a replication worker with nothing "
       "to do waits before looking again (at most 500 ms between looks).", minimum=10),
    _S("workerTimeoutMSec", int, 30000, "A shard worker whose heartbeat is older than this "
       "is killed and restarted.", minimum=1000),
    _S("ioThreadSliceMicros", int, 0, "CPU time slice (us) asked of Linux for the "
       "latency-critical loops: each shard worker's loop on a bookie, the I/O thread on a "
       "client. Shorter than the kernel's (about 1.4 ms on two cores), it lets them run "
       "sooner when they wake on a busy host (no more CPU share than before), at the cost "
       "of smaller batches: 200 measured 2.5-3x shorter waits for a core at p99 and "
       "5-20% more CPU per entry. 0: ask nothing (the kernel's default). Linux 6.12+ "
       "(clamped to 100-100000); elsewhere it does nothing (see docs/performance-log.md).",
       scope=BOTH, minimum=0, maximum=100000),
    _S("pidFile", str, "", "Pid file of the bookie. Empty: bookie.pid in the first ledger "
       "directory."),
    _S("logFile", str, "", "Log file. Empty: stderr in the foreground, bookie.log in the "
       "first ledger directory with --daemon."),
    _S("logLevel", str, "INFO", "Log level: DEBUG, INFO, WARNING, ERROR.", scope=BOTH),
    # --- observability ---------------------------------------------------------
    _S("httpServerEnabled", bool, False, "Serve HTTP on httpServerPort: /heartbeat, /metrics "
       "(Prometheus), /api/v1/bookie/info, /api/v1/bookie/state, "
       "/api/v1/autorecovery/status."),
    _S("httpServerPort", int, 8000, "Port of the HTTP server (with httpServerEnabled). 0: a "
       "free port, logged and registered (bkshell listbookies shows it).",
       minimum=0, maximum=65535),
    _S("enableStatistics", bool, True, "Count the metrics /metrics serves. false: shard "
       "workers count nothing (the HTTP endpoints still answer)."),
    # --- security (bk.security; see docs/security.md) ----------------------------
    _S("tlsCertificatePath", str, "", "PEM certificate chain. On a bookie: the certificate "
       "it serves (TLS is offered once it is set) and presents to other bookies; on a "
       "client: its own certificate for mutual TLS.", scope=BOTH),
    _S("tlsKeyStore", str, "", "PEM private key of tlsCertificatePath.", scope=BOTH),
    _S("tlsTrustStore", str, "", "PEM CA bundle. On a bookie: the CAs of client "
       "certificates; on a client (and a bookie talking to other bookies): the CAs of "
       "bookie certificates. Empty on a client: the system's CAs.", scope=BOTH),
    _S("tlsClientAuthentication", bool, False, "Mutual TLS: a client must present a "
       "certificate signed by tlsTrustStore."),
    _S("tlsRequired", bool, True, "With a certificate set: refuse plaintext connections "
       "(they get an error saying TLS is required). false: serve both."),
    _S("tlsCertFilesRefreshDurationSeconds", int, 0, "How often (seconds) a bookie checks "
       "its certificate, key and trust files and loads them again when they changed; new "
       "connections use them. 0: never.", minimum=0),
    _S("tlsEnabled", bool, False, "Connect to bookies with TLS (a bookie that does not "
       "offer it is an error, never a plaintext fallback). On a bookie: for bookie-to-bookie "
       "traffic (re-replication, recovery).", scope=BOTH),
    _S("tlsHostnameVerificationEnabled", bool, True, "Check that a bookie's certificate "
       "names the host connected to.", scope=BOTH),
    _S("authProvider", str, "none", "How a bookie identifies its clients: none, token "
       "(a signed token checked with tokenSecretKeyFile, its subject is the role) or tls "
       "(the client certificate's subject CN is the role)."),
    _S("tokenSecretKeyFile", str, "", "File holding the HS256 keys tokens are signed with "
       "(bkshell tokens create-secret-key), one per line: every key verifies, the first "
       "signs. Changes are picked up without a restart (key rotation)."),
    _S("tokenRevocationFile", str, "", "File listing revoked tokens ('jti ID' lines) and "
       "roles ('sub ROLE': every token of the role), refused from their next connection "
       "(bkshell tokens revoke). Empty: none."),
    _S("tokenFilesRefreshDurationSeconds", int, 60, "How often (seconds) a bookie checks "
       "tokenSecretKeyFile and tokenRevocationFile and loads them again when they changed; "
       "open connections of a revoked token or a removed key are then closed. 0: never.",
       minimum=0),
    _S("superUserRoles", str, "", "Comma-separated roles allowed everything: bookies, "
       "auto-recovery and administrators (the HTTP admin views)."),
    _S("clientRoles", str, "", "Comma-separated roles allowed the client's ops: adds, "
       "reads, fencing by a recovery open, LAC reads and writes."),
    _S("readOnlyRoles", str, "", "Comma-separated roles allowed reads and LAC reads only."),
    _S("authToken", str, "", "The signed token this client (or bookie, to other bookies) "
       "presents (bkshell tokens create). Prefer authTokenFile: a conf file is often "
       "readable by many.", scope=BOTH),
    _S("authTokenFile", str, "", "File holding the token to present.", scope=BOTH),
    _S("httpServerTlsEnable", bool, False, "Serve HTTPS with the bookie's certificate "
       "(tlsCertificatePath, tlsKeyStore)."),
    _S("httpServerAuthMetrics", bool, False, "With authProvider set, /heartbeat and "
       "/metrics also need a bearer token of a super-user role."),
    _S("etcdTrustStore", str, "", "PEM CA bundle of etcd's server certificate: talk to "
       "etcd over TLS.", scope=BOTH),
    _S("etcdCertificatePath", str, "", "PEM client certificate for etcd (etcd's "
       "--client-cert-auth).", scope=BOTH),
    _S("etcdKeyStore", str, "", "PEM private key of etcdCertificatePath.", scope=BOTH),
    _S("etcdUser", str, "", "etcd user (etcd's auth); its password is read from "
       "etcdPasswordFile.", scope=BOTH),
    _S("etcdPasswordFile", str, "", "File holding etcdUser's password.", scope=BOTH),
    # --- client ----------------------------------------------------------------
    _S("addEntryTimeoutSec", float, 10.0, "Seconds before a bookie that has not "
       "acknowledged an add is replaced.", scope=CLIENT, minimum=0.1),
    _S("bookieQuarantineTimeSeconds", float, 60.0, "Seconds a bookie that failed this "
       "client (a connection that could not be made or broke, a request that timed out, "
       "an add it failed) stays quarantined: reads ask it after the other replicas "
       "(reorderReadSequenceEnabled), and new ensembles and replacements avoid it while "
       "enough other bookies are writable. A bookie that answers again leaves "
       "quarantine at once. Auto-recovery's re-replication likewise avoids, for this "
       "long, a replacement bookie that a copy failed to reach.", scope=BOTH, minimum=0),
    _S("reorderReadSequenceEnabled", bool, True, "Reads ask the healthy replicas of an "
       "entry before quarantined ones, so an unreachable bookie costs the connect timeout "
       "once per quarantine instead of once per ledger read.", scope=CLIENT),
    _S("speculativeReadTimeout", int, 2000, "Milliseconds a read waits for a replica "
       "before also asking the next one (the first good copy wins). 0: only after the "
       "replica failed or readEntryTimeoutSec passed.", scope=CLIENT, minimum=0),
    _S("readEntryTimeoutSec", float, 10.0, "Seconds before a read from one bookie is "
       "abandoned for the next replica.", scope=CLIENT, minimum=0.1),
    _S("clientConnectTimeoutMillis", int, 5000, "Timeout (ms) to connect to a bookie.",
       scope=CLIENT, minimum=1),
    _S("metadataTimeoutMillis", int, 5000, "Timeout (ms) of one metadata store request, "
       "and of connecting to it.", scope=BOTH, minimum=100),
    _S("ensemblePlacementPolicy", str, "random", "How ensembles (and replacements in "
       "ensemble changes, recovery and re-replication) are chosen: random; rackaware "
       "(every write quorum spans minNumRacksPerWriteQuorum racks, from bkshell setrack / "
       "bookieRack); regionaware (the same over regions, the first part of /region/rack).",
       scope=BOTH),
    _S("minNumRacksPerWriteQuorum", int, 2, "Racks (regions, with regionaware) each write "
       "quorum spans at least (at most Qw counts).", scope=BOTH, minimum=1),
    _S("enforceMinNumRacksPerWriteQuorum", bool, False, "true: creating or changing an "
       "ensemble that cannot meet minNumRacksPerWriteQuorum fails with "
       "NotEnoughBookiesError naming the racks; false: the best spread is used and a "
       "warning logged.", scope=BOTH),
    _S("throttle", int, 5000, "Most adds a ledger handle keeps outstanding; add_entries "
       "blocks beyond it.", scope=CLIENT, minimum=1),
    _S("readWindowBytes", int, 64 * 1024 * 1024, "Bytes of entries a read_entries call keeps "
       "in flight (sized from the entries read so far; at most 1000 entries), so reading "
       "large entries does not hold hundreds of MB.", scope=CLIENT, minimum=1),
    _S("explicitLacInterval", int, 0, "Interval (ms) at which an idle writer sends its LAC "
       "explicitly. 0: the LAC only travels piggybacked on the next entry.",
       scope=CLIENT, minimum=0),
    # --- logs (bk.log) ------------------------------------------------------------
    _S("logRollBytes", int, 256 * 1024 * 1024, "A log writer rolls to a new ledger once its "
       "segment holds this many record bytes. 0: never by size.", scope=CLIENT, minimum=0),
    _S("logRollEntries", int, 0, "A log writer rolls to a new ledger once its segment has "
       "this many entries. 0: never by entry count.", scope=CLIENT, minimum=0),
    _S("logRollSeconds", float, 3600.0, "A log writer rolls to a new ledger once its segment "
       "is this old (seconds). 0: never by age.", scope=CLIENT, minimum=0),
    _S("logBatchBytes", int, 128 * 1024, "A log writer sends a ledger entry (a record set) "
       "once this many record bytes are buffered.", scope=CLIENT, minimum=1),
    _S("logBatchLingerMs", int, 2, "Longest time (ms) a log record waits for others to "
       "share its entry; an idle writer also sends its LAC after it, so that tailing "
       "readers see the last record.", scope=CLIENT, minimum=0),
]}

# The sections of the registry, in its order: each runs from the key named to the
# next section's first key, so a key added inside a section belongs to it.
# docs/configuration.md is grouped by them (scripts/gen_conf.py).
SECTIONS: list[tuple[str, str]] = [
    ("Identity and network", "bookieId"),
    ("Storage", "journalDirectories"),
    ("Disk space and garbage collection", "diskUsageThreshold"),
    ("Process, registration and auto-recovery", "registrationTtlSeconds"),
    ("Observability", "httpServerEnabled"),
    ("Security", "tlsCertificatePath"),
    ("Client", "addEntryTimeoutSec"),
    ("Logs (bk.log)", "logRollBytes"),
]


# Settings whose value is itself a secret (the others name files holding secrets).
SECRET_KEYS = frozenset({"authToken"})


def sections() -> list[tuple[str, list[Setting]]]:
    """The settings grouped as the registry groups them: ``[(title, [Setting, ...])]``."""
    starts = {first: title for title, first in SECTIONS}
    unknown = set(starts) - set(SETTINGS)
    if unknown:
        raise ConfigError(f"SECTIONS names keys that are not settings: {sorted(unknown)}")
    out: list[tuple[str, list[Setting]]] = []
    for s in SETTINGS.values():
        if s.name in starts:
            out.append((starts[s.name], []))
        elif not out:
            raise ConfigError(f"{s.name} comes before the first section of the registry")
        out[-1][1].append(s)
    return out


class Config(Mapping):
    """Read-only settings: ``conf.bookiePort`` or ``conf["bookiePort"]``."""

    def __init__(self, values: Mapping[str, Any], source: str | None = None):
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "source", source)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        raise AttributeError("Config is read-only; use Config.load(overrides=...)")

    def __getitem__(self, key):
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def __repr__(self):         # a secret never reaches a log line through a repr
        shown = {k: ("<secret>" if k in SECRET_KEYS and v else v) for k, v in self._values.items()}
        return f"Config({shown!r})"

    def with_overrides(self, **overrides) -> "Config":
        """A copy with some settings replaced (values are validated)."""
        values = dict(self._values)
        for key, value in overrides.items():
            values[key] = _setting(key).parse(value)
        return Config(values, self.source)

    # --- derived values, defined once -------------------------------------
    @property
    def bookie_id(self) -> str:
        return self._values["bookieId"] or f"{self.advertisedAddress}:{self.bookiePort}"

    @property
    def bind_address(self) -> str:
        return self._values["bindAddress"] or self._values["advertisedAddress"]

    @property
    def pid_file(self) -> str:
        return self._values["pidFile"] or os.path.join(self.ledgerDirectories[0], "bookie.pid")

    @property
    def num_shards(self) -> int:
        return self._values["numShards"] or (os.cpu_count() or 1)

    @classmethod
    def load(cls, path: str | None = None, overrides: Mapping[str, Any] | None = None,
             env: Mapping[str, str] | None = None) -> "Config":
        """Defaults < conf file < ``BK_<key>`` environment < overrides."""
        values = {name: s.default for name, s in SETTINGS.items()}
        if path:
            values.update(read_conf_file(path))
        env = os.environ if env is None else env
        for key, text in env.items():
            if key.startswith("BK_") and key[3:] in SETTINGS:
                values[key[3:]] = SETTINGS[key[3:]].parse(text)
        for key, value in (overrides or {}).items():
            if value is not None:
                values[key] = _setting(key).parse(value)
        return cls(values, path)


def _setting(key: str) -> Setting:
    try:
        return SETTINGS[key]
    except KeyError:
        raise ConfigError(f"unknown configuration key {key!r}") from None


def read_conf_file(path: str) -> dict[str, Any]:
    """Parse ``key=value`` lines (``#`` comments); unknown keys are errors."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise ConfigError(f"cannot read configuration file {path}: {e.strerror}") from None
    values: dict[str, Any] = {}
    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ConfigError(f"{path}:{lineno}: expected key=value, got {line!r}")
        key, _, text = line.partition("=")
        key = key.strip()
        if key not in SETTINGS:
            raise ConfigError(f"{path}:{lineno}: unknown configuration key {key!r}")
        try:
            values[key] = SETTINGS[key].parse(text)
        except ConfigError as e:
            raise ConfigError(f"{path}:{lineno}: {e}") from None
    return values
