"""What the pipeline writes for a live store: the manifest's `live` part and the store record's `live` flag
(both read back as written, a malformed one refused), and a value's stored form with its merge state."""

from __future__ import annotations

import json

import pytest

from keyroute.cluster.partition_map import RecordError, StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner
from keyroute.pipeline.lmdb_files import live_value
from keyroute.pipeline.publish import describe_store
from keyroute.storage.live import LiveConfig, Merge, decode_state, encode_stored, parse_aggregate, value_bytes
from keyroute.storage.snapshot import FORMAT_1, FORMAT_2, Manifest, SnapshotError, data_file

LIVE = LiveConfig(
    topic="trades",
    bootstrap_servers="kafka-0:9092",
    merge=Merge(
        "aggregate", "asset", aggregates=(parse_aggregate("n", "count(*)"), parse_aggregate("last", "max_by(p, ts)"))
    ),
    offsets=(0, 17),
    kafka={"security.protocol": "SASL_SSL", "sasl.password": "${KAFKA_PASSWORD}"},
    on_bad_record="stop",
    catch_up_records=50,
)


def manifest(live: LiveConfig | None = LIVE, partitions: int = 2) -> Manifest:
    return Manifest(
        store="trades",
        version=3,
        partitions=partitions,
        partitioner=Partitioner.MURMUR2,
        key_format=KeyFormat.STRING,
        value_columns=("n", "last"),
        rows=(0,) * partitions,
        files={p: (data_file(p),) for p in range(partitions)},
        created_at=1.5,
        format=FORMAT_2,
        checksums={p: "crc32:00000000" for p in range(partitions)},
        bytes={p: 8192 for p in range(partitions)},
        live=live,
    )


def test_the_manifest_carries_the_live_part_through_json() -> None:
    raw = manifest().to_json()
    assert json.loads(raw)["live"] == {
        "topic": "trades",
        "bootstrap_servers": "kafka-0:9092",
        "kafka": {"sasl.password": "${KAFKA_PASSWORD}", "security.protocol": "SASL_SSL"},
        "merge": LIVE.merge.to_json(),
        "offsets": [0, 17],
        "on_bad_record": "stop",
        "catch_up_records": 50,
    }
    assert Manifest.from_json(raw) == manifest()


def test_a_batch_manifest_has_no_live_part() -> None:
    raw = manifest(live=None).to_json()
    assert "live" not in json.loads(raw)
    assert Manifest.from_json(raw).live is None
    doc = json.loads(raw)
    doc["live"] = None  # written by hand: the same as absent
    assert Manifest.from_json(json.dumps(doc).encode()).live is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda live: "trades", "manifest's 'live' must be an object"),
        (lambda live: {**live, "offsets": [0]}, "manifest's live offsets name 1 partitions, not 2"),
        (lambda live: {**live, "offsets": [0, -1]}, "live offsets must be >= 0"),
        (lambda live: {k: v for k, v in live.items() if k != "topic"}, "manifest is malformed"),
        (lambda live: {**live, "merge": {**live["merge"], "mode": "median"}}, "unknown live merge mode 'median'"),
        (lambda live: {**live, "merge": []}, "manifest is malformed"),
        (lambda live: {**live, "on_bad_record": "ignore"}, "on_bad_record 'ignore'"),
    ],
)
def test_a_malformed_live_part_is_refused(change, message: str) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(manifest().to_json())
    doc["live"] = change(doc["live"])
    with pytest.raises(SnapshotError) as err:
        Manifest.from_json(json.dumps(doc).encode())
    assert message in str(err.value)


def test_only_format_2_manifests_are_live() -> None:
    doc = json.loads(manifest().to_json())
    doc["format"] = FORMAT_1
    for name in ("checksums", "bytes"):
        del doc[name]
    with pytest.raises(SnapshotError, match="a live store's manifest must be format keyroute-snapshot/2"):
        Manifest.from_json(json.dumps(doc).encode())


def record(**fields: object) -> StoreRecord:
    base: dict[str, object] = {
        "name": "trades",
        "partitions": 2,
        "partitioner": Partitioner.MURMUR2,
        "key_format": KeyFormat.STRING,
        "version": 3,
        "snapshot": "/out/trades/v000003",
    }
    return StoreRecord(**{**base, **fields})  # type: ignore[arg-type]


def test_the_store_record_says_whether_the_store_is_live() -> None:
    assert record().live is False
    assert json.loads(record(live=True).to_json())["live"] is True
    assert StoreRecord.from_json(record(live=True).to_json()) == record(live=True)
    assert StoreRecord.from_json(record().to_json()) == record()
    older = json.loads(record().to_json())
    del older["live"]  # written before stores could be live
    assert StoreRecord.from_json(json.dumps(older).encode()).live is False
    with pytest.raises(RecordError, match="'live' must be true or false"):
        StoreRecord.from_json(json.dumps({**older, "live": "yes"}).encode())


def test_a_batch_value_with_its_state_is_the_fold_s_stored_form() -> None:
    """`live_value` on what Spark writes (the value's JSON, the state as an object in merge order) gives
    the bytes `encode_stored` gives, so nodes read and continue it as their own."""
    state_from_spark = '{"0":null,"1":1718000000123}'
    stored = live_value(b'{"n":4,"last":12.5}', state_from_spark)
    assert stored == encode_stored({"n": 4, "last": 12.5}, [None, 1718000000123])
    assert value_bytes(stored) == b'{"n":4,"last":12.5}'
    assert decode_state(stored) == [None, 1718000000123]
    # A later record continues from the batch part's state: an older ts does not replace `last`.
    merge = LIVE.merge
    after = merge.apply(stored, {"asset": "a", "p": 99.0, "ts": 1718000000000})
    assert after is not None
    assert json.loads(value_bytes(after)) == {"n": 5, "last": 12.5}
    assert decode_state(after) == [None, 1718000000123]


def test_store_list_shows_whether_a_store_is_live() -> None:
    assert describe_store(record(live=True))["live"] is True
    assert describe_store(record())["live"] is False
