"""What one client remembers about bookies that failed it: quarantine and read order.

A bookie whose connection could not be made, broke, or that let a request time
out is *quarantined* for ``bookieQuarantineTimeSeconds`` (BookKeeper's name):
reads try it after the healthy replicas of an entry
(``reorderReadSequenceEnabled``), so a host that is down or cut off costs the
connect timeout once per quarantine, not once per ledger read. A quarantined
bookie is still tried when no other replica has an entry, and a successful
HELLO or answer from it lifts the quarantine at once (a bookie that is back is
used again). Writers also avoid quarantined bookies when they place or replace
one (``bk.client.ledger``), and auto-recovery avoids a replacement a copy
failed to reach (``bk.autorecovery.replicator``): a preference, never an
exclusion, so a small cluster never runs out of bookies.

Every method is cheap and called on the client's I/O thread; ``snapshot`` may
be called from any thread (a dict copy).
"""

from __future__ import annotations

import time


class BookieHealth:
    """Failures of bookies as one client saw them (see the module doc)."""

    def __init__(self, quarantine_seconds: float):
        self.quarantine = float(quarantine_seconds)
        self._failed_at: dict[str, float] = {}     # bookie -> monotonic time of its last failure
        self._failures: dict[str, int] = {}        # bookie -> failures since created

    def failed(self, bookie_id: str, now: float | None = None) -> None:
        """``bookie_id`` failed a request or a connection: quarantine it."""
        self._failed_at[bookie_id] = time.monotonic() if now is None else now
        self._failures[bookie_id] = self._failures.get(bookie_id, 0) + 1

    def ok(self, bookie_id: str) -> None:
        """``bookie_id`` answered: it is healthy again."""
        if self._failed_at:
            self._failed_at.pop(bookie_id, None)

    def quarantined(self, bookie_id: str, now: float | None = None) -> bool:
        t = self._failed_at.get(bookie_id)
        if t is None:
            return False
        if (time.monotonic() if now is None else now) - t < self.quarantine:
            return True
        self._failed_at.pop(bookie_id, None)
        return False

    def quarantined_set(self, now: float | None = None) -> set:
        now = time.monotonic() if now is None else now
        return {b for b in list(self._failed_at) if self.quarantined(b, now)}

    def order(self, bookies: list, now: float | None = None) -> list:
        """``bookies`` with the quarantined ones moved last (the others keep their
        order, so reads still spread over the write set as striping does)."""
        if not self._failed_at:
            return bookies
        now = time.monotonic() if now is None else now
        bad = [b for b in bookies if self.quarantined(b, now)]
        if not bad:
            return bookies
        return [b for b in bookies if b not in bad] + bad

    def snapshot(self) -> dict:
        """{bookie: {"failures": n, "quarantined": bool}} of every bookie that failed."""
        now = time.monotonic()
        return {b: {"failures": n, "quarantined": self.quarantined(b, now)}
                for b, n in dict(self._failures).items()}
