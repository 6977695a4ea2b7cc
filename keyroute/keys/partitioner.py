"""Key-to-partition hashing, bit-for-bit as the Kafka producers that wrote the data do it.

A store's partitioner decides which partition (and so which node) owns a key: any drift misroutes reads.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final, TypeVar

if TYPE_CHECKING:
    # Only an annotation: the compiled build (setup.py) keeps murmur2's mixing in native 64-bit integers,
    # which every product below fits (a 32-bit value times the 31-bit multiplier); the pure build's ints
    # are unaffected.
    from mypy_extensions import i64

_MASK32 = 0xFFFFFFFF
_SIGN32 = 0x80000000
# Kafka's partition count is a Java int; beyond that none of the formulas below are defined.
MAX_PARTITIONS = 0x7FFFFFFF  # Kafka's partition counts are Java ints
_MAX_PARTITIONS = MAX_PARTITIONS

_MURMUR2_SEED: Final = 0x9747B28C
_MURMUR2_M = 0x5BD1E995
_MURMUR2_R = 24

_FNV32_OFFSET = 0x811C9DC5
_FNV32_PRIME = 0x01000193

_LE_WORD: Final = struct.Struct("<I")
_LE_WORDS: Final = tuple(struct.Struct(f"<{n}I") for n in range(17))  # 0 to 16 words
# Key bytes as callers hold them (bytearray and memoryview too): one annotation, so that the compiled build
# (setup.py) accepts what the pure one does.
KeyBytes = bytes | bytearray | memoryview
_from_bytes: Final = int.from_bytes  # bound once: `int.from_bytes` looks the method up and binds it on every call


_Choice = TypeVar("_Choice", bound=enum.StrEnum)


def parse_choice(choices: type[_Choice], name: str, what: str) -> _Choice:
    """One of a string enum's values, read case-insensitively from the CLI or a config file; ValueError naming
    `what` and the allowed values otherwise."""
    try:
        return choices(name.lower())
    except ValueError:
        allowed = ", ".join(choice.value for choice in choices)
        raise ValueError(f"unknown {what} {name!r} (expected one of: {allowed})") from None


class Partitioner(enum.StrEnum):
    """The hash function (and its sign handling) that the producer placed keys with."""

    MURMUR2 = "murmur2"  # Java client default, kafka-python, kafkajs, librdkafka murmur2/murmur2_random
    CRC32 = "crc32"  # librdkafka's default consistent_random / consistent
    FNV1A = "fnv1a"  # Sarama's default hash partitioner, librdkafka fnv1a

    @classmethod
    def parse(cls, name: str) -> Partitioner:
        """Read a partitioner name from the CLI or a config file (case-insensitive)."""
        return parse_choice(cls, name, "partitioner")


def _signed32(value: int) -> int:
    return value - (1 << 32) if value & _SIGN32 else value


def murmur2_bits(data: KeyBytes) -> int:
    """Kafka's `Utils.murmur2` as its 32 bits, unsigned: `murmur2` without the sign. What a partition is
    computed from (`to_positive(murmur2(data)) == murmur2_bits(data) & 0x7FFFFFFF`), one frame and two
    operations less per key."""
    length = len(data)
    h: i64 = _MURMUR2_SEED ^ length
    body = length & ~3
    # The 4-byte little-endian words unpacked in C (one precompiled Struct for keys up to 64 bytes); only the
    # mixing stays in Python, with the fewest operations on these two-digit ints (each allocates): the
    # multiplier written as a literal, one mask per product that must be taken modulo 2**32 before a shift.
    n = body >> 2
    if n < 17:
        words: Iterable[int] = _LE_WORDS[n].unpack_from(data)
    else:
        words = [k for (k,) in _LE_WORD.iter_unpack(memoryview(data)[:body])]
    for word in words:
        k: i64 = word
        k = (k * 0x5BD1E995) & 0xFFFFFFFF
        h = ((h * 0x5BD1E995) ^ ((k ^ (k >> 24)) * 0x5BD1E995)) & 0xFFFFFFFF
    if length != body:
        # The Java switch's fallthrough mixes the 1 to 3 tail bytes in as one little-endian int.
        h = ((h ^ _from_bytes(data[body:], "little")) * 0x5BD1E995) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0x5BD1E995) & 0xFFFFFFFF
    return h ^ (h >> 15)


def murmur2(data: KeyBytes) -> int:
    """Kafka's `Utils.murmur2`: the signed 32-bit int the Java client computes."""
    h = murmur2_bits(data)
    return h - 0x100000000 if h & _SIGN32 else h


def to_positive(value: int) -> int:
    """Kafka's `Utils.toPositive`: clear the sign bit (not abs, so INT_MIN maps to 0)."""
    return value & 0x7FFFFFFF


def crc32(data: KeyBytes) -> int:
    """Standard CRC-32 as librdkafka's `rd_crc32`, unsigned."""
    return zlib.crc32(data) & _MASK32


def fnv1a_32(data: KeyBytes) -> int:
    """32-bit FNV-1a as Go's `hash/fnv.New32a`, unsigned."""
    h = _FNV32_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV32_PRIME) & _MASK32
    return h


def key_hash(partitioner: Partitioner, data: KeyBytes) -> int:
    """The hash shown to operators, in the sign convention of the client that owns that hash."""
    if partitioner is Partitioner.MURMUR2:
        return murmur2(data)
    if partitioner is Partitioner.CRC32:
        return crc32(data)
    if partitioner is Partitioner.FNV1A:
        return fnv1a_32(data)
    raise ValueError(f"unknown partitioner {partitioner!r}")


def partition_of_hash(partitioner: Partitioner, hash_value: int, partitions: int) -> int:
    """The partition for a `key_hash()` value: lets a caller that shows the hash compute it only once."""
    if not 1 <= partitions <= _MAX_PARTITIONS:
        raise ValueError(f"partition count must be between 1 and {_MAX_PARTITIONS}, got {partitions}")
    if partitioner is Partitioner.MURMUR2:
        return to_positive(hash_value) % partitions
    if partitioner is Partitioner.CRC32:
        return hash_value % partitions
    if partitioner is Partitioner.FNV1A:
        return abs(_signed32(hash_value)) % partitions
    raise ValueError(f"unknown partitioner {partitioner!r}")


def partition_for(partitioner: Partitioner, data: KeyBytes, partitions: int) -> int:
    """The partition a producer using `partitioner` sends a record with key bytes `data` to."""
    if not 1 <= partitions <= _MAX_PARTITIONS:
        raise ValueError(f"partition count must be between 1 and {_MAX_PARTITIONS}, got {partitions}")
    if partitioner is Partitioner.MURMUR2:
        return (murmur2_bits(data) & 0x7FFFFFFF) % partitions  # to_positive(murmur2(data))
    if partitioner is Partitioner.CRC32:
        return crc32(data) % partitions
    if partitioner is Partitioner.FNV1A:
        # Sarama: int32(h) % n with Go's truncated remainder, negated if negative. As |a rem n| == |a| mod n,
        # abs() first gives the same answer, also for h == INT32_MIN, where librdkafka's abs is a no-op.
        return abs(_signed32(fnv1a_32(data))) % partitions
    raise ValueError(f"unknown partitioner {partitioner!r}")
