"""Cross-checks keyroute.keys.partitioner against independent implementations on generated keys.

kafka-python's murmur2 and DefaultPartitioner are the oracle; its murmur2 returns an unsigned 32-bit int.
"""

from __future__ import annotations

import math
import random
import warnings
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from keyroute.keys.partitioner import Partitioner, crc32, fnv1a_32, murmur2, partition_for

with warnings.catch_warnings():
    # kafka-python 3.0 loads its protocol schemas through importlib.resources' legacy API, deprecated since
    # Python 3.11, and the project turns warnings into errors.
    warnings.filterwarnings("ignore", r"\w+ is deprecated\. Use files\(\) instead", DeprecationWarning)
    from kafka.partitioner.default import DefaultPartitioner
    from kafka.partitioner.default import murmur2 as kafka_python_murmur2

EXAMPLES = settings(max_examples=300, deadline=None)
# Small counts are where real topics live; the full int32 range catches sign and overflow slips.
partition_counts = st.integers(1, 1000) | st.integers(1, (1 << 31) - 1)


class _OneTopicCluster:
    """Just enough of kafka-python's ClusterMetadata for DefaultPartitioner.partition."""

    def __init__(self, partitions: int) -> None:
        self._partitions = set(range(partitions))

    def topics(self) -> set[str]:
        return {"t"}

    def partitions_for_topic(self, topic: str) -> set[int]:
        return self._partitions

    def available_partitions_for_topic(self, topic: str) -> set[int]:
        return self._partitions


def _signed32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


def test_murmur2_matches_kafka_python_at_every_length() -> None:
    # Every length 0..259 walks each tail case (len % 4) over many block counts.
    rng = random.Random(20240229)
    for length in range(260):
        data = rng.randbytes(length)
        assert murmur2(data) == _signed32(kafka_python_murmur2(data)), length


@EXAMPLES
@given(st.binary(max_size=64))
def test_murmur2_matches_kafka_python_short(data: bytes) -> None:
    assert murmur2(data) == _signed32(kafka_python_murmur2(data))


@EXAMPLES
@given(st.binary(min_size=65, max_size=4096))
def test_murmur2_matches_kafka_python_long(data: bytes) -> None:
    assert murmur2(data) == _signed32(kafka_python_murmur2(data))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=128), st.integers(min_value=1, max_value=2000))
def test_murmur2_partition_matches_kafka_python_default_partitioner(data: bytes, partitions: int) -> None:
    expected = DefaultPartitioner().partition("t", data, data, None, None, _OneTopicCluster(partitions))
    assert partition_for(Partitioner.MURMUR2, data, partitions) == expected


@EXAMPLES
@given(st.binary(max_size=256), partition_counts)
def test_crc32_partition_is_zlib_crc32_mod_n(data: bytes, partitions: int) -> None:
    assert crc32(data) == zlib.crc32(data)
    assert partition_for(Partitioner.CRC32, data, partitions) == zlib.crc32(data) % partitions


@EXAMPLES
@given(st.binary(max_size=256), partition_counts)
def test_fnv1a_partition_follows_go_truncated_remainder(data: bytes, partitions: int) -> None:
    # Literal Sarama: int32(h) % n with Go's sign-of-dividend remainder, then negate if negative.
    # fmod is exact here since both operands are below 2**53.
    remainder = int(math.fmod(_signed32(fnv1a_32(data)), partitions))
    assert partition_for(Partitioner.FNV1A, data, partitions) == (-remainder if remainder < 0 else remainder)


@EXAMPLES
@given(st.sampled_from(list(Partitioner)), st.binary(max_size=64), partition_counts)
def test_partition_is_in_range(partitioner: Partitioner, data: bytes, partitions: int) -> None:
    assert 0 <= partition_for(partitioner, data, partitions) < partitions
