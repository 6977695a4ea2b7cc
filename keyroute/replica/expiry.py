"""Time to live on a node's disk: the values of a live partition (of a `latest` store with a `ttl`) and the rows
of a live history partition that are expired are deleted from its LMDB environment, so that they leave the
disk as they left the answers.

A batch partition's file is the snapshot's (read-only, maybe hard-linked): the next build leaves its expired
values out (keyroute.pipeline.compute.unexpired). A live partition is written by its applier
(keyroute.replica.live); the node sweeps it now and then (keyroute.state_node.ownership, every
`--expiry-sweep-s`). A sweep never races a newer value for a key: each value is read and deleted in the same
write transaction, under the partition's write lock (the one the applier writes under), with "now" read
inside that transaction. A value the applier wrote before is the one checked; one it writes after is not
touched. A history row is expired when its time is below `Ttl.timeline_low`, the least time a read of it
serves (keyroute.storage.timeline's entry keys carry it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keyroute.storage.live import value_bytes
from keyroute.storage.lmdb_layout import TAG_HASHED, TAG_KEY
from keyroute.storage.timeline import StoreKind, split_entry
from keyroute.storage.ttl import Ttl

# Keys looked at per write transaction: the applier waits for the write lock at most one batch's time.
SWEEP_BATCH = 1000
_VALUE_TAGS = (TAG_KEY[0], TAG_HASHED[0])


def sweep_expired(held: Any, ttl: Ttl, clock: Callable[[], float], batch: int = SWEEP_BATCH) -> int:
    """Delete from `held` (a keyroute.replica.store.LivePartitionStore of a store of one value per key, or of a
    history store) every value (row) expired by `ttl` at `clock()` (seconds since the epoch, read once per
    transaction, inside it); returns how many were deleted. Stops early, having deleted what it had, once the
    partition is closed."""
    timeline = held.timeline
    if timeline is not None and timeline.kind is not StoreKind.HISTORY:
        return 0  # a windowed store has no ttl
    deleted = 0
    after: bytes | None = None
    while True:
        with held.write_lock:
            if held.closed:
                return deleted
            txn = held.write_txn()
            try:
                now = clock()
                low = None if timeline is None else ttl.timeline_low(now, timeline.time_type)
                cursor = txn.cursor()
                found = cursor.first() if after is None else cursor.set_range(after)
                if found and after is not None and cursor.key() == after:
                    found = cursor.next()
                seen = 0
                while found and seen < batch:
                    key = cursor.key()
                    after = bytes(key)
                    seen += 1
                    if after[0] in _VALUE_TAGS and (
                        ttl.expired(value_bytes(bytes(cursor.value())), now)
                        if low is None
                        else split_entry(after)[1] < low
                    ):
                        cursor.delete()  # moves to the next entry
                        deleted += 1
                        found = cursor.key() != b""
                    else:
                        found = cursor.next()
                txn.commit()
            except BaseException:
                txn.abort()
                raise
        if not found:
            return deleted
