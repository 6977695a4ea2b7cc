"""The store spec: which stores to build, from which source, keyed and partitioned how.

Parsed strictly from TOML into frozen values; every mistake is a SpecError naming the store and the field.
"""

from __future__ import annotations

import enum
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keyroute.core.key_format import KeyFormat
from keyroute.core.partitioner import Partitioner
from keyroute.pipeline.errors import SpecError

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


class Mode(enum.StrEnum):
    """How a store turns many events per key into one value per key."""

    LATEST = "latest"  # the row with the greatest `order_by` (a KTable)
    AGGREGATE = "aggregate"  # Spark SQL aggregate expressions over all rows of the key


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """One store as the spec describes it; `source` is absolute (or a URI) once parsed."""

    name: str
    source: str
    format: SourceFormat
    key: str
    partitions: int
    mode: Mode
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


@dataclass(frozen=True, slots=True)
class Spec:
    """Every store of one spec file, in the order the file lists them."""

    stores: tuple[StoreSpec, ...]

    def store(self, name: str) -> StoreSpec:
        for store in self.stores:
            if store.name == name:
                return store
        raise KeyError(name)


_FIELDS = (
    "source",
    "format",
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
    "snapshot_format",
)
# The snapshot formats a spec may ask for (keyroute_core.snapshot.FORMAT_1, FORMAT_2).
SNAPSHOT_FORMATS = (1, 2)


def load_spec(path: Path) -> Spec:
    """Read and check a spec file; relative sources are taken relative to the file's directory."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecError(None, f"spec {str(path)!r}: cannot be read ({exc.strerror or exc})") from exc
    try:
        text = raw.decode("utf-8")
        doc = tomllib.loads(text)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SpecError(None, f"spec {str(path)!r}: not valid TOML ({exc})") from exc
    return parse_spec(doc, base_dir=path.resolve().parent, origin=str(path))


def parse_spec(doc: Mapping[str, Any], base_dir: Path, origin: str = "spec") -> Spec:
    """Check a decoded spec document; `base_dir` anchors relative source paths."""
    unknown = sorted(set(doc) - {"stores"})
    if unknown:
        raise SpecError(
            None, f"spec {origin!r}: unknown top-level key {unknown[0]!r} (only [stores.NAME] tables)"
        )
    stores = doc.get("stores")
    if not isinstance(stores, dict) or not stores:
        raise SpecError(
            None, f"spec {origin!r}: defines no stores (expected at least one [stores.NAME] table)"
        )
    return Spec(stores=tuple(_parse_store(name, table, base_dir) for name, table in stores.items()))


def _parse_store(name: str, table: Any, base_dir: Path) -> StoreSpec:
    if not _STORE_NAME.fullmatch(name) or name in (".", ".."):
        raise SpecError(name, "invalid store name (use only letters, digits, '_', '.' and '-')")
    if not isinstance(table, dict):
        raise SpecError(name, "must be a table ([stores.NAME])")
    fields = _Fields(name, table)
    unknown = sorted(set(table) - set(_FIELDS))
    if unknown:
        raise SpecError(name, f"unknown field {unknown[0]!r} (expected some of: {', '.join(_FIELDS)})")

    key = fields.required_text("key")
    mode = fields.choice("mode", Mode, required=True)
    order_by = fields.text("order_by")
    columns = fields.names("columns")
    aggregations = fields.aggregations()
    source_partition_column = fields.text("source_partition_column")
    if source_partition_column == key:
        raise SpecError(name, f"'source_partition_column' names the key column {key!r}")
    if mode is Mode.LATEST:
        if order_by is None:
            raise SpecError(name, "mode 'latest' needs 'order_by' (the column whose greatest value wins)")
        if aggregations is not None:
            raise SpecError(name, "'aggregations' only apply to mode 'aggregate'")
        if columns is not None and key in columns:
            raise SpecError(name, f"'columns' lists the key column {key!r}; values hold the other columns")
    else:
        if not aggregations:
            raise SpecError(
                name, "mode 'aggregate' needs a non-empty 'aggregations' table (name = \"expression\")"
            )
        if order_by is not None:
            raise SpecError(name, "'order_by' only applies to mode 'latest'")
        if columns is not None:
            raise SpecError(
                name, "'columns' only applies to mode 'latest' (aggregate values are the aggregations)"
            )
        if key in aggregations:
            raise SpecError(name, f"aggregation {key!r} has the name of the key column")

    return StoreSpec(
        name=name,
        source=_resolve_source(fields.required_text("source"), base_dir),
        format=fields.choice("format", SourceFormat, required=True),
        key=key,
        key_format=fields.parsed("key_format", KeyFormat.parse, KeyFormat.STRING),
        partitions=fields.count("partitions", required=True, maximum=_MAX_PARTITIONS),
        partitioner=fields.parsed("partitioner", Partitioner.parse, Partitioner.MURMUR2),
        replication_factor=fields.count("replication_factor", default=1),
        mode=mode,
        order_by=order_by,
        columns=columns,
        aggregations=dict(aggregations or {}),
        source_partition_column=source_partition_column,
        snapshot_format=fields.snapshot_format(),
    )


def _resolve_source(source: str, base_dir: Path) -> str:
    # A one-letter "scheme" would be a Windows drive; any longer one is a URI for Spark (s3a:, hdfs:, file:).
    match = _URI_SCHEME.match(source)
    if match and match.end() > 2:
        return source
    path = Path(source).expanduser()
    return str(path if path.is_absolute() else (base_dir / path).resolve())


class _Fields:
    """Typed reads of one store table; each failure names the store and the field."""

    def __init__(self, store: str, table: Mapping[str, Any]) -> None:
        self.store = store
        self.table = table

    def _missing(self, name: str) -> SpecError:
        return SpecError(self.store, f"missing required field {name!r}")

    def text(self, name: str, *, required: bool = False) -> str | None:
        value = self.table.get(name)
        if value is None:
            if required:
                raise self._missing(name)
            return None
        if not isinstance(value, str) or not value:
            raise SpecError(self.store, f"{name!r} must be a non-empty string, got {value!r}")
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

    def count(
        self, name: str, *, required: bool = False, default: int = 1, maximum: int | None = None
    ) -> int:
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
            raise SpecError(
                self.store, f"'aggregations' must be a table of name = \"expression\", got {value!r}"
            )
        for agg_name, expr in value.items():
            if not agg_name:
                raise SpecError(self.store, "aggregation names must be non-empty")
            if not isinstance(expr, str) or not expr.strip():
                raise SpecError(
                    self.store,
                    f"aggregation {agg_name!r} must be a Spark SQL aggregate expression, got {expr!r}",
                )
        return dict(value)
