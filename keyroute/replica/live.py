"""Live partitions on a node: each replica serving partition p of a live store consumes topic partition p
itself and folds its records (keyroute.storage.live) into the partition's own LMDB environment.

    LivePartition   what readers, metrics and the status report see of one loaded live partition: the last
                    applied offset, lag, state, counters; `wait_reached` for reads bounded by `min_offset`
    LiveApplier     one Kafka consumer and one thread per (store, version) on this node: the partitions of
                    that version the node holds are assigned to it (`assign`, never a group subscription,
                    never a commit to Kafka), each from the offset its environment stores under OFFSET_KEY;
                    set up by a `LiveVersion` (what it consumes) and `ApplierSettings` (how)

A store of one value per key has its records folded here; a history or windowed store's records become
entries of their keys' timelines (keyroute.replica.timeline_writer).

The applier consumes in batches; per partition, one LMDB write transaction applies the batch's records in
offset order and stores the next offset under OFFSET_KEY in the same transaction, then commits (durably);
only then do readers see the new offset. A crash at any point leaves the rows and the offset of one commit:
nothing is lost or applied twice.

States (`LivePartition.state`):

    catching_up   loaded and consuming, not yet within `catch_up_records` of the topic's end: not announced
    live          caught up at least once: served and announced
    stalled       the broker is unreachable or the topic partition unknown (deleted): still served with what
                  it has; the client keeps reconnecting and consuming resumes by itself
    gap           records the partition needs are gone (its next offset is below the partition's low
                  watermark, or beyond its end: the topic was recreated): withdrawn, never served as if it
                  were complete, until a new version (a new build) covers it
    stopped       `on_bad_record = "stop"` met a bad record: consumption of the partition stops before it;
                  the partition keeps serving what it applied

A record whose offset is below the next expected one (seen again after a seek) is skipped. Offsets may skip
ahead inside a partition's retained log (compacted topics, transaction markers): that loses nothing, while
records removed by retention are told by the low watermark, which is then above the next expected offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from keyroute.formats.value_format import value_decoder
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.key_schema import KeySchema
from keyroute.keys.partitioner import Partitioner
from keyroute.keys.schema_registry import RegistryUnavailable
from keyroute.replica.timeline_writer import TimelineWriter
from keyroute.runtime.logs import describe
from keyroute.storage.live import OFFSET_KEY, BadRecord, LiveConfig, RecordReader
from keyroute.storage.live_keys import record_reader
from keyroute.storage.lmdb_layout import LMDB_MAX_KEY_BYTES, TAG_KEY, db_key

if TYPE_CHECKING:
    import lmdb

    from keyroute.replica.store import PartitionStore

log = logging.getLogger(__name__)

CATCHING_UP = "catching_up"
LIVE = "live"
STALLED = "stalled"
GAP = "gap"
STOPPED = "stopped"
STATES = (CATCHING_UP, LIVE, STALLED, GAP, STOPPED)

# Records asked of the client per consume call (a partition's share of them goes in one transaction).
DEFAULT_BATCH_RECORDS = 2000
# How often a live partition's commits are flushed to disk (keyroute.replica.store: a commit is safe from a
# process crash at once; this bounds what an operating-system crash could undo). 0: after every commit.
DEFAULT_SYNC_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class ApplierSettings:
    """How an applier consumes and commits; the node's `--live-batch-records` and `--live-sync-ms` set the
    first two, the rest are fixed by the product."""

    # Records asked of the client per consume call (a partition's share of them goes in one transaction).
    batch_records: int = DEFAULT_BATCH_RECORDS
    # How often commits are flushed to disk (see DEFAULT_SYNC_INTERVAL_S). 0: after every commit.
    sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S
    # How long one consume call waits for records when there are none.
    poll_timeout_s: float = 0.05
    # How often each partition's watermarks are asked of the broker (lag, retention gaps, broker faults).
    watermarks_every_s: float = 1.0
    # A query waits behind the client's fetch long-poll on the connection (fetch_wait_ms).
    watermarks_timeout_s: float = 1.0
    # How long the broker holds a fetch that finds no records: also the longest a watermark query waits for it.
    fetch_wait_ms: int = 100
    # A partition that received records this recently is not stalled because one watermark query timed out.
    recent_records_s: float = 5.0
    # How often each partition's watermarks are asked of the broker itself (which notices a deleted topic).
    query_every_s: float = 5.0
    # After a failed apply (or an offset reset by the client), the partition is assigned again this much later.
    reassign_after_s: float = 1.0
    # A consumer that could not be created is tried again this much later.
    recreate_after_s: float = 5.0
    # A partition stalled by an unreachable Schema Registry is tried again after reassign_after_s, doubling
    # with every failure in a row up to this.
    registry_backoff_max_s: float = 30.0


@dataclass(frozen=True, slots=True)
class LiveVersion:
    """One version of a live store as its applier consumes it: the topic and how the store's keys are
    serialized and partitioned (each record's key is checked against the partition it came from)."""

    store: str
    version: int
    config: LiveConfig
    key_format: KeyFormat
    partitioner: Partitioner
    partitions: int
    key_schema: KeySchema | None = None  # Schema Registry keys (keyroute.storage.live_keys)


_LONG_KEY = LMDB_MAX_KEY_BYTES


def read_next_offset(txn: lmdb.Transaction) -> int | None:
    """The next offset to apply, as a live partition's environment stores it (None: not stored)."""
    raw = txn.get(OFFSET_KEY)
    return None if raw is None else int(bytes(raw))


class LivePartition:
    """One loaded live partition as readers see it. The applier thread writes; any thread reads.

    `offset` is the last applied offset (-1: none), updated only after the rows reflecting it committed.
    `lag_records` is the last known high watermark minus the next offset to apply; `lag_ms` the age of the
    last applied record while behind (0 when not). `caught_up` turns true once the lag was at most the
    manifest's `catch_up_records` (then the partition may be announced)."""

    def __init__(self, store: str, version: int, partition: int, config: LiveConfig, next_offset: int) -> None:
        self.store = store
        self.version = version
        self.partition = partition
        self.config = config
        self.offset = next_offset - 1
        self.high = -1  # last known high watermark (-1: not known yet)
        self.low = -1
        self.state = CATCHING_UP
        self.error: str | None = None
        self.caught_up = False
        self.applied = 0
        self.skipped: dict[str, int] = {}
        # The last record skipped (on_bad_record = "skip"): its offset, reason and why (a schema id, a field).
        self.last_bad_record: str | None = None
        self.last_timestamp_ms: float | None = None
        self.started_at = time.time()
        # Called (on the applier's thread) when the state changes or the partition first catches up.
        self.on_change: Callable[[LivePartition], None] | None = None
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None], int]] = []

    def __repr__(self) -> str:
        return f"LivePartition({self.store} v{self.version} p{self.partition}, offset={self.offset}, {self.state})"

    # -- readers -----------------------------------------------------------------------------------

    @property
    def next_offset(self) -> int:
        return self.offset + 1

    @property
    def lag_records(self) -> int:
        high = self.high
        return max(0, high - (self.offset + 1)) if high >= 0 else 0

    @property
    def lag_ms(self) -> float:
        if self.lag_records <= 0:
            return 0.0
        last = self.last_timestamp_ms
        since_ms = last if last is not None else self.started_at * 1000
        return max(0.0, time.time() * 1000 - since_ms)

    @property
    def serves(self) -> bool:
        """Whether the partition may be served (announced): caught up once, and no gap."""
        return self.caught_up and self.state != GAP

    def reached(self, offset: int) -> bool:
        return self.offset >= offset

    async def wait_reached(self, offset: int, timeout_s: float) -> bool:
        """Wait (on the running loop, at most `timeout_s`) until the applied offset is at least `offset`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        entry = (loop, future, offset)
        with self._lock:
            if self.offset >= offset:
                return True
            self._waiters.append(entry)
        try:
            await asyncio.wait_for(future, timeout_s)
            return True
        except TimeoutError:
            return self.offset >= offset
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._waiters.remove(entry)

    def status(self) -> dict[str, Any]:
        """The partition's entry in the node's live status record (/live/{node_id})."""
        return {
            "version": self.version,
            "topic": self.config.topic,
            "offset": self.offset,
            "lag_records": self.lag_records,
            "lag_ms": round(self.lag_ms, 1),
            "state": self.state,
            "applied": self.applied,
            "skipped": dict(sorted(self.skipped.items())),
            "error": self.error,
            **({"last_bad_record": self.last_bad_record} if self.last_bad_record is not None else {}),
        }

    # -- the applier's side ------------------------------------------------------------------------

    def advance(
        self, next_offset: int, applied: int, skipped: Mapping[str, int], last_timestamp_ms: float | None
    ) -> None:
        """Records up to `next_offset` - 1 are committed: publish it and wake the readers waiting for it."""
        self.applied += applied
        for reason, n in skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + n
        if last_timestamp_ms is not None:
            self.last_timestamp_ms = last_timestamp_ms
        offset = next_offset - 1
        with self._lock:
            self.offset = offset
            due = [w for w in self._waiters if w[2] <= offset] if self._waiters else []
        for loop, future, _ in due:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_resolve, future)
        self._check_caught_up()

    def set_watermarks(self, low: int, high: int) -> None:
        if high >= 0:
            self.high = high
        if low >= 0:
            self.low = low
        self._check_caught_up()

    def set_state(self, state: str, error: str | None = None) -> None:
        """Change the state (logged once per change); `error` says why for stalled, gap and stopped."""
        if state == self.state and error == self.error:
            return
        previous, self.state, self.error = self.state, state, error
        if state == STOPPED:
            # It will not get any further: it serves what it applied (the contract of on_bad_record = "stop").
            self.caught_up = True
        where = f"live partition {self.store} v{self.version} p{self.partition}"
        if state in (GAP, STOPPED):
            log.error("%s: %s -> %s: %s", where, previous, state, error)
        elif state == STALLED:
            log.warning("%s: %s -> %s: %s", where, previous, state, error)
        elif state != previous:
            log.info("%s: %s -> %s (offset %d, lag %d records)", where, previous, state, self.offset, self.lag_records)
        self._changed()

    def resume(self) -> None:
        """Out of a fault (stalled): back to live, or to catching up when it never caught up."""
        if self.state == STALLED:
            self.set_state(LIVE if self.caught_up else CATCHING_UP)

    def _check_caught_up(self) -> None:
        if self.caught_up or self.high < 0 or self.state in (GAP, STALLED):
            return
        if self.lag_records <= self.config.catch_up_records:
            self.caught_up = True
            if self.state == CATCHING_UP:
                self.set_state(LIVE)
            else:
                self._changed()

    def _changed(self) -> None:
        callback = self.on_change
        if callback is not None:
            try:
                callback(self)
            except Exception:
                log.exception("a live partition's change callback failed")


def _stopped_message(offset: int, exc: BadRecord) -> str:
    return (
        f"bad record at offset {offset} ({exc.reason.value}: {exc}); consumption of this partition stopped "
        'before it (on_bad_record = "stop"); it serves what it applied until a new version replaces it'
    )


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(slots=True)
class _Slot:
    """One partition assigned to an applier: the store it writes, and the next offset it expects."""

    store: PartitionStore
    live: LivePartition
    reader: RecordReader
    next: int
    halted: bool = False  # gap or stopped: no longer consumed
    unsynced: bool = False  # commits not yet flushed to disk
    reassign_at: float | None = None  # unassigned after a failure; assigned again at this time
    registry_failures: int = 0  # failed attempts in a row to reach the Schema Registry
    skipped: dict[str, int] = field(default_factory=dict)


class LiveApplier:
    """Consumes the topic partitions of one (store, version) this node holds and applies them (one thread,
    one confluent_kafka Consumer). `add` and `remove` are called from any thread; once `remove` (or `close`)
    returns, the applier never touches that partition's environment again."""

    def __init__(
        self,
        source: LiveVersion,
        *,
        node_id: str,
        settings: ApplierSettings | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.store = source.store
        self.version = source.version
        self.config = source.config
        self._source = source
        self._node_id = node_id
        settings = ApplierSettings() if settings is None else settings
        self._settings = dataclasses.replace(
            settings, batch_records=max(1, settings.batch_records), sync_interval_s=max(0.0, settings.sync_interval_s)
        )
        self._environ = os.environ if environ is None else environ
        # Values in a Schema Registry format: one decoder (and schema cache) for every partition of the version.
        self._values = value_decoder(
            self.config.value_format,
            self.config.schema_registry,
            self._environ,
            store=source.store,
            merge=self.config.merge,
        )
        self._slots: dict[int, _Slot] = {}
        # Held while a batch is applied and while a slot is added or removed.
        self._lock = threading.Lock()
        self._commands: list[tuple[str, int, int]] = []
        self._commands_lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer: Any = None
        self._consumer_error: str | None = None
        self._brokers_down: str | None = None
        name = f"keyroute-live-{source.store}-v{source.version}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._received: dict[int, float] = {}
        # When each partition's watermarks were last asked of the broker (not only read from the client's cache).
        self._queried: dict[int, float] = {}
        self._started = False

    def __repr__(self) -> str:
        return f"LiveApplier({self.store} v{self.version}, partitions={sorted(self._slots)})"

    @property
    def partitions(self) -> list[int]:
        return sorted(self._slots)

    def add(self, held: PartitionStore) -> None:
        """Start consuming a loaded live partition of this version from its stored next offset."""
        live = held.live
        assert live is not None and held.version == self.version
        p = held.pid.partition
        source = self._source
        values = None if self._values is None else self._values.decode
        reader = record_reader(source.key_format, source.key_schema, source.partitioner, source.partitions, p, values)
        with self._lock:
            self._slots[p] = _Slot(held, live, reader, live.next_offset)
        with self._commands_lock:
            self._commands.append(("assign", p, live.next_offset))
        if not self._started:
            self._started = True
            self._thread.start()

    def remove(self, partition: int) -> None:
        """Stop consuming `partition` (blocks while a batch is being applied)."""
        with self._lock:
            removed = self._slots.pop(partition, None)
        if removed is not None:
            with self._commands_lock:
                self._commands.append(("unassign", partition, -1))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop consuming everything and wait for the thread (blocking)."""
        with self._lock:
            self._slots.clear()
        self._stop.set()
        if self._started:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the applier of %s v%d did not stop within %.0fs", self.store, self.version, timeout_s)

    # -- the thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        next_watermarks = 0.0
        next_sync = time.monotonic() + self._settings.sync_interval_s
        try:
            while not self._stop.is_set():
                if self._consumer is None and not self._create_consumer():
                    self._stop.wait(self._settings.recreate_after_s)
                    continue
                self._run_commands()
                messages = self._take()
                if messages:
                    self._apply(messages)
                now = time.monotonic()
                if now >= next_sync:
                    self._sync()
                    next_sync = time.monotonic() + self._settings.sync_interval_s
                if now >= next_watermarks:
                    self._refresh_watermarks(now)
                    next_watermarks = time.monotonic() + self._settings.watermarks_every_s
        except Exception:
            log.exception("the applier of %s v%d failed", self.store, self.version)
            with self._lock:
                for slot in self._slots.values():
                    slot.live.set_state(STALLED, "the applier failed unexpectedly (see the node's log)")
        finally:
            self._stop.set()
            consumer, self._consumer = self._consumer, None
            if consumer is not None:
                with contextlib.suppress(Exception):
                    consumer.close()

    def _sync(self) -> None:
        """Flush the partitions committed to since the last flush (one fsync each)."""
        with self._lock:
            for partition, slot in self._slots.items():
                if slot.unsynced:
                    slot.unsynced = False
                    try:
                        slot.store.sync()
                    except Exception as exc:  # lmdb.Error, OSError: a full or failing disk
                        log.error(
                            "live partition %s p%d: flushing to disk failed: %s", self.store, partition, describe(exc)
                        )
                        slot.unsynced = True

    def _take(self) -> list[Any]:
        """Every record the client holds, up to a batch, without waiting when there is one; else wait at most
        `poll_timeout_s` for the next one. (Asking for a whole batch with a timeout would hold records that
        arrived until the batch fills or the timeout ends: freshness would cost up to the timeout.)"""
        consumer, batch = self._consumer, self._settings.batch_records
        messages = consumer.consume(num_messages=batch, timeout=0)
        if messages:
            return messages
        messages = consumer.consume(num_messages=1, timeout=self._settings.poll_timeout_s)
        if messages and batch > 1:
            messages += consumer.consume(num_messages=batch - 1, timeout=0)
        return messages

    def _create_consumer(self) -> bool:
        from confluent_kafka import Consumer

        try:
            settings: dict[str, Any] = {
                # How long the broker may hold a fetch that finds no new record (a broker answers at once
                # when records arrive); the store's `kafka` settings may say otherwise.
                "fetch.wait.max.ms": self._settings.fetch_wait_ms,
                **self.config.consumer_settings(self._environ),
                "bootstrap.servers": self.config.bootstrap_servers,
                # The client wants a group id; nothing is ever committed or subscribed under it.
                "group.id": f"keyroute-node-{self._node_id}",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                # An offset the broker no longer (or not yet) holds is an error here, never a silent jump.
                "auto.offset.reset": "error",
                "enable.partition.eof": False,
                "error_cb": self._on_client_error,
                # librdkafka's own log repeats every reconnect attempt: faults are logged here, once per change.
                "log_level": 2,
            }
            self._consumer = Consumer(settings)
        except Exception as exc:  # LiveSpecError (a ${VAR} not set), KafkaException (a bad setting)
            error = f"the Kafka consumer could not be created: {exc}"
            if error != self._consumer_error:
                log.error("live store %s v%d: %s", self.store, self.version, error)
            self._consumer_error = error
            with self._lock:
                for slot in self._slots.values():
                    slot.live.set_state(STALLED, error)
            return False
        self._consumer_error = None
        return True

    def _run_commands(self) -> None:
        from confluent_kafka import TopicPartition

        with self._commands_lock:
            commands, self._commands = self._commands, []
        consumer = self._consumer
        topic = self.config.topic
        for action, partition, offset in commands:
            tp = TopicPartition(topic, partition, offset) if action == "assign" else TopicPartition(topic, partition)
            try:
                if action == "assign":
                    consumer.incremental_assign([tp])
                else:
                    consumer.incremental_unassign([tp])
            except Exception as exc:  # KafkaException: not assigned (already gone), or the client is closing
                log.debug(
                    "live store %s v%d: %s of partition %d: %s",
                    *(self.store, self.version, action, partition, describe(exc)),
                )
        now = time.monotonic()
        for partition, slot in list(self._slots.items()):
            if slot.reassign_at is not None and now >= slot.reassign_at and not slot.halted:
                slot.reassign_at = None
                try:
                    consumer.incremental_assign([TopicPartition(topic, partition, slot.next)])
                except Exception as exc:
                    log.debug("live store %s: assigning partition %d again: %s", self.store, partition, describe(exc))
                    slot.reassign_at = now + self._settings.reassign_after_s

    def _on_client_error(self, error: Any) -> None:
        """librdkafka's errors not tied to one partition (called from `consume`, on this thread)."""
        from confluent_kafka import KafkaError

        code = error.code()
        if code == KafkaError._ALL_BROKERS_DOWN:
            self._brokers_down = f"broker unreachable ({error.str()}); retrying"
            for slot in list(self._slots.values()):
                if not slot.halted:
                    slot.live.set_state(STALLED, self._brokers_down)
        elif error.fatal():
            log.error("live store %s v%d: fatal Kafka client error: %s", self.store, self.version, error.str())
        else:
            log.debug("live store %s v%d: Kafka client: %s", self.store, self.version, error.str())

    def _apply(self, messages: list[Any]) -> None:
        from confluent_kafka import KafkaError

        groups: dict[int, list[Any]] = {}
        for message in messages:
            error = message.error()
            if error is None:
                groups.setdefault(message.partition(), []).append(message)
            elif error.code() == KafkaError._AUTO_OFFSET_RESET and message.partition() is not None:
                self._offset_reset(message.partition(), error.str())
            else:
                log.debug("live store %s: consume error: %s", self.store, error.str())
        if not groups:
            return
        if self._brokers_down is not None:
            self._brokers_down = None
        now = time.monotonic()
        for partition in groups:
            self._received[partition] = now
        with self._lock:
            for partition, records in groups.items():
                slot = self._slots.get(partition)
                if slot is not None and not slot.halted and slot.reassign_at is None:
                    self._apply_partition(partition, slot, records)

    def _apply_partition(self, partition: int, slot: _Slot, records: list[Any]) -> None:
        held = slot.store
        live = slot.live
        config = self.config
        stop_on_bad = config.on_bad_record == "stop"
        expected = slot.next
        applied = 0
        skipped = slot.skipped
        skipped.clear()
        last = None
        halt: tuple[str, str] | None = None
        registry_down: str | None = None
        with held.write_lock:
            if held.closed:
                return
            try:
                txn = held.write_txn()
                try:
                    get = cast("Callable[[bytes], bytes | None]", txn.get)  # without buffers=True: bytes
                    put, delete = txn.put, txn.delete
                    read = slot.reader.read
                    merge = config.merge
                    fold = merge.apply
                    history = TimelineWriter(txn, merge) if merge.mode in ("history", "windowed") else None
                    for message in records:
                        offset = message.offset()
                        if offset != expected:
                            if offset < expected:
                                continue  # seen again after a seek: applied already
                            gone = self._records_gone(partition, expected, offset)
                            if gone is not None:
                                halt = (GAP, gone)
                                break
                        try:
                            key, row = read(message.key(), message.value())
                            if history is not None:
                                history.apply(key, row, offset)
                                applied += 1
                                expected = offset + 1
                                last = message
                                continue
                            lmdb_key = TAG_KEY + key if len(key) < _LONG_KEY else db_key(key)
                            if row is None:
                                delete(lmdb_key)
                            else:
                                stored = get(lmdb_key)
                                new = fold(stored, row)
                                if new is not None:
                                    put(lmdb_key, new)
                            applied += 1
                        except BadRecord as exc:
                            if stop_on_bad:
                                halt = (STOPPED, _stopped_message(offset, exc))
                                break
                            reason = exc.reason.value
                            skipped[reason] = skipped.get(reason, 0) + 1
                            live.last_bad_record = f"offset {offset}: {reason}: {exc}"
                        except RegistryUnavailable as exc:
                            # Applied up to the record before; this one is read again once the registry answers.
                            registry_down = f"schema registry unreachable at offset {offset} ({exc}); retrying"
                            break
                        expected = offset + 1
                        last = message
                    if expected != slot.next:
                        if history is not None:
                            history.save()
                        put(OFFSET_KEY, str(expected).encode("ascii"))
                        txn.commit()
                        slot.unsynced = True
                    else:
                        txn.abort()
                except BaseException:
                    txn.abort()
                    raise
            except Exception as exc:
                # Nothing of the batch committed: consume it again from the stored offset a moment later.
                log.exception("live partition %s v%d p%d: applying records failed", self.store, self.version, partition)
                live.set_state(STALLED, f"applying records failed: {describe(exc)}; retrying")
                self._unassign(partition, slot, retry=True)
                return
        if slot.unsynced and not self._settings.sync_interval_s:
            slot.unsynced = False
            held.sync()
        if expected != slot.next:
            slot.next = expected
            timestamp = last.timestamp()[1] if last is not None else -1
            live.advance(expected, applied, skipped, float(timestamp) if timestamp >= 0 else None)
        if registry_down is not None:
            slot.registry_failures += 1
            live.set_state(STALLED, registry_down)
            self._unassign(partition, slot, retry=True, failures=slot.registry_failures)
            return
        slot.registry_failures = 0
        if live.state == STALLED and self._brokers_down is None:
            live.resume()
        if halt is not None:
            live.set_state(*halt)
            self._unassign(partition, slot, retry=False)
            return
        with contextlib.suppress(Exception):
            from confluent_kafka import TopicPartition

            low, high = self._consumer.get_watermark_offsets(TopicPartition(config.topic, partition), cached=True)
            live.set_watermarks(low, high)

    def _records_gone(self, partition: int, expected: int, offset: int) -> str | None:
        """A record at `offset` came while `expected` was the next one: why the records between are gone
        (retention moved the low watermark past them), or None when the log simply holds none there."""
        low = self._query_watermarks(partition)[0]
        if low is None or low > expected:
            return self._gap_message(partition, expected, low if low is not None else offset)
        return None

    def _gap_message(self, partition: int, expected: int, low: int) -> str:
        return (
            f"records {expected}..{low - 1} of topic {self.config.topic!r} partition {partition} are gone (the topic "
            f"now starts at offset {low}): version {self.version} of store {self.store!r} cannot be completed, so "
            "this replica does not serve the partition until a new version covers it (a new build)"
        )

    def _ahead_message(self, partition: int, expected: int, high: int) -> str:
        return (
            f"the next offset to apply, {expected}, is beyond the end of topic {self.config.topic!r} partition "
            f"{partition} ({high}: the topic was recreated or truncated): version {self.version} of store "
            f"{self.store!r} cannot be completed, so this replica does not serve the partition until a new "
            "version covers it (a new build)"
        )

    def _offset_reset(self, partition: int, why: str) -> None:
        """The client could not fetch the partition's offset: a gap when the topic no longer holds it, else
        (a transient answer) the partition is assigned again a moment later."""
        with self._lock:
            slot = self._slots.get(partition)
            if slot is None or slot.halted:
                return
            if not self._check_watermarks(partition):
                log.warning("live partition %s p%d: %s; assigning it again", self.store, partition, why)
                self._unassign(partition, slot, retry=True)

    def _unassign(self, partition: int, slot: _Slot, *, retry: bool, failures: int = 1) -> None:
        """Stop fetching `partition`: for good, or (`retry`) until a moment later, doubling with each of
        `failures` in a row (up to registry_backoff_max_s)."""
        from confluent_kafka import TopicPartition

        if retry:
            settings = self._settings
            delay = settings.reassign_after_s * 2 ** min(failures - 1, 16)
            slot.reassign_at = time.monotonic() + min(
                delay, max(settings.registry_backoff_max_s, settings.reassign_after_s)
            )
        else:
            slot.halted = True
        with contextlib.suppress(Exception):
            self._consumer.incremental_unassign([TopicPartition(self.config.topic, partition)])

    def _query_watermarks(self, partition: int) -> tuple[int | None, int | None]:
        from confluent_kafka import TopicPartition

        try:
            low, high = self._consumer.get_watermark_offsets(
                TopicPartition(self.config.topic, partition), timeout=self._settings.watermarks_timeout_s
            )
        except Exception:
            return None, None
        return int(low), int(high)

    def _refresh_watermarks(self, now: float) -> None:
        """About once a second: each partition's watermarks as the client last saw them in a fetch answer
        (no request); asked of the broker when the client has none, every `query_every_s`, or more often
        while the partition is stalled (to notice the end of the fault). Lag, gaps, faults, recoveries."""
        from confluent_kafka import TopicPartition

        consumer = self._consumer
        with self._lock:
            for partition, slot in list(self._slots.items()):
                if self._stop.is_set():
                    return
                if slot.halted:
                    continue
                due = now - self._queried.get(partition, float("-inf")) >= self._settings.query_every_s
                if not due and slot.live.state != STALLED:
                    try:
                        low, high = consumer.get_watermark_offsets(
                            TopicPartition(self.config.topic, partition), cached=True
                        )
                    except Exception:
                        low, high = -1, -1
                    if high >= 0:
                        self._on_watermarks(partition, int(low), int(high), None)
                        continue
                self._queried[partition] = now
                self._check_watermarks(partition)

    def _check_watermarks(self, partition: int) -> bool:
        """Ask the broker for the partition's watermarks now (blocking) and act on them; True when the
        partition is in a gap. Called with `_lock` held."""
        from confluent_kafka import KafkaException, TopicPartition

        try:
            low, high = self._consumer.get_watermark_offsets(
                TopicPartition(self.config.topic, partition), timeout=self._settings.watermarks_timeout_s
            )
        except KafkaException as exc:
            return self._on_watermarks(partition, -1, -1, exc.args[0] if exc.args else exc)
        return self._on_watermarks(partition, int(low), int(high), None)

    def _on_watermarks(self, partition: int, low: int, high: int, error: Any) -> bool:
        """True when the partition is (now) in a gap. Called with `_lock` held."""
        from confluent_kafka import KafkaError

        slot = self._slots.get(partition)
        if slot is None or slot.halted:
            return slot is not None and slot.live.state == GAP
        live = slot.live
        if error is not None:
            code = error.code() if hasattr(error, "code") else None
            recent = time.monotonic() - self._received.get(partition, float("-inf")) < self._settings.recent_records_s
            if code == KafkaError._TIMED_OUT and recent and self._brokers_down is None:
                return False  # busy fetching: the next query will tell
            if self._brokers_down is not None:
                why = self._brokers_down
            else:
                text = error.str() if hasattr(error, "str") else str(error)
                why = f"topic {self.config.topic!r} partition {partition} is unavailable ({text}); retrying"
            live.set_state(STALLED, why)
            return False
        self._brokers_down = None
        if slot.next < low:
            live.set_watermarks(low, high)
            live.set_state(GAP, self._gap_message(partition, slot.next, low))
            self._unassign(partition, slot, retry=False)
            return True
        if slot.next > high:
            live.set_state(GAP, self._ahead_message(partition, slot.next, high))
            self._unassign(partition, slot, retry=False)
            return True
        live.resume()
        live.set_watermarks(low, high)
        return False
