"""The store spec: which stores to build, from which source (and for live stores, which Kafka topic), keyed
and partitioned how.

Parsed strictly from TOML into frozen values; every mistake is a SpecError naming the store and the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keyroute.formats.value_format import check_value_format
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.key_schema import KeySchema
from keyroute.keys.partitioner import Partitioner
from keyroute.keys.schema_registry import RegistrySettings
from keyroute.pipeline.errors import SpecError
from keyroute.pipeline.order_args import ordering_arguments
from keyroute.storage.live import (
    DEFAULT_CATCH_UP_RECORDS,
    ON_BAD_RECORD,
    STARTS,
    Aggregate,
    LiveSpecError,
    Merge,
    check_kafka_settings,
    parse_aggregate,
)
from keyroute.storage.timeline import Timeline, TimelineError, TimeType, duration_in_units, parse_duration_us

# Store names become ZooKeeper node names and directory names: nothing that needs escaping anywhere.
_STORE_NAME = re.compile(r"[A-Za-z0-9_.-]+", re.ASCII)
# A URI scheme (RFC 3986) followed by ':': such sources are handed to Spark untouched.
_URI_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:", re.ASCII)
# Kafka's partition count is a Java int.
_MAX_PARTITIONS = 0x7FFFFFFF


class SourceFormat(enum.StrEnum):
    """How the source files are encoded."""

    JSON = "json"  # JSON lines
    CSV = "csv"  # with a header line
    PARQUET = "parquet"
    ORC = "orc"


class Mode(enum.StrEnum):
    """How a store turns many events per key into one value per key."""

    LATEST = "latest"  # the row with the greatest `order_by` (a KTable)
    AGGREGATE = "aggregate"  # Spark SQL aggregate expressions over all rows of the key
    HISTORY = "history"  # every row of the key, in `order_by` order (bounded by `retention`)
    WINDOWED = "windowed"  # the aggregations per key and time `window` of `order_by`

    @property
    def timeline(self) -> bool:
        """Whether the store keeps many entries per key, in time order (keyroute.storage.timeline)."""
        return self is Mode.HISTORY or self is Mode.WINDOWED


@dataclass(frozen=True, slots=True)
class LiveSpec:
    """A store's `[stores.NAME.live]` table: the Kafka topic it follows, partitioned as the store is.

    `kafka` holds extra consumer settings, secrets only as `${ENV}` references; `start` says where a live
    store without `source` begins (its versions are empty; each build resolves it to offsets).
    """

    topic: str
    bootstrap_servers: str
    kafka: Mapping[str, str] = field(default_factory=dict)
    start: str = STARTS[0]
    on_bad_record: str = ON_BAD_RECORD[0]
    catch_up_records: int = DEFAULT_CATCH_UP_RECORDS
    # How values are written: JSON objects, or a Schema Registry format (then `schema_registry` says where
    # the registry is; keyroute.formats.value_format).
    value_format: str = "json"
    schema_registry: RegistrySettings | None = None


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """One store as the spec describes it; `source` is absolute (or a URI) once parsed.

    A store has a batch part (a batch store; with `live`, a hybrid one) read from one of `source` (files in
    `format`, read with the reader `options`), `source_table` (a table of the Spark session's catalog) or
    `source_sql` (a Spark SQL query), or only `live` (then all three are None and every version starts
    empty).
    """

    name: str
    source: str | None
    format: SourceFormat | None
    key: str
    partitions: int
    mode: Mode
    source_table: str | None = None
    source_sql: str | None = None
    # Spark reader options for `source`, as the text Spark takes (`header = true` is "true").
    options: Mapping[str, str] = field(default_factory=dict)
    key_format: KeyFormat = KeyFormat.STRING
    partitioner: Partitioner = Partitioner.MURMUR2
    replication_factor: int = 1
    order_by: str | None = None
    columns: tuple[str, ...] | None = None  # None: every source column but the key
    aggregations: Mapping[str, str] = field(default_factory=dict)
    # The Kafka partition each source record was produced to: when set, the build audits every record's.
    source_partition_column: str | None = None
    # How versions are written: 2 = ready-to-serve LMDB files per partition (keyroute-snapshot/2); 1 = JSON
    # lines (keyroute-snapshot/1, local outputs only) for nodes that do not read format 2 yet.
    snapshot_format: int = 2
    # The Kafka topic the store follows; None for a batch store.
    live: LiveSpec | None = None
    # The Kafka offset of each source record (a hybrid store's source is the topic's archive): where the
    # version's batch part ends in each partition.
    source_offset_column: str | None = None
    # History and windowed stores: how much of each key's timeline is kept (`Retention`), the window and
    # how far windows advance (duration texts; `advance` None: tumbling windows).
    retention: Retention | None = None
    window: str | None = None
    advance: str | None = None
    # The type the store's orderings (`order_by`; the ordering argument of max_by and min_by) are compared as:
    # how a text column is read (never compared as text), and a live store's when no source tells it.
    order_by_type: TimeType | None = None
    # Schema Registry keys (key_format avro/protobuf/json_schema): the subject whose latest schema, or the
    # schema id, the producer serializes keys with; `key_message` names a Protobuf key's message type.
    key_subject: str | None = None
    key_schema_id: int | None = None
    key_message: str = ""
    # The registry the build resolves the key schema from: the store's `schema_registry` table, else its live
    # values' one.
    schema_registry: RegistrySettings | None = None
    # The key schema as the build resolved it (id and text), recorded in the store's record: None until then.
    key_schema: KeySchema | None = None
    # How old a value (history row) may be and still be served, a duration text (keyroute.storage.ttl).
    ttl: str | None = None
    # The store this one is co-located with: partition p of both placed on the same replicas. It has the
    # same partition count and partitioner (checked against the spec, or its published record).
    colocate_with: str | None = None

    @property
    def batch(self) -> bool:
        """Whether the store has a batch part to read with Spark (else it is a live store without one)."""
        return self.source is not None or self.source_table is not None or self.source_sql is not None

    def describe_source(self) -> str:
        """The batch part as messages name it: "source '/data/x'", "source_table 'db.t'" or "source_sql"."""
        if self.source_table is not None:
            return f"source_table {self.source_table!r}"
        if self.source_sql is not None:
            return "source_sql"
        return f"source {self.source!r}"

    def merge(
        self,
        value_columns: tuple[str, ...] | None = None,
        timeline: Timeline | None = None,
        order_types: Mapping[str, TimeType | None] | None = None,
    ) -> Merge:
        """How the live topic's records fold into this store's values (keyroute.storage.live), keeping
        `value_columns` (a `latest` or `history` store's answer columns as the batch part holds them) when
        given; a history store's records are rows of `timeline`. `order_types` are the types the build
        ordered each ordering column as (keyroute.pipeline.ordering; None: numbers); a column it does not
        name (a live store without `source`) is ordered as `order_by_type`."""
        types = {} if order_types is None else order_types

        def order_type(column: str | None) -> str | None:
            if column is None:
                return None
            if timeline is not None and column == self.order_by:
                return timeline.time_type.value
            found = types.get(column, self.order_by_type)
            return None if found is None else found.value

        def aggregates() -> tuple[Aggregate, ...]:
            parsed = (parse_aggregate(name, expr) for name, expr in self.aggregations.items())
            return tuple(dataclasses.replace(a, by_type=order_type(a.by)) if a.by else a for a in parsed)

        if self.mode is Mode.HISTORY:
            assert self.order_by is not None
            # The source's type (the version's timeline), else the spec's; a config made only for the
            # consumer's settings (before any source is read) folds nothing.
            time_type = timeline.time_type if timeline is not None else self.order_by_type or TimeType.TIMESTAMP
            columns = self.columns if value_columns is None else value_columns
            retention = self.retention
            span = None
            if retention is not None and retention.duration is not None:
                span = duration_in_units(retention.duration, time_type)
            return Merge(
                "history",
                self.key,
                order_by=self.order_by,
                columns=columns or None,
                time_type=time_type.value,
                retention_count=None if retention is None else retention.count,
                retention_span=span,
            )
        if self.mode is Mode.WINDOWED:
            assert self.order_by is not None and self.window is not None
            time_type = timeline.time_type if timeline is not None else self.order_by_type or TimeType.TIMESTAMP
            retention = self.retention
            window = duration_in_units(self.window, time_type)
            return Merge(
                "windowed",
                self.key,
                order_by=self.order_by,
                aggregates=aggregates(),
                time_type=time_type.value,
                window=window,
                advance=window if self.advance is None else duration_in_units(self.advance, time_type),
                retention_count=None if retention is None else retention.count,
                retention_span=None
                if retention is None or retention.duration is None
                else duration_in_units(retention.duration, time_type),
            )
        if self.mode is Mode.LATEST:
            columns = self.columns if value_columns is None else value_columns
            return Merge(
                "latest", self.key, order_by=self.order_by, columns=columns, time_type=order_type(self.order_by)
            )
        return Merge("aggregate", self.key, aggregates=aggregates())


@dataclass(frozen=True, slots=True)
class Retention:
    """How much of a key's timeline a history or windowed store keeps: its last `count` entries, or the
    entries whose time is within `duration` (a duration text) of the store's latest time."""

    text: str
    count: int | None = None
    duration: str | None = None


_RETENTION_COUNT = re.compile(r"\s*([0-9]+)\s*(rows?|windows?)\s*", re.IGNORECASE)


def _parse_retention(name: str, value: Any) -> Retention | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = f"{value} rows"
    if not isinstance(value, str):
        raise SpecError(name, f'\'retention\' must be a text such as "1000 rows" or "30 days", got {value!r}')
    counted = _RETENTION_COUNT.fullmatch(value)
    if counted is not None:
        count = int(counted.group(1))
        if count < 1:
            raise SpecError(name, f"'retention' = {value!r}: keep at least 1")
        return Retention(value, count=count)
    try:
        parse_duration_us(value)
    except TimelineError as exc:
        raise SpecError(name, f"'retention': {exc}; or a count such as \"1000 rows\"") from None
    return Retention(value, duration=value)


def _parse_ttl(name: str, value: Any, mode: Mode, order_by: str | None, columns: tuple[str, ...] | None) -> str | None:
    """`ttl`: a positive duration text, on a store whose values carry their time (keyroute.storage.ttl): a
    `history` store's rows, a `latest` store's values when they hold its `order_by` column."""
    text = _duration_field(name, "ttl", value)
    if text is None:
        return None
    if parse_duration_us(text) <= 0:
        raise SpecError(name, f"'ttl' = {text!r}: expected a positive duration")
    if mode not in (Mode.LATEST, Mode.HISTORY):
        raise SpecError(
            name,
            "'ttl' applies to modes 'latest' and 'history' (values that carry their time); "
            f"a {mode.value} store's values have no time of their own",
        )
    if mode is Mode.LATEST and columns is not None and order_by not in columns:
        raise SpecError(
            name, f"'ttl' ages a value by its order_by {order_by!r}: add it to 'columns' so values carry it"
        )
    return text


def _duration_field(name: str, field_name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise SpecError(name, f"'{field_name}' must be a duration text such as \"5 minutes\", got {value!r}")
    try:
        parse_duration_us(value)
    except TimelineError as exc:
        raise SpecError(name, f"'{field_name}': {exc}") from None
    return value


@dataclass(frozen=True, slots=True)
class SparkSpec:
    """The spec's `[spark]` table: Spark settings (`spark.*` names, text values) the build's SparkSession runs
    with, such as the catalogs `source_table` and `source_sql` read (keyroute.pipeline.session applies
    them). A relative `spark.sql.warehouse.dir` is taken relative to the spec file."""

    conf: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Spec:
    """Every store of one spec file, in the order the file lists them, and the Spark settings they need."""

    stores: tuple[StoreSpec, ...]
    spark: SparkSpec = field(default_factory=SparkSpec)

    def store(self, name: str) -> StoreSpec:
        for store in self.stores:
            if store.name == name:
                return store
        raise KeyError(name)


_FIELDS = (
    "source",
    "source_table",
    "source_sql",
    "format",
    "options",
    "key",
    "key_format",
    "partitions",
    "partitioner",
    "replication_factor",
    "mode",
    "order_by",
    "columns",
    "aggregations",
    "source_partition_column",
    "source_offset_column",
    "snapshot_format",
    "live",
    "retention",
    "ttl",
    "colocate_with",
    "window",
    "advance",
    "order_by_type",
    "key_subject",
    "key_schema_id",
    "key_message",
    "schema_registry",
)
_LIVE_FIELDS = (
    "topic",
    "bootstrap_servers",
    "kafka",
    "start",
    "on_bad_record",
    "catch_up_records",
    "value_format",
    "schema_registry",
)
# The snapshot formats a spec may ask for (keyroute.storage.snapshot.FORMAT_1, FORMAT_2).
SNAPSHOT_FORMATS = (1, 2)
# Where a store's batch part is read from: exactly one of these, or none for a live-only store.
_SOURCE_FIELDS = ("source", "source_table", "source_sql")
# Spark settings keyroute decides itself: the master is the CLI's --master, and times are read in UTC.
_FIXED_SPARK = {
    "spark.master": "use the --master option",
    "spark.sql.session.timeZone": "keyroute reads and writes times in UTC",
}
_WAREHOUSE_DIR = "spark.sql.warehouse.dir"


def load_spec(path: Path) -> Spec:
    """Read and check a spec file; relative sources are taken relative to the file's directory."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecError(None, f"spec {str(path)!r}: cannot be read ({exc.strerror or exc})") from exc
    try:
        text = raw.decode("utf-8")
        doc = tomllib.loads(text)
    except UnicodeDecodeError as exc:
        raise SpecError(None, f"spec {str(path)!r}: not valid TOML ({exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        # The parser reads a header's key before its ']': `[stores.x` after `[stores.x]` is "declared twice".
        unclosed = unclosed_header(text)
        if unclosed is not None:
            number, line = unclosed
            raise SpecError(
                None, f"spec {str(path)!r}: line {number}: table header {line!r} is not closed (a ']' is missing)"
            ) from exc
        raise SpecError(None, f"spec {str(path)!r}: not valid TOML ({exc})") from exc
    return parse_spec(doc, base_dir=path.resolve().parent, origin=str(path))


def unclosed_header(text: str) -> tuple[int, str] | None:
    """The first line (1-based number, text) that opens a table header (`[stores.x`, `[[x]`) without closing
    it; None when every header is closed. Only asked once the parser failed: a line of a multi-line array may
    start with '[' too."""
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped.startswith("["):
            continue
        opened = 2 if stripped.startswith("[[") else 1
        closing = 0
        quote = None
        for char in stripped[opened:]:
            if quote is not None:
                if char == quote:
                    quote = None
            elif char in "\"'":
                quote = char
            elif char == "#" or (closing and char != "]"):
                break
            elif char == "]":
                closing += 1
            elif char in ",={":  # a line of an array value, not a header
                closing = opened
                break
        if closing < opened:
            return number, stripped
    return None


def did_you_mean(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to `name` (difflib's, case-insensitive), or None when none is close."""
    by_lower = {k.lower(): k for k in known}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1)
    return by_lower[close[0]] if close else None


def unknown_field(name: str, known: tuple[str, ...], prefix: str = "") -> str:
    """What to say about an unknown field: the close one it may be a typo of, else every field there is."""
    near = did_you_mean(name, known)
    if near is not None:
        return f"unknown field {prefix + name!r} (did you mean {prefix + near!r}?)"
    return f"unknown field {prefix + name!r} (expected some of: {', '.join(known)})"


def parse_spec(doc: Mapping[str, Any], base_dir: Path, origin: str = "spec") -> Spec:
    """Check a decoded spec document; `base_dir` anchors relative source paths."""
    unknown = sorted(set(doc) - {"stores", "spark"})
    if unknown:
        near = did_you_mean(unknown[0], ("stores", "spark"))
        hint = f" (did you mean {near!r}?)" if near else ""
        raise SpecError(
            None,
            f"spec {origin!r}: unknown top-level key {unknown[0]!r}{hint} (only [spark] and [stores.NAME] tables)",
        )
    stores = doc.get("stores")
    if not isinstance(stores, dict) or not stores:
        raise SpecError(None, f"spec {origin!r}: defines no stores (expected at least one [stores.NAME] table)")
    parsed = tuple(_parse_store(name, table, base_dir) for name, table in stores.items())
    by_name = {store.name: store for store in parsed}
    for store in parsed:
        other = by_name.get(store.colocate_with or "")
        if other is not None and (problem := colocation_mismatch(store, other.partitions, other.partitioner)):
            raise SpecError(store.name, problem)
    return Spec(stores=parsed, spark=_parse_spark(doc.get("spark", {}), base_dir, origin))


def colocation_mismatch(store: StoreSpec, partitions: int, partitioner: Partitioner) -> str | None:
    """Why `store` cannot be co-located with its `colocate_with` store of `partitions` and `partitioner`
    (None: it can): a key must be in partition p of both."""
    if (store.partitions, store.partitioner) == (partitions, partitioner):
        return None
    return (
        f"'colocate_with' = {store.colocate_with!r}: that store has {partitions} partitions ({partitioner.value}),"
        f" this one {store.partitions} ({store.partitioner.value}); co-located stores need the same partition"
        " count and partitioner"
    )


def _parse_spark(table: Any, base_dir: Path, origin: str) -> SparkSpec:
    """The `[spark]` table: `spark.*` settings with text, boolean or number values. Dotted names may be
    quoted (`"spark.sql.warehouse.dir" = ...`) or nested tables (TOML's unquoted dotted keys): both are read
    as the dotted name."""
    if not isinstance(table, dict):
        raise SpecError(None, f"spec {origin!r}: 'spark' must be a table ([spark]) of Spark settings, got {table!r}")
    conf: dict[str, str] = {}
    for name, value in _flattened(table):
        what = f"spec {origin!r}: [spark] {name!r}"
        if not name.startswith("spark."):
            raise SpecError(None, f"{what}: Spark settings are named spark.* (e.g. 'spark.sql.warehouse.dir')")
        if name in _FIXED_SPARK:
            raise SpecError(None, f"{what} cannot be set in a spec: {_FIXED_SPARK[name]}")
        if name in conf:
            raise SpecError(None, f"{what} is set twice (once quoted, once as dotted keys)")
        text = setting_text(value)
        if text is None:
            raise SpecError(None, f"{what} must be a string, boolean or number, got {value!r}")
        if name == _WAREHOUSE_DIR:
            text = _resolve_source(text, base_dir)
        conf[name] = text
    return SparkSpec(conf)


def _flattened(table: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for name, value in table.items():
        if isinstance(value, dict) and value:
            yield from _flattened(value, f"{prefix}{name}.")
        else:
            yield prefix + name, value


def setting_text(value: Any) -> str | None:
    """A TOML value as the text Spark takes for a setting or reader option (true, 10, 0.5, "x"); None for
    a value of another type (an array, a table, a date)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    return None


def _parse_store(name: str, table: Any, base_dir: Path) -> StoreSpec:
    if not _STORE_NAME.fullmatch(name) or name in (".", ".."):
        raise SpecError(name, "invalid store name (use only letters, digits, '_', '.' and '-')")
    if not isinstance(table, dict):
        raise SpecError(name, "must be a table ([stores.NAME])")
    fields = _Fields(name, table)
    unknown = sorted(set(table) - set(_FIELDS))
    if unknown:
        raise SpecError(name, unknown_field(unknown[0], _FIELDS))

    key = fields.required_text("key")
    mode = fields.choice("mode", Mode, required=True)
    order_by = fields.text("order_by")
    columns = fields.names("columns")
    aggregations = fields.aggregations()
    source_partition_column = fields.text("source_partition_column")
    if source_partition_column == key:
        raise SpecError(name, f"'source_partition_column' names the key column {key!r}")
    source = fields.text("source")
    source_table = fields.text("source_table")
    source_sql = fields.text("source_sql")
    given = [f for f, v in zip(_SOURCE_FIELDS, (source, source_table, source_sql), strict=True) if v is not None]
    if len(given) > 1:
        raise SpecError(
            name, f"give one of 'source', 'source_table' or 'source_sql', not both {given[0]!r} and {given[1]!r}"
        )
    batch = bool(given)
    live = _parse_live(name, table.get("live"), has_source=batch)
    if not batch and live is None:
        raise SpecError(
            name,
            "missing required field 'source' (or 'source_table', 'source_sql', or a [stores.NAME.live] table: "
            "a live store)",
        )
    source_format = fields.choice("format", SourceFormat, required=source is not None)
    if source is None and source_format is not None:
        raise SpecError(name, _only_for_files("format", given))
    options = fields.options()
    if source is None and options:
        raise SpecError(name, _only_for_files("options", given))
    source_offset_column = fields.text("source_offset_column")
    snapshot_format = fields.snapshot_format()
    retention = _parse_retention(name, table.get("retention"))
    order_by_type = fields.choice("order_by_type", TimeType)
    if order_by_type is not None and mode is Mode.AGGREGATE and not ordering_arguments((aggregations or {}).values()):
        raise SpecError(
            name,
            "'order_by_type' applies to a store that orders rows: modes 'latest', 'history' and 'windowed', "
            "or aggregations with max_by or min_by",
        )
    if mode.timeline and live is not None and not batch and order_by_type is None:
        raise SpecError(
            name,
            f"a live {mode.value} store without 'source' needs 'order_by_type' (timestamp, date or integer): "
            "the type of its records' order_by",
        )
    window = _duration_field(name, "window", table.get("window"))
    advance = _duration_field(name, "advance", table.get("advance"))
    if window is not None and mode is not Mode.WINDOWED:
        raise SpecError(name, "'window' only applies to mode 'windowed'")
    if advance is not None and window is None:
        raise SpecError(name, "'advance' (hopping windows) needs 'window'")
    if advance is not None and window is not None and parse_duration_us(advance) > parse_duration_us(window):
        raise SpecError(name, f"'advance' = {advance!r} is longer than 'window' = {window!r}")
    if retention is not None and not mode.timeline:
        raise SpecError(name, "'retention' only applies to modes 'history' and 'windowed'")
    ttl = _parse_ttl(name, table.get("ttl"), mode, order_by, columns)
    colocate_with = fields.text("colocate_with")
    if colocate_with == name:
        raise SpecError(name, "'colocate_with' names the store itself: name the store to place it with")
    if mode.timeline:
        _check_timeline_store(name, mode, key, order_by, columns, aggregations, snapshot_format, live, batch)
        if mode is Mode.WINDOWED and window is None:
            raise SpecError(name, "mode 'windowed' needs 'window' (a duration such as \"5 minutes\")")
    elif mode is Mode.LATEST:
        if order_by is None:
            raise SpecError(name, "mode 'latest' needs 'order_by' (the column whose greatest value wins)")
        if aggregations is not None:
            raise SpecError(name, "'aggregations' only apply to modes 'aggregate' and 'windowed'")
        if columns is not None and key in columns:
            raise SpecError(name, f"'columns' lists the key column {key!r}; values hold the other columns")
    else:
        _check_aggregations(
            name,
            mode,
            key,
            aggregations,
            (
                (order_by is not None, "'order_by' only applies to mode 'latest'"),
                (
                    columns is not None,
                    "'columns' only applies to mode 'latest' (aggregate values are the aggregations)",
                ),
            ),
        )
    if live is not None:
        _check_live_store(name, mode, aggregations or {}, snapshot_format)
    _check_offset_column(name, key, batch, live, source_partition_column, source_offset_column)
    key_format = fields.parsed("key_format", KeyFormat.parse, KeyFormat.STRING)
    key_subject, key_schema_id, key_message, registry = _key_schema_fields(name, fields, table, key_format, live)

    return StoreSpec(
        name=name,
        source=None if source is None else _resolve_source(source, base_dir),
        format=source_format,
        source_table=source_table,
        source_sql=source_sql,
        options=options,
        key=key,
        key_format=key_format,
        key_subject=key_subject,
        key_schema_id=key_schema_id,
        key_message=key_message,
        schema_registry=registry,
        partitions=fields.count("partitions", required=True, maximum=_MAX_PARTITIONS),
        partitioner=fields.parsed("partitioner", Partitioner.parse, Partitioner.MURMUR2),
        replication_factor=fields.count("replication_factor", default=1),
        mode=mode,
        order_by=order_by,
        columns=columns,
        aggregations=dict(aggregations or {}),
        source_partition_column=source_partition_column,
        snapshot_format=snapshot_format,
        live=live,
        source_offset_column=source_offset_column,
        retention=retention,
        window=window,
        advance=advance,
        order_by_type=order_by_type,
        ttl=ttl,
        colocate_with=colocate_with,
    )


def _key_schema_fields(
    name: str, fields: _Fields, table: Mapping[str, Any], key_format: KeyFormat, live: LiveSpec | None
) -> tuple[str | None, int | None, str, RegistrySettings | None]:
    """`key_subject`, `key_schema_id`, `key_message` and the `schema_registry` table: exactly one of the first
    two for a Schema Registry key format, none of them for another. Without its own `schema_registry` table,
    the store's keys are read from its live values' registry."""
    subject = fields.text("key_subject")
    schema_id = table.get("key_schema_id")
    message = fields.text("key_message") or ""
    registry = table.get("schema_registry")
    if not key_format.registered:
        given = [f for f in ("key_subject", "key_schema_id", "key_message") if f in table]
        if given or registry is not None:
            what = given[0] if given else "schema_registry"
            raise SpecError(name, f"{what!r} applies to key_format avro, protobuf or json_schema")
        return None, None, "", None
    if (subject is None) == (schema_id is None):
        raise SpecError(name, f"key_format {key_format.value!r} needs 'key_subject' or 'key_schema_id' (one of them)")
    if schema_id is not None and (isinstance(schema_id, bool) or not isinstance(schema_id, int) or schema_id < 0):
        raise SpecError(name, f"'key_schema_id' must be a schema id (an integer >= 0), got {schema_id!r}")
    if message and key_format is not KeyFormat.PROTOBUF:
        raise SpecError(name, "'key_message' applies to key_format 'protobuf'")
    if registry is not None:
        try:
            return subject, schema_id, message, RegistrySettings.parse(registry)
        except ValueError as exc:  # RegistrySettingsError
            raise SpecError(name, str(exc)) from None
    if live is None or live.schema_registry is None:
        raise SpecError(
            name, f"key_format {key_format.value!r} needs a [stores.{name}.schema_registry] table with a 'url'"
        )
    return subject, schema_id, message, live.schema_registry


def _check_aggregations(
    name: str,
    mode: Mode,
    key: str,
    aggregations: Mapping[str, str] | None,
    not_applying: Iterable[tuple[bool, str]],
) -> None:
    """The values of an aggregate or windowed store: a non-empty 'aggregations' table, none named like the key
    column. `not_applying` pairs each field the mode does not take (whether it is given) with what to say when
    it is, checked in between, in order."""
    if not aggregations:
        raise SpecError(name, f"mode {mode.value!r} needs a non-empty 'aggregations' table (name = \"expression\")")
    for given, message in not_applying:
        if given:
            raise SpecError(name, message)
    if key in aggregations:
        raise SpecError(name, f"aggregation {key!r} has the name of the key column")


def _check_timeline_store(
    name: str,
    mode: Mode,
    key: str,
    order_by: str | None,
    columns: tuple[str, ...] | None,
    aggregations: Mapping[str, str] | None,
    snapshot_format: int,
    live: LiveSpec | None,
    batch: bool = False,
) -> None:
    """What a history or windowed store needs: a time column (`order_by`), format-2 versions, and (windowed)
    aggregations or (history) value columns. A live windowed store's aggregations merge one record at a time;
    with a batch part too they keep no merge state (its batch windows carry none)."""
    what = f"mode {mode.value!r}"
    if order_by is None:
        raise SpecError(name, f"{what} needs 'order_by' (the time column its entries are ordered and queried by)")
    if snapshot_format != 2:
        raise SpecError(name, f"{what} needs 'snapshot_format' 2 (its files are written for nodes to serve)")
    if mode is Mode.HISTORY:
        if aggregations is not None:
            raise SpecError(name, "'aggregations' apply to modes 'aggregate' and 'windowed', not 'history'")
        if columns is not None and key in columns:
            raise SpecError(name, f"'columns' lists the key column {key!r}; values hold the other columns")
        return
    _check_aggregations(
        name,
        mode,
        key,
        aggregations,
        ((columns is not None, "'columns' does not apply to mode 'windowed' (its values are the aggregations)"),),
    )
    if live is not None:
        for agg_name, expr in (aggregations or {}).items():  # _check_aggregations refused none
            try:
                aggregate = parse_aggregate(agg_name, expr)
            except LiveSpecError as exc:
                raise SpecError(name, f"'aggregations': {exc}") from None
            if batch and aggregate.has_state:
                raise SpecError(
                    name,
                    f"aggregation {agg_name!r} = {expr!r}: a windowed store with both 'source' and 'live' "
                    "takes count, sum, min and max only (its batch windows keep no merge state)",
                )


def _parse_live(name: str, table: Any, has_source: bool) -> LiveSpec | None:
    """The `[stores.NAME.live]` table, checked; None when the store has none."""
    if table is None:
        return None
    if not isinstance(table, dict):
        raise SpecError(name, f"'live' must be a table ([stores.{name}.live]), got {table!r}")
    unknown = sorted(set(table) - set(_LIVE_FIELDS))
    if unknown:
        raise SpecError(name, unknown_field(unknown[0], _LIVE_FIELDS, prefix="live."))
    fields = _Fields(name, table, prefix="live.")
    kafka = table.get("kafka", {})
    if not isinstance(kafka, dict):
        raise SpecError(name, f"'live.kafka' must be a table of consumer settings, got {kafka!r}")
    try:
        settings = check_kafka_settings(kafka)
    except LiveSpecError as exc:
        raise SpecError(name, f"'live.kafka': {exc}") from None
    start = fields.text("start")
    if start is not None and has_source:
        raise SpecError(
            name,
            "'live.start' is for a live store without 'source'; a hybrid store's versions start where "
            "its source ends ('source_offset_column')",
        )
    on_bad_record = fields.text("on_bad_record") or ON_BAD_RECORD[0]
    if on_bad_record not in ON_BAD_RECORD:
        raise SpecError(
            name, f"unknown live.on_bad_record {on_bad_record!r} (expected one of: {', '.join(ON_BAD_RECORD)})"
        )
    start = start or STARTS[0]
    if start not in STARTS:
        raise SpecError(name, f"unknown live.start {start!r} (expected one of: {', '.join(STARTS)})")
    catch_up = table.get("catch_up_records", DEFAULT_CATCH_UP_RECORDS)
    if not isinstance(catch_up, int) or isinstance(catch_up, bool) or catch_up < 0:
        raise SpecError(name, f"'live.catch_up_records' must be an integer of at least 0, got {catch_up!r}")
    value_format = table.get("value_format", "json")
    registry_table = table.get("schema_registry")
    try:
        registry = None if registry_table is None else RegistrySettings.parse(registry_table, "live.schema_registry")
        check_value_format(value_format, registry)
    except ValueError as exc:  # RegistrySettingsError, LiveSpecError
        raise SpecError(name, str(exc)) from None
    return LiveSpec(
        topic=fields.required_text("topic"),
        bootstrap_servers=fields.required_text("bootstrap_servers"),
        kafka=settings,
        start=start,
        on_bad_record=on_bad_record,
        catch_up_records=catch_up,
        value_format=value_format,
        schema_registry=registry,
    )


def _check_live_store(name: str, mode: Mode, aggregations: Mapping[str, str], snapshot_format: int) -> None:
    """What a live store needs besides its table: format-2 versions and aggregates that merge one record
    at a time (a latest store's `order_by` is checked with the mode)."""
    if snapshot_format != 2:
        raise SpecError(
            name,
            f"'snapshot_format' must be 2 for a live store (nodes apply the topic to format-2 files), "
            f"got {snapshot_format}",
        )
    if mode is Mode.AGGREGATE:
        for agg_name, expr in aggregations.items():
            try:
                parse_aggregate(agg_name, expr)
            except LiveSpecError as exc:
                raise SpecError(name, f"'aggregations': {exc}") from None


def _check_offset_column(
    name: str,
    key: str,
    batch: bool,
    live: LiveSpec | None,
    partition_column: str | None,
    offset_column: str | None,
) -> None:
    """A hybrid store's source carries each record's Kafka partition and offset; nothing else has offsets."""
    if offset_column is None:
        if live is not None and batch:
            raise SpecError(
                name,
                "a live store with 'source' (the topic's archive) needs 'source_offset_column' and "
                "'source_partition_column': where each partition's archive ends, so nodes replay the topic "
                "from the next offset",
            )
        return
    if live is None:
        raise SpecError(name, "'source_offset_column' only applies to a live store ([stores.NAME.live])")
    if not batch:
        raise SpecError(name, "'source_offset_column' names a column of 'source', which this store does not have")
    if partition_column is None:
        raise SpecError(
            name, "'source_offset_column' needs 'source_partition_column' (an offset is within a partition)"
        )
    if offset_column == key:
        raise SpecError(name, f"'source_offset_column' names the key column {key!r}")
    if offset_column == partition_column:
        raise SpecError(name, f"'source_offset_column' and 'source_partition_column' both name {offset_column!r}")


def _only_for_files(field_name: str, given: list[str]) -> str:
    """Why `field_name` (format, options) does not apply to a store whose batch part is `given` (a table, a
    query, or nothing)."""
    if given:
        return f"{field_name!r} describes the files of 'source'; a store read from {given[0]!r} takes none"
    return f"{field_name!r} describes 'source', which a live store without 'source' does not have"


def _resolve_source(source: str, base_dir: Path) -> str:
    # A one-letter "scheme" would be a Windows drive; any longer one is a URI for Spark (s3a:, hdfs:, file:).
    match = _URI_SCHEME.match(source)
    if match and match.end() > 2:
        return source
    path = Path(source).expanduser()
    return str(path if path.is_absolute() else (base_dir / path).resolve())


class _Fields:
    """Typed reads of one store table; each failure names the store and the field."""

    def __init__(self, store: str, table: Mapping[str, Any], prefix: str = "") -> None:
        self.store = store
        self.table = table
        self.prefix = prefix  # how field names are spelled in messages: "live." for the live table's

    def _missing(self, name: str) -> SpecError:
        return SpecError(self.store, f"missing required field {self.prefix + name!r}")

    def text(self, name: str, *, required: bool = False) -> str | None:
        value = self.table.get(name)
        if value is None:
            if required:
                raise self._missing(name)
            return None
        if not isinstance(value, str) or not value:
            raise SpecError(self.store, f"{self.prefix + name!r} must be a non-empty string, got {value!r}")
        return value

    def required_text(self, name: str) -> str:
        value = self.text(name, required=True)
        assert value is not None
        return value

    def choice(self, name: str, kind: type[enum.StrEnum], *, required: bool = False) -> Any:
        value = self.text(name, required=required)
        try:
            return kind(value.lower()) if value is not None else None
        except ValueError:
            allowed = ", ".join(member.value for member in kind)
            raise SpecError(self.store, f"unknown {name} {value!r} (expected one of: {allowed})") from None

    def parsed(self, name: str, parse: Any, default: Any) -> Any:
        value = self.text(name)
        if value is None:
            return default
        try:
            return parse(value)
        except ValueError as exc:
            raise SpecError(self.store, str(exc)) from None

    def count(self, name: str, *, required: bool = False, default: int = 1, maximum: int | None = None) -> int:
        value = self.table.get(name)
        if value is None:
            if required:
                raise self._missing(name)
            return default
        # bool is an int in Python; `partitions = true` is a typo, not 1.
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(self.store, f"{name!r} must be an integer of at least 1, got {value!r}")
        if maximum is not None and value > maximum:
            raise SpecError(self.store, f"{name!r} must be at most {maximum}, got {value}")
        return value

    def snapshot_format(self) -> int:
        value = self.table.get("snapshot_format", SNAPSHOT_FORMATS[-1])
        if not isinstance(value, int) or isinstance(value, bool) or value not in SNAPSHOT_FORMATS:
            allowed = " or ".join(str(v) for v in SNAPSHOT_FORMATS)
            raise SpecError(self.store, f"'snapshot_format' must be {allowed}, got {value!r}")
        return int(value)

    def options(self) -> dict[str, str]:
        """The `options` table: Spark reader options, each value as the text Spark takes."""
        value = self.table.get("options", {})
        if not isinstance(value, dict):
            raise SpecError(self.store, f"'options' must be a table of Spark reader options, got {value!r}")
        options = {}
        for option, given in value.items():
            text = setting_text(given)
            if text is None:
                raise SpecError(
                    self.store,
                    f"'options.{option}' must be a string, boolean or number (the text Spark's reader takes), "
                    f"got {given!r}",
                )
            options[option] = text
        return options

    def names(self, name: str) -> tuple[str, ...] | None:
        value = self.table.get(name)
        if value is None:
            return None
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise SpecError(self.store, f"{name!r} must be a non-empty list of column names, got {value!r}")
        duplicates = sorted({v for v in value if value.count(v) > 1})
        if duplicates:
            raise SpecError(self.store, f"{name!r} lists {duplicates[0]!r} more than once")
        return tuple(value)

    def aggregations(self) -> dict[str, str] | None:
        value = self.table.get("aggregations")
        if value is None:
            return None
        if not isinstance(value, dict):
            raise SpecError(self.store, f"'aggregations' must be a table of name = \"expression\", got {value!r}")
        for agg_name, expr in value.items():
            if not agg_name:
                raise SpecError(self.store, "aggregation names must be non-empty")
            if not isinstance(expr, str) or not expr.strip():
                raise SpecError(
                    self.store,
                    f"aggregation {agg_name!r} must be a Spark SQL aggregate expression, got {expr!r}",
                )
        return dict(value)
