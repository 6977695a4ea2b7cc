"""keyroute.pipeline.publish, pipeline.writer and pipeline.build without Spark or ZooKeeper: the decisions alone.

Shape checks, version numbering, the record published, and a bad spec failing before anything starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.pipeline import build as build_module
from keyroute.pipeline.build import PublishedVersion, build
from keyroute.pipeline.errors import PublishError, SpecError
from keyroute.pipeline.publish import PublishedStore, check_shape, store_record
from keyroute.pipeline.spec import Mode, SourceFormat, StoreSpec
from keyroute.pipeline.writer import WrittenVersion, next_version, version_snapshot
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.snapshot import Manifest

STORE = StoreSpec(
    name="bookings",
    source="/data/events",
    format=SourceFormat.JSON,
    key="customer_id",
    partitions=12,
    mode=Mode.LATEST,
    order_by="ts",
    replication_factor=2,
)


def published(**changes: object) -> PublishedStore:
    fields = dict(
        name="bookings",
        partitions=12,
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.STRING,
        version=3,
        snapshot="/out/bookings/v000003",
    )
    fields.update(changes)
    return PublishedStore(StoreRecord(**fields), znode_version=0)  # type: ignore[arg-type]


def test_first_version_may_have_any_shape() -> None:
    check_shape(STORE, None)


def test_same_shape_may_publish_again() -> None:
    check_shape(STORE, published(replication_factor=5, value_columns=("other",)))


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"partitions": 6}, "partitions is 6 in ZooKeeper but 12 in the spec"),
        ({"partitioner": Partitioner.CRC32}, "partitioner is 'crc32' in ZooKeeper but 'murmur2' in the spec"),
        ({"key_format": KeyFormat.UUID}, "key_format is 'uuid' in ZooKeeper but 'string' in the spec"),
    ],
)
def test_a_changed_routing_shape_is_refused(changes: dict[str, object], named: str) -> None:
    with pytest.raises(PublishError) as err:
        check_shape(STORE, published(**changes))
    assert str(err.value).startswith(f"store 'bookings': cannot publish: {named}.")


def test_store_record_carries_what_nodes_and_routers_need(tmp_path: Path) -> None:
    manifest = Manifest(
        store="bookings",
        version=4,
        partitions=12,
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.STRING,
        value_columns=("ts", "fare"),
        rows=(1,) * 12,
    )
    written = WrittenVersion("bookings", 4, tmp_path / "bookings" / "v000004", manifest)
    record = store_record(STORE, written, published_at=123.0)
    assert record == StoreRecord(
        name="bookings",
        partitions=12,
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.STRING,
        version=4,
        snapshot=str(tmp_path / "bookings" / "v000004"),
        value_columns=("ts", "fare"),
        replication_factor=2,
        published_at=123.0,
    )


def test_next_version_is_past_disk_and_zookeeper(tmp_path: Path) -> None:
    output = str(tmp_path)
    assert next_version(output, "bookings", None) == 1
    assert next_version(output, "bookings", 7) == 8
    for name in ("v000002", "v000009", "vx", "notes"):
        (tmp_path / "bookings" / name).mkdir(parents=True)
    assert next_version(output, "bookings", None) == 10
    assert next_version(output, "bookings", 12) == 13
    assert next_version(tmp_path.as_uri(), "bookings", None) == 10


def test_a_version_lives_under_any_output() -> None:
    assert version_snapshot("s3a://bucket/out", "bookings", 1) == "s3a://bucket/out/bookings/v000001"
    assert version_snapshot("file:///out", "bookings", 2) == "/out/bookings/v000002"


def test_published_version_describes_itself() -> None:
    version = PublishedVersion(
        store="bookings", version=2, snapshot="/out/bookings/v000002", rows=10, partitions=4
    )
    assert version.describe() == {
        "store": "bookings",
        "version": 2,
        "snapshot": "/out/bookings/v000002",
        "rows": 10,
        "partitions": 4,
        "live": False,
    }
    live = PublishedVersion(
        store="clicks", version=3, snapshot="/out/clicks/v000003", rows=0, partitions=2, live_offsets=(5, 0)
    )
    assert live.describe() == {
        "store": "clicks",
        "version": 3,
        "snapshot": "/out/clicks/v000003",
        "rows": 0,
        "partitions": 2,
        "live": True,
        "live_offsets": [5, 0],
    }


def test_a_bad_spec_fails_before_zookeeper_or_spark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("must not be reached")

    monkeypatch.setattr(build_module, "connect", forbidden)
    monkeypatch.setattr(build_module, "create_session", forbidden)
    spec = tmp_path / "stores.toml"
    spec.write_text(
        '[stores.bookings]\nsource = "x"\nformat = "json"\nkey = "k"\npartitions = 0\nmode = "latest"\n'
        'order_by = "ts"\n'
    )
    with pytest.raises(SpecError) as err:
        build(spec, ZkSettings(hosts="127.0.0.1:1"), str(tmp_path / "out"))
    assert str(err.value) == "store 'bookings': 'partitions' must be an integer of at least 1, got 0"


def test_a_format_1_store_with_a_remote_output_fails_before_zookeeper_or_spark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build_module, "connect", lambda *a, **k: pytest.fail("must not connect"))
    spec = tmp_path / "stores.toml"
    spec.write_text(
        '[stores.bookings]\nsource = "x"\nformat = "json"\nkey = "k"\npartitions = 2\nmode = "latest"\n'
        'order_by = "ts"\nsnapshot_format = 1\n'
    )
    with pytest.raises(PublishError) as err:
        build(spec, ZkSettings(hosts="127.0.0.1:1"), "s3a://bucket/out")
    assert str(err.value).startswith(
        "store 'bookings': snapshot_format 1 is written to local paths or file:// URIs only, not 's3a://bucket/out'"
    )


def test_an_output_no_filesystem_writes_fails_before_zookeeper_or_spark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build_module, "connect", lambda *a, **k: pytest.fail("must not connect"))
    spec = tmp_path / "stores.toml"
    spec.write_text(
        '[stores.bookings]\nsource = "x"\nformat = "json"\nkey = "k"\npartitions = 2\nmode = "latest"\n'
        'order_by = "ts"\n'
    )
    with pytest.raises(PublishError) as err:
        build(spec, ZkSettings(hosts="127.0.0.1:1"), "nosuchfs://bucket/out")
    assert str(err.value).startswith("stores 'bookings': snapshot location 'nosuchfs://bucket/out'")


def test_a_changed_key_schema_id_is_refused() -> None:
    import dataclasses

    from keyroute.keys.key_schema import KeySchema

    old, new = (KeySchema(KeyFormat.AVRO, n, '"string"') for n in (7, 8))
    store = dataclasses.replace(STORE, key_format=KeyFormat.AVRO, key_schema=new)
    check_shape(store, published(key_format=KeyFormat.AVRO, key_schema=new))
    with pytest.raises(PublishError) as err:
        check_shape(store, published(key_format=KeyFormat.AVRO, key_schema=old))
    assert "key schema id is 7 in ZooKeeper but 8 in the spec" in str(err.value)
