"""keyroute's shared core: what the pipeline, the state nodes and the routers all need.

Pure values and formats are re-exported here; ZooKeeper plumbing (`zk`, `map_watcher`,
`zookeeper_server`) is imported from its module so that hashing a key never loads kazoo.
"""

from keyroute.core.api import ApiError
from keyroute.core.key_format import Key, KeyFormat, KeyFormatError, key_from_data, key_from_value, parse_key
from keyroute.core.key_location import Endpoint, KeyLocation, StoreLocator
from keyroute.core.partition_map import (
    Assignment,
    NodeRecord,
    PartitionMap,
    RecordError,
    ServingRecord,
    StoreRecord,
)
from keyroute.core.partitioner import Partitioner, crc32, fnv1a_32, key_hash, murmur2, partition_for, to_positive
from keyroute.core.settings import HttpSettings, NodeSettings, RouterSettings, ZkSettings
from keyroute.core.snapshot import Manifest, SnapshotError

__all__ = [
    "ApiError",
    "Assignment",
    "Endpoint",
    "HttpSettings",
    "Key",
    "KeyFormat",
    "KeyFormatError",
    "KeyLocation",
    "Manifest",
    "NodeRecord",
    "NodeSettings",
    "PartitionMap",
    "Partitioner",
    "RecordError",
    "RouterSettings",
    "ServingRecord",
    "SnapshotError",
    "StoreLocator",
    "StoreRecord",
    "ZkSettings",
    "crc32",
    "fnv1a_32",
    "key_from_data",
    "key_from_value",
    "key_hash",
    "murmur2",
    "parse_key",
    "partition_for",
    "to_positive",
]
