"""Key hashes and partitions for a whole Arrow batch at once, equal key for key to `partitioner`'s functions.

For the pipeline's Arrow UDFs: a few NumPy passes per byte or word column instead of a Python call per key.
"""

from __future__ import annotations

import dataclasses
import operator
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from keyroute.keys.partitioner import (
    _FNV32_OFFSET,
    _FNV32_PRIME,
    _MAX_PARTITIONS,
    _MURMUR2_M,
    _MURMUR2_R,
    _MURMUR2_SEED,
    Partitioner,
    fnv1a_32,
    murmur2,
)

__all__ = ["hashes", "partitions"]

Keys: TypeAlias = pa.Array | pa.ChunkedArray | Sequence[bytes]

# Hash state lives in uint32 *arrays*: their arithmetic wraps modulo 2**32 silently, exactly the Java/C int
# arithmetic being reproduced, whereas NumPy scalars warn on overflow (an error under our pytest config).
_U32 = np.uint32
_M = _U32(_MURMUR2_M)
_PRIME = _U32(_FNV32_PRIME)
# Indexed by len % 4: which bytes of a word are murmur2's tail, and Java's multiply only when there is one.
_TAIL_MASK = np.array([0, 0xFF, 0xFFFF, 0xFFFFFF], dtype=_U32)
_TAIL_MULTIPLIER = np.array([1, _MURMUR2_M, _MURMUR2_M, _MURMUR2_M], dtype=_U32)

# Keys are hashed a chunk at a time so that the per-step arrays stay in cache (Spark's Arrow batches are
# 10,000 rows by default, well under this). The byte cap bounds the word table, 4x the chunk's bytes; a
# single longer key gets a chunk of its own.
_CHUNK_KEYS = 1 << 16
_CHUNK_BYTES = 1 << 22


def hashes(partitioner: Partitioner, keys: Keys) -> np.ndarray:
    """`key_hash(partitioner, key)` for every key, as int64: signed for murmur2, unsigned for crc32 and fnv1a.

    `keys` is a pyarrow binary, large_binary, string or large_string array (strings hash as their UTF-8
    bytes), a ChunkedArray of one of those, or a sequence of bytes. A null key raises ValueError.
    """
    unsigned = _hash32(partitioner, _binary_array(keys))
    if partitioner is Partitioner.MURMUR2:
        # Kafka's Utils.murmur2 returns a Java int: the same bits, read as signed.
        return unsigned.view(np.int32).astype(np.int64)
    return unsigned.astype(np.int64)


def partitions(partitioner: Partitioner, keys: Keys, n: int) -> np.ndarray:
    """`partition_for(partitioner, key, n)` for every key, as int32; `keys` as for `hashes`."""
    count = operator.index(n)
    if not 1 <= count <= _MAX_PARTITIONS:
        raise ValueError(f"partition count must be between 1 and {_MAX_PARTITIONS}, got {count}")
    unsigned = _hash32(partitioner, _binary_array(keys))
    if partitioner is Partitioner.MURMUR2:
        positive = unsigned & 0x7FFFFFFF  # Utils.toPositive: clear the sign bit, not abs
    elif partitioner is Partitioner.CRC32:
        positive = unsigned
    else:
        # |int32(h)|: the uint32 negation of a negative int32 is its magnitude, INT32_MIN's 2**31 included,
        # which is what Sarama's negated remainder and librdkafka's no-op abs amount to (see partition_for).
        positive = np.where(unsigned & 0x80000000, -unsigned, unsigned)
    return (positive % _U32(count)).astype(np.int32)


def _binary_array(keys: Keys) -> pa.Array:
    """`keys` as a null-free binary or large_binary array (zero-copy for Arrow input)."""
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()  # a table column; this copies only when there are several chunks
    if not isinstance(keys, pa.Array):
        keys = pa.array(keys, type=pa.binary())
    kind = keys.type
    if pa.types.is_string(kind):
        keys = keys.view(pa.binary())  # the same buffers: the UTF-8 bytes are the key
    elif pa.types.is_large_string(kind):
        keys = keys.view(pa.large_binary())
    elif not (pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        raise TypeError(f"keys must be a binary or string array, got {kind}")
    if keys.null_count:
        # A producer sends a null key to a partition of its own choosing: no hash decides it.
        raise ValueError(f"{keys.null_count} of {len(keys)} keys are null; a null key has no partition")
    return keys


def _buffers(keys: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The array's len + 1 offsets as intp, and its whole data buffer as uint8 (not copied)."""
    _, offsets_buffer, data_buffer = keys.buffers()
    offset_type = np.dtype(np.int64 if pa.types.is_large_binary(keys.type) else np.int32)
    if offsets_buffer is None:
        offsets = np.zeros(len(keys) + 1, dtype=np.intp)
    else:
        # A sliced array shares its parent's buffers: its offsets start at index keys.offset and point into
        # the parent's whole data buffer.
        offsets = np.frombuffer(
            offsets_buffer, dtype=offset_type, count=len(keys) + 1, offset=keys.offset * offset_type.itemsize
        ).astype(np.intp)
    data = np.empty(0, dtype=np.uint8) if data_buffer is None else np.frombuffer(data_buffer, dtype=np.uint8)
    return offsets, data


def _chunks(offsets: np.ndarray) -> Iterator[tuple[int, int]]:
    """[first, stop) key ranges: up to _CHUNK_KEYS keys and _CHUNK_BYTES bytes, or one key that is longer."""
    count = len(offsets) - 1
    first = 0
    while first < count:
        stop = min(first + _CHUNK_KEYS, count)
        if offsets[stop] - offsets[first] > _CHUNK_BYTES:
            fitting = int(np.searchsorted(offsets, offsets[first] + _CHUNK_BYTES, side="right")) - 1
            stop = max(fitting, first + 1)
        yield first, stop
        first = stop


@dataclass(frozen=True, slots=True)
class _KeyChunk:
    """Consecutive keys of a batch, sorted longest first.

    Sorted by length, "the keys that still have a byte (or word) at index i" is a prefix of the order for
    every i, so each column step works on a contiguous slice, and a long key costs only its own extra
    steps rather than a pass over the whole chunk per extra byte.
    """

    order: np.ndarray  # intp: position in the chunk of each key, longest first (stable among equal lengths)
    lengths: np.ndarray  # intp: key lengths, in `order` (non-increasing)
    negated_lengths: np.ndarray  # intp: -lengths, ascending, for searchsorted
    starts: np.ndarray  # intp: offset of each key in `key_bytes`, in `order`
    key_bytes: np.ndarray  # uint8: the chunk's keys, back to back, as in the Arrow data buffer

    @classmethod
    def of(cls, offsets: np.ndarray, data: np.ndarray) -> _KeyChunk:
        first_byte = int(offsets[0])
        key_bytes = data[first_byte : int(offsets[-1])]
        lengths: npt.NDArray[np.intp] = np.diff(offsets)
        # A stable sort keeps equal-length keys in buffer order, so gathers walk memory forwards; lengths that
        # fit 16 bits take NumPy's radix sort.
        narrow = np.int16 if len(lengths) and int(lengths.max()) < 1 << 15 else np.intp
        order = np.argsort((-lengths).astype(narrow), kind="stable")
        starts = offsets[:-1][order] - first_byte
        sorted_lengths: npt.NDArray[np.intp] = lengths[order]
        return cls(order, sorted_lengths, -sorted_lengths, starts, key_bytes)

    @property
    def size(self) -> int:
        return len(self.lengths)

    def longer_than(self, length: int) -> int:
        """How many keys have more than `length` bytes: the prefix that a step at that byte touches."""
        return int(np.searchsorted(self.negated_lengths, -length, side="left"))

    def words(self) -> tuple[np.ndarray, np.ndarray]:
        """The chunk's bytes as aligned little-endian words, and the index there of each key's first word.

        Row r of the (4, columns) table holds the bytes from byte r on, so the 4 bytes at any offset p are
        the one aligned element [p % 4, p // 4]: NumPy gathers aligned uint32 several times faster than from
        an unaligned strided view of the bytes. Rows end with at least a word of zeros, so reading the word
        that holds a key's tail never leaves the table. The table is returned flat.
        """
        columns = len(self.key_bytes) // 4 + 1
        table = np.zeros((4, columns), dtype="<u4")
        table_bytes = table.view(np.uint8)
        for row in range(min(4, len(self.key_bytes))):
            table_bytes[row, : len(self.key_bytes) - row] = self.key_bytes[row:]
        first_words = (self.starts & 3) * columns + (self.starts >> 2)
        return table.ravel(), first_words

    def longest_keys(self, count: int) -> list[bytes]:
        """The first `count` keys in `order`, as bytes."""
        chunk = self.key_bytes.tobytes()
        spans = zip(self.starts[:count].tolist(), self.lengths[:count].tolist(), strict=True)
        return [chunk[start : start + length] for start, length in spans]

    def without_longest(self, count: int) -> _KeyChunk:
        return dataclasses.replace(
            self,
            order=self.order[count:],
            lengths=self.lengths[count:],
            negated_lengths=self.negated_lengths[count:],
            starts=self.starts[count:],
        )

    def unsort(self, sorted_values: np.ndarray) -> np.ndarray:
        result = np.empty_like(sorted_values)
        result[self.order] = sorted_values
        return result


@dataclass(frozen=True, slots=True)
class _HashKind:
    """How to compute one partitioner's hash: column-wise for most keys, the scalar function for the rest.

    A column step has a fixed cost of a few microseconds of NumPy calls, so bytes that only a handful of
    keys reach are cheaper hashed per key; and CRC-32's table steps cost more per byte than zlib does.
    """

    columnwise: Callable[[_KeyChunk], np.ndarray]  # hashes of a chunk's keys, in its (sorted) order
    per_key: Callable[[bytes], int]
    per_key_above: int  # keys longer than this many bytes are hashed per key...
    per_key_at_most: int | None  # ...but only the longest this many of them (None: all of them)

    def per_key_count(self, chunk: _KeyChunk) -> int:
        """How many of the chunk's longest keys to hash per key."""
        limit = self.per_key_above
        if self.per_key_at_most is not None and chunk.size > self.per_key_at_most:
            limit = max(limit, int(chunk.lengths[self.per_key_at_most]))
        return chunk.longer_than(limit)

    def hash_chunk(self, chunk: _KeyChunk) -> np.ndarray:
        hashed = np.empty(chunk.size, dtype=_U32)
        per_key = self.per_key_count(chunk)
        if per_key < chunk.size:
            hashed[per_key:] = self.columnwise(chunk.without_longest(per_key))
        if per_key:
            # int64 holds both murmur2's signed and the others' unsigned results; the cast keeps the low bits.
            scalar = map(self.per_key, chunk.longest_keys(per_key))
            hashed[:per_key] = np.fromiter(scalar, dtype=np.int64, count=per_key).astype(_U32)
        return chunk.unsort(hashed)


def _hash32(partitioner: Partitioner, keys: pa.Array) -> np.ndarray:
    """The partitioner's hash of every key as its uint32 bit pattern, in batch order."""
    # Partitioner is a StrEnum: the isinstance check keeps a plain "murmur2" out, as partition_for does.
    kind = _HASH_KINDS.get(partitioner) if isinstance(partitioner, Partitioner) else None
    if kind is None:
        raise ValueError(f"unknown partitioner {partitioner!r}")
    offsets, data = _buffers(keys)
    result = np.empty(len(keys), dtype=_U32)
    for first, stop in _chunks(offsets):
        result[first:stop] = kind.hash_chunk(_KeyChunk.of(offsets[first : stop + 1], data))
    return result


def _murmur2_columns(chunk: _KeyChunk) -> np.ndarray:
    """Kafka's Utils.murmur2 over word columns: word i of every key that has one, then every key's tail."""
    lengths = chunk.lengths
    h = lengths.astype(_U32)
    h ^= _MURMUR2_SEED
    words, position = chunk.words()  # position: each key's next word, advanced in place
    word = 0
    while (active := chunk.longer_than(4 * word + 3)) > 0:
        k = words[position[:active]]
        k *= _M
        k ^= k >> _MURMUR2_R
        k *= _M
        head = h[:active]
        head *= _M
        head ^= k
        position[:active] += 1
        word += 1
    # `position` now points at the word after each key's last whole one. Java's switch falls through,
    # xoring byte 2 << 16, byte 1 << 8 and byte 0: together, the low len % 4 bytes of that word.
    tail = lengths & 3
    h ^= words[position] & _TAIL_MASK[tail]
    h *= _TAIL_MULTIPLIER[tail]
    h ^= h >> 13
    h *= _M
    h ^= h >> 15
    return h


def _fnv1a_columns(chunk: _KeyChunk) -> np.ndarray:
    """32-bit FNV-1a over byte columns, gathering four columns (one word) at a time."""
    h = np.full(chunk.size, _FNV32_OFFSET, dtype=_U32)
    words, position = chunk.words()
    word = 0
    while (active := chunk.longer_than(4 * word)) > 0:
        # Little-endian words, so column j of the byte view is byte 4 * word + j of each key.
        key_bytes = words[position[:active]].view(np.uint8).reshape(active, 4)
        for column in range(4):
            head = h[: chunk.longer_than(4 * word + column)]
            head ^= key_bytes[: len(head), column]
            head *= _PRIME
        position[:active] += 1
        word += 1
    return h


def _crc32_tables() -> np.ndarray:
    """Slicing-by-4 tables for the reflected CRC-32 polynomial (zlib's): row k advances a byte by k more."""
    table = np.arange(256, dtype=_U32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ 0xEDB88320, table >> 1)
    rows = [table]
    for _ in range(3):
        rows.append((rows[-1] >> 8) ^ table[rows[-1] & 0xFF])
    return np.stack(rows)


_CRC32_TABLES = _crc32_tables()


def _crc32_columns(chunk: _KeyChunk) -> np.ndarray:
    """zlib's CRC-32 over word columns (slicing-by-4: four independent table lookups per word), then tails."""
    table0, table1, table2, table3 = _CRC32_TABLES
    h = np.full(chunk.size, 0xFFFFFFFF, dtype=_U32)
    words, position = chunk.words()
    word = 0
    while (active := chunk.longer_than(4 * word + 3)) > 0:
        head = h[:active]
        head ^= words[position[:active]]
        mixed = table3[head & 0xFF]
        mixed ^= table2[(head >> 8) & 0xFF]
        mixed ^= table1[(head >> 16) & 0xFF]
        mixed ^= table0[head >> 24]
        head[:] = mixed
        position[:active] += 1
        word += 1
    # The last len % 4 bytes go one at a time; tail lengths are not sorted, so every key steps and keeps the
    # result only where it has that byte.
    tail = chunk.lengths & 3
    tail_bytes = words[position].view(np.uint8).reshape(chunk.size, 4)
    for column in range(3):
        stepped = (h >> 8) ^ table0[(h ^ tail_bytes[:, column]) & 0xFF]
        h = np.where(tail > column, stepped, h)
    h ^= 0xFFFFFFFF
    return h


# Thresholds measured on the project's 2-core machines: the scalar murmur2 and fnv1a take ~0.6 us per word and
# ~0.18 us per byte, a column step 3-10 us, so a column pays once some 30 keys share it; per key, zlib.crc32
# overtakes the table steps at 64-100 bytes (1 KiB keys: zlib ~6x faster, 16-36 bytes: columns ~2x).
_HASH_KINDS = {
    Partitioner.MURMUR2: _HashKind(_murmur2_columns, murmur2, per_key_above=256, per_key_at_most=32),
    Partitioner.FNV1A: _HashKind(_fnv1a_columns, fnv1a_32, per_key_above=256, per_key_at_most=32),
    # zlib.crc32 itself, not partitioner.crc32: that is the same function behind one more Python call.
    Partitioner.CRC32: _HashKind(_crc32_columns, zlib.crc32, per_key_above=64, per_key_at_most=None),
}
