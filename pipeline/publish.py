"""Publishing versions: the StoreRecord at /stores/{store} in ZooKeeper, all stores at once.

A store's routing shape (partitions, partitioner, key format) can never change under a published store.
Each record also lists the versions retained for a rollback (the last N that were current); a version
that falls out of that list has its snapshot directory removed. `rollback` makes a retained version
current again; `list_stores` shows what is published and retained. Nothing here needs Spark.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, KazooException, NoNodeError, RolledBackError
from kazoo.protocol.states import ZnodeStat

from keyroute.cluster import zk_layout
from keyroute.cluster.partition_map import RecordError, StoreRecord
from keyroute.pipeline.errors import PipelineError, PublishError, SpecError
from keyroute.pipeline.spec import Mode, colocation_mismatch
from keyroute.runtime.logs import describe
from keyroute.storage.snapshot import SnapshotError, read_manifest, resolve_location
from keyroute.storage.timeline import StoreKind
from keyroute.storage.ttl import Ttl

if TYPE_CHECKING:  # type names only: publishing and rolling back must not load Spark
    from keyroute.keys.key_schema import KeySchema
    from keyroute.pipeline.spec import Spec, StoreSpec
    from keyroute.pipeline.writer import WrittenVersion

log = logging.getLogger(__name__)

# Versions kept for a rollback, the current one included.
DEFAULT_RETAIN = 3
_retain: contextvars.ContextVar[int] = contextvars.ContextVar("keyroute_retain", default=DEFAULT_RETAIN)


class RollbackError(PipelineError):
    """A rollback was refused (unknown store, version not retained, snapshot gone); nothing changed."""


class DeleteError(PipelineError):
    """A deletion was refused (unknown store, its record changed meanwhile); nothing changed."""


@contextlib.contextmanager
def retaining(versions: int) -> Iterator[None]:
    """Publish with `versions` retained within this block (how `keyroute pipeline build --retain N`
    reaches `publish` through `keyroute.pipeline.build.build`, which does not take the option itself)."""
    if versions < 1:
        raise ValueError(f"at least 1 version must be retained, got {versions}")
    token = _retain.set(versions)
    try:
        yield
    finally:
        _retain.reset(token)


def retained_after(before: StoreRecord | None, new: StoreRecord, retain: int) -> dict[int, str]:
    """The versions retained once `new` is current: `new`, the version it replaces (the natural rollback
    target, even when older than others, e.g. after a rollback), then the newest of the rest; `retain`
    in all."""
    if before is None:
        return {new.version: new.snapshot}
    candidates = {**before.retained, before.version: before.snapshot}
    candidates.pop(new.version, None)
    order = [before.version] + sorted((v for v in candidates if v != before.version), reverse=True)
    kept = {new.version: new.snapshot}
    for version in order[: max(0, retain - 1)]:
        kept[version] = candidates[version]
    return kept


@dataclass(frozen=True, slots=True)
class PublishedStore:
    """What ZooKeeper holds for a store before this build: its record and znode version (for the swap)."""

    record: StoreRecord
    znode_version: int


def read_published(client: KazooClient, store: str) -> PublishedStore | None:
    """The store as currently published, or None for a store never published."""
    try:
        raw, stat = client.get(zk_layout.store_path(store))
    except NoNodeError:
        return None
    except KazooException as exc:
        raise PublishError(store, f"cannot read its record from ZooKeeper: {describe(exc)}") from exc
    try:
        return PublishedStore(StoreRecord.from_json(raw), _znode_version(stat))
    except RecordError as exc:
        raise PublishError(store, f"its record in ZooKeeper is unreadable ({exc}); fix or delete it") from exc


def check_colocation(client: KazooClient, spec: Spec) -> None:
    """Refuse a store co-located with a store outside the spec that is not published, or whose published
    partition count or partitioner differ from its own (stores of the spec were checked with the spec)."""
    names = {store.name for store in spec.stores}
    for store in spec.stores:
        other = store.colocate_with
        if other is None or other in names:
            continue
        found = read_published(client, other)
        if found is None:
            raise SpecError(
                store.name, f"'colocate_with' = {other!r}: no such store in the spec or published in ZooKeeper"
            )
        problem = colocation_mismatch(store, found.record.partitions, found.record.partitioner)
        if problem is not None:
            raise SpecError(store.name, problem)


def check_shape(store: StoreSpec, published: PublishedStore | None) -> None:
    """Refuse a spec that would route keys differently from the published store (a first version is free)."""
    if published is None:
        return
    record = published.record
    changes = [
        (what, before, after)
        for what, before, after in (
            ("partitions", record.partitions, store.partitions),
            ("partitioner", record.partitioner.value, store.partitioner.value),
            ("key_format", record.key_format.value, store.key_format.value),
            ("key schema id", _key_schema_id(record.key_schema), _key_schema_id(store.key_schema)),
            ("kind", "value" if record.timeline is None else record.timeline.kind.value, store_kind(store).value),
        )
        if before != after
    ]
    if changes:
        listed = "; ".join(
            f"{what} is {before!r} in ZooKeeper but {after!r} in the spec" for what, before, after in changes
        )
        raise PublishError(
            store.name,
            f"cannot publish: {listed}. Changing these moves keys to other partitions; "
            "publish under a new store name instead",
        )


def store_record(store: StoreSpec, written: WrittenVersion, published_at: float | None = None) -> StoreRecord:
    return StoreRecord(
        name=store.name,
        partitions=store.partitions,
        partitioner=store.partitioner,
        key_format=store.key_format,
        key_schema=store.key_schema,
        version=written.version,
        snapshot=str(written.snapshot),
        value_columns=written.manifest.value_columns,
        replication_factor=store.replication_factor,
        published_at=time.time() if published_at is None else published_at,
        live=written.manifest.live is not None,
        timeline=written.manifest.timeline,
        ttl=None if store.ttl is None else Ttl.parse(store.ttl, store.order_by),
        colocate_with=store.colocate_with,
    )


def _key_schema_id(schema: KeySchema | None) -> int | None:
    return None if schema is None else schema.schema_id


def store_kind(store: StoreSpec) -> StoreKind:
    """What the store keeps per key: one value (modes latest, aggregate), its history, or its windows."""
    if store.mode is Mode.HISTORY:
        return StoreKind.HISTORY
    if store.mode is Mode.WINDOWED:
        return StoreKind.WINDOWED
    return StoreKind.VALUE


def publish(
    client: KazooClient,
    versions: Sequence[tuple[StoreSpec, WrittenVersion]],
    published: Mapping[str, PublishedStore | None],
    retain: int | None = None,
) -> list[StoreRecord]:
    """Publish every version in one ZooKeeper transaction: all stores switch, or none does.

    `published` is what the build saw before it started; if any store record changed since (another
    build published), the transaction fails instead of overwriting the newer version. Each record
    retains `retain` versions (default: the `retaining` block's, else DEFAULT_RETAIN); snapshot
    directories of versions no longer retained are removed after the commit.
    """
    keep = _retain.get() if retain is None else retain
    if keep < 1:
        raise PublishError(None, f"at least 1 version must be retained, got {keep}")
    transaction = client.transaction()
    records = []
    owners: list[str] = []  # the store of each operation in the transaction, in order
    dropped: list[tuple[str, int, str]] = []
    now = time.time()
    for store, written in versions:
        before = published.get(store.name)
        check_shape(store, before)
        if before is not None and written.version <= before.record.version:
            raise PublishError(
                store.name,
                f"version {written.version} is not newer than published version {before.record.version}",
            )
        record = store_record(store, written, now)
        old = before.record if before is not None else None
        record = dataclasses.replace(record, retained=retained_after(old, record, keep))
        if old is not None:
            previous = {**old.retained, old.version: old.snapshot}
            dropped += [(store.name, v, path) for v, path in previous.items() if v not in record.retained]
        path = zk_layout.store_path(store.name)
        if before is None:
            transaction.create(path, record.to_json())
            owners.append(store.name)
            # Published again after a `store delete`: the new record supersedes the tombstone, which goes
            # in the same transaction (nodes drop nothing of it then: they load the new version).
            tombstone = _tombstone_version(client, store.name)
            if tombstone is not None:
                transaction.delete(zk_layout.deleted_path(store.name), version=tombstone)
                owners.append(store.name)
        else:
            transaction.set_data(path, record.to_json(), version=before.znode_version)
            owners.append(store.name)
        records.append(record)
    try:
        results = transaction.commit()
    except KazooException as exc:
        names = ", ".join(repr(store.name) for store, _ in versions)
        raise PublishError(None, f"stores {names}: publishing in ZooKeeper failed ({exc!r})") from exc
    failures = [
        (name, result)
        for name, result in zip(owners, results, strict=True)
        if isinstance(result, Exception) and not isinstance(result, RolledBackError)
    ]
    if failures:
        name, result = failures[0]
        raise PublishError(
            name,
            f"its record changed in ZooKeeper while this build ran ({type(result).__name__}); "
            "nothing was published, run the build again",
        )
    for store_name, version, snapshot in dropped:
        remove_snapshot(store_name, version, snapshot)
    return records


def remove_snapshot(store: str, version: int, snapshot: str) -> bool:
    """Remove a version's snapshot directory that is no longer retained (a local directory or a location on
    a pyarrow filesystem). Only a version whose manifest names this store and version is removed; anything
    else is left alone (and logged)."""
    try:
        where = resolve_location(snapshot)
        manifest = read_manifest(where)
    except (SnapshotError, OSError) as exc:
        log.info("store %r: not removing version %d at %s (%s)", store, version, snapshot, describe(exc))
        return False
    if (manifest.store, manifest.version) != (store, version):
        log.warning(
            "store %r: %s holds %s v%d, not removing it", store, snapshot, manifest.store, manifest.version
        )
        return False
    log.info("store %r: version %d is no longer retained; removing %s", store, version, snapshot)
    if isinstance(where, Path):
        shutil.rmtree(where, ignore_errors=True)
        return True
    try:
        where.delete()
    except OSError as exc:
        log.warning("store %r: removing version %d at %s failed (%s)", store, version, snapshot, describe(exc))
        return False
    return True


def list_stores(client: KazooClient) -> list[StoreRecord]:
    """Every published store, by name."""
    try:
        names = sorted(client.get_children(zk_layout.STORES))
    except NoNodeError:
        return []
    except KazooException as exc:
        raise PublishError(None, f"cannot list stores in ZooKeeper: {exc!r}") from exc
    records = []
    for name in names:
        found = read_published(client, name)
        if found is not None:
            records.append(found.record)
    return records


def rollback(client: KazooClient, store: str, version: int, verify: bool = True) -> StoreRecord:
    """Make retained `version` the current version of `store` again; returns the record published.

    Refused (RollbackError, nothing written) for an unknown store or a version that is not retained;
    with `verify`, also when the version's snapshot has no readable manifest for that store and version.
    The retained set is unchanged, so a rollback can itself be undone. Routers keep answering from the
    version being left until nodes serve the rolled-back one (nodes reuse its files while they have them).
    """
    found = read_published(client, store)
    if found is None:
        raise RollbackError(store, "no such store is published")
    current = found.record
    snapshot = current.snapshot_of(version)
    if snapshot is None:
        listed = ", ".join(str(v) for v in current.retained_versions)
        raise RollbackError(
            store,
            f"version {version} is not retained (retained versions: {listed}; current: {current.version})",
        )
    if version == current.version:
        return current
    value_columns = current.value_columns
    if verify:
        try:
            manifest = read_manifest(snapshot)
        except SnapshotError as exc:
            raise RollbackError(
                store,
                f"version {version} cannot be verified at {snapshot}: {exc} (--no-verify skips this check)",
            ) from exc
        if (manifest.store, manifest.version, manifest.partitions) != (store, version, current.partitions):
            raise RollbackError(
                store,
                f"the snapshot at {snapshot} holds {manifest.store!r} v{manifest.version} with "
                f"{manifest.partitions} partitions, not v{version} with {current.partitions}",
            )
        value_columns = manifest.value_columns
    retained = {**current.retained, current.version: current.snapshot}
    record = dataclasses.replace(
        current,
        version=version,
        snapshot=snapshot,
        value_columns=value_columns,
        published_at=time.time(),
        retained=retained,
    )
    try:
        client.set(zk_layout.store_path(store), record.to_json(), version=found.znode_version)
    except BadVersionError as exc:
        raise RollbackError(
            store, "its record changed in ZooKeeper meanwhile; nothing was changed, retry"
        ) from exc
    except KazooException as exc:
        raise RollbackError(store, f"writing its record in ZooKeeper failed ({describe(exc)})") from exc
    return record


def delete_store(client: KazooClient, store: str) -> dict[str, object]:
    """Delete `store`: in one transaction its record goes and its tombstone (/deleted/{store}: the versions
    deleted and when) is written. Only a tombstone makes nodes drop a store's partitions and files; the
    controller drops it from the assignment (and its placement record) as for any store without a record.
    Snapshots in the output location stay. Publishing the store again removes the tombstone. Returns the
    tombstone. Refused (DeleteError, nothing written) for a store that is not published."""
    found = read_published(client, store)
    if found is None:
        raise DeleteError(store, "no such store is published (`keyroute store list` shows the stores)")
    record = found.record
    tombstone: dict[str, object] = {
        "store": store,
        "deleted_at": time.time(),
        "version": record.version,
        "versions": sorted({record.version, *record.retained}),
    }
    data = json.dumps(tombstone, sort_keys=True).encode()
    transaction = client.transaction()
    transaction.delete(zk_layout.store_path(store), version=found.znode_version)
    existing = _tombstone_version(client, store)
    if existing is not None:
        # Deleted and created again (not rewritten): watchers see tombstones through /deleted's listing.
        transaction.delete(zk_layout.deleted_path(store), version=existing)
    transaction.create(zk_layout.deleted_path(store), data)
    try:
        results = transaction.commit()
    except KazooException as exc:
        raise DeleteError(store, f"writing its tombstone in ZooKeeper failed ({exc!r})") from exc
    if any(isinstance(result, Exception) for result in results):
        raise DeleteError(store, "its record changed in ZooKeeper meanwhile; nothing was changed, retry")
    return tombstone


def _tombstone_version(client: KazooClient, store: str) -> int | None:
    """The znode version of the store's tombstone, or None when it has none."""
    try:
        stat = client.exists(zk_layout.deleted_path(store))
    except KazooException as exc:
        raise PublishError(store, f"cannot read its tombstone from ZooKeeper: {exc!r}") from exc
    return None if stat is None else _znode_version(stat)


def describe_store(record: StoreRecord) -> dict[str, object]:
    """One line of `keyroute store list`."""
    return {
        "store": record.name,
        "version": record.version,
        "snapshot": record.snapshot,
        "published_at": record.published_at,
        "partitions": record.partitions,
        "replication_factor": record.replication_factor,
        "live": record.live,
        "retained": {str(v): record.snapshot_of(v) for v in record.retained_versions},
    }


def _znode_version(stat: ZnodeStat) -> int:
    return int(stat.version)
