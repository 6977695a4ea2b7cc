"""The partitioner audit: is every source record in the partition that the store's partitioner gives its key?

Spark finds the records that are not; `explain` names the likely cause from a sample of them, by placing the
sample with the other partitioners, partition counts and key formats.

How every record is checked without hashing every record: a key's partition is a function of its bytes, so
the reduce keeps, per key, the least and greatest source partition (a null one as -1), and a key passes when
both equal the partition it is routed to. Only when some key fails does a per-record pass (the same
vectorised hashing, in an Arrow UDF) count the mismatching records and sample them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql import types as T

from keyroute.keys.key_format import KeyFormat, KeyFormatError, key_from_value
from keyroute.keys.partition_vectorized import hashes
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.pipeline.errors import PartitionAuditError
from keyroute.pipeline.sources import record_column
from keyroute.pipeline.spec import StoreSpec

# Per-key aggregates of the source partition column, named so they cannot meet a source column.
LEAST = "__keyroute_audit_least"
GREATEST = "__keyroute_audit_greatest"
KEY_COLUMNS = (LEAST, GREATEST)

MISMATCH_SAMPLE = 10_000  # mismatching records the cause is looked for in
MATCH_SAMPLE = 1_000  # matching records a cause must also place right (it explains the whole source)
COUNT_SPAN = 64  # partition counts tried: from the greatest source partition + 1, this many
# A placement that explains only part of the mismatching sample is named when it places at least this share
# of it, and this many records.
_MOSTLY = 0.5
_EVIDENCE = 20

_PARTITIONER_NAMES = {
    Partitioner.MURMUR2: "the Java client's default",
    Partitioner.CRC32: "librdkafka's default consistent_random",
    Partitioner.FNV1A: "Sarama's default",
}
_FORMAT_NAMES = {
    KeyFormat.STRING: "UTF-8 text, Kafka's StringSerializer",
    KeyFormat.INT16: "2-byte big-endian, Kafka's ShortSerializer",
    KeyFormat.INT32: "4-byte big-endian, Kafka's IntegerSerializer",
    KeyFormat.INT64: "8-byte big-endian, Kafka's LongSerializer",
    KeyFormat.UUID: "lowercase text, Kafka's UUIDSerializer",
    KeyFormat.BYTES: "raw bytes",
}


# --- in Spark ---------------------------------------------------------------------------------------------


def source_partition(store: StoreSpec, schema: T.StructType) -> Column | None:
    """The store's source partition column as a long, or None when the store is not audited."""
    return record_column(store, schema, "source_partition_column", store.source_partition_column, "partition")


def key_aggregates(source: Column) -> list[Column]:
    """What the reduce keeps per key: the least and greatest source partition of its records.

    A null partition counts as -1, which no key is routed to. Two plain aggregates: every function added to
    the reduce is paid per source record.
    """
    placed = F.coalesce(source, F.lit(-1))
    return [
        F.min(placed).alias(LEAST),
        F.max(placed).alias(GREATEST),
    ]


def regroup_key_aggregates() -> list[Column]:
    """`key_aggregates` of several groups of a key's records (a windowed store's windows) combined."""
    return [F.min(LEAST).alias(LEAST), F.max(GREATEST).alias(GREATEST)]


def key_off_partition(partition: Column) -> Column:
    """True for a key with a record outside `partition`; null for a key without one (it is not routable)."""
    return (F.col(LEAST) != partition) | (F.col(GREATEST) != partition)


@dataclass(frozen=True, slots=True)
class SampledRecord:
    """One source record: its raw key as the source holds it (str, int or bytes) and its source partition."""

    key: object
    partition: int


@dataclass(frozen=True, slots=True)
class Findings:
    """What the per-record pass found: counts over every record with a routable key, and samples."""

    column: str
    records: int
    mismatches: int  # records not in the partition the store computes, null source partitions included
    null_partitions: int
    least_partition: int | None
    greatest_partition: int | None
    empty_keys: Mapping[int, int]  # records whose serialized key is empty, per (non-null) source partition
    mismatched: tuple[SampledRecord, ...]  # with a source partition
    matched: tuple[SampledRecord, ...]


def find_mismatches(store: StoreSpec, keyed: DataFrame, raw_key: Column, source: Column, computed: Column) -> Findings:
    """Compare every record's `computed` partition with its `source` one: the failure path, several jobs.

    `computed` is null for a key that does not fit the key format: such records are left to the key check.
    """
    assert store.source_partition_column is not None
    records = (
        keyed.select(raw_key.alias("key"), source.alias("source"), computed.alias("computed"))
        .where(F.col("computed").isNotNull())
        .withColumn("mismatch", ~F.col("source").eqNullSafe(F.col("computed")))
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    try:
        totals = records.agg(
            F.count(F.lit(1)).alias("records"),
            F.count(F.when(F.col("mismatch"), True)).alias("mismatches"),
            F.count(F.when(F.col("source").isNull(), True)).alias("nulls"),
            F.min("source").alias("least"),
            F.max("source").alias("greatest"),
        ).first()
        assert totals is not None
        empty_keys: dict[int, int] = {}
        if isinstance(keyed.select(raw_key).schema[0].dataType, (T.StringType, T.BinaryType)):
            empty = records.where((F.length("key") == 0) & F.col("source").isNotNull())
            empty_keys = {row[0]: row[1] for row in empty.groupBy("source").count().collect()}
        with_source = F.col("source").isNotNull()
        mismatched = records.where(F.col("mismatch") & with_source).limit(MISMATCH_SAMPLE)
        matched = records.where(~F.col("mismatch")).limit(MATCH_SAMPLE)
        return Findings(
            column=store.source_partition_column,
            records=totals["records"],
            mismatches=totals["mismatches"],
            null_partitions=totals["nulls"],
            least_partition=totals["least"],
            greatest_partition=totals["greatest"],
            empty_keys=empty_keys,
            mismatched=_sampled(mismatched.select("key", "source").collect()),
            matched=_sampled(matched.select("key", "source").collect()),
        )
    finally:
        records.unpersist()


def _sampled(rows: Iterable[Row]) -> tuple[SampledRecord, ...]:
    # PySpark hands binary values over as bytearray.
    return tuple(
        SampledRecord(bytes(row["key"]) if isinstance(row["key"], bytearray) else row["key"], row["source"])
        for row in rows
    )


def fail(store: StoreSpec, findings: Findings) -> PartitionAuditError:
    return PartitionAuditError(store.name, explain(store, findings))


# --- why: pure ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Placement:
    """How a producer may have placed records: a partitioner, over a partition count, of keys in a format."""

    partitioner: Partitioner
    partitions: int
    key_format: KeyFormat

    def changes_from(self, store: StoreSpec) -> list[str]:
        """The spec settings that would make `store` place keys like this, e.g. ['partitioner = "crc32"']."""
        changes = []
        if self.partitioner is not store.partitioner:
            changes.append(f'partitioner = "{self.partitioner.value}"')
        if self.partitions != store.partitions:
            changes.append(f"partitions = {self.partitions}")
        if self.key_format is not store.key_format:
            changes.append(f'key_format = "{self.key_format.value}"')
        return changes

    def describe(self, store: StoreSpec) -> str:
        text = f"{self.partitioner.value} ({_PARTITIONER_NAMES[self.partitioner]})"
        if self.partitions != store.partitions:
            text += f" over {_partitions(self.partitions)}"
        if self.key_format is not store.key_format:
            text += f" of keys serialized as {self.key_format.value} ({_FORMAT_NAMES[self.key_format]})"
        return text


@dataclass(frozen=True, slots=True)
class Candidate:
    """A placement tried on the sample: how many mismatching and matching sampled records it places right."""

    placement: Placement
    mismatched_placed: int
    matched_placed: int


def serialized(key_format: KeyFormat, key: object) -> bytes | None:
    """The bytes a producer's serializer for `key_format` writes for a raw source key, or None if it cannot.

    As the pipeline reads keys: an integer source key in a string store is its decimal text.
    """
    if key_format is KeyFormat.STRING and isinstance(key, int) and not isinstance(key, bool):
        return str(key).encode("ascii")
    try:
        return key_from_value(key_format, key).data
    except KeyFormatError:
        return None


def alternative_formats(store_format: KeyFormat, keys: Sequence[object]) -> list[KeyFormat]:
    """Key formats other than the store's that serialize every key, and differently from the store's format.

    Bytes keys are bytes in any format, and reading text as base64url is no serializer's doing: `bytes` is
    neither a candidate nor has candidates.
    """
    if store_format is KeyFormat.BYTES:
        return []
    own = [serialized(store_format, key) for key in keys]
    found: list[KeyFormat] = []
    for fmt in KeyFormat:
        if fmt in (store_format, KeyFormat.BYTES):
            continue
        data = [serialized(fmt, key) for key in keys]
        if all(d is not None for d in data) and data != own:
            found.append(fmt)
    return found


def candidate_counts(store_partitions: int, greatest_partition: int | None) -> list[int]:
    """Partition counts a producer may have used: the store's, if the source fits in it, and the COUNT_SPAN
    counts from the greatest source partition + 1 on."""
    least = 1 if greatest_partition is None else max(greatest_partition + 1, 1)
    counts = set(range(least, least + COUNT_SPAN))
    if store_partitions >= least:
        counts.add(store_partitions)
    return sorted(counts)


def positive_hashes(partitioner: Partitioner, data: Sequence[bytes]) -> np.ndarray:
    """For every key, the non-negative value whose remainder by the count is its partition (any count)."""
    h = hashes(partitioner, pa.array(data, pa.binary()))
    if partitioner is Partitioner.MURMUR2:
        return h & 0x7FFFFFFF  # Utils.toPositive
    if partitioner is Partitioner.FNV1A:
        return np.abs(np.where(h >= 1 << 31, h - (1 << 32), h))  # |int32(h)|, as partition_for
    return h


def try_placements(
    store: StoreSpec,
    findings: Findings,
    mismatched: Sequence[SampledRecord],
    matched: Sequence[SampledRecord],
) -> list[Candidate]:
    """Every placement other than the store's, tried on the sampled records; best first.

    Best: places the most mismatching records, then (on a tie) the most matching ones, then changes the
    fewest settings (partitioner before partition count before key format), then by name and count.
    """
    if not mismatched:
        return []
    sample = [*mismatched, *matched]
    keys = [record.key for record in sample]
    sources = np.array([record.partition for record in sample], dtype=np.int64)
    is_mismatched = np.arange(len(sample)) < len(mismatched)
    counts = candidate_counts(store.partitions, findings.greatest_partition)
    found: list[Candidate] = []
    for fmt in [store.key_format, *alternative_formats(store.key_format, keys)]:
        data = [d for d in (serialized(fmt, key) for key in keys) if d is not None]
        assert len(data) == len(keys)  # the store's format routed them; alternatives were checked
        for partitioner in Partitioner:
            positive = positive_hashes(partitioner, data)
            for count in counts:
                placement = Placement(partitioner, count, fmt)
                if placement == Placement(store.partitioner, store.partitions, store.key_format):
                    continue
                placed = positive % count == sources
                found.append(
                    Candidate(
                        placement,
                        int(np.count_nonzero(placed & is_mismatched)),
                        int(np.count_nonzero(placed & ~is_mismatched)),
                    )
                )
    order = list(Partitioner)

    def rank(candidate: Candidate) -> tuple[int, int, int, int, int, int, int]:
        p = candidate.placement
        return (
            -candidate.mismatched_placed,
            -candidate.matched_placed,
            len(p.changes_from(store)),
            p.key_format is not store.key_format,
            p.partitions != store.partitions,
            order.index(p.partitioner),
            p.partitions,
        )

    return sorted(found, key=rank)


def explain(store: StoreSpec, findings: Findings) -> str:
    """The audit's failure message: how many records are misplaced, and the likely cause."""
    column = findings.column
    parts = [
        f"partitioner audit: {findings.mismatches:,} of {findings.records:,} records are not in the "
        f"partition {store.partitioner.value} assigns their key over {_partitions(store.partitions)} "
        f"(source_partition_column {column!r})"
    ]
    if findings.null_partitions:
        parts.append(f"{findings.null_partitions:,} have no source partition (null in column {column!r})")
    least, greatest = findings.least_partition, findings.greatest_partition
    if least is not None and least < 0:
        parts.append(f"column {column!r} holds negative partitions (down to {least}): is it the partition?")
    if greatest is not None and greatest >= store.partitions:
        parts.append(
            f"source partitions go up to {greatest} but the store has {_partitions(store.partitions)} "
            "(partitions must count every partition of the topic)"
        )

    def has_key(record: SampledRecord) -> bool:
        return serialized(store.key_format, record.key) != b""

    # Empty keys are judged apart: librdkafka's default spreads them at random, so they tell nothing.
    mismatched = [r for r in findings.mismatched if has_key(r)]
    matched = [r for r in findings.matched if has_key(r)]
    effective = Placement(store.partitioner, store.partitions, store.key_format)
    if mismatched:
        cause, found = _cause(store, findings, mismatched, matched)
        parts.append(cause)
        effective = found or effective
    empty_keys = _empty_keys(findings, effective)
    if empty_keys:
        parts.append(empty_keys)
    return "; ".join(parts)


def _cause(
    store: StoreSpec,
    findings: Findings,
    mismatched: Sequence[SampledRecord],
    matched: Sequence[SampledRecord],
) -> tuple[str, Placement | None]:
    """What the sample says about the mismatching records, and the placement that explains all records."""
    candidates = try_placements(store, findings, mismatched, matched)
    best = candidates[0] if candidates else None
    if best is not None and (best.mismatched_placed, best.matched_placed) == (len(mismatched), len(matched)):
        settings = " and ".join(best.placement.changes_from(store))
        cause = f"they match {best.placement.describe(store)} — set {settings}"
        # Only as simple alternatives are worth naming: with one partition, say, every partitioner would do.
        alike = [
            c.placement.describe(store)
            for c in candidates[1:]
            if (c.mismatched_placed, c.matched_placed) == (best.mismatched_placed, best.matched_placed)
            and len(c.placement.changes_from(store)) == len(best.placement.changes_from(store))
        ]
        sampled = len(mismatched) + len(matched)
        if alike:
            shown = "; ".join(alike[:2]) + ("; …" if len(alike) > 2 else "")
            cause += f" (judged by only {sampled:,} records: {shown} would place them too)"
        elif sampled < _EVIDENCE:
            cause += f" (judged by only {sampled:,} records)"
        return cause, best.placement
    if best is None or not _telling(best, len(mismatched)):
        return _nothing_matches(store, findings, mismatched), None
    described = best.placement.describe(store)
    if best.mismatched_placed == len(mismatched):
        return (
            f"the sampled mismatching records match {described}, the others {store.partitioner.value}: "
            "the source mixes producers, and no single setting places every record",
            None,
        )
    share = best.mismatched_placed / len(mismatched)
    return (
        f"{share:.0%} of the {len(mismatched):,} sampled mismatching records match {described}; no single "
        "setting places every record: the source may mix producers",
        None,
    )


def _telling(candidate: Candidate, sampled: int) -> bool:
    """Whether a placement that explains only part of the mismatching sample is worth naming: it must place
    most of them, at least _EVIDENCE records, and twice the share a random placement would."""
    placed = candidate.mismatched_placed
    share = placed / sampled
    return placed >= _EVIDENCE and share >= max(_MOSTLY, 2 / candidate.placement.partitions)


def _empty_keys(findings: Findings, placement: Placement) -> str | None:
    """Records with an empty key outside the partition `placement` gives the empty key, if any."""
    if placement.key_format not in (KeyFormat.STRING, KeyFormat.BYTES):
        return None  # no key of these formats serializes to nothing
    home = partition_for(placement.partitioner, b"", placement.partitions)
    elsewhere = sum(n for partition, n in findings.empty_keys.items() if partition != home)
    if not elsewhere:
        return None
    records = "record with an empty key is" if elsewhere == 1 else "records with an empty key are"
    text = f"{elsewhere:,} {records} not in partition {home}, where {placement.partitioner.value} puts it"
    if placement.partitioner is Partitioner.CRC32:
        text += (
            ": empty keys are spread at random by consistent_random (librdkafka's default) and cannot be "
            "looked up — drop them from the source, or produce them with partitioner consistent"
        )
    return text


def _nothing_matches(store: StoreSpec, findings: Findings, mismatched: Sequence[SampledRecord]) -> str:
    counts = candidate_counts(store.partitions, findings.greatest_partition)
    formats = [store.key_format, *alternative_formats(store.key_format, [r.key for r in mismatched])]
    return (
        f"no partitioner ({', '.join(p.value for p in Partitioner)}) over {_spans(counts)} partitions with "
        f"keys serialized as {' or '.join(f.value for f in formats)} puts the sampled mismatching records "
        f"({len(mismatched):,}) where column {findings.column!r} says they are: check that it holds the "
        "partition each record was produced to"
    )


def _partitions(count: int) -> str:
    return f"{count} partition" + ("" if count == 1 else "s")


def _spans(counts: Sequence[int]) -> str:
    """Sorted counts as ranges: [1, 2, 3, 7] -> '1..3, 7'."""
    spans: list[list[int]] = []
    for count in counts:
        if spans and count == spans[-1][1] + 1:
            spans[-1][1] = count
        else:
            spans.append([count, count])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in spans)
