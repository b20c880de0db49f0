"""Group commit for metadata writes: concurrent ledger writes share one etcd txn.

Theory of operation. A gRPC call to etcd costs this client ~200 us of CPU
whatever it carries, and creating plus closing a ledger is two of them, so a
process creating ledgers from many threads is bound by calls, not by etcd.
:class:`TxnCombiner` lets concurrent compare-and-swaps of *different* keys
travel together, the way the bookie journal's group commit shares an fsync:

* A thread that finds no batch in flight sends its write alone, at once: a
  lone writer pays nothing (no timer, no wait for company).
* Threads that arrive while a batch is in flight queue up. When the batch
  returns, the first queued thread becomes the next leader and sends the
  whole queue (distinct keys, at most ``max_batch``) as one transaction whose
  comparisons are all of theirs and whose success branch is all of their puts.
  Under load (the previous transaction carried several writes) the leader
  first waits ``linger`` (1 ms) for more company: a call costs client and etcd
  the same CPU whether it carries 5 writes or 10 (32 threads creating and
  closing ledgers: 0.3 -> 0.16 transactions a ledger, ~13% less client and
  ~25% less etcd CPU per ledger, measured alternating).
* If that transaction succeeds, every write in it succeeded, each key's new
  version being the transaction's revision. If any comparison failed, nothing
  was written (etcd transactions are atomic) and each write is sent again
  alone, so each gets exactly the answer it would have had alone
  (``LedgerExistsError``, ``MetadataVersionError``, ...). A broken call fails
  every write of the batch with the same error: like a lone write, its outcome
  is unknown and it is not retried blindly.

The CAS semantics of each write are therefore unchanged; only the number of
calls shrinks (to ~1 per ``max_batch`` writes under load).

Asynchronous writes (:meth:`TxnCombiner.submit`, behind ``create_ledger_async``
and ``close_async``) have no thread to lead a batch or wait for it. They join
the same queue, and the combiner's own sender thread (``bk-meta-txn``, started
on first use, parked on an eventfd while idle) leads whenever the first write
queued is asynchronous: it sends the batch, hands the done writes to the
completer thread (``bk-meta-done``), which runs their callbacks ``(error,
version)``, and sends the next batch meanwhile (callbacks run on the sender
itself left etcd idle while they ran: 5% fewer ledgers/s). A blocking write
queued first is promoted as before, so blocking and asynchronous writes share
transactions and the one-leader rule; a blocking leader runs the callbacks of
the asynchronous writes of its batch itself, after handing the queue on.
Callbacks must not wait on another metadata write's result (a blocking write
made on the sender thread is sent alone rather than deadlock).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable

from bk.errors import MetadataError
from bk.park import Parker, parker

log = logging.getLogger(__name__)


class _Write:
    __slots__ = ("key", "compare", "put", "alone", "parker", "woken", "lead", "result",
                 "error", "callback", "queued_at", "what")

    def __init__(self, key, compare, put, alone, callback=None):
        self.key = key
        self.compare = compare        # the txn comparison of this write
        self.put = put                # its put op
        self.alone = alone            # () -> version: the write sent by itself
        # A queued write's thread parks (bk.park: woken outside the GIL) until
        # ``woken``, when the write is done or it is to lead.
        self.parker = None
        self.woken = False
        self.lead = False             # woken to send the next batch, not with a result
        self.result = None
        self.error: BaseException | None = None
        self.callback = callback      # an asynchronous write's (error, version) callback
        self.queued_at = 0.0          # an asynchronous write's submit time (see expire)
        self.what = ""                # and what it is, for its errors


class TxnCombiner:
    """Shares etcd transactions among concurrent writes (see the module doc).

    ``send(compares, puts) -> (succeeded, revision)`` runs one transaction."""

    def __init__(self, send: Callable, max_batch: int = 64, linger: float = 0.001,
                 expire: float | None = None, where: str = ""):
        self._send = send
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._queue: list[_Write] = []
        self._busy = False
        self.batches = 0              # transactions sent for more than one write (stats)
        self.enabled = True           # False: every write alone (benchmarks compare)
        self.linger = linger          # seconds a leader waits for company under load
        self._last = 0                # writes in the previous transaction
        # An asynchronous write still queued ``expire`` seconds after its submit
        # (the transactions ahead of it hung: etcd stopped) fails unsent with
        # MetadataError, so that none waits out one timeout per batch ahead of it
        # (MetadataStore: two timeouts).
        self.expire = expire
        self._where = where           # the store's URI, for that error
        # the sender thread of asynchronous writes (see the module doc)
        self._sender: threading.Thread | None = None
        self._sender_parker: Parker | None = None
        self._sender_pid = os.getpid()
        self._sender_work = False     # it is to lead the queue (set under _lock)
        self._stopping = False
        # Batches of asynchronous writes done, whose callbacks the completer thread
        # (bk-meta-done) runs while the sender already sends the next batch.
        self.complete_apart = True    # False: the sender runs them (benchmarks compare)
        self._done: collections.deque = collections.deque()
        self._completer: threading.Thread | None = None
        self._completer_parker: Parker | None = None

    def write(self, key: bytes, compare, put, alone: Callable[[], int]) -> int:
        """The new version of ``key``: ``alone()`` if no batch is in flight, else as
        part of the next shared transaction (same result, same errors)."""
        if not self.enabled or threading.current_thread() is self._sender:
            # on the sender thread (a callback making a blocking write): it could
            # never lead the batch it would wait for; alone, same answer
            return alone()
        w = _Write(key, compare, put, alone)
        with self._lock:
            if self._busy:
                w.parker = parker()
                self._queue.append(w)
            else:
                self._busy = True
                w.lead = True
        if not w.lead:
            while not w.woken:
                w.parker.park()
        if w.lead:
            self._lead(w)
        if w.error is not None:
            raise w.error
        return w.result

    def submit(self, key: bytes, compare, put, alone: Callable[[], int],
               callback: Callable, what: str = "metadata write") -> None:
        """Asynchronous :meth:`write`: returns at once; ``callback(error, version)``
        runs on the combiner's sender thread (or a blocking leader) once the write is
        done, with what :meth:`write` would have returned or raised."""
        w = _Write(key, compare, put, alone, callback)
        w.what = what
        if self.expire is not None:
            w.queued_at = time.monotonic()
        with self._lock:
            if self._sender_pid != os.getpid():     # forked: the parent's queue is not ours
                self._queue, self._busy, self._sender = [], False, None
                self._completer, self._done = None, collections.deque()
                self._sender_pid = os.getpid()
            self._queue.append(w)
            if self._busy:
                return                  # the leader in flight hands it on
            self._busy = True
            self._wake_sender()

    def _wake_sender(self) -> None:
        # under self._lock: the sender is to lead the queue
        self._sender_work = True
        if self._sender is None:
            self._sender_parker = Parker()
            self._sender = threading.Thread(target=self._sender_main, name="bk-meta-txn",
                                            daemon=True)
            self._sender.start()
        else:
            self._sender_parker.unpark()

    def _sender_main(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                if self._sender is not me:
                    return
                work, self._sender_work = self._sender_work, False
                if not work and self._stopping:
                    self._sender = None
                    return
            if not work:
                self._sender_parker.park()
                continue
            while self._lead(None):
                pass

    def _complete_later(self, writes: list) -> None:
        """Hand done asynchronous writes to the completer thread (sender thread)."""
        with self._lock:        # once per batch: orders it against the completer's exit
            self._done.append(writes)
            if self._completer is None:
                self._completer_parker = Parker()
                self._completer = threading.Thread(
                    target=self._completer_main, name="bk-meta-done", daemon=True)
                self._completer.start()
                return
            parker_ = self._completer_parker
        parker_.unpark()

    def _completer_main(self) -> None:
        me = threading.current_thread()
        done = self._done
        while True:
            while done:
                for w in done.popleft():
                    try:
                        w.callback(w.error, w.result)
                    except Exception:
                        log.exception("metadata write callback failed")
            with self._lock:
                if self._completer is not me or (self._stopping and not done):
                    if self._completer is me:
                        self._completer = None
                    return
            self._completer_parker.park()

    def close(self) -> None:
        """Let the sender and completer threads end once they have nothing left to
        do (a later submit starts others)."""
        with self._lock:
            self._stopping = True
            if self._sender is not None:
                self._sender_parker.unpark()
            if self._completer is not None:
                self._completer_parker.unpark()

    def _lead(self, me: _Write | None) -> bool:
        """Send the next batch; ``me`` is the blocking write leading it, None for the
        sender thread. True if the sender is to lead the next one too."""
        if self.linger and self._last > 1 and len(self._queue) < self.max_batch:
            time.sleep(self.linger)     # under load: let more writes join this one
        with self._lock:
            batch, keys, rest = [], set(), []
            # a promoted leader is first in the queue; the first leader is in no queue
            pending = self._queue if me is None or me in self._queue else [me] + self._queue
            limit = self.max_batch if self.enabled else 1
            expired = []
            too_old = (time.monotonic() - self.expire) if self.expire is not None else None
            for w in pending:
                if too_old is not None and w.callback is not None and w.queued_at < too_old:
                    w.error = MetadataError(
                        f"{w.what}: not sent: etcd answered none of the transactions "
                        f"ahead of it within {self.expire:g}s ({self._where})")
                    expired.append(w)
                elif len(batch) < limit and w.key not in keys:
                    batch.append(w)
                    keys.add(w.key)
                else:
                    rest.append(w)       # the same key twice: the later waits its turn
            self._queue = rest
        again = False
        try:
            if batch:
                self._run(batch)
        finally:
            batch += expired
            nxt = None
            with self._lock:
                if not self._queue:
                    self._busy = False
                elif self._queue[0].callback is None:
                    nxt = self._queue[0]        # a blocking write leads the next batch
                    nxt.lead = True
                    nxt.woken = True
                elif me is None:
                    again = True                # the sender goes on
                else:
                    self._wake_sender()
            if nxt is not None:
                nxt.parker.unpark()         # outside the lock: it takes it at once
            apart = me is None and self.complete_apart
            later = []
            for w in batch:
                if w is me:
                    continue
                if w.callback is not None and apart:
                    later.append(w)
                elif w.callback is not None:
                    try:
                        w.callback(w.error, w.result)
                    except Exception:
                        log.exception("metadata write callback failed")
                else:
                    w.lead = False
                    w.woken = True
                    w.parker.unpark()
            if later:
                self._complete_later(later)
        return again

    def _run(self, batch: list[_Write]) -> None:
        self._last = len(batch)
        if len(batch) > 1:
            try:
                ok, rev = self._send([w.compare for w in batch], [w.put for w in batch])
            except BaseException as e:        # the outcome is unknown for all of them
                for w in batch:
                    w.error = e
                return
            self.batches += 1
            if ok:
                for w in batch:
                    w.result = rev
                return
        for w in batch:                       # alone, or a comparison failed: each by itself
            try:
                w.result = w.alone()
            except BaseException as e:
                w.error = e
