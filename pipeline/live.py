"""A live store's Kafka topic at build time: is it there with the store's partition count, and from which
offset does each partition of the new version follow it.

    live-only store   (no `source`) every version is empty; its offsets are the topic's watermarks when it
                      is built (`start` earliest: the low watermarks, latest: the high ones), so every
                      replica starts from the same record
    hybrid store      the source is the topic's archive; offsets[p] = 1 + its greatest offset in partition p
                      (0 for a partition it has no record of), computed by Spark with the rest of the store
                      (keyroute.pipeline.offsets), and checked here against the topic's high watermarks

The cluster is asked through librdkafka's consumer, for metadata and watermarks only: it joins no group,
commits nothing and creates no topic; every question is bounded by `timeout_s`. Kafka settings that name
`${ENV}` variables are resolved from the `environ` the caller passes (the CLI passes its environment).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from keyroute.formats.value_format import ValueDecoder
from keyroute.keys.schema_registry import RegistrySettingsError, RegistryUnavailable, SchemaFetcher, UnknownSchema
from keyroute.pipeline.errors import SpecError, TopicError
from keyroute.pipeline.spec import Mode, StoreSpec
from keyroute.storage.live import BadRecord, LiveConfig, LiveSpecError
from keyroute.storage.timeline import Timeline, TimeType

log = logging.getLogger(__name__)

# How long the build waits for the cluster's answer to one question (metadata, a partition's watermarks).
METADATA_TIMEOUT_S = 15.0
# The consumer group id librdkafka insists on; the build never joins it and never commits.
PIPELINE_GROUP = "keyroute-pipeline"


@dataclass(frozen=True, slots=True)
class Watermarks:
    """Per topic partition: the first offset still held (`low`) and the next offset to be written (`high`)."""

    low: tuple[int, ...]
    high: tuple[int, ...]


def live_config(
    store: StoreSpec,
    offsets: tuple[int, ...],
    value_columns: tuple[str, ...] | None = None,
    timeline: Timeline | None = None,
    order_types: Mapping[str, TimeType | None] | None = None,
) -> LiveConfig:
    """The manifest's `live` part for a version of `store` whose batch part ends at `offsets`; a `latest`
    or `history` store's fold keeps `value_columns` (the batch part's answer columns; default: the spec's
    `columns`); a history store's records are rows of `timeline`; records are ordered as the batch part's
    rows were (`order_types`, keyroute.pipeline.ordering; default: the spec's `order_by_type`)."""
    live = store.live
    assert live is not None
    return LiveConfig(
        topic=live.topic,
        bootstrap_servers=live.bootstrap_servers,
        merge=store.merge(value_columns, timeline, order_types),
        offsets=offsets,
        kafka=dict(live.kafka),
        on_bad_record=live.on_bad_record,
        catch_up_records=live.catch_up_records,
        value_format=live.value_format,
        schema_registry=live.schema_registry,
    )


def check_value_schema(store: StoreSpec, environ: Mapping[str, str], fetcher: SchemaFetcher | None = None) -> None:
    """A store whose values are in a Schema Registry format: the topic's value subject (`TOPIC-value`) is
    registered and its latest schema has the columns the store needs; SpecError naming the store, the subject,
    the field and the schema id otherwise (TopicError when the registry cannot be reached)."""
    live = store.live
    if live is None or live.value_format == "json" or live.schema_registry is None:
        return
    subject = f"{live.topic}-value"
    try:
        fetcher = SchemaFetcher(live.schema_registry, environ) if fetcher is None else fetcher
        latest = fetcher.latest(subject)
        decoder = ValueDecoder(live.value_format, lambda: fetcher, store=store.name, merge=store.merge())
        decoder.check(latest.schema_id)
    except RegistrySettingsError as exc:
        raise SpecError(store.name, str(exc)) from None
    except UnknownSchema:
        raise SpecError(
            store.name,
            f"subject {subject!r} is not in the schema registry ({live.schema_registry.url}): value_format "
            f'"{live.value_format}" reads values of the topic\'s registered schemas; produce a record (or register '
            "its schema) first",
        ) from None
    except RegistryUnavailable as exc:
        raise TopicError(store.name, f"the schema registry cannot be reached: {exc}") from None
    except BadRecord as exc:
        raise SpecError(store.name, f"subject {subject!r}, latest version {latest.version}: {exc}") from None


def live_value_columns(store: StoreSpec) -> tuple[str, ...]:
    """The answer columns of a live-only store (its versions have no source to read them from): the
    aggregations, or a `latest` store's `columns` (none listed: every field of the records but the key)."""
    if store.mode is Mode.AGGREGATE or store.mode is Mode.WINDOWED:
        return tuple(store.aggregations)
    if store.mode is Mode.HISTORY and store.columns:
        assert store.order_by is not None
        return (store.order_by, *[c for c in store.columns if c != store.order_by])
    return store.columns or ()


def check_topic(store: StoreSpec, environ: Mapping[str, str], timeout_s: float = METADATA_TIMEOUT_S) -> None:
    """The store's topic exists and has exactly the store's partition count (store partition p is topic
    partition p); TopicError or SpecError naming the store otherwise."""
    with _client(store, environ) as client:
        client.partitions(timeout_s)


def start_offsets(
    store: StoreSpec, environ: Mapping[str, str], timeout_s: float = METADATA_TIMEOUT_S
) -> tuple[int, ...]:
    """Where an empty version of a live-only store starts in each partition: the watermarks its `start` names."""
    assert store.live is not None
    with _client(store, environ) as client:
        marks = client.watermarks(timeout_s)
    return marks.high if store.live.start == "latest" else marks.low


def check_offsets(
    store: StoreSpec, offsets: tuple[int, ...], environ: Mapping[str, str], timeout_s: float = METADATA_TIMEOUT_S
) -> None:
    """A hybrid version's offsets are within the topic: an archive that runs past a partition's end is the
    archive of another topic (or of one since recreated), and fails the build. Offsets the topic no longer
    holds (retention) are logged: nodes report that partition as a gap until a newer version covers it."""
    with _client(store, environ) as client:
        marks = client.watermarks(timeout_s)
    beyond = [p for p, offset in enumerate(offsets) if offset > marks.high[p]]
    if beyond:
        shown = "; ".join(
            f"partition {p}: source ends at offset {offsets[p] - 1}, topic at {marks.high[p] - 1}" for p in beyond[:5]
        )
        raise TopicError(
            store.name,
            f"the source holds offsets beyond the end of topic {client.topic!r} ({shown}); is "
            "'source' the archive of this topic?",
        )
    lost = [p for p, offset in enumerate(offsets) if offset < marks.low[p]]
    if lost:
        log.warning(
            "store %r: topic %r no longer holds the records right after the source in partition(s) %s "
            "(retention); nodes will report a gap there until a newer version covers it",
            store.name,
            client.topic,
            ", ".join(str(p) for p in lost[:20]),
        )


class _ClientLog:
    """librdkafka's log lines (it calls `log` from its own threads): kept at debug level, and the last
    warning remembered, because it says why a broker could not be reached (refused, TLS, SASL)."""

    def __init__(self) -> None:
        self.last_problem: str | None = None

    def log(self, level: int, message: str, *args: Any) -> None:
        text = message % args if args else message
        if level >= logging.WARNING:
            self.last_problem = text
        log.debug("librdkafka: %s", text)


class _TopicClient:
    """One consumer connection asking about the store's topic."""

    def __init__(self, store: StoreSpec, consumer: Any, client_log: _ClientLog) -> None:
        assert store.live is not None
        self.store = store
        self.topic = store.live.topic
        self.servers = store.live.bootstrap_servers
        self._consumer = consumer
        self._log = client_log

    def partitions(self, timeout_s: float) -> int:
        from confluent_kafka import KafkaException

        try:
            metadata = self._consumer.list_topics(self.topic, timeout=timeout_s)
        except KafkaException as exc:
            raise self._unreachable(exc, timeout_s) from exc
        found = metadata.topics.get(self.topic)
        if found is None or found.error is not None:
            problem = "it does not exist" if found is None else found.error.str()
            raise TopicError(
                self.store.name,
                f"topic {self.topic!r} at {self.servers!r} cannot be used: {problem} (the topic must exist, "
                f"with {self.store.partitions} partitions; the build creates none)",
            )
        count = len(found.partitions)
        if count != self.store.partitions:
            raise SpecError(
                self.store.name,
                f"topic {self.topic!r} has {count} partitions but the store has {self.store.partitions}: "
                "store partition p is topic partition p, so the counts must be equal",
            )
        return count

    def watermarks(self, timeout_s: float) -> Watermarks:
        from confluent_kafka import KafkaException, TopicPartition

        count = self.partitions(timeout_s)
        deadline = time.monotonic() + timeout_s
        low, high = [], []
        for partition in range(count):
            remaining = max(0.1, deadline - time.monotonic())
            try:
                first, end = self._consumer.get_watermark_offsets(
                    TopicPartition(self.topic, partition), timeout=remaining, cached=False
                )
            except KafkaException as exc:
                raise self._unreachable(exc, timeout_s, f"the offsets of partition {partition}") from exc
            low.append(int(first))
            high.append(int(end))
        return Watermarks(tuple(low), tuple(high))

    def _unreachable(self, exc: Any, timeout_s: float, what: str = "its metadata") -> TopicError:
        error = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
        self._consumer.poll(0)  # serves the client's queued log lines (nothing is assigned: no records)
        why = f"; last client message: {self._log.last_problem}" if self._log.last_problem else ""
        return TopicError(
            self.store.name,
            f"cannot read {what} of topic {self.topic!r} from Kafka at {self.servers!r} within {timeout_s:g} s: "
            f"{error}{why}",
        )


@contextmanager
def _client(store: StoreSpec, environ: Mapping[str, str]) -> Iterator[_TopicClient]:
    from confluent_kafka import Consumer, KafkaException

    live = store.live
    assert live is not None
    try:
        settings = live_config(store, ()).consumer_settings(environ)
    except LiveSpecError as exc:
        raise TopicError(store.name, f"'live.kafka': {exc}") from None
    client_log = _ClientLog()
    config: dict[str, Any] = {
        **settings,
        "bootstrap.servers": live.bootstrap_servers,
        "group.id": PIPELINE_GROUP,
        "enable.auto.commit": False,
        "allow.auto.create.topics": False,
        "logger": client_log,
    }
    try:
        consumer = Consumer(config)
    except KafkaException as exc:
        raise SpecError(
            store.name, f"'live.kafka': the Kafka client refuses its settings: {exc.args[0].str()}"
        ) from exc
    try:
        yield _TopicClient(store, consumer, client_log)
    finally:
        consumer.close()
