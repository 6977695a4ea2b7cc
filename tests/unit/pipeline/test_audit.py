"""keyroute.pipeline.audit's reasoning: from the records a failed partitioner audit found to the likely cause.

Pure: no Spark. `findings` stands in for the Spark pass, computed here with the scalar partitioners; the
sources are "produced" the same way, by the producer each test imitates.
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections import Counter
from collections.abc import Sequence

import pytest
from pyspark.sql import types as T

from keyroute.keys.key_format import KeyFormat, key_from_value
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.pipeline import audit
from keyroute.pipeline.audit import Findings, SampledRecord, explain
from keyroute.pipeline.errors import DataError, PartitionAuditError
from keyroute.pipeline.spec import Mode, SourceFormat, StoreSpec

MURMUR2, CRC32, FNV1A = Partitioner.MURMUR2, Partitioner.CRC32, Partitioner.FNV1A
Record = tuple[object, int | None]  # raw key as the source holds it, source partition


def store(
    partitioner: Partitioner = MURMUR2, partitions: int = 6, key_format: KeyFormat = KeyFormat.STRING
) -> StoreSpec:
    return StoreSpec(
        name="bookings",
        source="/data/bookings",
        format=SourceFormat.JSON,
        key="customer_id",
        partitions=partitions,
        mode=Mode.LATEST,
        order_by="ts",
        key_format=key_format,
        partitioner=partitioner,
        source_partition_column="partition",
    )


def findings(spec: StoreSpec, records: Sequence[Record]) -> Findings:
    """What audit.find_mismatches reports for these records (every key fits the store's key format)."""
    mismatched, matched = [], []
    empty: Counter[int] = Counter()
    nulls = 0
    for key, source in records:
        data = audit.serialized(spec.key_format, key)
        assert data is not None
        computed = partition_for(spec.partitioner, data, spec.partitions)
        if source is None:
            nulls += 1
            continue
        if data == b"":
            empty[source] += 1
        (matched if source == computed else mismatched).append(SampledRecord(key, source))
    sources = [source for _, source in records if source is not None]
    return Findings(
        column="partition",
        records=len(records),
        mismatches=len(mismatched) + nulls,
        null_partitions=nulls,
        least_partition=min(sources, default=None),
        greatest_partition=max(sources, default=None),
        empty_keys=dict(empty),
        mismatched=tuple(mismatched[: audit.MISMATCH_SAMPLE]),
        matched=tuple(matched[: audit.MATCH_SAMPLE]),
    )


def produced(
    keys: Sequence[object], partitioner: Partitioner, partitions: int, serialize: KeyFormat = KeyFormat.STRING
) -> list[Record]:
    """Records as a producer with this partitioner and key serializer placed them."""
    return [(key, partition_for(partitioner, serialized(serialize, key), partitions)) for key in keys]


def serialized(fmt: KeyFormat, key: object) -> bytes:
    data = audit.serialized(fmt, key)
    assert data is not None
    return data


def customer_keys(count: int = 2000, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [f"cust-{rng.randrange(500):04d}" for _ in range(count)]


def message(spec: StoreSpec, records: Sequence[Record]) -> str:
    return explain(spec, findings(spec, records))


HEADER = "partitioner audit: {m:,} of {n:,} records are not in the partition {p} assigns their key over {c} "


# --- causes --------------------------------------------------------------------------------------------


def test_a_crc32_source_in_a_murmur2_store_names_crc32() -> None:
    spec = store(MURMUR2, 6)
    records = produced(customer_keys(), CRC32, 6)
    found = findings(spec, records)
    assert explain(spec, found) == (
        f"partitioner audit: {found.mismatches:,} of 2,000 records are not in the partition murmur2 assigns "
        "their key over 6 partitions (source_partition_column 'partition'); they match crc32 (librdkafka's "
        'default consistent_random) — set partitioner = "crc32"'
    )


@pytest.mark.parametrize(
    ("produced_with", "name"), [(MURMUR2, "the Java client's default"), (FNV1A, "Sarama's default")]
)
def test_each_partitioner_is_named_with_its_client(produced_with: Partitioner, name: str) -> None:
    text = message(store(CRC32, 6), produced(customer_keys(), produced_with, 6))
    assert f'they match {produced_with.value} ({name}) — set partitioner = "{produced_with.value}"' in text


def test_a_topic_with_more_partitions_than_the_store() -> None:
    text = message(store(MURMUR2, 12), produced(customer_keys(), MURMUR2, 24))
    assert "source partitions go up to 23 but the store has 12 partitions" in text
    assert text.endswith("they match murmur2 (the Java client's default) over 24 partitions — set partitions = 24")


def test_a_topic_with_fewer_partitions_than_the_store() -> None:
    text = message(store(MURMUR2, 12), produced(customer_keys(), MURMUR2, 4))
    assert "source partitions go up to" not in text  # 0..3 fit in the store's 12
    assert text.endswith("over 4 partitions — set partitions = 4")


def test_a_topic_with_one_partition() -> None:
    text = message(store(MURMUR2, 12), produced(customer_keys(), MURMUR2, 1))
    assert text.endswith("over 1 partition — set partitions = 1")


def test_another_partitioner_and_count_together() -> None:
    text = message(store(MURMUR2, 12), produced(customer_keys(), FNV1A, 10))
    assert text.endswith(
        'they match fnv1a (Sarama\'s default) over 10 partitions — set partitioner = "fnv1a" and partitions = 10'
    )


def test_int_keys_produced_as_strings() -> None:
    # An int64 store whose producer used StringSerializer on the decimal text; the source column is integer.
    rng = random.Random(2)
    keys = [rng.randrange(-(2**40), 2**40) for _ in range(1500)]
    spec = store(MURMUR2, 8, KeyFormat.INT64)
    text = message(spec, produced(keys, MURMUR2, 8, serialize=KeyFormat.STRING))
    assert text.endswith(
        "they match murmur2 (the Java client's default) of keys serialized as string (UTF-8 text, Kafka's "
        'StringSerializer) — set key_format = "string"'
    )


@pytest.mark.parametrize("fmt", [KeyFormat.INT16, KeyFormat.INT32, KeyFormat.INT64])
def test_string_keys_that_were_ints_on_the_wire(fmt: KeyFormat) -> None:
    # A string store reads an integer column as its decimal text; the producer wrote big-endian ints.
    rng = random.Random(3)
    keys = [str(rng.randrange(-30000, 30000)) for _ in range(1500)]
    text = message(store(CRC32, 8), produced(keys, CRC32, 8, serialize=fmt))
    assert text.endswith(f'— set key_format = "{fmt.value}"')


def test_uuid_keys_produced_in_upper_case_by_a_string_serializer() -> None:
    keys = [str(uuid.UUID(int=random.Random(i).getrandbits(128))).upper() for i in range(800)]
    text = message(store(MURMUR2, 6, KeyFormat.UUID), produced(keys, MURMUR2, 6, serialize=KeyFormat.STRING))
    assert text.endswith('— set key_format = "string"')


# --- no single cause -----------------------------------------------------------------------------------


def test_two_producers_into_one_topic() -> None:
    keys = customer_keys()
    records = produced(keys[:1000], MURMUR2, 6) + produced(keys[1000:], CRC32, 6)
    text = message(store(MURMUR2, 6), records)
    assert text.endswith(
        "the sampled mismatching records match crc32 (librdkafka's default consistent_random), the others "
        "murmur2: the source mixes producers, and no single setting places every record"
    )


def test_a_partial_match_is_named_with_its_share() -> None:
    rng = random.Random(4)
    keys = [f"k{i}" for i in range(2000)]
    # crc32 for most keys; the rest in an arbitrary other partition than either partitioner gives them.
    records: list[Record] = []
    for key, (_, partition) in zip(keys, produced(keys, CRC32, 6), strict=True):
        data = key.encode()
        if rng.random() < 0.25:
            partition = next(
                p for p in range(6) if p not in (partition_for(MURMUR2, data, 6), partition_for(CRC32, data, 6))
            )
        records.append((key, partition))
    found = findings(store(MURMUR2, 6), records)
    text = explain(store(MURMUR2, 6), found)
    share = sum(1 for r in found.mismatched if r.partition == partition_for(CRC32, str(r.key).encode(), 6)) / len(
        found.mismatched
    )
    assert text.endswith(
        f"{share:.0%} of the {len(found.mismatched):,} sampled mismatching records match crc32 (librdkafka's "
        "default consistent_random); no single setting places every record: the source may mix producers"
    )


def test_partitions_that_no_placement_explains() -> None:
    rng = random.Random(5)
    records: list[Record] = [(key, rng.randrange(6)) for key in customer_keys()]
    found = findings(store(MURMUR2, 6), records)
    assert explain(store(MURMUR2, 6), found).endswith(
        "no partitioner (murmur2, crc32, fnv1a) over 6..69 partitions with keys serialized as string puts "
        f"the sampled mismatching records ({len(found.mismatched):,}) where column 'partition' says they "
        "are: check that it holds the partition each record was produced to"
    )


def test_one_misplaced_record_is_not_blamed_on_a_placement_it_fits_by_chance() -> None:
    records = produced(customer_keys(), MURMUR2, 6)
    key, partition = records[0]
    records[0] = (key, (partition + 1) % 6)  # type: ignore[operator]
    text = message(store(MURMUR2, 6), records)
    assert text.startswith(HEADER.format(m=1, n=2000, p="murmur2", c="6 partitions"))
    assert "no partitioner (murmur2, crc32, fnv1a)" in text
    assert "match" not in text.replace("mismatching", "")


def test_a_small_sample_says_what_else_would_fit() -> None:
    records = produced(["a", "b"], CRC32, 6)
    text = message(store(MURMUR2, 6), records)
    assert text.endswith('set partitioner = "crc32" (judged by only 2 records)')


# --- nulls, empty keys, odd values ---------------------------------------------------------------------


def test_null_source_partitions_are_mismatches() -> None:
    records: list[Record] = [*produced(customer_keys(), MURMUR2, 6), ("cust-x", None), ("cust-y", None)]
    text = message(store(MURMUR2, 6), records)
    assert text == (
        HEADER.format(m=2, n=2002, p="murmur2", c="6 partitions")
        + "(source_partition_column 'partition'); 2 have no source partition (null in column 'partition')"
    )


def consistent_random(keys: Sequence[str], partitions: int, seed: int = 6) -> list[Record]:
    """librdkafka's default partitioner: crc32 of the key, but a random partition for an empty key."""
    rng = random.Random(seed)
    return [
        (key, rng.randrange(partitions) if key == "" else partition_for(CRC32, key.encode(), partitions))
        for key in keys
    ]


def with_empty_keys(count: int = 2000, empty_every: int = 20) -> list[str]:
    return ["" if i % empty_every == 0 else key for i, key in enumerate(customer_keys(count))]


def test_empty_keys_spread_by_consistent_random_in_a_crc32_store() -> None:
    records = consistent_random(with_empty_keys(), 5)
    elsewhere = sum(1 for key, partition in records if key == "" and partition != 0)
    assert elsewhere
    text = message(store(CRC32, 5), records)
    assert text == (
        HEADER.format(m=elsewhere, n=2000, p="crc32", c="5 partitions")
        + f"(source_partition_column 'partition'); {elsewhere:,} records with an empty key are not in "
        "partition 0, where crc32 puts it: empty keys are spread at random by consistent_random "
        "(librdkafka's default) and cannot be looked up — drop them from the source, or produce them with "
        "partitioner consistent"
    )


def test_consistent_random_into_a_murmur2_store_names_crc32_and_the_empty_keys() -> None:
    records = consistent_random(with_empty_keys(), 5)
    elsewhere = sum(1 for key, partition in records if key == "" and partition != 0)
    text = message(store(MURMUR2, 5), records)
    assert 'they match crc32 (librdkafka\'s default consistent_random) — set partitioner = "crc32"' in text
    assert text.endswith(
        f"{elsewhere:,} records with an empty key are not in partition 0, where crc32 puts it: empty keys "
        "are spread at random by consistent_random (librdkafka's default) and cannot be looked up — "
        "drop them from the source, or produce them with partitioner consistent"
    )


def test_empty_keys_misplaced_under_murmur2() -> None:
    home = partition_for(MURMUR2, b"", 6)
    records = [*produced(customer_keys(), MURMUR2, 6), ("", (home + 1) % 6), ("", home)]
    text = message(store(MURMUR2, 6), records)
    assert text.endswith(f"; 1 record with an empty key is not in partition {home}, where murmur2 puts it")


def test_negative_partitions_are_pointed_out() -> None:
    records = [(key, -1) for key in customer_keys(50)]
    assert "column 'partition' holds negative partitions (down to -1): is it the partition?" in message(
        store(), records
    )


# --- the pieces ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("partitioner", list(Partitioner))
def test_positive_hashes_give_partition_for_at_any_count(partitioner: Partitioner) -> None:
    rng = random.Random(7)
    data = [rng.randbytes(rng.randrange(0, 40)) for _ in range(3000)]
    data += [b"1468509572224"]  # Sarama's edge: fnv1a hashes it to INT32_MIN
    positive = audit.positive_hashes(partitioner, data)
    for count in (1, 2, 7, 12, 1000, 2**31 - 1):
        assert [int(p) % count for p in positive] == [partition_for(partitioner, d, count) for d in data]


@pytest.mark.parametrize(
    ("store_partitions", "greatest", "expected"),
    [
        (12, None, list(range(1, 65))),
        (12, 5, list(range(6, 70))),
        (12, 23, list(range(24, 88))),
        (100, 5, [*range(6, 70), 100]),
    ],
)
def test_candidate_counts(store_partitions: int, greatest: int | None, expected: list[int]) -> None:
    assert audit.candidate_counts(store_partitions, greatest) == expected


@pytest.mark.parametrize(
    ("fmt", "key", "expected"),
    [
        (KeyFormat.STRING, "日本", "日本".encode()),
        (KeyFormat.STRING, 42, b"42"),  # an integer column in a string store: its decimal text
        (KeyFormat.INT32, "42", (42).to_bytes(4, "big")),
        (KeyFormat.INT16, 70000, None),
        (KeyFormat.UUID, "ABCDEF00-0000-0000-0000-000000000000", b"abcdef00-0000-0000-0000-000000000000"),
        (KeyFormat.UUID, "nope", None),
        (KeyFormat.BYTES, b"\x00\xff", b"\x00\xff"),
        (KeyFormat.INT64, b"\x00", None),
    ],
)
def test_serialized(fmt: KeyFormat, key: object, expected: bytes | None) -> None:
    assert audit.serialized(fmt, key) == expected


@pytest.mark.parametrize(
    ("store_format", "keys", "expected"),
    [
        (KeyFormat.STRING, ["123", "-5"], [KeyFormat.INT16, KeyFormat.INT32, KeyFormat.INT64]),
        (KeyFormat.STRING, ["123", "70000"], [KeyFormat.INT32, KeyFormat.INT64]),
        (KeyFormat.STRING, ["abc"], []),
        # Lowercase uuids serialize alike as string and uuid: nothing to try.
        (KeyFormat.STRING, [str(uuid.UUID(int=1))], []),
        (KeyFormat.STRING, [str(uuid.UUID(int=0xABC)).upper()], [KeyFormat.UUID]),
        (KeyFormat.INT64, [1, -(2**40)], [KeyFormat.STRING]),
        (KeyFormat.UUID, [str(uuid.UUID(int=1))], []),
        (KeyFormat.BYTES, [b"123"], []),
    ],
)
def test_alternative_formats(store_format: KeyFormat, keys: list[object], expected: list[KeyFormat]) -> None:
    assert audit.alternative_formats(store_format, keys) == expected


def test_serialized_agrees_with_the_key_formats() -> None:
    for fmt, key in [
        (KeyFormat.INT64, -(2**63)),
        (KeyFormat.UUID, str(uuid.UUID(int=99))),
        (KeyFormat.STRING, ""),
    ]:
        assert audit.serialized(fmt, key) == key_from_value(fmt, key).data


def test_the_error_is_a_data_error_naming_the_store() -> None:
    spec = store(MURMUR2, 6)
    error = audit.fail(spec, findings(spec, produced(customer_keys(), CRC32, 6)))
    assert isinstance(error, PartitionAuditError) and isinstance(error, DataError)
    assert error.store == "bookings"
    assert str(error).startswith("store 'bookings': partitioner audit: ")


def test_the_source_partition_column_must_be_an_integer() -> None:
    schema = T.StructType([T.StructField("customer_id", T.StringType()), T.StructField("partition", T.StringType())])
    with pytest.raises(DataError) as failure:
        audit.source_partition(store(), schema)
    assert str(failure.value) == (
        "store 'bookings': source_partition_column 'partition' has type string; it must hold the Kafka "
        "partition of each record, an integer"
    )


def test_a_store_without_the_column_is_not_audited() -> None:
    unaudited = dataclasses.replace(store(), source_partition_column=None)
    assert audit.source_partition(unaudited, T.StructType([])) is None
