"""Raw protocol connections to bookies: blocking, single threaded, for ``bkshell``
(inspection, recovery), re-replication, the auditor's checks, benchmarks and
tests. :class:`BookieConnection` is one connection to one shard of one
bookie; :class:`BookiePool` keeps one per (bookie, shard) and pipelines
requests on them. The client library has its own pipelined connection layer
(``bk.client.connection``). Both take a :class:`bk.security.ClientSecurity`
(TLS context and token); a bookie-to-bookie pool uses the bookie's own.
"""

from __future__ import annotations

import socket
import ssl

from bk import protocol as P
from bk.errors import (BookieUnavailableError, ProtocolError, SecurityError,
                       error_for_status)
from bk.security import PLAINTEXT, ClientSecurity, tls
from bk.util import parse_host_port


class BookieConnection:
    """A blocking, single-threaded connection to one shard of one bookie, speaking
    the raw protocol.

        with BookieConnection("127.0.0.1:3181", shard=0) as c:
            c.call(P.add(c.next_rid(), 1, 0, -1, key, b"", b"data"))   # -> response list
    """

    def __init__(self, bookie_id: str, shard: int = -1, timeout: float = 10.0,
                 security: ClientSecurity | None = None):
        security = security or PLAINTEXT
        host, port = parse_host_port(bookie_id)
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise BookieUnavailableError(f"connect to bookie {bookie_id}: {e}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.fb = P.FrameBuffer(1 << 30)
        self.bookie_id = bookie_id
        self.role = None
        self._rid = 0
        self._ready: list = []
        try:
            self._setup(host, shard, security)
        except BaseException:
            self.sock.close()
            raise

    def _setup(self, host: str, shard: int, security: ClientSecurity):
        """HELLO, then (START_TLS) the TLS handshake, then AUTH when due."""
        start_tls = security.context is not None
        hello = self.call(P.hello(self.next_rid(), shard, start_tls))
        if hello[2] != 0:
            why = hello[7] if len(hello) > 7 else None
            err = error_for_status(hello[2], f"HELLO to bookie {self.bookie_id} shard {shard}")
            if why:
                err.args = (f"{err.args[0]}: {why}",)
            raise err
        self.num_shards = hello[4]
        self.features = hello[6] if len(hello) > 6 and type(hello[6]) is int else 0
        if start_tls:
            try:
                self.sock = security.wrap(self.sock, host)
                self.sock.do_handshake()
            except (ssl.SSLError, ssl.CertificateError) as e:
                raise SecurityError(f"TLS with bookie {self.bookie_id} failed: "
                                    f"{tls.reason(e)}") from None
        if start_tls or self.features & P.FEATURE_AUTH:
            try:
                answer = self.call(P.auth(self.next_rid(), security.token))
            except ssl.SSLError as e:
                raise SecurityError(f"bookie {self.bookie_id} refused the connection: "
                                    f"{tls.reason(e)}") from None
            except BookieUnavailableError as e:
                raise SecurityError(f"bookie {self.bookie_id} closed the connection at "
                                    f"AUTH: {e}") from None
            if answer[2] != 0:
                err = error_for_status(answer[2], f"AUTH to bookie {self.bookie_id}")
                err.args = (f"{err.args[0]}: {answer[3]}",)
                raise err
            self.role = answer[3]

    def next_rid(self) -> int:
        self._rid += 1
        return self._rid

    def send(self, msg) -> None:
        self.sock.sendall(P.encode_frame(msg))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> list:
        """The next response; BookieUnavailableError if the bookie closed the connection."""
        while not self._ready:
            data = self.sock.recv(1 << 20)
            if not data:
                raise BookieUnavailableError(f"bookie {self.bookie_id} closed the connection")
            self.fb.feed(data)
            self._ready.extend(self.fb.frames())
        return self._ready.pop(0)

    def call(self, msg) -> list:
        self.send(msg)
        resp = self.recv()
        if resp[1] != msg[1]:
            raise ProtocolError(f"response to request {resp[1]}, expected {msg[1]}")
        return resp

    def closed_by_peer(self, timeout: float = 5.0) -> bool:
        """True if the bookie closes this connection within ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except OSError as e:
            return not isinstance(e, TimeoutError)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class BookiePool:
    """Blocking raw connections to bookies, one per (bookie, shard), made on demand.

    ``store`` (a :class:`bk.meta.store.MetadataStore`) tells where a bookie id
    listens (its registration) and how many shards it has. Requests are
    pipelined: :meth:`send` returns a ticket, :meth:`recv` its responses, and
    several tickets may be outstanding on several bookies at once."""

    def __init__(self, store, timeout: float = 10.0, security: ClientSecurity | None = None):
        self.store = store
        self.timeout = timeout
        self.security = security
        self._conns: dict = {}
        self._shards: dict[str, int] = {}
        self._addr: dict[str, str] = {}
        self._stash: dict = {}     # connection -> {rid: response} received ahead of its recv

    def address(self, bookie_id: str) -> str:
        addr = self._addr.get(bookie_id)
        if addr is None:
            info = self.store.bookie_info(bookie_id)
            addr = bookie_id
            if info and info.get("address") and info.get("port"):
                addr = f"{info['address']}:{info['port']}"
            if info and info.get("numShards"):
                self._shards[bookie_id] = int(info["numShards"])
            self._addr[bookie_id] = addr
        return addr

    def num_shards(self, bookie_id: str) -> int:
        addr = self.address(bookie_id)
        n = self._shards.get(bookie_id)
        if n is None:
            # Asked at HELLO when the registration does not say (a bookie whose lease
            # expired: paused, partitioned). An OS error here is the bookie's, like
            # conn()'s: a paused bookie accepts (the kernel's backlog) and never
            # answers, and the timeout once escaped the auditor's checks as a trace.
            try:
                with BookieConnection(addr, -1, timeout=self.timeout,
                                      security=self.security) as c:
                    n = self._shards[bookie_id] = int(c.num_shards)
            except OSError as e:
                raise BookieUnavailableError(f"HELLO to bookie {bookie_id}: {e}") from None
        return n

    def conn(self, bookie_id: str, ledger_id: int | None = None, shard: int | None = None):
        if shard is None:
            shard = P.shard_of(ledger_id, self.num_shards(bookie_id))
        key = (bookie_id, shard)
        c = self._conns.get(key)
        if c is None:
            try:
                c = BookieConnection(self.address(bookie_id), shard, timeout=self.timeout,
                                     security=self.security)
            except OSError as e:
                raise BookieUnavailableError(f"connect to bookie {bookie_id}: {e}") from None
            self._conns[key] = c
        return c

    def drop(self, bookie_id: str) -> None:
        for key in [k for k in self._conns if k[0] == bookie_id]:
            c = self._conns.pop(key)
            self._stash.pop(c, None)
            try:
                c.close()
            except OSError:
                pass

    def send(self, bookie_id: str, ledger_id: int, msgs: list):
        """Send ``msgs`` pipelined on one connection without waiting; returns the
        ticket :meth:`recv` takes. Several tickets may be outstanding on one
        connection (and on several bookies) at once: that is how a copy keeps
        reads and adds in flight together. BookieUnavailableError (and the
        bookie's connections dropped) if the bookie fails."""
        try:
            c = self.conn(bookie_id, ledger_id)
            c.send_raw(b"".join(P.encode_frame(m) for m in msgs))
        except (OSError, BookieUnavailableError) as e:
            self.drop(bookie_id)
            raise BookieUnavailableError(f"bookie {bookie_id}: {e}") from None
        return bookie_id, c, [m[1] for m in msgs]

    def recv(self, ticket) -> list:
        """The responses to a :meth:`send`, in its order. Responses to other
        requests on the connection met on the way are kept for their own recv."""
        bookie_id, c, rids = ticket
        if not rids:
            return []
        stash = self._stash.setdefault(c, {})
        out = []
        try:
            for rid in rids:
                r = stash.pop(rid, None)
                while r is None:
                    resp = c.recv()
                    if resp[1] == rid:
                        r = resp
                    else:
                        stash[resp[1]] = resp
                out.append(r)
        except (OSError, BookieUnavailableError, IndexError, TypeError) as e:
            self._stash.pop(c, None)
            self.drop(bookie_id)
            raise BookieUnavailableError(f"bookie {bookie_id}: {e}") from None
        if not stash:
            del self._stash[c]
        return out

    def features(self, bookie_id: str, ledger_id: int) -> int:
        """What the bookie announced at HELLO (``P.FEATURE_*`` bits)."""
        return self.conn(bookie_id, ledger_id).features

    def send_frame(self, bookie_id: str, ledger_id: int, frame: bytes, rid: int):
        """Send one pre-encoded frame (e.g. an ADD_BATCH); a ticket for :meth:`recv`."""
        try:
            c = self.conn(bookie_id, ledger_id)
            c.send_raw(frame)
        except (OSError, BookieUnavailableError) as e:
            self.drop(bookie_id)
            raise BookieUnavailableError(f"bookie {bookie_id}: {e}") from None
        return bookie_id, c, [rid]

    def calls(self, bookie_id: str, ledger_id: int, msgs: list) -> list:
        """Send ``msgs`` pipelined on one connection; their responses in order.
        BookieUnavailableError (and the connection dropped) if the bookie fails."""
        if not msgs:
            return []
        return self.recv(self.send(bookie_id, ledger_id, msgs))

    def call(self, bookie_id: str, ledger_id: int, build, *args) -> list:
        c = self.conn(bookie_id, ledger_id)
        return self.calls(bookie_id, ledger_id, [build(c.next_rid(), *args)])[0]

    def rids(self, bookie_id: str, ledger_id: int, n: int) -> list[int]:
        c = self.conn(bookie_id, ledger_id)
        return [c.next_rid() for _ in range(n)]

    def close(self) -> None:
        for c in self._conns.values():
            try:
                c.close()
            except OSError:
                pass
        self._conns.clear()
        self._stash.clear()
