"""One pipeline build: compute and write a new version of every store in a spec, then publish them all.

A store that fails stops the build before anything is published, and its build's written versions are removed.
Every store's source columns are checked (schema inference and analysis, no job) before any store is computed,
live stores' topics before any Spark work (keyroute.pipeline.live); a live store without a source
gets an empty version starting at the offsets its `start` names, without Spark (a spec of only such stores
starts no Spark session at all).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kazoo.client import KazooClient
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from keyroute.cluster.zk import ZkUnavailableError, close, connect
from keyroute.keys.key_schema import KeySchemaLookupError, fetch_key_schema
from keyroute.pipeline.compute import CheckedStore, check_store, compute_store
from keyroute.pipeline.errors import PipelineError, PublishError, SpecError
from keyroute.pipeline.live import (
    METADATA_TIMEOUT_S,
    check_offsets,
    check_topic,
    check_value_schema,
    live_config,
    live_value_columns,
    start_offsets,
)
from keyroute.pipeline.publish import PublishedStore, check_colocation, check_shape, publish, read_published
from keyroute.pipeline.session import SparkConfError, create_session, restore_conf, set_conf
from keyroute.pipeline.spark_errors import spark_message
from keyroute.pipeline.spec import Spec, StoreSpec, load_spec
from keyroute.pipeline.timeline import timeline_of
from keyroute.pipeline.writer import (
    WrittenVersion,
    claim_next_version,
    remove_version,
    write_empty_version,
    write_version,
)
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.snapshot import ArrowLocation, SnapshotError, is_local, local_path

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PublishedVersion:
    """A store version this build wrote and published."""

    store: str
    version: int
    snapshot: str
    rows: int
    partitions: int
    # Live stores: the next offset of each topic partition nodes apply on top of the version's rows.
    live_offsets: tuple[int, ...] | None = None

    def describe(self) -> dict[str, Any]:
        line: dict[str, Any] = {
            "store": self.store,
            "version": self.version,
            "snapshot": self.snapshot,
            "rows": self.rows,
            "partitions": self.partitions,
            "live": self.live_offsets is not None,
        }
        if self.live_offsets is not None:
            line["live_offsets"] = list(self.live_offsets)
        return line


@dataclass(frozen=True, slots=True)
class KafkaAccess:
    """How the build asks live stores' Kafka clusters: `environ` resolves `${ENV}` settings, every question
    is bounded by `timeout_s`."""

    environ: Mapping[str, str]
    timeout_s: float = METADATA_TIMEOUT_S


def build(
    spec_path: Path,
    zk: ZkSettings,
    output: str,
    master: str | None = None,
    spark: SparkSession | None = None,
    kafka: KafkaAccess | None = None,
    spark_secret_file: Path | None = None,
    clock: Callable[[], float] = time.time,
) -> list[PublishedVersion]:
    """Build every store of the spec at `spec_path` into `output` and publish the new versions in ZooKeeper.

    The spec is checked before Spark or ZooKeeper are touched, live stores' topics before Spark, and every
    store's source columns (schema only) before any store is computed. A session
    passed in is left running; one created here (on `master`, default local[*]) is stopped before
    returning. `kafka` says how to reach live stores' clusters (default: no environment variables).
    `spark_secret_file`: a session created here authenticates and encrypts its RPC with this secret.
    `clock` is the build's clock (seconds since the epoch; the driver's wall clock): read once, as the stores
    start computing, it is the "now" a store's `ttl` is counted back from (expired rows are left out).
    """
    kafka = KafkaAccess({}) if kafka is None else kafka
    spec = with_key_schemas(load_spec(spec_path), kafka.environ)
    _check_output(spec, output)
    client = _connect(zk)
    try:
        published = {store.name: read_published(client, store.name) for store in spec.stores}
        for store in spec.stores:
            check_shape(store, published[store.name])  # before hours of Spark work, not after
        check_colocation(client, spec)
        for store in spec.stores:
            if store.live is not None:
                check_topic(store, kafka.environ, kafka.timeout_s)
                check_value_schema(store, kafka.environ)
        needs_spark = spark is None and any(store.batch for store in spec.stores)
        session = _start_spark(master, spec, spec_path, spark_secret_file) if needs_spark else spark
        try:
            with _spark_settings(session, spec, spec_path, joined=not needs_spark):
                written = _write_all(session, spec, output, published, kafka, clock)
        finally:
            if needs_spark and session is not None:
                session.stop()
        try:
            publish(client, list(zip(spec.stores, written, strict=True)), published)
        except BaseException:
            for version in written:
                remove_version(version.snapshot)
            raise
    finally:
        close(client)
    result = [
        PublishedVersion(
            store=w.store,
            version=w.version,
            snapshot=str(w.snapshot),
            rows=w.manifest.total_rows,
            partitions=w.manifest.partitions,
            live_offsets=None if w.manifest.live is None else w.manifest.live.offsets,
        )
        for w in written
    ]
    for done in result:
        log.info("store %r: published version %d (%d rows)", done.store, done.version, done.rows)
    return result


def _write_all(
    spark: SparkSession | None,
    spec: Spec,
    output: str,
    published: Mapping[str, PublishedStore | None],
    kafka: KafkaAccess,
    clock: Callable[[], float] = time.time,
) -> list[WrittenVersion]:
    # Every store's source and the columns its spec names, checked before any store is computed: a spec with
    # a mistake in its last store fails in the time schema inference takes, not after the other stores.
    checked: dict[str, CheckedStore] = {}
    for store in spec.stores:
        if store.batch:
            assert spark is not None
            checked[store.name] = check_store(spark, store)
    written: list[WrittenVersion] = []
    now_s = clock()  # one "now" for every store's ttl
    try:
        for store in spec.stores:
            before = published[store.name]
            if not store.batch:
                written.append(_write_live_only(store, output, before, kafka))
                continue
            assert spark is not None
            written.append(_write_store(spark, checked[store.name], output, before, kafka, now_s))
    except BaseException:
        for version in written:
            remove_version(version.snapshot)
        raise
    return written


def _write_store(
    spark: SparkSession,
    checked: CheckedStore,
    output: str,
    published: PublishedStore | None,
    kafka: KafkaAccess,
    now_s: float | None = None,
) -> WrittenVersion:
    store = checked.spec
    log.info("store %r: computing from %s", store.name, store.describe_source())
    computed = compute_store(spark, store, checked, now_s)
    try:
        live = None
        if store.live is not None:
            assert computed.live_offsets is not None  # a hybrid store's spec names its offset column
            check_offsets(store, computed.live_offsets, kafka.environ, kafka.timeout_s)
            live = live_config(
                store, computed.live_offsets, computed.value_columns, computed.timeline, computed.order_types
            )
        # Claimed once the data is known good, so a failed computation leaves no version behind.
        claimed = claim_next_version(output, store.name, published.record.version if published else None)
        log.info("store %r: writing version %d to %s", store.name, claimed.version, claimed.snapshot)
        written = write_version(computed, claimed, live)
    finally:
        computed.release()
    log.info("store %r: wrote version %d to %s", store.name, written.version, written.snapshot)
    return written


def _write_live_only(
    store: StoreSpec, output: str, published: PublishedStore | None, kafka: KafkaAccess
) -> WrittenVersion:
    """An empty version of a live store without a source, starting at the watermarks its `start` names."""
    assert store.live is not None
    offsets = start_offsets(store, kafka.environ, kafka.timeout_s)
    claimed = claim_next_version(output, store.name, published.record.version if published else None)
    log.info(
        "store %r: writing empty version %d to %s, following topic %r from its %s offsets %s",
        store.name,
        claimed.version,
        claimed.snapshot,
        store.live.topic,
        store.live.start,
        list(offsets),
    )
    timeline = None
    if store.mode.timeline:
        assert store.order_by_type is not None  # the spec requires it without a source
        timeline = timeline_of(store, store.order_by_type)
    live = live_config(store, offsets, None, timeline)
    return write_empty_version(store, claimed, live, live_value_columns(store), timeline)


@contextlib.contextmanager
def _spark_settings(session: SparkSession | None, spec: Spec, spec_path: Path, joined: bool) -> Iterator[None]:
    """While open, a session passed in to the build runs with the spec's `[spark]` settings (put back after);
    one the build started has them from its start."""
    if session is None or not joined or not spec.spark.conf:
        yield
        return
    try:
        previous = set_conf(session, spec.spark.conf)
    except SparkConfError as exc:
        raise SpecError(None, f"spec {str(spec_path)!r}: {exc}") from exc
    try:
        yield
    finally:
        restore_conf(session, previous)


def with_key_schemas(spec: Spec, environ: Mapping[str, str]) -> Spec:
    """`spec` with every Schema Registry key schema resolved (id and text, from the store's registry; its
    `${ENV}` settings from `environ`), so the build serializes keys as the producer does and the store's
    record carries the schema to readers."""
    stores = []
    for store in spec.stores:
        if store.key_format.registered and store.key_schema is None:
            assert store.schema_registry is not None  # the spec requires it
            try:
                schema = fetch_key_schema(
                    store.key_format,
                    store.schema_registry,
                    store.key_subject,
                    store.key_schema_id,
                    store.key_message,
                    environ,
                )
            except KeySchemaLookupError as exc:
                raise SpecError(store.name, str(exc)) from None
            store = dataclasses.replace(store, key_schema=schema)
        stores.append(store)
    return dataclasses.replace(spec, stores=tuple(stores))


def _check_output(spec: Spec, output: str) -> None:
    """The output is a local path, a file:// URI or a URI some pyarrow filesystem writes; format-1 stores
    need a local one (Spark's JSON writer on the driver's filesystem)."""
    names = ", ".join(repr(store.name) for store in spec.stores)
    try:
        if is_local(output):
            local_path(output)
            return
    except SnapshotError as exc:
        raise PublishError(None, f"stores {names}: {exc}") from exc
    for store in spec.stores:
        if store.snapshot_format == 1:
            raise PublishError(
                store.name,
                f"snapshot_format 1 is written to local paths or file:// URIs only, not {output!r} "
                "(format 2, the default, is written to any filesystem pyarrow reaches)",
            )
    try:
        ArrowLocation.from_uri(output)  # the filesystem exists and (for S3) its bucket's region resolves
    except SnapshotError as exc:
        raise PublishError(None, f"stores {names}: {exc}") from exc


def _connect(zk: ZkSettings) -> KazooClient:
    try:
        return connect(zk)
    except ZkUnavailableError as exc:
        raise PublishError(None, f"cannot publish: {exc}") from exc


def _start_spark(master: str | None, spec: Spec, spec_path: Path, secret_file: Path | None = None) -> SparkSession:
    try:
        # Spark's own logging and start-up notes only when debugging; a stage progress bar on a terminal.
        quiet = logging.getLogger().getEffectiveLevel() > logging.DEBUG
        progress = quiet and sys.stderr.isatty()
        return create_session(master, quiet=quiet, progress=progress, conf=spec.spark.conf, secret_file=secret_file)
    except SparkConfError as exc:
        raise SpecError(None, f"spec {str(spec_path)!r}: {exc}") from exc
    except OSError as exc:
        raise PipelineError(None, f"cannot read the Spark secret {secret_file}: {exc.strerror or exc}") from exc
    except (PySparkException, RuntimeError) as exc:
        where = master or "local[*]"
        raise PipelineError(None, f"cannot start Spark on {where}: {spark_message(exc)}") from exc
