"""`colocate_with` in the spec: a store placed with another of the same partition count and partitioner;
any other pairing is a SpecError naming the store and both shapes; the record carries the link and the
partition map shows the group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from keyroute.cluster.colocation import colocation_groups
from keyroute.cluster.partition_map import Assignment, PartitionMap, StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.pipeline.errors import SpecError
from keyroute.pipeline.publish import check_colocation
from keyroute.pipeline.spec import load_spec
from tests.unit.pipeline.test_spec import spec_error, write_spec

TWO = """
[stores.profile]
source = "p.json"
format = "json"
key = "customer_id"
partitions = 8
mode = "latest"
order_by = "ts"

[stores.balance]
source = "b.json"
format = "json"
key = "customer_id"
partitions = {partitions}
partitioner = "{partitioner}"
mode = "aggregate"
aggregations = {{ n = "count(*)" }}
colocate_with = "{target}"
"""


def test_a_store_is_colocated_with_one_of_its_shape(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, TWO.format(partitions=8, partitioner="murmur2", target="profile")))
    assert {s.name: s.colocate_with for s in spec.stores} == {"profile": None, "balance": "profile"}


@pytest.mark.parametrize(
    ("partitions", "partitioner", "target", "says"),
    [
        (4, "murmur2", "profile", "that store has 8 partitions (murmur2), this one 4 (murmur2)"),
        (8, "crc32", "profile", "that store has 8 partitions (murmur2), this one 8 (crc32)"),
        (8, "murmur2", "balance", "names the store itself"),
    ],
)
def test_a_store_of_another_shape_is_refused(
    tmp_path: Path, partitions: int, partitioner: str, target: str, says: str
) -> None:
    error = spec_error(tmp_path, TWO.format(partitions=partitions, partitioner=partitioner, target=target))
    assert "balance" in str(error) and says in str(error), str(error)


def test_the_record_carries_the_link_and_the_map_shows_the_group() -> None:
    def record(name: str, link: str | None) -> StoreRecord:
        return StoreRecord(name, 2, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/x", colocate_with=link)

    records = {"a": record("a", None), "b": record("b", "a"), "c": record("c", None)}
    assert StoreRecord.from_json(records["b"].to_json()) == records["b"]
    view = PartitionMap.build(records, {}, Assignment(1, {}), {}).describe(now=0.0)
    assert view["stores"]["b"]["colocate_with"] == "a"
    assert view["stores"]["a"]["colocation_group"] == view["stores"]["b"]["colocation_group"] == "a"
    assert "colocation_group" not in view["stores"]["c"]
    assert colocation_groups({n: r.colocate_with for n, r in records.items()}) == {"a": "a", "b": "a"}


class _Records:
    """A stand-in ZooKeeper client holding published store records (only `get`, as read_published uses it)."""

    def __init__(self, records: dict[str, StoreRecord]) -> None:
        self.records = records

    def get(self, path: str) -> tuple[bytes, Any]:
        from kazoo.exceptions import NoNodeError
        from kazoo.protocol.states import ZnodeStat

        name = path.rsplit("/", 1)[-1]
        if name not in self.records:
            raise NoNodeError(path)
        return self.records[name].to_json(), ZnodeStat(0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0)


def test_a_store_colocated_with_a_published_store_is_checked_against_its_record(tmp_path: Path) -> None:
    alone = TWO.format(partitions=8, partitioner="murmur2", target="elsewhere")
    alone = alone[alone.index("[stores.balance]") :]
    spec = load_spec(write_spec(tmp_path, alone))
    published = StoreRecord("elsewhere", 8, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/x")
    check_colocation(_Records({"elsewhere": published}), spec)  # type: ignore[arg-type]
    other = StoreRecord("elsewhere", 6, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/x")
    with pytest.raises(SpecError, match="that store has 6 partitions"):
        check_colocation(_Records({"elsewhere": other}), spec)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="no such store in the spec or published"):
        check_colocation(_Records({}), spec)  # type: ignore[arg-type]
