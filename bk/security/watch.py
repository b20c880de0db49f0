"""Files that a running process reads again when they change: certificates,
token keys, the token revocation list, a client's token file.

Operators replace such files in place (renewal, key rotation, revocation) and
expect the change to apply without a restart. :class:`FileWatch` tells,
at most once per interval, whether any of its files changed since the last
time it said so: a ``stat`` per file, nothing read, so a caller can ask on a
hot-ish path (a new connection) or from a periodic tick.
"""

from __future__ import annotations

import os
import time


class FileWatch:
    """``changed()``: True once after any of ``paths`` changed (mtime, size, inode
    or existence), looked at no more often than every ``interval`` seconds
    (0: on every call). Empty paths are ignored."""

    def __init__(self, paths, interval: float):
        self.paths = [p for p in paths if p]
        self.interval = interval
        self._stamp = self._pending = self.stamp()
        self._next = time.monotonic() + interval

    def stamp(self):
        out = []
        for p in self.paths:
            try:
                st = os.stat(p)
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return out

    def changed(self, now: float | None = None) -> bool:
        if self.interval:
            now = time.monotonic() if now is None else now
            if now < self._next:
                return False
            self._next = now + self.interval
        stamp = self.stamp()
        if stamp == self._stamp:
            return False
        self._pending = stamp
        return True

    def accept(self) -> None:
        """The change ``changed()`` reported was loaded: do not report it again. (A
        caller that could not load it yet, e.g. a half-written pair, does not call
        this and hears of the change again at the next look.)"""
        self._stamp = self._pending
