"""How many bytes of JSON a row's value may take as `to_json` spells it: a bound counted while the compute
pass checks the frame, by which keyroute.pipeline.writer sizes its Arrow batches.
"""

from __future__ import annotations

from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

from keyroute.pipeline.columns import STATE

# The most bytes `to_json` spells a value of each scalar type in (quotes included): integers with sign,
# floats as Java prints them (-1.2345678901234567E-308, -Infinity), decimals of up to 38 digits with sign,
# point and exponent, dates and timestamps with the widest years, `null` for any of them.
_JSON_SCALAR_BYTES: dict[type[T.DataType], int] = {
    T.NullType: 4,
    T.BooleanType: 5,
    T.ByteType: 20,
    T.ShortType: 20,
    T.IntegerType: 20,
    T.LongType: 20,
    T.FloatType: 32,
    T.DoubleType: 32,
    T.DecimalType: 64,
    T.DateType: 40,
    T.TimestampType: 64,
    T.TimestampNTZType: 64,
}


def json_bounded(value_type: T.DataType) -> bool:
    """Whether `json_bytes` bounds a value of this type: a struct of scalar fields (the JSON length of its
    string and binary fields depends on the data, `row_text_bytes`); any other value is not bounded here."""
    return isinstance(value_type, T.StructType) and all(
        isinstance(field.dataType, (T.StringType, T.BinaryType)) or type(field.dataType) in _JSON_SCALAR_BYTES
        for field in value_type.fields
    )


def row_text_bytes(value_type: T.DataType, state: bool) -> Column:
    """Per row, the bytes `to_json` may spell its value's string and binary fields in beyond `json_bytes`'s
    fixed part (a string escapes to at most 6 bytes per byte, \\u00XX; binary is base64), plus its merge
    state's JSON. A column of the cached frame, made as the cache is built: the check job then reads one
    integer per row, not the value (reading a struct back from Spark's cache costs far more)."""
    assert isinstance(value_type, T.StructType)
    parts = []
    for field in value_type.fields:
        size = F.coalesce(F.octet_length(F.col("value").getField(field.name)), F.lit(0))
        if isinstance(field.dataType, T.StringType):
            parts.append(size * 6)
        elif isinstance(field.dataType, T.BinaryType):
            parts.append((F.floor(size / 3) + 1) * 4)
    if state:
        parts.append(F.coalesce(F.octet_length(F.col(STATE)), F.lit(0)))
    total = F.lit(0)
    for part in parts:
        total = total + part
    return total.cast(T.LongType())


def json_bytes(value_type: T.DataType, longest_text_bytes: int) -> int:
    """An upper bound of the bytes of one row's value as `to_json` spells it (object braces, every field's
    escaped name, colon and comma, its value), plus its merge state's JSON: the fixed part of every field
    (a string's or binary's quotes, or null), and the most any row's `row_text_bytes` came to."""
    assert isinstance(value_type, T.StructType)
    total = 2
    for field in value_type.fields:
        name = 6 * len(field.name.encode("utf-8")) + 2
        if isinstance(field.dataType, (T.StringType, T.BinaryType)):
            value = 4  # the quotes (the rest is the row's text bytes), or null
        else:
            value = max(_JSON_SCALAR_BYTES[type(field.dataType)], 4)
        total += name + 1 + value + 1
    return total + longest_text_bytes
