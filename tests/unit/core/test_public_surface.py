"""The shared core's public surface is deliberate: adding or removing a name is a visible change."""

from __future__ import annotations

import subprocess
import sys

import keyroute.core


def test_public_surface_is_pinned_and_sorted() -> None:
    assert keyroute.core.__all__ == sorted(keyroute.core.__all__)
    assert set(keyroute.core.__all__) == {
        "ApiError", "Assignment", "Endpoint", "HttpSettings", "Key", "KeyFormat", "KeyFormatError", "KeyLocation",
        "Manifest", "NodeRecord", "NodeSettings", "PartitionMap", "Partitioner", "RecordError", "RouterSettings",
        "ServingRecord", "SnapshotError", "StoreLocator", "StoreRecord", "ZkSettings", "crc32", "fnv1a_32",
        "key_from_data", "key_from_value", "key_hash", "murmur2", "parse_key", "partition_for", "to_positive",
    }
    for name in keyroute.core.__all__:
        assert getattr(keyroute.core, name) is not None


def test_hashing_a_key_does_not_load_zookeeper_or_spark() -> None:
    code = (
        "import sys, keyroute.core; keyroute.core.partition_for(keyroute.core.Partitioner.MURMUR2, b'k', 3); "
        "assert not [m for m in sys.modules if m.split('.')[0] in ('kazoo', 'pyspark')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
