"""Pins keyroute.keys.partition_vectorized to published Kafka client vectors, and to the scalar functions.

The expected values come from other projects' test suites (named at each list), never from this code.
"""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

from keyroute.keys import partition_vectorized
from keyroute.keys.partition_vectorized import hashes, partitions
from keyroute.keys.partitioner import Partitioner, key_hash, partition_for

# org.apache.kafka.common.utils.UtilsTest.testMurmur2
KAFKA_UTILS_TEST = [
    (b"21", -973932308),
    (b"foobar", -790332482),
    (b"a-little-bit-long-string", -985981536),
    (b"a-little-bit-longer-string", -1486304829),
    (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    (b"abc", 479470107),
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

# librdkafka src/rdmurmur2.c unittest_murmur2 and src/rdfnv1a.c unittest_fnv1a (unsigned bit patterns; the
# fnv1a ones are |int32(h)|), on keys that start at every alignment.
_SHORT = b"1234"
_UNALIGNED = b"PreAmbleWillBeRemoved,ThePrePartThatIs"
_LIBRDKAFKA_KEYS = [b"kafka", b"giberish123456789", _SHORT, _SHORT[1:], _SHORT[2:], _SHORT[3:]]
_LIBRDKAFKA_KEYS += [_UNALIGNED, _UNALIGNED[1:], _UNALIGNED[2:], _UNALIGNED[3:], b""]
LIBRDKAFKA_MURMUR2 = [0xD067CF64, 0x8F552B0C, 0x9FC97B14, 0xE7C009CA, 0x873930DA, 0x5A4B5CA1]
LIBRDKAFKA_MURMUR2 += [0x78424F1C, 0x4A62B377, 0xE0E4E09E, 0x62B8B43F, 0x106E08D9]
LIBRDKAFKA_FNV1A_ABS = [0x0D33C4E1, 0x77A58295, 0x023BDD03, 0x2DEA3CD2, 0x740FA83E, 0x310CA263]
LIBRDKAFKA_FNV1A_ABS += [0x65CBD69C, 0x6E49C79A, 0x69EED356, 0x6ABCC023, 0x7EE3623B]

# Sarama TestHashPartitionerWithHasherMinInt32: fnv1a of this key is 0x80000000, i.e. int32 min.
SARAMA_MIN_INT32_KEY = b"1468509572224"

ARROW_TYPES = [pa.binary(), pa.large_binary(), pa.string(), pa.large_string()]


def _arrow(keys: list[bytes], arrow_type: pa.DataType) -> pa.Array:
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return pa.array([key.decode() for key in keys], type=arrow_type)
    return pa.array(keys, type=arrow_type)


def _scalar_hashes(partitioner: Partitioner, keys: list[bytes]) -> list[int]:
    return [key_hash(partitioner, key) for key in keys]


def _scalar_partitions(partitioner: Partitioner, keys: list[bytes], n: int) -> list[int]:
    return [partition_for(partitioner, key, n) for key in keys]


def test_murmur2_matches_kafka_utils_test_in_one_batch() -> None:
    keys = [key for key, _ in KAFKA_UTILS_TEST]
    assert hashes(Partitioner.MURMUR2, keys).tolist() == [expected for _, expected in KAFKA_UTILS_TEST]


@pytest.mark.parametrize(("key", "expected"), KAFKA_UTILS_TEST)
def test_murmur2_matches_kafka_utils_test_one_key(key: bytes, expected: int) -> None:
    assert hashes(Partitioner.MURMUR2, [key]).tolist() == [expected]


@pytest.mark.parametrize("arrow_type", ARROW_TYPES)
def test_murmur2_kafka_vectors_from_every_arrow_type(arrow_type: pa.DataType) -> None:
    keys = [key for key, _ in KAFKA_UTILS_TEST]
    assert hashes(Partitioner.MURMUR2, _arrow(keys, arrow_type)).tolist() == [e for _, e in KAFKA_UTILS_TEST]


def test_murmur2_partitions_match_kafka_python_vectors() -> None:
    keys = [key for key, _ in KAFKA_PYTHON_1000]
    assert partitions(Partitioner.MURMUR2, keys, 1000).tolist() == [
        expected for _, expected in KAFKA_PYTHON_1000
    ]


def test_murmur2_matches_librdkafka_at_every_alignment() -> None:
    unsigned = hashes(Partitioner.MURMUR2, _LIBRDKAFKA_KEYS) & 0xFFFFFFFF
    assert unsigned.tolist() == LIBRDKAFKA_MURMUR2


def test_fnv1a_matches_librdkafka_abs_values() -> None:
    signed = hashes(Partitioner.FNV1A, _LIBRDKAFKA_KEYS).astype(np.uint32).view(np.int32)
    assert np.abs(signed.astype(np.int64)).tolist() == LIBRDKAFKA_FNV1A_ABS
    # librdkafka's fnv1a partitioner is |h| % n, and Sarama's agrees.
    assert partitions(Partitioner.FNV1A, _LIBRDKAFKA_KEYS, 7).tolist() == [
        h % 7 for h in LIBRDKAFKA_FNV1A_ABS
    ]


def test_fnv1a_sarama_min_int32_edge() -> None:
    assert hashes(Partitioner.FNV1A, [SARAMA_MIN_INT32_KEY]).tolist() == [0x80000000]
    # Go: int32(-2147483648) % 12 == -8, negated to 8; Sarama's own test uses 50 partitions: -48 -> 48.
    assert partitions(Partitioner.FNV1A, [SARAMA_MIN_INT32_KEY], 12).tolist() == [8]
    assert partitions(Partitioner.FNV1A, [SARAMA_MIN_INT32_KEY], 50).tolist() == [48]


def test_crc32_check_value() -> None:
    # The CRC-32 catalogue's check value for "123456789".
    assert hashes(Partitioner.CRC32, [b"123456789"]).tolist() == [0xCBF43926]
    assert partitions(Partitioner.CRC32, [b"123456789"], 1000).tolist() == [0xCBF43926 % 1000]


@pytest.mark.parametrize("partitioner", list(Partitioner))
def test_sign_conventions_and_dtypes(partitioner: Partitioner) -> None:
    keys = [b"", b"21", b"kafka", SARAMA_MIN_INT32_KEY]
    hashed = hashes(partitioner, keys)
    placed = partitions(partitioner, keys, 12)
    assert hashed.dtype == np.int64
    assert placed.dtype == np.int32
    assert hashed.tolist() == _scalar_hashes(partitioner, keys)
    if partitioner is Partitioner.MURMUR2:
        assert hashed.min() < 0  # signed, as Kafka's Java int
    else:
        assert hashed.max() >= 1 << 31  # unsigned


@pytest.mark.parametrize("partitioner", list(Partitioner))
@pytest.mark.parametrize("arrow_type", ARROW_TYPES)
def test_sliced_arrays_hash_only_their_own_keys(partitioner: Partitioner, arrow_type: pa.DataType) -> None:
    # A slice shares its parent's buffers: offsets start mid-buffer, and bytes of other keys surround its own.
    keys = [f"key-{i}-{'é' * (i % 7)}".encode() for i in range(40)]
    parent = _arrow(keys, arrow_type)
    for start, length in [(1, 5), (13, 20), (39, 1), (7, 0), (0, 40)]:
        sliced = parent.slice(start, length)
        assert sliced.offset == start
        expected = keys[start : start + length]
        assert hashes(partitioner, sliced).tolist() == _scalar_hashes(partitioner, expected)
        assert partitions(partitioner, sliced, 13).tolist() == _scalar_partitions(partitioner, expected, 13)


@pytest.mark.parametrize("partitioner", list(Partitioner))
def test_slice_of_a_slice(partitioner: Partitioner) -> None:
    keys = [bytes([i]) * i for i in range(30)]
    sliced = pa.array(keys, pa.large_binary()).slice(3, 20).slice(4, 10)
    assert hashes(partitioner, sliced).tolist() == _scalar_hashes(partitioner, keys[7:17])


@pytest.mark.parametrize("partitioner", list(Partitioner))
def test_chunked_array(partitioner: Partitioner) -> None:
    keys = [b"a", b"bb", b"", b"dddd", b"eeeee"]
    chunked = pa.chunked_array([pa.array(keys[:2], pa.binary()), pa.array(keys[2:], pa.binary())])
    assert hashes(partitioner, chunked).tolist() == _scalar_hashes(partitioner, keys)


def test_string_keys_hash_as_their_utf8_bytes() -> None:
    texts = ["", "ascii", "clé", "ключ", "🔑", "顧客-42"]
    for arrow_type in (pa.string(), pa.large_string()):
        array = pa.array(texts, type=arrow_type)
        for partitioner in Partitioner:
            expected = _scalar_hashes(partitioner, [text.encode() for text in texts])
            assert hashes(partitioner, array).tolist() == expected


@pytest.mark.parametrize("partitioner", list(Partitioner))
@pytest.mark.parametrize(
    "keys",
    [
        pa.array([b"a", None, b"c"], pa.binary()),
        pa.array(["a", None], pa.large_string()),
        pa.array([None], pa.large_binary()),
        [b"a", None],
    ],
    ids=["binary", "large_string", "only_null", "list"],
)
def test_null_keys_are_rejected(partitioner: Partitioner, keys: object) -> None:
    with pytest.raises(ValueError, match="null"):
        hashes(partitioner, keys)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="null"):
        partitions(partitioner, keys, 3)  # type: ignore[arg-type]


def test_a_slice_that_leaves_the_nulls_out_is_accepted() -> None:
    array = pa.array([None, b"a", b"b", None], pa.binary())
    assert hashes(Partitioner.MURMUR2, array.slice(1, 2)).tolist() == _scalar_hashes(
        Partitioner.MURMUR2, [b"a", b"b"]
    )


@pytest.mark.parametrize("partitioner", list(Partitioner))
@pytest.mark.parametrize(
    "keys", [[], (), pa.array([], pa.binary()), pa.array([], pa.large_string()), pa.array([b"x"]).slice(1)]
)
def test_empty_batch(partitioner: Partitioner, keys: object) -> None:
    hashed = hashes(partitioner, keys)  # type: ignore[arg-type]
    placed = partitions(partitioner, keys, 5)  # type: ignore[arg-type]
    assert hashed.shape == placed.shape == (0,)
    assert hashed.dtype == np.int64
    assert placed.dtype == np.int32


@pytest.mark.parametrize("partitioner", list(Partitioner))
def test_empty_keys(partitioner: Partitioner) -> None:
    only_empty = [b""] * 5
    assert hashes(partitioner, only_empty).tolist() == _scalar_hashes(partitioner, only_empty)
    mixed = [b"", b"abcd", b"", b"abcde", b""]
    assert partitions(partitioner, mixed, 10).tolist() == _scalar_partitions(partitioner, mixed, 10)


@pytest.mark.parametrize("partitioner", list(Partitioner))
def test_every_length_and_alignment(partitioner: Partitioner) -> None:
    rng = random.Random(7)
    # Lengths 0..300 in shuffled order, so keys start at every offset modulo 4 and lengths are unsorted.
    keys = [rng.randbytes(length) for length in range(301)]
    rng.shuffle(keys)
    assert hashes(partitioner, keys).tolist() == _scalar_hashes(partitioner, keys)


@pytest.mark.parametrize("partitioner", list(Partitioner))
def test_many_long_keys(partitioner: Partitioner) -> None:
    # Far more than a handful of keys over 256 bytes: these are hashed column-wise, not per key.
    rng = random.Random(11)
    keys = [rng.randbytes(rng.randrange(257, 3000)) for _ in range(120)] + [b"short", b""]
    rng.shuffle(keys)
    assert hashes(partitioner, keys).tolist() == _scalar_hashes(partitioner, keys)
    assert partitions(partitioner, keys, 999).tolist() == _scalar_partitions(partitioner, keys, 999)


@pytest.mark.parametrize("partitioner", list(Partitioner))
def test_one_huge_key_among_short_ones(partitioner: Partitioner) -> None:
    rng = random.Random(13)
    keys = [str(rng.randrange(10**6)).encode() for _ in range(2000)]
    keys.insert(1234, rng.randbytes(1 << 20))
    keys.insert(7, b"k" * 5000)
    assert hashes(partitioner, keys).tolist() == _scalar_hashes(partitioner, keys)


@pytest.mark.parametrize("partitioner", list(Partitioner))
def test_batches_split_into_chunks(partitioner: Partitioner, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tiny chunks, so that chunk boundaries fall everywhere, including around keys longer than a chunk.
    rng = random.Random(17)
    keys = [rng.randbytes(rng.choice([0, 1, 3, 4, 9, 40, 70])) for _ in range(300)]
    for chunk_keys, chunk_bytes in [(1, 1 << 20), (7, 1 << 20), (64, 50), (1000, 8)]:
        monkeypatch.setattr(partition_vectorized, "_CHUNK_KEYS", chunk_keys)
        monkeypatch.setattr(partition_vectorized, "_CHUNK_BYTES", chunk_bytes)
        assert hashes(partitioner, keys).tolist() == _scalar_hashes(partitioner, keys), (
            chunk_keys,
            chunk_bytes,
        )


@pytest.mark.parametrize("partitioner", list(Partitioner))
@pytest.mark.parametrize("n", [1, 2, 3, 1000, (1 << 31) - 1])
def test_partition_counts(partitioner: Partitioner, n: int) -> None:
    keys = [b"", b"a", b"21", b"foobar", SARAMA_MIN_INT32_KEY, b"kafka"]
    placed = partitions(partitioner, keys, n)
    assert placed.tolist() == _scalar_partitions(partitioner, keys, n)
    assert ((placed >= 0) & (placed < n)).all()


@pytest.mark.parametrize("partitioner", list(Partitioner))
@pytest.mark.parametrize("n", [0, -1, 1 << 31])
def test_bad_partition_count_rejected(partitioner: Partitioner, n: int) -> None:
    with pytest.raises(ValueError, match="partition count"):
        partitions(partitioner, [b"k"], n)


def test_partition_count_must_be_an_integer() -> None:
    with pytest.raises(TypeError):
        partitions(Partitioner.MURMUR2, [b"k"], 3.0)  # type: ignore[arg-type]
    # Counts read from NumPy or pandas arrive as NumPy integers, which are integers all the same.
    numpy_count = np.int64(1000)
    placed = partitions(Partitioner.MURMUR2, [b"21"], numpy_count)  # type: ignore[arg-type]
    assert placed.tolist() == [partition_for(Partitioner.MURMUR2, b"21", 1000)]


@pytest.mark.parametrize("array", [pa.array([1, 2], pa.int64()), pa.array([b"ab"], pa.binary(2))])
def test_non_binary_arrays_are_rejected(array: pa.Array) -> None:
    with pytest.raises(TypeError, match="binary or string"):
        hashes(Partitioner.MURMUR2, array)


def test_unknown_partitioner_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown partitioner"):
        hashes("murmur3", [b"k"])  # type: ignore[arg-type]


def test_partitioner_names_are_not_partitioners() -> None:
    # As partition_for: a StrEnum equals its value, but a bare name has no sign convention attached.
    with pytest.raises(ValueError, match="unknown partitioner"):
        hashes("murmur2", [b"k"])  # type: ignore[arg-type]
