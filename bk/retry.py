"""One retry policy for bk: how long to wait between attempts, and what to retry.

* :class:`Backoff` is the schedule: delays that grow from ``first`` by
  ``factor`` up to ``cap``, optionally cut at a deadline. ``Backoff`` is a
  frozen description; :meth:`Backoff.start` makes the per-call state
  (as kazoo's ``KazooRetry.copy()``), so one policy object is shared safely.
* :class:`Retry` pairs a schedule with the errors worth retrying and a bound
  (attempts and/or seconds), and calls a function under it.
* :func:`retry_cas` is the compare-and-swap loop of every metadata change:
  ``attempt`` re-reads, computes and writes; a lost CAS
  (:class:`~bk.errors.MetadataVersionError`) means someone else changed the
  record, so it is tried again at once, a bounded number of times. Anything
  else (a guard failing: :class:`~bk.errors.LockLostError`) propagates.

No I/O here; callers pass the sleeping function when they have a stop event.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from bk.errors import ClientClosedError, MetadataVersionError, TransientError

T = TypeVar("T")

CAS_TRIES = 50


@dataclass(frozen=True)
class Backoff:
    """Delays ``first, first*factor, ...`` capped at ``cap`` seconds; ``jitter`` is the
    fraction of each delay drawn at random (0: none), so that many clients
    retrying one failure do not retry in step."""

    first: float = 0.05
    factor: float = 2.0
    cap: float = 2.0
    jitter: float = 0.0

    def start(self, deadline: float | None = None) -> "_Schedule":
        """The state of one retrying call; ``deadline`` (time.monotonic()) cuts delays."""
        return _Schedule(self, deadline)


class _Schedule:
    __slots__ = ("policy", "deadline", "delay", "attempts")

    def __init__(self, policy: Backoff, deadline: float | None):
        self.policy = policy
        self.deadline = deadline
        self.delay = policy.first
        self.attempts = 0

    def next_delay(self) -> float | None:
        """The next wait in seconds, or None when the deadline leaves no room for it."""
        p = self.policy
        d = self.delay
        if p.jitter:
            d *= 1.0 - p.jitter * random.random()
        self.delay = min(p.cap, self.delay * p.factor)
        self.attempts += 1
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                return None
            d = min(d, left)
        return d

    def reset(self) -> None:
        """After a success: the next failure waits ``first`` again."""
        self.delay = self.policy.first
        self.attempts = 0


@dataclass(frozen=True)
class Retry:
    """Call a function until it succeeds, retrying the errors in ``on`` with the
    ``backoff`` schedule, at most ``tries`` attempts (None: no bound) and within
    ``timeout`` seconds (None: no bound). The last error propagates. An error in
    ``never`` propagates at once even when ``on`` covers it: a closed client's
    calls (:class:`~bk.errors.ClientClosedError`, a BookieUnavailableError) can
    never succeed on that client, so retrying them would only wait out the bound."""

    on: tuple = (TransientError,)
    backoff: Backoff = Backoff()
    tries: int | None = None
    timeout: float | None = None
    never: tuple = (ClientClosedError,)

    def call(self, fn: Callable[[], T], sleep: Callable[[float], object] = time.sleep) -> T:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        schedule = self.backoff.start(deadline)
        while True:
            try:
                return fn()
            except self.never:
                raise
            except self.on:
                if self.tries is not None and schedule.attempts + 1 >= self.tries:
                    raise
                delay = schedule.next_delay()
                if delay is None:
                    raise
                sleep(delay)


def retry_cas(what: str, attempt: Callable[[], T], tries: int = CAS_TRIES) -> T:
    """Run ``attempt`` (read, compute, compare-and-swap) until its CAS wins; after
    ``tries`` lost in a row raise MetadataVersionError naming ``what``."""
    for _ in range(tries):
        try:
            return attempt()
        except MetadataVersionError:
            continue
    raise MetadataVersionError(f"{what}: {tries} compare-and-swaps lost in a row to "
                               f"concurrent changes")
