"""The vectorised hashes equal the scalar ones (already pinned to Kafka's clients) on generated batches.

kafka-python's pure-Python murmur2 is a second, independent oracle for murmur2; it returns an unsigned int.
"""

from __future__ import annotations

import random
import warnings

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from keyroute.keys.partition_vectorized import hashes, partitions
from keyroute.keys.partitioner import Partitioner, key_hash, partition_for

with warnings.catch_warnings():
    # kafka-python 3.0 loads its protocol schemas through importlib.resources' legacy API, deprecated since
    # Python 3.11, and the project turns warnings into errors.
    warnings.filterwarnings("ignore", r"\w+ is deprecated\. Use files\(\) instead", DeprecationWarning)
    from kafka.partitioner.default import murmur2 as kafka_python_murmur2

EXAMPLES = settings(max_examples=200, deadline=None)

partitioners = st.sampled_from(list(Partitioner))
partition_counts = st.integers(1, 10_000)
binary_types = st.sampled_from([pa.binary(), pa.large_binary()])

# Every length 0..64 once per batch (each tail case at every word count), in a generated order, so keys start
# at every offset modulo 4 and the length sort has work to do.
every_short_length = st.tuples(*(st.binary(min_size=n, max_size=n) for n in range(65))).flatmap(
    lambda keys: st.permutations(list(keys))
)
some_longer = st.lists(st.binary(min_size=65, max_size=700), max_size=3)


def _scalar_partitions(partitioner: Partitioner, keys: list[bytes], n: int) -> list[int]:
    return [partition_for(partitioner, key, n) for key in keys]


@EXAMPLES
@given(partitioners, every_short_length, some_longer, partition_counts)
def test_every_length_matches_scalar(
    partitioner: Partitioner, short: list[bytes], longer: list[bytes], n: int
) -> None:
    keys = short + longer
    assert hashes(partitioner, keys).tolist() == [key_hash(partitioner, key) for key in keys]
    assert partitions(partitioner, keys, n).tolist() == _scalar_partitions(partitioner, keys, n)


@EXAMPLES
@given(partitioners, st.lists(st.binary(max_size=64), max_size=80), partition_counts, binary_types, st.data())
def test_sliced_arrow_batches_match_scalar(
    partitioner: Partitioner, keys: list[bytes], n: int, binary_type: pa.DataType, data: st.DataObject
) -> None:
    # The batch sits inside a larger array, as a slice of a Spark batch would: other keys' bytes surround it.
    before = data.draw(st.lists(st.binary(max_size=8), max_size=3), label="before")
    after = data.draw(st.lists(st.binary(max_size=8), max_size=3), label="after")
    batch = pa.array(before + keys + after, type=binary_type).slice(len(before), len(keys))
    assert partitions(partitioner, batch, n).tolist() == _scalar_partitions(partitioner, keys, n)


@EXAMPLES
@given(st.lists(st.binary(max_size=200), max_size=50))
def test_murmur2_matches_kafka_python(keys: list[bytes]) -> None:
    expected = [h - (1 << 32) if h >= 1 << 31 else h for h in map(kafka_python_murmur2, keys)]
    assert hashes(Partitioner.MURMUR2, keys).tolist() == expected


@settings(max_examples=30, deadline=None)
@given(partitioners, st.integers(0, 2**64 - 1), partition_counts)
def test_large_mixed_batches_match_scalar(partitioner: Partitioner, seed: int, n: int) -> None:
    # Bigger than hypothesis builds byte by byte, so drawn from a seed. A third of the keys (about a hundred)
    # are 257 bytes to 2 KiB long: too many to hash one by one, so most of those are hashed column-wise.
    rng = random.Random(seed)
    length_ranges = [(0, 24), (24, 80), (257, 2048)]
    keys = [rng.randbytes(rng.randrange(*rng.choice(length_ranges))) for _ in range(300)]
    assert hashes(partitioner, keys).tolist() == [key_hash(partitioner, key) for key in keys]
    assert partitions(partitioner, keys, n).tolist() == _scalar_partitions(partitioner, keys, n)
