"""Records of a live history or windowed store written into its partition's LMDB environment: each record
an entry of its key's timeline (keyroute.storage.timeline's layout), in the applier's write transaction.

The live applier (keyroute.replica.live) folds the records of a store of one value per key itself; a
timeline store's records it hands to a `TimelineWriter`, one per transaction. Readers are in
keyroute.replica.store.
"""

from __future__ import annotations

from typing import Any

from keyroute.storage.live import META_TAG, Merge
from keyroute.storage.timeline import INT64_MIN, SUFFIX_BYTES, entry_key, key_part, last_at_or_before

# A live record's entry sequence: above every batch row's (their index in the key's rows), the record's
# offset making it unique among the key's entries of the same time (keyroute.storage.timeline).
LIVE_SEQUENCE = 1 << 31
STREAM_TIME_KEY = META_TAG + b"stream-time"


class TimelineWriter:
    """Records of a live history or windowed store applied in one write transaction. History: each record
    appends a row under (key, time, LIVE_SEQUENCE + offset), so applying a record again writes the same
    entry. Windowed: each record is folded into every window it falls in, under (key, window start, 0).
    A tombstone deletes the key's entries; retention trims the key's oldest ones. The partition's latest
    time (its stream time, for a retention span) is kept in the same transaction."""

    __slots__ = ("txn", "cursor", "merge", "stream_time", "changed")

    def __init__(self, txn: Any, merge: Merge) -> None:
        self.txn = txn
        self.cursor = txn.cursor()
        self.merge = merge
        stored = txn.get(STREAM_TIME_KEY)
        self.stream_time: int | None = None if stored is None else int(stored)
        self.changed = False

    def apply(self, key: bytes, row: dict[str, Any] | None, offset: int) -> None:
        part = key_part(key)
        if row is None:
            self._delete(part, None)
            return
        merge = self.merge
        windowed = merge.mode == "windowed"
        if windowed:
            time, value = merge.record_time(row), b""
        else:
            time, value = merge.history_row(row)
        span = merge.retention_span
        if span is not None:
            if self.stream_time is None or time > self.stream_time:
                self.stream_time, self.changed = time, True
            cutoff = self.stream_time - span
            if time <= cutoff:
                return  # older than the retention keeps: as if it had been trimmed
            # Rows at or before the cutoff; windows that ended by then.
            oldest = cutoff + 1 - (merge.window or 0) if windowed else cutoff + 1
            self._delete(part, entry_key(part, max(oldest, INT64_MIN), 0))
        if windowed:
            txn = self.txn
            for start in merge.window_starts(time):
                window = entry_key(part, start, 0)
                txn.put(window, merge.fold_window(txn.get(window), row, start))
        else:
            self.txn.put(entry_key(part, time, LIVE_SEQUENCE + (offset & 0x7FFFFFFF)), value)
        count = merge.retention_count
        if count is not None:
            self._keep_newest(part, count)

    def save(self) -> None:
        if self.changed and self.stream_time is not None:
            self.txn.put(STREAM_TIME_KEY, str(self.stream_time).encode("ascii"))

    def _delete(self, part: bytes, before: bytes | None) -> None:
        """Delete the entries of the key part `part` (those below `before` only, when given)."""
        cursor = self.cursor
        more = cursor.set_range(part)
        while more:
            lmdb_key = cursor.key()
            if not lmdb_key.startswith(part) or (before is not None and lmdb_key >= before):
                return
            more = cursor.delete()

    def _keep_newest(self, part: bytes, count: int) -> None:
        cursor = self.cursor
        # The key's newest entry: the greatest LMDB key at most its key part + the greatest time and sequence.
        positioned = last_at_or_before(cursor, part + b"\xff" * SUFFIX_BYTES)
        seen = 0
        while positioned and cursor.key().startswith(part):
            seen += 1
            if seen > count:
                self._delete(part, bytes(cursor.key()) + b"\x00")
                return
            positioned = cursor.prev()
