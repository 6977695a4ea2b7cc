"""`keyroute store adopt`: publish again the versions an output location still holds, into an empty or rebuilt
ZooKeeper, without running the pipeline.

The pipeline writes each version to `{output}/{store}/v{version:06d}/` and its manifest last
(`keyroute.storage.snapshot`), so a version with a readable manifest naming that store and version, whose data
files are all there at the sizes the manifest records, is complete; anything else is skipped (and said). Of a
store's complete versions the newest becomes current and the next newest are retained for a rollback, as the
pipeline would have left them. A store already published keeps its record unless that record lacks those
versions: then they are added to what it retains, and the newest becomes current only when it is newer than
every version the record knows (a record from a backup older than the last build). Nothing here needs Spark.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NoNodeError

from keyroute.cluster import zk_layout
from keyroute.cluster.partition_map import RecordError, StoreRecord
from keyroute.storage.snapshot import (
    FORMAT_2,
    Manifest,
    SnapshotError,
    data_file,
    existing_versions,
    file_sizes,
    folders,
    read_manifest,
    resolve_location,
    version_uri,
)

DEFAULT_RETAIN = 3


class AdoptError(RuntimeError):
    """Adopting was refused before anything was written (one line)."""


@dataclass(slots=True)
class Adopted:
    """What adopting did to one store: one JSON line of `keyroute store adopt`."""

    store: str
    action: str  # "published", "extended", "unchanged", "skipped"
    version: int | None = None
    retained: list[int] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    reason: str = ""

    def describe(self) -> dict[str, Any]:
        line: dict[str, Any] = {"store": self.store, "action": self.action, "version": self.version}
        line["retained"] = self.retained
        if self.skipped:
            line["skipped"] = self.skipped
        if self.reason:
            line["reason"] = self.reason
        return line


def stores_in(output: str) -> list[str]:
    """The names of the stores under `output`: folders holding at least one version folder."""
    try:
        names = folders(output)
    except (SnapshotError, OSError) as exc:
        raise AdoptError(f"output location {output} cannot be listed: {exc}") from None
    if names is None:
        raise AdoptError(f"output location {output} is not a directory")
    return [name for name in names if existing_versions(output, name)]


def verify_version(output: str, store: str, version: int) -> Manifest:
    """The manifest of a complete version; SnapshotError saying what is wrong otherwise."""
    location = version_uri(output, store, version)
    manifest = read_manifest(location)
    if (manifest.store, manifest.version) != (store, version):
        raise SnapshotError(f"its manifest names {manifest.store!r} v{manifest.version}")
    sizes = file_sizes(resolve_location(location))
    for p in range(manifest.partitions):
        names = (data_file(p),) if manifest.format == FORMAT_2 else manifest.files.get(p, ())
        for name in names:
            size = sizes.get(name)
            if size is None:
                raise SnapshotError(f"partition {p}: {name} is missing")
            if manifest.format == FORMAT_2 and size != manifest.bytes[p]:
                raise SnapshotError(f"partition {p}: {name} has {size} bytes, the manifest says {manifest.bytes[p]}")
    return manifest


def adopt(
    client: KazooClient,
    output: str,
    stores: Iterable[str] | None = None,
    *,
    retain: int = DEFAULT_RETAIN,
    replication_factor: int = 1,
    now: float | None = None,
) -> list[Adopted]:
    """Publish the complete versions under `output` of `stores` (default: every store found there)."""
    if retain < 1:
        raise AdoptError(f"at least 1 version must be retained, got {retain}")
    names = sorted(stores) if stores is not None else stores_in(output)
    if not names:
        raise AdoptError(f"no store versions found under {output} (is it the pipeline's --output?)")
    when = time.time() if now is None else now
    named = stores is not None
    return [_adopt_store(client, output, name, retain, replication_factor, when, named) for name in names]


def _adopt_store(
    client: KazooClient, output: str, store: str, retain: int, replication_factor: int, now: float, named: bool
) -> Adopted:
    result = Adopted(store, "skipped")
    tombstone = client.exists(zk_layout.deleted_path(store))
    if tombstone is not None and not named:
        # Deleted on purpose (`keyroute store delete` keeps its snapshots): adopting every store found must not
        # bring it back. Naming it with --store publishes it again, as the pipeline would.
        result.reason = "deleted by `keyroute store delete` (a tombstone); name it with --store to publish it again"
        return result
    complete: dict[int, Manifest] = {}
    for version in existing_versions(output, store):
        try:
            complete[version] = verify_version(output, store, version)
        except (SnapshotError, OSError) as exc:
            result.skipped.append(f"v{version}: {exc}")
    if not complete:
        result.reason = "no complete version under the output location"
        return result
    newest = complete[max(complete)]
    for version in sorted(complete, reverse=True):
        if _shape(complete[version]) != _shape(newest):
            result.skipped.append(f"v{version}: its keys are routed differently from v{newest.version}'s")
            del complete[version]
    chosen = sorted(complete, reverse=True)[:retain]
    found = {v: version_uri(output, store, v) for v in chosen}
    path = zk_layout.store_path(store)
    try:
        raw, stat = client.get(path)
    except NoNodeError:
        record = _record(store, newest, found, replication_factor, now)
        # The record and the removal of a tombstone in one transaction, as publishing does: nodes never see the
        # new record beside a tombstone that would make them drop it.
        transaction = client.transaction()
        transaction.create(path, record.to_json())
        if tombstone is not None:
            transaction.delete(zk_layout.deleted_path(store), version=tombstone.version)
        if any(isinstance(outcome, Exception) for outcome in transaction.commit()):
            result.reason = "its record or tombstone changed meanwhile; run adopt again"
            return result
        return _done(result, "published", record)
    try:
        current = StoreRecord.from_json(raw)
    except RecordError as exc:
        result.reason = f"its record in ZooKeeper is unreadable ({exc}); fix or delete it"
        return result
    if _shape(newest) != _published_shape(current):
        result.reason = f"its published record routes keys differently from v{newest.version}; left alone"
        return result
    known = set(current.retained_versions)
    if known >= set(found):
        return _done(result, "unchanged", current)
    retained = {**current.retained, current.version: current.snapshot}
    retained.update({v: uri for v, uri in found.items() if v not in known})
    if newest.version > max(known):
        record = _record(store, newest, retained, current.replication_factor, now)
    else:
        record = dataclasses.replace(current, retained=retained)
    try:
        client.set(path, record.to_json(), version=stat.version)
    except BadVersionError:
        result.reason = "its record changed meanwhile; run adopt again"
        return result
    return _done(result, "extended", record)


def _record(
    store: str, manifest: Manifest, snapshots: dict[int, str], replication_factor: int, now: float
) -> StoreRecord:
    return StoreRecord(
        name=store,
        partitions=manifest.partitions,
        partitioner=manifest.partitioner,
        key_format=manifest.key_format,
        version=manifest.version,
        snapshot=snapshots[manifest.version],
        value_columns=manifest.value_columns,
        replication_factor=replication_factor,
        published_at=now,
        retained=dict(snapshots),
        live=manifest.live is not None,
        timeline=manifest.timeline,
        key_schema=manifest.key_schema,
    )


def _done(result: Adopted, action: str, record: StoreRecord) -> Adopted:
    result.action = action
    result.version = record.version
    result.retained = list(record.retained_versions)
    return result


def _shape(manifest: Manifest) -> tuple[Any, ...]:
    """What must not change between versions of a store: how keys are routed, and its kind."""
    kind = None if manifest.timeline is None else manifest.timeline.kind
    key_schema_id = None if manifest.key_schema is None else manifest.key_schema.schema_id
    live = manifest.live is not None
    return (manifest.partitions, manifest.partitioner, manifest.key_format, kind, live, key_schema_id)


def _published_shape(record: StoreRecord) -> tuple[Any, ...]:
    kind = None if record.timeline is None else record.timeline.kind
    key_schema_id = None if record.key_schema is None else record.key_schema.schema_id
    return (record.partitions, record.partitioner, record.key_format, kind, record.live, key_schema_id)
