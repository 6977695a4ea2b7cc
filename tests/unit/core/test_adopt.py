"""`keyroute store adopt`'s core: which versions under an output location are complete, and what it writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from keyroute.cli.adopt import AdoptError, adopt, stores_in
from keyroute.cluster import zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.key_schema import KeySchema
from keyroute.keys.partitioner import Partitioner
from keyroute.storage import snapshot as snapshot_module
from keyroute.storage.snapshot import FORMAT_2, Manifest, data_file, version_dir, version_name, write_manifest
from tests.memory_fs import memory_filesystem


class Stat:
    def __init__(self, version: int) -> None:
        self.version = version


class FakeZk:
    """get/create/set with znode versions, on a dict."""

    def __init__(self) -> None:
        self.nodes: dict[str, tuple[bytes, int]] = {}

    def get(self, path: str) -> tuple[bytes, Any]:
        if path not in self.nodes:
            raise NoNodeError(path)
        data, version = self.nodes[path]
        return data, Stat(version)

    def create(self, path: str, data: bytes, makepath: bool = False) -> str:
        if path in self.nodes:
            raise NodeExistsError(path)
        self.nodes[path] = (data, 0)
        return path

    def set(self, path: str, data: bytes, version: int = -1) -> None:
        if self.nodes[path][1] != version:
            raise BadVersionError(path)
        self.nodes[path] = (data, version + 1)

    def exists(self, path: str) -> Stat | None:
        return Stat(self.nodes[path][1]) if path in self.nodes else None

    def transaction(self) -> FakeTransaction:
        return FakeTransaction(self)

    def record(self, store: str) -> StoreRecord:
        return StoreRecord.from_json(self.nodes[zk_layout.store_path(store)][0])


class FakeTransaction:
    """create/delete applied together at commit, or not at all (kazoo's results: an exception per failed op)."""

    def __init__(self, zk: FakeZk) -> None:
        self.zk = zk
        self.ops: list[tuple[str, str, bytes, int]] = []

    def create(self, path: str, data: bytes) -> None:
        self.ops.append(("create", path, data, -1))

    def delete(self, path: str, version: int = -1) -> None:
        self.ops.append(("delete", path, b"", version))

    def commit(self) -> list[object]:
        nodes = dict(self.zk.nodes)
        for op, path, data, version in self.ops:
            if op == "create":
                if path in nodes:
                    return [NodeExistsError(path)]
                nodes[path] = (data, 0)
            else:
                if path not in nodes or version not in (-1, nodes[path][1]):
                    return [BadVersionError(path)]
                del nodes[path]
        self.zk.nodes = nodes
        return [True] * len(self.ops)


def write_version(
    output: Path,
    store: str,
    version: int,
    partitions: int = 2,
    key_format: KeyFormat = KeyFormat.STRING,
    key_schema: KeySchema | None = None,
) -> Path:
    """A format-2 version: one data file per partition of a few bytes, and its manifest."""
    where = version_dir(str(output), store, version)
    sizes = {}
    for p in range(partitions):
        path = where / data_file(p)
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x" * (p + 3))
        sizes[p] = p + 3
    manifest = Manifest(
        store,
        version,
        partitions,
        Partitioner.MURMUR2,
        key_format,
        ("v",),
        (1,) * partitions,
        files={p: (data_file(p),) for p in range(partitions)},
        format=FORMAT_2,
        checksums={p: "crc32:00000000" for p in range(partitions)},
        bytes=sizes,
        key_schema=key_schema,
    )
    write_manifest(where, manifest)
    return where


def test_the_newest_complete_version_is_current_and_the_next_newest_retained(tmp_path: Path) -> None:
    for version in (1, 2, 3, 4):
        write_version(tmp_path, "fares", version)
    (version_dir(str(tmp_path), "fares", 5) / "partition=0").mkdir(parents=True)  # no manifest: unfinished
    (write_version(tmp_path, "fares", 6) / data_file(1)).write_bytes(b"short")  # a file cut off
    zk = FakeZk()
    [result] = adopt(zk, str(tmp_path), retain=3, replication_factor=2, now=7.0)  # type: ignore[arg-type]
    assert (result.action, result.version, result.retained) == ("published", 4, [2, 3, 4])
    assert result.skipped[0].startswith("v5: no manifest")
    assert result.skipped[1] == "v6: partition 1: partition=1/data.mdb has 5 bytes, the manifest says 4"
    record = zk.record("fares")
    assert (record.version, record.replication_factor, record.published_at) == (4, 2, 7.0)
    assert record.snapshot == str(version_dir(str(tmp_path), "fares", 4))
    assert record.snapshot_of(2) == str(version_dir(str(tmp_path), "fares", 2))


def test_a_published_store_is_left_alone_unless_it_lacks_the_versions(tmp_path: Path) -> None:
    write_version(tmp_path, "fares", 1)
    write_version(tmp_path, "fares", 2)
    zk = FakeZk()
    adopt(zk, str(tmp_path))  # type: ignore[arg-type]
    [again] = adopt(zk, str(tmp_path))  # type: ignore[arg-type]
    assert (again.action, again.version, again.retained) == ("unchanged", 2, [1, 2])
    write_version(tmp_path, "fares", 3)  # built after the record a backup restored
    [newer] = adopt(zk, str(tmp_path))  # type: ignore[arg-type]
    assert (newer.action, newer.version, newer.retained) == ("extended", 3, [1, 2, 3])
    assert zk.nodes[zk_layout.store_path("fares")][1] == 1  # one write, on the version read


def test_a_rolled_back_store_keeps_its_current_version(tmp_path: Path) -> None:
    for version in (1, 2):
        write_version(tmp_path, "fares", version)
    zk = FakeZk()
    snapshot = str(version_dir(str(tmp_path), "fares", 1))
    record = StoreRecord("fares", 2, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",), retained={})
    zk.create(zk_layout.store_path("fares"), record.to_json())
    # A record that knows only version 1 (restored from a backup older than version 2): 2 becomes current.
    [result] = adopt(zk, str(tmp_path))  # type: ignore[arg-type]
    assert (result.action, result.version) == ("extended", 2)
    rolled_back = StoreRecord(
        "fares",
        2,
        Partitioner.MURMUR2,
        KeyFormat.STRING,
        1,
        snapshot,
        ("v",),
        retained={2: str(version_dir(str(tmp_path), "fares", 2))},
    )
    zk.nodes[zk_layout.store_path("fares")] = (rolled_back.to_json(), 5)  # rolled back to 1 on purpose
    [kept] = adopt(zk, str(tmp_path))  # type: ignore[arg-type]
    assert (kept.action, kept.version) == ("unchanged", 1)


def test_versions_routed_differently_and_stores_without_a_complete_version_are_skipped(tmp_path: Path) -> None:
    write_version(tmp_path, "fares", 1, partitions=4)
    write_version(tmp_path, "fares", 2, partitions=2)
    (version_dir(str(tmp_path), "empty", 1)).mkdir(parents=True)
    zk = FakeZk()
    assert stores_in(str(tmp_path)) == ["empty", "fares"]
    empty, fares = adopt(zk, str(tmp_path))  # type: ignore[arg-type]
    assert (empty.action, empty.reason) == ("skipped", "no complete version under the output location")
    assert (fares.action, fares.version, fares.retained) == ("published", 2, [2])
    assert fares.skipped == ["v1: its keys are routed differently from v2's"]
    assert zk_layout.store_path("empty") not in zk.nodes


def test_a_store_published_with_another_shape_is_left_alone(tmp_path: Path) -> None:
    write_version(tmp_path, "fares", 2, key_format=KeyFormat.INT64)
    zk = FakeZk()
    snapshot = str(tmp_path / "elsewhere")
    published = StoreRecord("fares", 2, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",))
    zk.create(zk_layout.store_path("fares"), published.to_json())
    [result] = adopt(zk, str(tmp_path))  # type: ignore[arg-type]
    assert result.action == "skipped" and "routes keys differently" in result.reason
    assert zk.record("fares") == published


def test_an_output_without_versions_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AdoptError, match="no store versions found under"):
        adopt(FakeZk(), str(tmp_path))  # type: ignore[arg-type]
    with pytest.raises(AdoptError, match="is not a directory"):
        adopt(FakeZk(), str(tmp_path / "missing"))  # type: ignore[arg-type]


def test_a_deleted_store_is_adopted_only_when_named_and_its_tombstone_goes_with_it(tmp_path: Path) -> None:
    write_version(tmp_path, "fares", 1)
    write_version(tmp_path, "trips", 1)
    zk = FakeZk()
    zk.nodes[zk_layout.deleted_path("fares")] = (b'{"store": "fares", "version": 1}', 0)
    results = {r.store: r for r in adopt(zk, str(tmp_path), now=1.0)}  # type: ignore[arg-type]
    assert results["fares"].action == "skipped" and "tombstone" in results["fares"].reason
    assert zk_layout.store_path("fares") not in zk.nodes
    assert results["trips"].action == "published"
    [named] = adopt(zk, str(tmp_path), ["fares"], now=2.0)  # type: ignore[arg-type]
    assert (named.action, named.version) == ("published", 1)
    assert zk.record("fares").version == 1
    assert zk_layout.deleted_path("fares") not in zk.nodes


def test_a_pyarrow_filesystem_is_adopted_from_as_a_local_path_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same versions, complete and not, copied to an in-memory pyarrow filesystem: the same decisions."""
    for version in (1, 2, 3):
        write_version(tmp_path, "fares", version)
    (write_version(tmp_path, "fares", 4) / data_file(0)).write_bytes(b"cu")  # a file cut off
    (write_version(tmp_path, "fares", 5) / data_file(1)).unlink()  # a file missing
    filesystem = memory_filesystem()
    for path in tmp_path.rglob("*"):
        if path.is_file():
            with filesystem.open_output_stream(f"bucket/out/{path.relative_to(tmp_path).as_posix()}") as out:
                out.write(path.read_bytes())
    real = snapshot_module._arrow_from_uri
    monkeypatch.setattr(
        snapshot_module,
        "_arrow_from_uri",
        lambda uri: (filesystem, uri[len("mock://") :]) if uri.startswith("mock://") else real(uri),
    )
    output = "mock://bucket/out"
    assert stores_in(output) == ["fares"]
    zk = FakeZk()
    [result] = adopt(zk, output, retain=2)  # type: ignore[arg-type]
    assert (result.action, result.version, result.retained) == ("published", 3, [2, 3])
    assert result.skipped == [
        "v4: partition 0: partition=0/data.mdb has 2 bytes, the manifest says 3",
        "v5: partition 1: partition=1/data.mdb is missing",
    ]
    assert zk.record("fares").snapshot == f"{output}/fares/{version_name(3)}"


def test_a_store_of_schema_registry_keys_is_adopted_with_its_key_schema(tmp_path: Path) -> None:
    old, new = KeySchema(KeyFormat.AVRO, 5, '"string"'), KeySchema(KeyFormat.AVRO, 6, '"string"')
    write_version(tmp_path, "fares", 1, key_format=KeyFormat.AVRO, key_schema=old)
    write_version(tmp_path, "fares", 2, key_format=KeyFormat.AVRO, key_schema=new)
    zk = FakeZk()
    [result] = adopt(zk, str(tmp_path))  # type: ignore[arg-type]
    # Version 1's keys were framed with another schema id: routed differently, so not retained.
    assert (result.action, result.version, result.retained) == ("published", 2, [2])
    assert result.skipped == ["v1: its keys are routed differently from v2's"]
    assert zk.record("fares").key_schema == new
