"""The blocking bk client: ``bk.BookKeeper`` and its ledger handles.

Modules, one responsibility each:

* ``digest``     passwords, master keys, entry digests (sans-IO)
* ``placement``  which bookies form an ensemble or replace a failed one
* ``connection`` the per-client I/O thread and pipelined bookie connections
* ``ledger``     write handles (quorum acks, ensemble change, close) and reads
* ``recovery``   fencing and closing a ledger as a reader
* ``bookkeeper`` the entry point

Nothing is imported here, so that ``bk.client.digest`` can be used without
loading the etcd binding.
"""
