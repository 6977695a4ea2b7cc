"""Deterministic sample events for the demo and the tests: bookings per customer and trades per asset.

The same seed always gives the same files, so printed example requests always answer the same way.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Keys that exercise URL encoding and UTF-8 end to end.
SPECIAL_CUSTOMERS = ("Zoë", "東京-42", "a/b", "100%", "x+y", "what?", "#tag", "with space", "ünïcødé/ključ")
ROUTES = ("AMS-BER", "BER-VIE", "VIE-ZRH", "ZRH-PAR", "PAR-AMS", "LON-EDI", "MAD-BCN")


@dataclass(frozen=True, slots=True)
class SampleFiles:
    bookings: Path
    trades: Path
    customers: int
    assets: int


def customer_id(i: int) -> str:
    return f"C{i:06d}"


def asset_id(i: int) -> str:
    return f"ASSET-{i:04d}"


def generate(folder: Path, events: int = 120_000, seed: int = 7) -> SampleFiles:
    """Write bookings.jsonl and trades.jsonl with `events` lines each into `folder`."""
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
    return SampleFiles(bookings=bookings, trades=trades, customers=customers, assets=assets)


# The demo's live store: quotes per asset, produced to this topic while the demo runs.
LIVE_TOPIC = "quotes"
LIVE_ASSETS = 50


def quote(rng: random.Random, n: int) -> tuple[bytes, bytes]:
    """One quote event: (record key, record value) as the demo's producer writes them."""
    asset = asset_id(rng.randrange(LIVE_ASSETS))
    value = {"ts": 1_800_000_000_000 + n, "bid": round(rng.uniform(10.0, 20.0), 2), "seq": n}
    return asset.encode(), json.dumps(value).encode()


def live_spec_toml(bootstrap_servers: str, partitions: int = 6, replication_factor: int = 2) -> str:
    """A live-only store following LIVE_TOPIC from its first record: the latest quote per asset."""
    return f"""\
[stores.quotes]
key = "asset"
partitions = {partitions}
replication_factor = {replication_factor}
mode = "latest"
order_by = "ts"

[stores.quotes.live]
topic = "{LIVE_TOPIC}"
bootstrap_servers = "{bootstrap_servers}"
start = "earliest"
# The demo's broker (librdkafka's mock cluster) holds every fetch this long even when records arrive.
kafka = {{ "fetch.wait.max.ms" = 20 }}
"""


def spec_toml(files: SampleFiles, partitions: int = 12, replication_factor: int = 2) -> str:
    return f"""\
[stores.bookings]
source = {json.dumps(str(files.bookings))}
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
source = {json.dumps(str(files.trades))}
format = "json"
key = "asset"
partitions = {max(1, partitions // 2)}
replication_factor = {replication_factor}
mode = "aggregate"
aggregations = {{ trades = "count(*)", volume = "sum(qty)", last_price = "max_by(price, ts)" }}
"""
