"""Key hashes and partitions for a whole Arrow batch at once, equal key for key to `partitioner`'s functions.

For the pipeline's Arrow UDFs: NumPy passes over the batch's own buffers instead of a Python call per key.
"""

from __future__ import annotations

import operator
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from keyroute_core.partitioner import (
    _FNV32_OFFSET,
    _FNV32_PRIME,
    _MAX_PARTITIONS,
    _MURMUR2_M,
    _MURMUR2_R,
    _MURMUR2_SEED,
    Partitioner,
)

__all__ = ["hashes", "partitions"]

# All hash state lives in uint32 *arrays*: their arithmetic wraps modulo 2**32 silently, exactly the Java/C
# int arithmetic being reproduced, whereas NumPy scalars warn on overflow (an error under our pytest config).
_U32 = np.uint32
_M = _U32(_MURMUR2_M)
_PRIME = _U32(_FNV32_PRIME)
# Multiplier for murmur2's tail step, indexed by len % 4: Java multiplies only when there is a tail.
_TAIL_MULTIPLIER = np.array([1, _MURMUR2_M, _MURMUR2_M, _MURMUR2_M], dtype=_U32)
_SIGN_BIT = _U32(0x80000000)
_LOW31 = _U32(0x7FFFFFFF)

Keys = pa.Array | pa.ChunkedArray | Sequence[bytes]


@dataclass(frozen=True, slots=True)
class _KeyColumns:
    """A batch's keys as views of its Arrow buffers, ordered longest first.

    With keys sorted by length, "the keys that still have a byte (or word) at index i" is a prefix of the
    order for every i, so each column step works on a contiguous slice, and one long key costs only its
    own extra steps instead of a full-batch pass per extra byte.
    """

    data: np.ndarray  # uint8 view of the Arrow data buffer (no copy)
    order: np.ndarray  # intp: batch positions of the keys, longest first (stable among equal lengths)
    starts: np.ndarray  # intp: byte offset of each key in `data`, in `order`
    lengths: np.ndarray  # intp: key lengths, in `order` (non-increasing)

    @property
    def size(self) -> int:
        return len(self.order)

    def longer_than(self, length: int) -> int:
        """How many keys have more than `length` bytes: the prefix of `order` that a step at byte `length` touches."""
        # lengths is non-increasing; search its negation, which is non-decreasing.
        return int(np.searchsorted(-self.lengths, -length, side="left"))

    def words(self) -> np.ndarray:
        """Every 4-byte little-endian word starting at any byte of `data`, as an unaligned uint32 view."""
        count = max(len(self.data) - 3, 0)
        return np.ndarray((count,), dtype="<u4", buffer=self.data, strides=(1,))

    def unsort(self, sorted_values: np.ndarray) -> np.ndarray:
        result = np.empty_like(sorted_values)
        result[self.order] = sorted_values
        return result


def hashes(partitioner: Partitioner, keys: Keys) -> np.ndarray:
    """`key_hash(partitioner, key)` for every key, as int64: signed for murmur2, unsigned for crc32 and fnv1a.

    `keys` is a pyarrow binary, large_binary, string or large_string array (strings hash as their UTF-8
    bytes), a ChunkedArray of one of those, or a sequence of bytes. A null key raises ValueError.
    """
    unsigned = _hash32(partitioner, _binary_array(keys))
    if partitioner is Partitioner.MURMUR2:
        # Kafka's Utils.murmur2 returns a Java int: same bits, read as signed.
        return unsigned.view(np.int32).astype(np.int64)
    return unsigned.astype(np.int64)


def partitions(partitioner: Partitioner, keys: Keys, n: int) -> np.ndarray:
    """`partition_for(partitioner, key, n)` for every key, as int32; `keys` as for `hashes`."""
    count = operator.index(n)
    if not 1 <= count <= _MAX_PARTITIONS:
        raise ValueError(f"partition count must be between 1 and {_MAX_PARTITIONS}, got {count}")
    unsigned = _hash32(partitioner, _binary_array(keys))
    divisor = _U32(count)
    if partitioner is Partitioner.MURMUR2:
        positive = unsigned & _LOW31  # Utils.toPositive: clear the sign bit, not abs
    elif partitioner is Partitioner.CRC32:
        positive = unsigned
    else:
        # |int32(h)|: the uint32 negation of a negative int32 is its magnitude, INT32_MIN included
        # (2**31, which Sarama and librdkafka also end up dividing; see partitioner.partition_for).
        positive = np.where(unsigned & _SIGN_BIT, -unsigned, unsigned)
    return (positive % divisor).astype(np.int32)


def _hash32(partitioner: Partitioner, keys: pa.Array) -> np.ndarray:
    """The partitioner's hash of every key as its uint32 bit pattern, in batch order."""
    if partitioner is Partitioner.MURMUR2:
        return _murmur2(_key_columns(keys))
    if partitioner is Partitioner.CRC32:
        return _crc32(keys)
    if partitioner is Partitioner.FNV1A:
        return _fnv1a_32(_key_columns(keys))
    raise ValueError(f"unknown partitioner {partitioner!r}")


def _binary_array(keys: Keys) -> pa.Array:
    """`keys` as a null-free binary or large_binary array (zero-copy for Arrow input)."""
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()  # a table column; combining copies only when there are several chunks
    if not isinstance(keys, pa.Array):
        keys = pa.array(keys, type=pa.binary())
    kind = keys.type
    if pa.types.is_string(kind):
        keys = keys.view(pa.binary())  # same buffers: the UTF-8 bytes are the key
    elif pa.types.is_large_string(kind):
        keys = keys.view(pa.large_binary())
    elif not (pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        raise TypeError(f"keys must be a binary or string array, got {kind}")
    if keys.null_count:
        # A producer sends a null key to a partition of its own choosing: no hash decides it.
        raise ValueError(f"{keys.null_count} of {len(keys)} keys are null; a null key has no partition")
    return keys


def _key_columns(keys: pa.Array) -> _KeyColumns:
    _, offsets_buffer, data_buffer = keys.buffers()
    offset_type = np.int64 if pa.types.is_large_binary(keys.type) else np.int32
    # A sliced array shares its parent's buffers: its offsets begin at keys.offset and index the whole data
    # buffer, so they are used as they are.
    if offsets_buffer is None:
        offsets = np.zeros(len(keys) + 1, dtype=np.intp)
    else:
        offsets = np.frombuffer(
            offsets_buffer,
            dtype=offset_type,
            count=len(keys) + 1,
            offset=keys.offset * np.dtype(offset_type).itemsize,
        ).astype(np.intp)
    data = np.empty(0, dtype=np.uint8) if data_buffer is None else np.frombuffer(data_buffer, dtype=np.uint8)
    lengths = np.diff(offsets)
    # A stable sort keeps equal-length keys in buffer order, so gathers walk memory forwards. Lengths that
    # fit 16 bits take NumPy's radix sort.
    if len(lengths) and int(lengths.max()) < 1 << 15:
        order = np.argsort(-lengths.astype(np.int16), kind="stable")
    else:
        order = np.argsort(-lengths, kind="stable")
    return _KeyColumns(data=data, order=order, starts=offsets[:-1][order], lengths=lengths[order])


def _murmur2(columns: _KeyColumns) -> np.ndarray:
    """Kafka's Utils.murmur2 over 4-byte word columns: word i of every key that has one, then the tails."""
    lengths = columns.lengths
    h = (_U32(_MURMUR2_SEED) ^ lengths.astype(_U32)).astype(_U32)
    words = columns.words()
    position = columns.starts.copy()  # byte offset of each key's next word, advanced in place
    word_index = 0
    while (active := columns.longer_than(4 * word_index + 3)) > 0:
        k = words[position[:active]]
        k *= _M
        k ^= k >> _U32(_MURMUR2_R)
        k *= _M
        head = h[:active]
        head *= _M
        head ^= k
        position[:active] += 4
        word_index += 1
    h ^= _murmur2_tails(columns, words)
    h *= _TAIL_MULTIPLIER[lengths & 3]
    h ^= h >> _U32(13)
    h *= _M
    h ^= h >> _U32(15)
    return columns.unsort(h)


def _murmur2_tails(columns: _KeyColumns, words: np.ndarray) -> np.ndarray:
    """The last len % 4 bytes of every key as a little-endian uint32 (0 when there are none).

    Java's switch falls through, xoring byte 2 << 16, byte 1 << 8 and byte 0: together, one little-endian
    word of the tail bytes.
    """
    tails = np.zeros(columns.size, dtype=_U32)
    tail_lengths = (columns.lengths & 3).astype(_U32)
    # Keys of 4+ bytes: read the word that ends where the key ends (inside the key, so never past the buffer)
    # and shift the tail bytes down; shifting by 32 - 8 * 0 would be undefined, so tail-less keys shift by 0
    # and are masked out.
    long_keys = columns.longer_than(3)
    if long_keys:
        ends = columns.starts[:long_keys] + columns.lengths[:long_keys]
        last_words = words[ends - 4]
        tail = tail_lengths[:long_keys]
        shifted = last_words >> ((_U32(32) - _U32(8) * tail) & _U32(31))
        tails[:long_keys] = np.where(tail != 0, shifted, _U32(0))
    # Keys of 1-3 bytes (the end of the order) are all tail: gather their bytes one column at a time.
    for byte_index in range(3):
        short = slice(long_keys, columns.longer_than(byte_index))
        if short.stop > short.start:
            byte = columns.data[columns.starts[short] + byte_index].astype(_U32)
            tails[short] |= byte << _U32(8 * byte_index)
    return tails


def _fnv1a_32(columns: _KeyColumns) -> np.ndarray:
    """32-bit FNV-1a over byte columns: byte i of every key that has one."""
    h = np.full(columns.size, _FNV32_OFFSET, dtype=_U32)
    position = columns.starts.copy()
    byte_index = 0
    while (active := columns.longer_than(byte_index)) > 0:
        head = h[:active]
        head ^= columns.data[position[:active]]
        head *= _PRIME
        position[:active] += 1
        byte_index += 1
    return columns.unsort(h)


def _crc32(keys: pa.Array) -> np.ndarray:
    """zlib.crc32 of every key.

    Measured against a table-driven CRC over byte columns (benchmarks/hashing.py), zlib's C loop per key wins:
    a column step costs five NumPy passes per byte, while zlib's per-key overhead is one C call, and zlib
    stays fast for long keys. map() keeps the per-key loop in C, and the answer is zlib's by construction.
    """
    return np.fromiter(map(zlib.crc32, keys.to_pylist()), dtype=_U32, count=len(keys))
