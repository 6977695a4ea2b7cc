"""Deterministic sample events for the demo and the tests: bookings and trips per customer, trades per asset.

The same seed always gives the same files, so printed example requests always answer the same way.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

# Keys that exercise URL encoding and UTF-8 end to end.
SPECIAL_CUSTOMERS = ("Zoë", "東京-42", "a/b", "100%", "x+y", "what?", "#tag", "with space", "ünïcødé/ključ")
ROUTES = ("AMS-BER", "BER-VIE", "VIE-ZRH", "ZRH-PAR", "PAR-AMS", "LON-EDI", "MAD-BCN")
# Trips happen in June 2024; the README's customer C000042 also takes a run of them on the morning of
# June 11th, so its history and 5-minute windows between 10:00 and 11:00 are never empty.
TRIPS_FROM = dt.datetime(2024, 6, 1, tzinfo=dt.UTC)
TRIPS_DAYS = 30
BUSY_CUSTOMER = 42
BUSY_MORNING = dt.datetime(2024, 6, 11, 10, 0, tzinfo=dt.UTC)
BUSY_MINUTES = (2, 4, 13, 14, 27, 41, 43, 58)


@dataclass(frozen=True, slots=True)
class SampleFiles:
    bookings: Path
    trades: Path
    trips: Path
    customers: int
    assets: int


def customer_id(i: int) -> str:
    return f"C{i:06d}"


def asset_id(i: int) -> str:
    return f"ASSET-{i:04d}"


def generate(folder: Path, events: int = 120_000, seed: int = 7) -> SampleFiles:
    """Write bookings.jsonl and trades.jsonl with `events` lines each into `folder`, and trips.csv with
    half as many trips (ISO 8601 times, which Spark's CSV reader takes as timestamps)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    customers = max(len(SPECIAL_CUSTOMERS) + 1, events // 8)
    assets = max(2, min(2_000, events // 50))
    customer_keys = [customer_id(i) for i in range(customers - len(SPECIAL_CUSTOMERS))] + list(SPECIAL_CUSTOMERS)
    bookings = folder / "bookings.jsonl"
    with open(bookings, "w", encoding="utf-8") as fh:
        for n in range(events):
            record = {
                "customer_id": customer_keys[rng.randrange(customers)],
                # Unique per event, so "latest" is never ambiguous.
                "ts": 1_700_000_000_000 + n * 1_000 + rng.randrange(1_000),
                "route": rng.choice(ROUTES),
                "fare": round(rng.uniform(9.0, 400.0), 2),
                "seats": rng.randint(1, 6),
            }
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    trades = folder / "trades.jsonl"
    with open(trades, "w", encoding="utf-8") as fh:
        for n in range(events):
            record = {
                "asset": asset_id(rng.randrange(assets)),
                "ts": 1_700_000_000_000 + n * 1_000 + rng.randrange(1_000),
                "qty": rng.randint(1, 500),
                "price": round(rng.uniform(1.0, 1_000.0), 4),
            }
            fh.write(json.dumps(record) + "\n")
    trips = folder / "trips.csv"
    span_ms = TRIPS_DAYS * 86_400_000
    rows = [
        (customer_keys[rng.randrange(customers)], TRIPS_FROM + dt.timedelta(milliseconds=rng.randrange(span_ms)))
        for _ in range(max(1, events // 2))
    ]
    busy = BUSY_MORNING + dt.timedelta(seconds=rng.randrange(60))
    rows += [(customer_id(BUSY_CUSTOMER), busy + dt.timedelta(minutes=m)) for m in BUSY_MINUTES]
    with open(trips, "w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["customer_id", "ts", "route", "fare"])
        for customer, at in sorted(rows, key=lambda row: row[1]):
            # Whole euros: the windows' sums stay exact.
            writer.writerow([customer, _iso(at), rng.choice(ROUTES), rng.randint(9, 400)])
    return SampleFiles(bookings=bookings, trades=trades, trips=trips, customers=customers, assets=assets)


def _iso(at: dt.datetime) -> str:
    """UTC with milliseconds and a Z, as keyroute's answers show timestamps."""
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def _source(path: Path, relative_to: Path | None) -> str:
    """A spec's `source`: relative to the spec's folder when given (the pipeline reads it so)."""
    return json.dumps(str(path) if relative_to is None else os.path.relpath(path, relative_to))


# The demo's live store: quotes per asset, produced to this topic while the demo runs.
LIVE_TOPIC = "quotes"
LIVE_ASSETS = 50


def quote(rng: random.Random, n: int) -> tuple[bytes, bytes]:
    """One quote event: (record key, record value) as the demo's producer writes them."""
    asset = asset_id(rng.randrange(LIVE_ASSETS))
    value = {"ts": 1_800_000_000_000 + n, "bid": round(rng.uniform(10.0, 20.0), 2), "seq": n}
    return asset.encode(), json.dumps(value).encode()


# The demo's Avro live store: ticks per asset, written by confluent-kafka's AvroSerializer (Schema Registry
# wire format) to this topic while the demo runs.
AVRO_TOPIC = "ticks"
_TICK_FIELDS = (
    ("asset", "string"),
    ("ts", {"type": "long", "logicalType": "timestamp-millis"}),
    ("price", "double"),
    ("volume", "long"),
)
TICK_SCHEMA = {
    "type": "record",
    "name": "Tick",
    "namespace": "keyroute.dev.demo",
    "fields": [{"name": name, "type": kind} for name, kind in _TICK_FIELDS],
}


def tick(rng: random.Random, n: int) -> tuple[bytes, dict[str, object]]:
    """One tick event: (record key, the record the AvroSerializer writes as its value)."""
    asset = asset_id(rng.randrange(LIVE_ASSETS))
    moment = dt.datetime(2027, 1, 15, tzinfo=dt.UTC) + dt.timedelta(milliseconds=n)
    return asset.encode(), {"asset": asset, "ts": moment, "price": round(rng.uniform(10.0, 20.0), 2), "volume": n}


def _live_store(name: str, topic: str, bootstrap_servers: str, partitions: int, replication_factor: int) -> str:
    return f"""\
[stores.{name}]
key = "asset"
partitions = {partitions}
replication_factor = {replication_factor}
mode = "latest"
order_by = "ts"
# Quotes carry epoch milliseconds, ticks (Avro timestamp-millis) ISO 8601 text: both are instants.
order_by_type = "timestamp"

[stores.{name}.live]
topic = "{topic}"
bootstrap_servers = "{bootstrap_servers}"
start = "earliest"
# The demo's broker (librdkafka's mock cluster) holds every fetch this long even when records arrive.
kafka = {{ "fetch.wait.max.ms" = 20 }}
"""


def live_spec_toml(
    bootstrap_servers: str, partitions: int = 6, replication_factor: int = 2, registry_url: str | None = None
) -> str:
    """A live-only store following LIVE_TOPIC from its first record: the latest quote per asset; with
    `registry_url`, also `ticks` following AVRO_TOPIC, whose values are Avro (Schema Registry wire format)."""
    text = _live_store("quotes", LIVE_TOPIC, bootstrap_servers, partitions, replication_factor)
    if registry_url is not None:
        text += (
            "\n"
            + _live_store("ticks", AVRO_TOPIC, bootstrap_servers, partitions, replication_factor)
            + f'value_format = "avro"\n\n[stores.ticks.live.schema_registry]\nurl = "{registry_url}"\n'
        )
    return text


def spec_toml(
    files: SampleFiles, partitions: int = 12, replication_factor: int = 2, relative_to: Path | None = None
) -> str:
    """The one-value stores: the latest booking per customer (`bookings`), trade totals per asset
    (`positions`)."""
    return f"""\
[stores.bookings]
source = {_source(files.bookings, relative_to)}
format = "json"
key = "customer_id"
key_format = "string"
partitions = {partitions}
partitioner = "murmur2"
replication_factor = {replication_factor}
mode = "latest"
order_by = "ts"
columns = ["ts", "route", "fare", "seats"]

[stores.positions]
source = {_source(files.trades, relative_to)}
format = "json"
key = "asset"
partitions = {max(1, partitions // 2)}
replication_factor = {replication_factor}
mode = "aggregate"
aggregations = {{ trades = "count(*)", volume = "sum(qty)", last_price = "max_by(price, ts)" }}
"""


def timeline_spec_toml(
    files: SampleFiles, partitions: int = 12, replication_factor: int = 2, relative_to: Path | None = None
) -> str:
    """The timeline stores: every trip of a customer (`trips`, a history store) and its trips and fares per
    5 minutes (`fares_5m`, a windowed store). Both read the trips file, keyed and partitioned alike."""
    trips = f"""\
source = {_source(files.trips, relative_to)}
format = "csv"
key = "customer_id"
partitions = {partitions}
replication_factor = {replication_factor}"""
    return f"""\
[stores.trips]
{trips}
mode = "history"
order_by = "ts"
columns = ["route", "fare"]

[stores.fares_5m]
{trips}
mode = "windowed"
order_by = "ts"
window = "5 minutes"
aggregations = {{ trips = "count(*)", revenue = "sum(fare)" }}
"""
