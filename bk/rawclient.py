"""One raw protocol connection to one shard of one bookie: blocking, single
threaded, for ``bkshell`` (inspection, recovery), benchmarks and tests. The
client library has its own pipelined connection layer (``bk.client.connection``).
"""

from __future__ import annotations

import socket

from bk import protocol as P
from bk.errors import BKError, BookieUnavailableError, ProtocolError
from bk.util import parse_host_port


class BookieConnection:
    """A blocking, single-threaded connection to one shard of one bookie, speaking
    the raw protocol.

        with BookieConnection("127.0.0.1:3181", shard=0) as c:
            c.call(P.add(c.next_rid(), 1, 0, -1, key, b"", b"data"))   # -> response list
    """

    def __init__(self, bookie_id: str, shard: int = -1, timeout: float = 10.0,
                 auth_token: str | None = None):
        host, port = parse_host_port(bookie_id)
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise BookieUnavailableError(f"connect to bookie {bookie_id}: {e}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.fb = P.FrameBuffer(1 << 30)
        self.bookie_id = bookie_id
        self._rid = 0
        self._ready: list = []
        hello = self.call(P.hello(self.next_rid(), shard, auth_token))
        if hello[2] != 0:
            raise BKError(f"HELLO to {bookie_id} shard {shard} refused with status {hello[2]}")
        self.num_shards = hello[4]
        self.features = hello[6] if len(hello) > 6 and type(hello[6]) is int else 0

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
