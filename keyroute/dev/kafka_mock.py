"""A Kafka-protocol broker on 127.0.0.1 for the demo and the tests: librdkafka's mock cluster.

librdkafka (which confluent-kafka bundles) carries a mock cluster that speaks the Kafka protocol to any
client (produce, fetch, metadata, offsets), in the process that created it. Its control API (topics with
chosen partition counts, brokers taken down and up) is public C API (rdkafka_mock.h) that confluent-kafka
does not wrap, so it is called through ctypes. It is not a production broker: no durability, no security.

    with MockKafka() as kafka:
        kafka.create_topic("bookings", 12)
        kafka.bootstrap_servers          # "127.0.0.1:NNNNN", for any Kafka client
"""

from __future__ import annotations

import ctypes
import functools
from types import TracebackType

_PRODUCER = 0  # rd_kafka_type_t RD_KAFKA_PRODUCER
_VOID_P = ctypes.c_void_p
_CHAR_P = ctypes.c_char_p


class MockKafkaError(RuntimeError):
    """The mock cluster refused a control call (the message says which and librdkafka's error code)."""


@functools.cache
def _librdkafka() -> ctypes.CDLL:
    import confluent_kafka.cimpl as cimpl

    # Symbol lookup through the extension's handle also searches the libraries it links, so this works
    # whether the wheel bundles librdkafka or the extension links a system one.
    lib = ctypes.CDLL(cimpl.__file__)
    lib.rd_kafka_conf_new.restype = _VOID_P
    lib.rd_kafka_conf_set.argtypes = [_VOID_P, _CHAR_P, _CHAR_P, _CHAR_P, ctypes.c_size_t]
    lib.rd_kafka_new.restype = _VOID_P
    lib.rd_kafka_new.argtypes = [ctypes.c_int, _VOID_P, _CHAR_P, ctypes.c_size_t]
    lib.rd_kafka_handle_mock_cluster.restype = _VOID_P
    lib.rd_kafka_handle_mock_cluster.argtypes = [_VOID_P]
    lib.rd_kafka_mock_topic_create.argtypes = [_VOID_P, _CHAR_P, ctypes.c_int, ctypes.c_int]
    lib.rd_kafka_mock_topic_delete.argtypes = [_VOID_P, _CHAR_P]
    lib.rd_kafka_mock_broker_set_down.argtypes = [_VOID_P, ctypes.c_int32]
    lib.rd_kafka_mock_broker_set_up.argtypes = [_VOID_P, ctypes.c_int32]
    lib.rd_kafka_mock_cluster_bootstraps.restype = _CHAR_P
    lib.rd_kafka_mock_cluster_bootstraps.argtypes = [_VOID_P]
    lib.rd_kafka_destroy.argtypes = [_VOID_P]
    return lib


class MockKafka:
    """A mock cluster of `brokers` brokers (ids 1..brokers), alive until `close()`."""

    def __init__(self, brokers: int = 1) -> None:
        lib = _librdkafka()
        error = ctypes.create_string_buffer(512)
        conf = lib.rd_kafka_conf_new()
        # log_level 3: the mock's own teardown disconnects are logged at info level.
        for name, value in ((b"test.mock.num.brokers", str(brokers).encode()), (b"log_level", b"3")):
            if lib.rd_kafka_conf_set(conf, name, value, error, len(error)) != 0:
                raise MockKafkaError(f"mock cluster setting {name.decode()}: {error.value.decode()}")
        owner = lib.rd_kafka_new(_PRODUCER, conf, error, len(error))  # takes ownership of conf
        if not owner:
            raise MockKafkaError(f"mock cluster did not start: {error.value.decode()}")
        self._lib = lib
        self._owner: int | None = owner
        self._cluster = lib.rd_kafka_handle_mock_cluster(owner)
        self.bootstrap_servers: str = lib.rd_kafka_mock_cluster_bootstraps(self._cluster).decode()

    def create_topic(self, topic: str, partitions: int) -> None:
        """A topic of `partitions` partitions (the mock broker does not implement CreateTopics itself)."""
        self._check("create topic", self._lib.rd_kafka_mock_topic_create(self._cluster, topic.encode(), partitions, 1))

    def delete_topic(self, topic: str) -> None:
        self._check("delete topic", self._lib.rd_kafka_mock_topic_delete(self._cluster, topic.encode()))

    def broker_down(self, broker_id: int = 1) -> None:
        """Close the broker's connections and refuse new ones until `broker_up`."""
        self._check("broker down", self._lib.rd_kafka_mock_broker_set_down(self._cluster, broker_id))

    def broker_up(self, broker_id: int = 1) -> None:
        self._check("broker up", self._lib.rd_kafka_mock_broker_set_up(self._cluster, broker_id))

    def close(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            self._lib.rd_kafka_destroy(owner)  # and with it the mock cluster

    def _check(self, what: str, code: int) -> None:
        if self._owner is None:
            raise MockKafkaError(f"{what}: the mock cluster is closed")
        if code != 0:
            raise MockKafkaError(f"{what}: librdkafka error {code}")

    def __enter__(self) -> MockKafka:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
