"""Publishing written versions: the StoreRecord at /stores/{store} in ZooKeeper, all stores at once.

A store's routing shape (partitions, partitioner, key format) can never change under a published store.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NoNodeError, RolledBackError
from kazoo.protocol.states import ZnodeStat

from keyroute_core import zk_layout
from keyroute_core.partition_map import RecordError, StoreRecord
from pipeline.errors import PublishError
from pipeline.spec import StoreSpec
from pipeline.writer import WrittenVersion


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
        raise PublishError(store, f"cannot read its record from ZooKeeper: {exc!r}") from exc
    try:
        return PublishedStore(StoreRecord.from_json(raw), _znode_version(stat))
    except RecordError as exc:
        raise PublishError(store, f"its record in ZooKeeper is unreadable ({exc}); fix or delete it") from exc


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
        version=written.version,
        snapshot=str(written.snapshot),
        value_columns=written.manifest.value_columns,
        replication_factor=store.replication_factor,
        published_at=time.time() if published_at is None else published_at,
    )


def publish(
    client: KazooClient,
    versions: Sequence[tuple[StoreSpec, WrittenVersion]],
    published: Mapping[str, PublishedStore | None],
) -> list[StoreRecord]:
    """Publish every version in one ZooKeeper transaction: all stores switch, or none does.

    `published` is what the build saw before it started; if any store record changed since (another
    build published), the transaction fails instead of overwriting the newer version.
    """
    transaction = client.transaction()
    records = []
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
        path = zk_layout.store_path(store.name)
        if before is None:
            transaction.create(path, record.to_json())
        else:
            transaction.set_data(path, record.to_json(), version=before.znode_version)
        records.append(record)
    try:
        results = transaction.commit()
    except KazooException as exc:
        names = ", ".join(repr(store.name) for store, _ in versions)
        raise PublishError(None, f"stores {names}: publishing in ZooKeeper failed ({exc!r})") from exc
    failures = [
        (store.name, result)
        for (store, _), result in zip(versions, results, strict=True)
        if isinstance(result, Exception) and not isinstance(result, RolledBackError)
    ]
    if failures:
        name, result = failures[0]
        raise PublishError(
            name,
            f"its record changed in ZooKeeper while this build ran ({type(result).__name__}); "
            "nothing was published, run the build again",
        )
    return records


def _znode_version(stat: ZnodeStat) -> int:
    return int(stat.version)
