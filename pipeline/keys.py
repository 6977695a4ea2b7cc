"""Keys as the producer's serializer wrote them: serialization of raw keys, their partitions, LMDB keys.

The Arrow functions (`serialize_keys`, `route_keys`, `key_partitions`, `lmdb_keys`) run inside Spark's Arrow
UDFs on whole batches; the column functions put them (or, for text keys, the JVM's own functions) into a
store's build.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

from keyroute.keys.key_format import KeyFormat, KeyFormatError, key_from_value
from keyroute.keys.key_schema import KeySchema
from keyroute.keys.partition_vectorized import partitions as vectorized_partitions
from keyroute.keys.partitioner import Partitioner
from keyroute.pipeline.errors import DataError
from keyroute.pipeline.lmdb_files import is_text
from keyroute.pipeline.sources import INTEGRAL, quoted
from keyroute.pipeline.spec import StoreSpec
from keyroute.storage.lmdb_layout import LMDB_MAX_KEY_BYTES, TAG_HASHED, TAG_KEY, db_keys
from keyroute.storage.timeline import key_parts

ROUTE_TYPE = T.StructType(
    [
        T.StructField("key", T.StringType()),
        T.StructField("partition", T.IntegerType()),
        T.StructField("error", T.StringType()),
    ]
)
# A format-2 store's route also carries each key's LMDB key (columns.LMDB_KEY).
ROUTE_TYPE_WITH_LMDB_KEY = T.StructType([*ROUTE_TYPE.fields, T.StructField("lmdb_key", T.BinaryType())])
# Key formats whose serialized bytes are the canonical text's UTF-8 (Kafka's String and UUID serializers):
# the writer makes their LMDB keys in the JVM (text_lmdb_key_column), the route UDF does not return them.
TEXT_SERIALIZED = frozenset({KeyFormat.STRING, KeyFormat.UUID})

# Kafka's Short/Integer/LongSerializer widths, as in key_format.
_INT_WIDTHS = {KeyFormat.INT16: 2, KeyFormat.INT32: 4, KeyFormat.INT64: 8}
_INT_FORMATS = frozenset(_INT_WIDTHS)
_INT_BOUNDS = {fmt: (-(1 << (8 * n - 1)), (1 << (8 * n - 1)) - 1) for fmt, n in _INT_WIDTHS.items()}
# key_format's syntax checks in RE2, for Arrow's kernels: the same ASCII-only classes, anchored at both ends.
_DECIMAL_PATTERN = r"^-?[0-9]+$"
_UUID_PATTERN = r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"


@dataclass(frozen=True, slots=True)
class SerializedKeys:
    """A batch of raw keys in Kafka's serialized form; each entry has either data and text, or an error."""

    data: pa.Array  # binary: the bytes the producer's serializer wrote, i.e. what is hashed; null on error
    text: pa.Array  # string: the canonical text; null on error
    error: pa.Array  # string: why the key does not fit the key format; null when it does


def serialize_keys(
    keys: pa.Array | pa.ChunkedArray, key_format: KeyFormat, key_schema: KeySchema | None = None
) -> SerializedKeys:
    """Serialize a batch of raw keys (as `raw_key_column` types them) exactly as `key_from_value` does, key for key.

    Batches of well-formed string, integer and uuid keys are serialized by Arrow and NumPy kernels; any other
    batch (bytes keys, or one holding a key that does not fit, which fails the build anyway) key by key.
    """
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    if key_schema is not None:  # Schema Registry keys: by the schema's codec, built once per worker
        return _serialize_per_key(keys, key_format, key_schema)
    return serialize_vectorized(keys, key_format) or _serialize_per_key(keys, key_format)


def route_keys(
    keys: pa.Array,
    key_format: KeyFormat,
    partitioner: Partitioner,
    partitions: int,
    lmdb_key: bool = False,
    timeline: bool = False,
    key_schema: KeySchema | None = None,
) -> pa.StructArray:
    """Canonical text and partition for a batch of raw keys; a key that does not fit gets an error instead.
    With `lmdb_key`, also the LMDB key the node stores it under (`db_key` of the serialized bytes the
    partition was computed from; null for a key that does not fit), or with `timeline` the key part of its
    entries' LMDB keys (keyroute.storage.timeline.key_part).

    Errors are returned, not raised: the driver reports how many keys failed, with examples, rather than
    the first worker traceback.
    """
    serialized = serialize_keys(keys, key_format, key_schema)
    arrays = [serialized.text, _partitions(serialized.data, partitioner, partitions), serialized.error]
    names = ["key", "partition", "error"]
    if lmdb_key:
        arrays.append(key_parts(serialized.data) if timeline else db_keys(serialized.data))
        names.append("lmdb_key")
    return pa.StructArray.from_arrays(arrays, names=names)


def key_partitions(
    keys: pa.Array,
    key_format: KeyFormat,
    partitioner: Partitioner,
    partitions: int,
    key_schema: KeySchema | None = None,
) -> pa.Array:
    """The partition of every raw key as int32, null for a key that does not fit (the audit's record UDF)."""
    return _partitions(serialize_keys(keys, key_format, key_schema).data, partitioner, partitions)


def _partitions(data: pa.Array, partitioner: Partitioner, partitions: int) -> pa.Array:
    if not data.null_count:
        return pa.array(vectorized_partitions(partitioner, data, partitions), pa.int32())
    missing = data.is_null().to_numpy(zero_copy_only=False)
    parts = np.zeros(len(data), dtype=np.int32)
    present = data.drop_null()
    if len(present):
        parts[~missing] = vectorized_partitions(partitioner, present, partitions)
    return pa.array(parts, pa.int32(), mask=missing)


def serialize_vectorized(keys: pa.Array, key_format: KeyFormat) -> SerializedKeys | None:
    """The batch serialized by Arrow/NumPy kernels, or None when it needs `key_from_value` key by key."""
    kind = keys.type
    if key_format is KeyFormat.STRING and is_text(kind):
        # Arrow strings are valid UTF-8, i.e. already the serialized key: the same buffers, seen as bytes.
        binary = pa.large_binary() if pa.types.is_large_string(kind) else pa.binary()
        return SerializedKeys(keys.view(binary), keys.cast(pa.string()), _null_key_errors(keys, key_format))
    if key_format in _INT_WIDTHS:
        numbers = _whole_numbers(keys, key_format)
        if numbers is None:
            return None
        return SerializedKeys(
            _big_endian(numbers, _INT_WIDTHS[key_format]),
            pc.cast(numbers, pa.string()),  # decimal, as str(int): "007" was read as 7 and reads "7"
            _null_key_errors(keys, key_format),
        )
    if key_format is KeyFormat.UUID and is_text(kind) and _all_match(keys, _UUID_PATTERN):
        # Kafka's UUIDSerializer writes the lowercase text; the pattern admits ASCII only.
        text = pc.ascii_lower(keys.cast(pa.string()))
        return SerializedKeys(text.view(pa.binary()), text, _null_key_errors(keys, key_format))
    return None


def _whole_numbers(keys: pa.Array, key_format: KeyFormat) -> pa.Array | None:
    """Integer keys, or strict decimal text, as int64 when every one fits the format; else None."""
    kind = keys.type
    if is_text(kind):
        if not _all_match(keys, _DECIMAL_PATTERN):
            return None
    elif not pa.types.is_integer(kind):
        return None
    try:
        numbers = pc.cast(keys, pa.int64())  # checked: text beyond 64 bits raises rather than wraps
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    low, high = _INT_BOUNDS[key_format]
    bounds = pc.min_max(numbers)
    least, greatest = bounds["min"].as_py(), bounds["max"].as_py()
    if least is not None and not low <= least <= greatest <= high:
        return None
    return numbers


def _big_endian(numbers: pa.Array, width: int) -> pa.Array:
    """int64 values as `width`-byte big-endian two's complement, one binary value each (null stays null)."""
    count = len(numbers)
    values = numbers.fill_null(0).to_numpy()
    # The low `width` bytes of the big-endian int64 are the value's `width`-byte two's complement.
    data = np.ascontiguousarray(values.astype(">i8").view(np.uint8).reshape(count, 8)[:, 8 - width :])
    offsets = np.arange(0, (count + 1) * width, width, dtype=np.int32)
    validity = pc.is_valid(numbers).buffers()[1] if numbers.null_count else None
    return pa.Array.from_buffers(
        pa.binary(),
        count,
        [validity, pa.py_buffer(offsets), pa.py_buffer(data)],
        null_count=numbers.null_count,
    )


def _all_match(keys: pa.Array, pattern: str) -> bool:
    """Whether every non-null key matches `pattern` (RE2 syntax, anchored)."""
    return bool(pc.all(pc.match_substring_regex(keys, pattern)).as_py() is not False)


def _null_key_errors(keys: pa.Array, key_format: KeyFormat) -> pa.Array:
    if not keys.null_count:
        return pa.nulls(len(keys), pa.string())
    # key_from_value's message for a null key.
    message = pa.scalar(f"null key ({key_format.value} keys cannot be null)", pa.string())
    return pc.if_else(keys.is_null(), message, pa.scalar(None, pa.string()))


def _serialize_per_key(keys: pa.Array, key_format: KeyFormat, key_schema: KeySchema | None = None) -> SerializedKeys:
    texts: list[str | None] = []
    datas: list[bytes | None] = []
    errors: list[str | None] = []
    # to_pylist gives exact Python ints/str/bytes: no float detour for int64 keys.
    for value in keys.to_pylist():
        try:
            key = key_from_value(key_format, value, key_schema)
        except KeyFormatError as exc:
            texts.append(None)
            datas.append(None)
            errors.append(str(exc))
            continue
        texts.append(key.text)
        datas.append(key.data)
        errors.append(None)
    return SerializedKeys(pa.array(datas, pa.binary()), pa.array(texts, pa.string()), pa.array(errors, pa.string()))


def lmdb_keys(
    keys: pa.Array,
    parts: pa.Array,
    key_format: KeyFormat,
    partitioner: Partitioner,
    partitions: int,
    verify: bool = True,
    key_schema: KeySchema | None = None,
) -> pa.Array:
    """The LMDB key (`db_key`) of every canonical key text, or null for a key that does not parse or (with
    `verify`) whose serialized bytes do not hash to its row's partition: such a row must never be written."""
    data = serialize_keys(keys, key_format, key_schema).data
    if verify:
        placed = _partitions(data, partitioner, partitions)
        fits = pc.fill_null(pc.equal(placed, pc.cast(parts, pa.int32())), False)
    else:
        fits = pc.is_valid(data)
    return pc.if_else(fits, db_keys(data), pa.scalar(None, pa.binary()))


def raw_key_column(store: StoreSpec, dtype: T.DataType) -> Column:
    """The key column in the one Spark type that key format reads exactly; anything else is refused."""
    column = quoted(store.key)
    fmt = store.key_format
    is_string = isinstance(dtype, T.StringType)
    is_integral = isinstance(dtype, INTEGRAL)
    # JSON gives integers beyond 64 bits as decimal(20,0); as text they meet the range check.
    is_whole_decimal = isinstance(dtype, T.DecimalType) and dtype.scale == 0
    if fmt in _INT_FORMATS:
        if is_integral:
            return column.cast(T.LongType())
        if is_string:  # validated as strict decimal text by the key format
            return column
        if is_whole_decimal:
            return column.cast(T.StringType())
    elif fmt is KeyFormat.STRING:
        if is_string:
            return column
        if is_integral or is_whole_decimal:  # what a producer's StringSerializer got: the decimal text
            return column.cast(T.StringType())
    elif fmt is KeyFormat.UUID:
        if is_string:
            return column
    elif fmt is KeyFormat.BYTES and (is_string or isinstance(dtype, T.BinaryType)):
        return column  # binary as is; text as base64url
    elif fmt.registered:
        if is_string or isinstance(dtype, T.StructType):  # a primitive key or a record key's text; a record
            return column
        if is_integral:
            return column.cast(T.LongType())
        if is_whole_decimal:
            return column.cast(T.StringType())
    expected = {
        KeyFormat.STRING: "string or integer",
        KeyFormat.UUID: "string",
        KeyFormat.BYTES: "binary or base64url string",
        KeyFormat.AVRO: "string, integer or struct",
        KeyFormat.PROTOBUF: "string, integer or struct",
        KeyFormat.JSON_SCHEMA: "string, integer or struct",
    }.get(fmt, "integer or decimal string")
    raise DataError(
        store.name,
        f"key column {store.key!r} has type {dtype.simpleString()}, which cannot hold {fmt.value} keys "
        f"(expected {expected})",
    )


def _router(store: StoreSpec) -> Any:
    key_format, partitioner, partitions = store.key_format, store.partitioner, store.partitions
    key_schema = store.key_schema
    timeline = store.mode.timeline
    lmdb_key = store.snapshot_format != 1 and (timeline or key_format not in TEXT_SERIALIZED)

    def route(keys: pa.Array) -> pa.Array:
        return route_keys(keys, key_format, partitioner, partitions, lmdb_key, timeline, key_schema)

    # arrow_udf: whole Arrow batches in and out, no pandas in between (a scalar Arrow UDF, Spark >= 4.1).
    # The kind is read from the type hints; pyspark's stubs insist on functionType, which it warns about.
    return F.arrow_udf(route, ROUTE_TYPE_WITH_LMDB_KEY if lmdb_key else ROUTE_TYPE)  # type: ignore[call-overload]


def partition_column(store: StoreSpec, raw_key: Column) -> Column:
    """The partition of every raw key (null for a key that does not fit): `key_partitions` in an Arrow UDF."""
    key_format, partitioner, partitions = store.key_format, store.partitioner, store.partitions
    key_schema = store.key_schema

    def partition(keys: pa.Array) -> pa.Array:
        return key_partitions(keys, key_format, partitioner, partitions, key_schema)

    return F.arrow_udf(partition, T.IntegerType())(raw_key)  # type: ignore[call-overload]


def lmdb_key_column(store: StoreSpec, key: Column, partition: Column) -> Column:
    """`lmdb_keys` in an Arrow UDF: the canonical `key` text serialized again with the store's key format,
    checked against `partition`, and laid out as the node's LMDB key (binary, ordered as LMDB orders it).

    The partition check is left out only while a benchmark has swapped `route_step` for one that places
    keys by another hash (`unhashed_route_column`): then no key is where the partitioner puts it.
    """
    key_format, partitioner, partitions = store.key_format, store.partitioner, store.partitions
    key_schema = store.key_schema
    verify = route_step is route_column

    def lmdb_key(keys: pa.Array, parts: pa.Array) -> pa.Array:
        return lmdb_keys(keys, parts, key_format, partitioner, partitions, verify, key_schema)

    return F.arrow_udf(lmdb_key, T.BinaryType())(key, partition)  # type: ignore[call-overload]


def route_column(store: StoreSpec, raw_key: Column) -> Column:
    """struct(key, partition, error) for every raw key: `route_keys` in an Arrow UDF on Spark's workers."""
    return _router(store)(raw_key)


def unhashed_route_column(store: StoreSpec, raw_key: Column) -> Column:
    """FOR BENCHMARKS ONLY: `route_column` without the partition step (no Python UDF, no Kafka hash).

    Keys keep their text and are spread over the store's partitions by Spark's own JVM hash, so the write
    stays as parallel as a real build's; no producer would agree with these partitions.
    """
    placed = F.pmod(F.hash(raw_key), F.lit(store.partitions)).cast(T.IntegerType())
    return F.struct(
        raw_key.cast(T.StringType()).alias("key"),
        placed.alias("partition"),
        F.lit(None).cast(T.StringType()).alias("error"),
    )


def text_lmdb_key_column(key: Column) -> Column:
    """The LMDB key (`db_key`) of a TEXT_SERIALIZED store's canonical `key` text, made by the JVM: the text's
    UTF-8 bytes as Spark holds them (a cast to binary copies them unchanged: the very bytes the route UDF
    received as Arrow strings and computed the partition from), tagged, or hashed when too long for LMDB."""
    data = key.cast(T.BinaryType())
    return F.when(F.length(data) < LMDB_MAX_KEY_BYTES, F.concat(F.lit(bytearray(TAG_KEY)), data)).otherwise(
        F.concat(F.lit(bytearray(TAG_HASHED)), F.unhex(F.sha2(data, 256)))
    )


def routes_lmdb_key(store: StoreSpec) -> bool:
    """Whether compute_store's frame has the LMDB key column (format 2, routed by `route_column`, keys whose
    serialized bytes are not their text's UTF-8)."""
    return (
        store.snapshot_format != 1
        and (store.mode.timeline or store.key_format not in TEXT_SERIALIZED)
        and route_step is route_column
    )


# Internal hook, not a spec option: how compute_store routes keys. Only benchmarks/pipeline.py replaces it
# (with unhashed_route_column), to time the same build with and without the partition step.
route_step: Callable[[StoreSpec, Column], Column] = route_column
