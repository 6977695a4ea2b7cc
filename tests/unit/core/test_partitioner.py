"""Pins keyroute.keys.partitioner to vectors published by Kafka, librdkafka, kafkajs, kafka-python and Sarama.

Every expected value here comes from another project's test suite, never from this implementation.
"""

from __future__ import annotations

import zlib

import pytest

from keyroute.keys.partitioner import (
    Partitioner,
    crc32,
    fnv1a_32,
    key_hash,
    murmur2,
    partition_for,
    to_positive,
)

# org.apache.kafka.common.utils.UtilsTest.testMurmur2
KAFKA_UTILS_TEST = [
    (b"21", -973932308),
    (b"foobar", -790332482),
    (b"a-little-bit-long-string", -985981536),
    (b"a-little-bit-longer-string", -1486304829),
    (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    (b"abc", 479470107),
]

# librdkafka src/rdmurmur2.c unittest_murmur2 (int32 literals, compared as unsigned bit patterns)
_SHORT = b"1234"
_UNALIGNED = b"PreAmbleWillBeRemoved,ThePrePartThatIs"
LIBRDKAFKA_MURMUR2 = [
    (b"kafka", 0xD067CF64),
    (b"giberish123456789", 0x8F552B0C),
    (_SHORT, 0x9FC97B14),
    (_SHORT[1:], 0xE7C009CA),
    (_SHORT[2:], 0x873930DA),
    (_SHORT[3:], 0x5A4B5CA1),
    (_UNALIGNED, 0x78424F1C),
    (_UNALIGNED[1:], 0x4A62B377),
    (_UNALIGNED[2:], 0xE0E4E09E),
    (_UNALIGNED[3:], 0x62B8B43F),
    (b"", 0x106E08D9),
]

# kafkajs src/producer/partitioners/default/murmur2.spec.js, generated with the Java client
KAFKAJS_JAVA = [
    (b"0", 971027396),
    (b"1", -1993445489),
    (b"128", -326012175),
    (b"2187", -1508407203),
    (b"16384", -325739742),
    (b"78125", -1654490814),
    (b"279936", 1462227128),
    (b"823543", -2014198330),
    (b"2097152", 607668903),
    (b"4782969", -1182699775),
    (b"10000000", -1830336757),
    (b"19487171", -1603849305),
    (b"35831808", -857013643),
    (b"62748517", -1167431028),
    (b"105413504", -381294639),
    (b"170859375", -1658323481),
    (b"100:48069", 1009543857),
]

# kafka-python test/test_partitioner.py test_murmur2_java_compatibility: 1000 partitions
KAFKA_PYTHON_1000 = [
    (b"", 681),
    (b"a", 524),
    (b"ab", 434),
    (b"abc", 107),
    (b"123456789", 566),
    (b"\x00 ", 742),
]

# librdkafka src/rdfnv1a.c unittest_fnv1a: |int32(fnv1a)| as Sarama's NewHashPartitioner uses it
LIBRDKAFKA_FNV1A_ABS = [
    (b"kafka", 0x0D33C4E1),
    (b"giberish123456789", 0x77A58295),
    (_SHORT, 0x023BDD03),
    (_SHORT[1:], 0x2DEA3CD2),
    (_SHORT[2:], 0x740FA83E),
    (_SHORT[3:], 0x310CA263),
    (_UNALIGNED, 0x65CBD69C),
    (_UNALIGNED[1:], 0x6E49C79A),
    (_UNALIGNED[2:], 0x69EED356),
    (_UNALIGNED[3:], 0x6ABCC023),
    (b"", 0x7EE3623B),
]

# Sarama TestHashPartitionerWithHasherMinInt32: fnv1a of this key is 0x80000000, i.e. int32 min.
SARAMA_MIN_INT32_KEY = b"1468509572224"


@pytest.mark.parametrize(("data", "expected"), KAFKA_UTILS_TEST)
def test_murmur2_matches_kafka_utils_test(data: bytes, expected: int) -> None:
    assert murmur2(data) == expected


@pytest.mark.parametrize(("data", "expected"), LIBRDKAFKA_MURMUR2)
def test_murmur2_matches_librdkafka(data: bytes, expected: int) -> None:
    assert murmur2(data) & 0xFFFFFFFF == expected


@pytest.mark.parametrize(("data", "expected"), KAFKAJS_JAVA)
def test_murmur2_matches_kafkajs_java_vectors(data: bytes, expected: int) -> None:
    assert murmur2(data) == expected


def test_murmur2_is_signed_32_bit() -> None:
    assert murmur2(b"kafka") == 0xD067CF64 - (1 << 32)
    assert all(-(1 << 31) <= murmur2(data) < (1 << 31) for data, _ in LIBRDKAFKA_MURMUR2)


def test_murmur2_accepts_bytearray_and_memoryview() -> None:
    assert murmur2(bytearray(b"foobar")) == murmur2(memoryview(b"foobar")) == -790332482


@pytest.mark.parametrize(("data", "expected"), KAFKA_PYTHON_1000)
def test_murmur2_partition_matches_kafka_python_vectors(data: bytes, expected: int) -> None:
    assert partition_for(Partitioner.MURMUR2, data, 1000) == expected


# kafka-python 3.0 loads its schemas through importlib.resources' legacy API, deprecated since Python 3.11.
@pytest.mark.filterwarnings(r"ignore:\w+ is deprecated\. Use files\(\) instead:DeprecationWarning")
@pytest.mark.parametrize(("data", "expected"), KAFKA_PYTHON_1000)
def test_murmur2_partition_matches_kafka_python_default_partitioner(data: bytes, expected: int) -> None:
    from kafka.partitioner.default import DefaultPartitioner

    cluster = _OneTopicCluster("t", 1000)
    assert DefaultPartitioner().partition("t", data, data, None, None, cluster) == expected


def test_to_positive_clears_only_the_sign_bit() -> None:
    assert to_positive(-1) == 0x7FFFFFFF
    assert to_positive(-(1 << 31)) == 0  # unlike abs()
    assert to_positive(5) == 5
    assert to_positive(-973932308) == -973932308 & 0x7FFFFFFF


@pytest.mark.parametrize("data", [b"", b"a", b"123456789", b"kafka", _UNALIGNED, bytes(range(256))])
def test_crc32_is_zlib_crc32(data: bytes) -> None:
    assert crc32(data) == zlib.crc32(data)


def test_crc32_check_value() -> None:
    # The CRC-32 catalogue's check value for "123456789".
    assert crc32(b"123456789") == 0xCBF43926


def test_crc32_partition() -> None:
    assert partition_for(Partitioner.CRC32, b"123456789", 1000) == 0xCBF43926 % 1000
    assert key_hash(Partitioner.CRC32, b"123456789") == 0xCBF43926


@pytest.mark.parametrize(
    ("data", "expected"),
    [(b"", 0x811C9DC5), (b"a", 0xE40C292C), (b"foobar", 0xBF9CF968)],
)
def test_fnv1a_known_values(data: bytes, expected: int) -> None:
    assert fnv1a_32(data) == expected


@pytest.mark.parametrize(("data", "expected"), LIBRDKAFKA_FNV1A_ABS)
def test_fnv1a_matches_librdkafka_abs_values(data: bytes, expected: int) -> None:
    h = fnv1a_32(data)
    signed = h - (1 << 32) if h >= 1 << 31 else h
    assert abs(signed) == expected
    # With the abs folded in, librdkafka's fnv1a partitioner is |h| % n; Sarama's must agree.
    assert partition_for(Partitioner.FNV1A, data, 7) == expected % 7


def test_fnv1a_sarama_min_int32_edge() -> None:
    assert fnv1a_32(SARAMA_MIN_INT32_KEY) == 0x80000000
    # Go: int32(-2147483648) % 12 == -8, negated to 8.
    assert partition_for(Partitioner.FNV1A, SARAMA_MIN_INT32_KEY, 12) == 8
    # Sarama's own test uses 50 partitions: -2147483648 % 50 == -48 in Go.
    assert partition_for(Partitioner.FNV1A, SARAMA_MIN_INT32_KEY, 50) == 48
    assert key_hash(Partitioner.FNV1A, SARAMA_MIN_INT32_KEY) == 0x80000000


def test_fnv1a_partition_of_negative_hash_is_negated_remainder() -> None:
    # fnv1a("") is 0x811C9DC5, int32 -2128831035; Go: -2128831035 % 10 == -5 -> 5.
    assert partition_for(Partitioner.FNV1A, b"", 10) == 5


def test_key_hash_sign_conventions() -> None:
    assert key_hash(Partitioner.MURMUR2, b"21") == -973932308
    assert key_hash(Partitioner.FNV1A, b"") == 0x811C9DC5
    assert key_hash(Partitioner.CRC32, b"") == 0


@pytest.mark.parametrize("partitioner", list(Partitioner))
def test_single_partition_always_zero(partitioner: Partitioner) -> None:
    for data, _ in LIBRDKAFKA_MURMUR2:
        assert partition_for(partitioner, data, 1) == 0


@pytest.mark.parametrize("partitioner", list(Partitioner))
@pytest.mark.parametrize("partitions", [0, -1, 1 << 31])
def test_bad_partition_count_rejected(partitioner: Partitioner, partitions: int) -> None:
    with pytest.raises(ValueError, match="partition count"):
        partition_for(partitioner, b"k", partitions)


def test_partitioner_parse() -> None:
    assert Partitioner.parse("murmur2") is Partitioner.MURMUR2
    assert Partitioner.parse("crc32") is Partitioner.CRC32
    assert Partitioner.parse("fnv1a") is Partitioner.FNV1A
    assert Partitioner.parse("MURMUR2") is Partitioner.MURMUR2
    assert Partitioner("fnv1a") is Partitioner.FNV1A


@pytest.mark.parametrize("name", ["x", "", "murmur", "consistent_random", " murmur2"])
def test_partitioner_parse_rejects_unknown(name: str) -> None:
    with pytest.raises(ValueError) as err:
        Partitioner.parse(name)
    assert str(err.value) == f"unknown partitioner {name!r} (expected one of: murmur2, crc32, fnv1a)"


class _OneTopicCluster:
    """Just enough of kafka-python's ClusterMetadata for DefaultPartitioner.partition."""

    def __init__(self, topic: str, partitions: int) -> None:
        self._topic = topic
        self._partitions = set(range(partitions))

    def topics(self) -> set[str]:
        return {self._topic}

    def partitions_for_topic(self, topic: str) -> set[int]:
        return self._partitions

    def available_partitions_for_topic(self, topic: str) -> set[int]:
        return self._partitions
