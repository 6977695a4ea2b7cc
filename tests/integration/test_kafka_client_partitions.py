"""A real Kafka client picks the partitions: librdkafka, via confluent-kafka, producing to its mock cluster.

Every delivered partition must be the one `partitions()` and `partition_for` compute for the same key bytes.

What librdkafka does with an EMPTY key (b"", which confluent-kafka passes as a non-NULL key of length 0), as
read in its src/rdkafka_msg.c and confirmed by the tests below:
- murmur2, murmur2_random, fnv1a, fnv1a_random and consistent hash it like any other key; the `_random`
  variants go random (sticky) only for a NULL key. consistent puts it on partition crc32(b"") % n == 0.
- consistent_random, librdkafka's default, hashes only keys of length > 0: empty keys are spread like NULL
  keys. Records written that way cannot be found by key, so keyroute must not route empty keys for it.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import confluent_kafka
import pytest

from keyroute.dev.kafka_mock import MockKafka
from keyroute.keys.partition_vectorized import partitions
from keyroute.keys.partitioner import Partitioner, partition_for

pytestmark = pytest.mark.integration

_DELIVERY_TIMEOUT_S = 30.0

# Topics the test creates, with partition counts that are not powers of two: modulo a power of two, clearing
# the sign bit and reading the hash as unsigned agree, so a sign slip would go unseen. The mock cluster
# auto-creates any other topic, with its default partition count (4).
_CREATED_TOPICS = {"keys-37": 37, "keys-1000": 1000}
_AUTO_CREATED_TOPIC = "keys-auto"


def _keys() -> list[bytes]:
    rng = random.Random(20240229)
    keys = [b"", b"a", b"21", b"foobar", b"1468509572224", "ключ-clé-🔑".encode(), "顧客-42".encode()]
    keys += [f"customer-{rng.randrange(10**9):09d}".encode() for _ in range(100)]
    keys += [rng.randbytes(length) for length in range(65)]  # every tail case, over 0..16 words
    keys += [rng.randbytes(rng.randrange(65, 300)) for _ in range(60)]
    keys += [rng.randbytes(length) for length in (1023, 1024, 1025, 4099)]
    keys += [("ü" * rng.randrange(1, 40)).encode() for _ in range(20)]
    return keys


KEYS = _keys()
NON_EMPTY_KEYS = [key for key in KEYS if key]


@dataclass(frozen=True)
class MockCluster:
    bootstrap_servers: str
    topics: tuple[str, ...]


@pytest.fixture(scope="module")
def mock_cluster() -> Iterator[MockCluster]:
    """One mock broker with topics of the partition counts we choose (the mock broker does not implement
    CreateTopics; `MockKafka.create_topic` goes through librdkafka's mock API)."""
    with MockKafka() as kafka:
        for topic, count in _CREATED_TOPICS.items():
            kafka.create_topic(topic, count)
        yield MockCluster(kafka.bootstrap_servers, (*_CREATED_TOPICS, _AUTO_CREATED_TOPIC))


@dataclass(frozen=True)
class Delivered:
    partition_count: int
    partitions: list[int]  # where the producer put each key, in key order


def _produce(
    cluster: MockCluster,
    client_partitioner: str,
    keys: Sequence[bytes],
    topics: Sequence[str] | None = None,
    **config: object,
) -> dict[str, Delivered]:
    """Produce every key to each topic (all by default) with `client_partitioner`; where each one went."""
    producer = confluent_kafka.Producer(
        {
            "bootstrap.servers": cluster.bootstrap_servers,
            "partitioner": client_partitioner,
            "log_level": 3,  # the mock broker's teardown disconnects are logged at info level
            **config,
        }
    )
    delivered: dict[str, Delivered] = {}
    for topic in cluster.topics if topics is None else topics:
        # The partition count the producer partitions with is the one in its metadata; asking for the topic
        # also makes the mock cluster auto-create `keys-auto`.
        count = len(producer.list_topics(topic, timeout=_DELIVERY_TIMEOUT_S).topics[topic].partitions)
        placed: dict[int, int] = {}
        failures: list[str] = []
        for index, key in enumerate(keys):
            on_delivery = functools.partial(_record, placed, failures, index)
            producer.produce(topic, value=b"v", key=key, on_delivery=on_delivery)
            producer.poll(0)
        assert producer.flush(_DELIVERY_TIMEOUT_S) == 0, f"undelivered messages to {topic}"
        assert not failures, failures[:3]
        delivered[topic] = Delivered(count, [placed[index] for index in range(len(keys))])
    return delivered


def _record(placed: dict[int, int], failures: list[str], index: int, error: object, message: object) -> None:
    if error is not None:
        failures.append(f"key #{index}: {error}")
    else:
        placed[index] = message.partition()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("client_partitioner", "partitioner"),
    [
        ("murmur2", Partitioner.MURMUR2),  # the Java client's partitioner
        ("murmur2_random", Partitioner.MURMUR2),
        ("consistent", Partitioner.CRC32),
        ("fnv1a", Partitioner.FNV1A),  # Sarama's
        ("fnv1a_random", Partitioner.FNV1A),
    ],
)
def test_librdkafka_puts_every_key_where_we_compute(
    mock_cluster: MockCluster, client_partitioner: str, partitioner: Partitioner
) -> None:
    for topic, delivered in _produce(mock_cluster, client_partitioner, KEYS).items():
        vectorised = partitions(partitioner, KEYS, delivered.partition_count).tolist()
        assert delivered.partitions == vectorised, topic
        scalar = [partition_for(partitioner, key, delivered.partition_count) for key in KEYS]
        assert delivered.partitions == scalar, topic


def test_default_consistent_random_hashes_non_empty_keys_with_crc32(mock_cluster: MockCluster) -> None:
    for topic, delivered in _produce(mock_cluster, "consistent_random", NON_EMPTY_KEYS).items():
        expected = partitions(Partitioner.CRC32, NON_EMPTY_KEYS, delivered.partition_count)
        assert delivered.partitions == expected.tolist(), topic


# A sticky partition that lasts 0 ms is drawn afresh for every message, so random placement would show.
_NO_STICKINESS = {"sticky.partitioning.linger.ms": 0}
_EMPTY_KEYS = [b""] * 60


@pytest.mark.parametrize(
    ("client_partitioner", "partitioner"),
    [
        ("murmur2", Partitioner.MURMUR2),
        ("murmur2_random", Partitioner.MURMUR2),
        ("fnv1a", Partitioner.FNV1A),
        ("fnv1a_random", Partitioner.FNV1A),
        ("consistent", Partitioner.CRC32),
    ],
)
def test_empty_keys_are_hashed(mock_cluster: MockCluster, client_partitioner: str, partitioner: Partitioner) -> None:
    (delivered,) = _produce(mock_cluster, client_partitioner, _EMPTY_KEYS, ["keys-37"], **_NO_STICKINESS).values()
    assert set(delivered.partitions) == {partition_for(partitioner, b"", 37)}
    assert partitions(partitioner, [b""], 37).tolist() == [partition_for(partitioner, b"", 37)]


def test_consistent_random_scatters_empty_keys(mock_cluster: MockCluster) -> None:
    (delivered,) = _produce(mock_cluster, "consistent_random", _EMPTY_KEYS, ["keys-37"], **_NO_STICKINESS).values()
    # Hashed, all 60 would sit on crc32(b"") % 37 == 0; 60 random draws from 37 partitions all landing on
    # one partition has a chance of about 37**-59.
    assert len(set(delivered.partitions)) > 1
