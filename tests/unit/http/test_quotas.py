"""Quotas' token buckets and their shares (routers up, nodes serving a store), with an injected clock: no
sleeps."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from keyroute.cluster.partition_map import MapBuilder, NodeRecord, ServingRecord, StoreRecord
from keyroute.http.quotas import (
    OTHER,
    Bucket,
    QuotaConfig,
    QuotaError,
    QuotaExceeded,
    QuotaFile,
    Quotas,
    ServingShares,
)
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def quotas(text: str, clock: Clock, known: set[str] | None = None) -> Quotas:
    return Quotas(
        QuotaConfig.parse(text), clock=clock, known_store=(lambda s: True) if known is None else known.__contains__
    )


def admitted(q: Quotas, identity: str, store: str, n: int, cost: int = 1) -> int:
    count = 0
    for _ in range(n):
        try:
            q.admit(identity, store, cost)
        except QuotaExceeded:
            continue
        count += 1
    return count


def test_a_full_bucket_admits_its_burst_then_its_rate() -> None:
    clock = Clock()
    q = quotas("[identities.anonymous]\nrate = 10\n", clock)
    assert admitted(q, "anonymous", "s", 50) == 10  # burst: 1 s of rate
    clock.now += 0.5
    assert admitted(q, "anonymous", "s", 50) == 5
    clock.now += 100  # refills up to the burst only
    assert admitted(q, "anonymous", "s", 50) == 10


def test_refusal_says_identity_store_and_when_to_come_back() -> None:
    clock = Clock()
    q = quotas("[identities.anonymous]\nrate = 0.25\n", clock)  # burst: 0.25 token: one read needs 0.25
    q.admit("anonymous", "bookings")
    with pytest.raises(QuotaExceeded) as caught:
        q.admit("anonymous", "bookings")
    err = caught.value
    assert err.status == 429 and err.code == "quota_exceeded"
    assert "'anonymous'" in err.message and "'bookings'" in err.message
    # The read took a whole token from a bucket of 0.25: it is 0.75 below zero, and 0.25 token is due in 4 s.
    assert err.headers["Retry-After"] == "4"
    clock.now += 3.99
    with pytest.raises(QuotaExceeded):
        q.admit("anonymous", "bookings")
    clock.now += 0.02
    q.admit("anonymous", "bookings")


def test_retry_after_rounds_up_whole_seconds() -> None:
    bucket = Bucket(2.0, 2.0, 0.0, 2.0, ("a", "s"))
    assert bucket.take(2, 0.0) == 0.0
    assert bucket.take(1, 0.0) == pytest.approx(0.5)
    clock = Clock()
    q = quotas("[identities.a]\nrate = 0.1\nburst_s = 10\n", clock)
    q.admit("a", "s")
    with pytest.raises(QuotaExceeded) as caught:
        q.admit("a", "s")
    assert caught.value.headers["Retry-After"] == "10"


def test_a_batch_bigger_than_the_burst_passes_when_full_and_is_paid_for() -> None:
    clock = Clock()
    q = quotas("[identities.a]\nrate = 10\n", clock)
    q.admit("a", "s", 100)  # a full bucket lets it through: tokens go to -90
    with pytest.raises(QuotaExceeded) as caught:
        q.admit("a", "s", 1)
    assert caught.value.headers["Retry-After"] == "10"  # 91 tokens at 10/s: 9.1 s
    clock.now += 9.0
    assert admitted(q, "a", "s", 1) == 0
    clock.now += 0.2
    assert admitted(q, "a", "s", 1) == 1


def test_per_store_rates_default_rate_and_any_identity() -> None:
    clock = Clock()
    text = """
[identities.team]
rate = 5
[identities.team.stores]
big = 20
[identities."*"]
rate = 2
"""
    q = quotas(text, clock)
    assert admitted(q, "team", "big", 100) == 20
    assert admitted(q, "team", "small", 100) == 5
    assert admitted(q, "team", "other-store", 100) == 5  # each store its own bucket
    assert admitted(q, "stranger", "big", 100) == 2
    assert admitted(q, "another", "big", 100) == 2  # each identity its own bucket


def test_unlisted_identity_without_default_is_unlimited() -> None:
    q = quotas("[identities.team]\nrate = 1\n", Clock())
    assert admitted(q, "someone", "s", 1000) == 1000
    q = quotas("[identities.team.stores]\nbig = 1\n", Clock())
    assert admitted(q, "team", "small", 1000) == 1000
    assert admitted(q, "team", "big", 1000) == 1


def test_no_quotas_is_inactive() -> None:
    assert not Quotas().active
    assert not quotas("", Clock()).active
    assert quotas("[identities.a]\nrate = 1\n", Clock()).active


def test_routers_up_split_the_rate() -> None:
    clock = Clock()
    q = quotas("[identities.a]\nrate = 100\n", clock)
    q.set_routers(2)
    assert admitted(q, "a", "s", 1000) == 50
    clock.now += 1.0
    assert admitted(q, "a", "s", 1000) == 50
    q.set_routers(4)
    assert admitted(q, "a", "s", 1000) == 25
    q.set_routers(0)  # never below one router's worth
    assert admitted(q, "a", "s", 1000) == 100
    assert q.table()["routers"] == 1


def serve(builder: MapBuilder, node_id: str, stores: dict[str, list[int]]) -> None:
    """`node_id` is up and serves these partitions of each store, at version 1."""
    url = f"http://{node_id}:8000"
    builder.set_node(node_id, NodeRecord(node_id, url))
    builder.set_serving(node_id, ServingRecord(node_id, url, {s: dict.fromkeys(ps, 1) for s, ps in stores.items()}))


def store(name: str, partitions: int) -> StoreRecord:
    return StoreRecord(name, partitions, Partitioner.MURMUR2, KeyFormat.STRING, 1, f"/snapshots/{name}/v1")


def test_nodes_share_each_store_by_the_nodes_serving_it() -> None:
    clock = Clock()
    q = Quotas(QuotaConfig.parse("[identities.a]\nrate = 120\n"), clock=clock, process="node")
    shares = ServingShares(q)
    builder = MapBuilder()
    for name in ("wide", "narrow"):
        builder.set_store(name, store(name, 6))
    serve(builder, "n1", {"wide": [0, 1], "narrow": [0, 1, 2, 3, 4, 5]})
    serve(builder, "n2", {"wide": [2, 3]})
    serve(builder, "n3", {"wide": [4, 5]})
    shares.follow(builder.build(1))
    # Three nodes serve "wide": this node admits a third of its rate, per second; one node serves "narrow".
    assert admitted(q, "a", "wide", 1000) == 40
    assert admitted(q, "a", "narrow", 1000) == 120
    clock.now += 0.5
    assert admitted(q, "a", "wide", 1000) == 20
    assert admitted(q, "a", "narrow", 1000) == 60
    with pytest.raises(QuotaExceeded) as caught:
        q.admit("a", "wide")
    assert "on this node" in caught.value.message and "40 reads/s" in caught.value.message
    assert caught.value.headers["Retry-After"] == "1"

    # n3 goes: "wide" is served by two nodes, and its bucket starts again at half the rate, full; the bucket of
    # "narrow", whose routes did not change, keeps what it spent.
    builder.set_serving("n3", None)
    builder.set_node("n3", None)
    builder.set_serving("n2", ServingRecord("n2", "http://n2:8000", {"wide": {2: 1, 3: 1, 4: 1, 5: 1}}))
    shares.follow(builder.build(2))
    assert admitted(q, "a", "wide", 1000) == 60
    assert admitted(q, "a", "narrow", 1000) == 0
    clock.now += 1.0
    assert admitted(q, "a", "wide", 1000) == 60
    assert admitted(q, "a", "narrow", 1000) == 120
    # The counts of the dropped bucket are kept: of 4,001 reads of "wide" (4,000 of "narrow"), the admitted ones.
    wide, narrow = 40 + 20 + 60 + 60, 120 + 60 + 0 + 120
    assert q.counts() == {"a": {"wide": [wide, 4001 - wide], "narrow": [narrow, 4000 - narrow]}}


def test_a_map_change_that_leaves_the_nodes_serving_a_store_keeps_its_buckets() -> None:
    clock = Clock()
    q = Quotas(QuotaConfig.parse("[identities.a]\nrate = 10\n"), clock=clock, process="node")
    shares = ServingShares(q)
    builder = MapBuilder()
    builder.set_store("s", store("s", 2))
    serve(builder, "n1", {"s": [0]})
    serve(builder, "n2", {"s": [1]})
    shares.follow(builder.build(1))
    assert admitted(q, "a", "s", 100) == 5
    # Partitions change hands between the same two nodes: still two, nothing refilled.
    serve(builder, "n1", {"s": [1]})
    serve(builder, "n2", {"s": [0]})
    second = builder.build(2)
    shares.follow(second)
    assert admitted(q, "a", "s", 100) == 0
    # A map not derived from the last one seen (a snapshot from scratch) is counted afresh: still two.
    rebuilt = MapBuilder()
    rebuilt.set_store("s", store("s", 2))
    serve(rebuilt, "n1", {"s": [0, 1]})
    serve(rebuilt, "n2", {"s": [1]})
    shares.follow(rebuilt.build(3))
    assert admitted(q, "a", "s", 100) == 0
    # Nobody serves the store: the node enforces the whole rate (never a share of zero).
    nobody = MapBuilder()
    nobody.set_store("s", store("s", 2))
    shares.follow(nobody.build(4))
    assert shares.count("s") == 0
    assert admitted(q, "a", "s", 100) == 10


def test_a_node_without_a_map_yet_enforces_the_whole_rate() -> None:
    q = Quotas(QuotaConfig.parse("[identities.a]\nrate = 10\n"), clock=Clock(), process="node")
    ServingShares(q)
    assert admitted(q, "a", "s", 100) == 10


def test_counts_by_bounded_labels_survive_a_reconfiguration() -> None:
    clock = Clock()
    q = quotas('[identities.a]\nrate = 2\n[identities."*"]\nrate = 1\n', clock, known={"s"})
    admitted(q, "a", "s", 3)
    admitted(q, "x", "s", 2)
    admitted(q, "y", "nope", 2)
    expected = {"a": {"s": [2, 1]}, OTHER: {"s": [1, 1], "_unknown": [1, 1]}}
    assert q.counts() == expected
    q.configure(QuotaConfig.parse("[identities.a]\nrate = 5\n"))
    admitted(q, "a", "s", 1)
    expected["a"]["s"][0] += 1
    assert q.counts() == expected


def test_table_shows_each_bucket_against_its_quota() -> None:
    clock = Clock()
    q = quotas("[identities.a]\nrate = 10\n", clock)
    q.set_routers(2)
    admitted(q, "a", "s", 7)
    table = q.table()
    assert table["routers"] == 2
    assert table["identities"] == {"a": {"rate": 10.0, "burst_s": 1.0, "stores": {}}}
    (row,) = table["buckets"]
    assert row == {"identity": "a", "store": "s", "quota": 10.0, "share": 5.0, "used": 1.0, "reads": 5, "rejected": 2}
    clock.now += 0.2
    assert q.table()["buckets"][0]["used"] == pytest.approx(0.8)


def test_made_up_store_names_do_not_grow_the_buckets_without_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    import keyroute.http.quotas as module

    monkeypatch.setattr(module, "MAX_BUCKETS", 10)
    q = quotas("[identities.a]\nrate = 1\n", Clock())
    admitted(q, "a", "s", 1)
    for i in range(25):
        admitted(q, "a", f"junk{i}", 1)
    assert q.buckets_held <= 10
    assert q.counts()["a"]["s"] == [1, 0]  # kept, though its bucket was dropped


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[identities.a\n", "not valid TOML"),
        ("[identities.a]\nrate = 0\n", "identities.a.rate must be a positive number"),
        ("[identities.a]\nrate = -1\n", "positive"),
        ('[identities.a]\nrate = "fast"\n', "positive"),
        ("[identities.a]\nrate = true\n", "positive"),
        ("[identities.a]\nrate = inf\n", "positive"),
        ("[identities.a]\nrates = 1\n", "unknown key(s) rates"),
        ("[identities.a.stores]\nb = 0\n", "identities.a.stores.b"),
        ("[identities.a]\nstores = 3\n", "stores must be a table"),
        ("identities = 3\n", "'identities' must be a table"),
        ("identities.a = 3\n", "identities.a must be a table"),
        ("[quota]\n", "unknown table(s) quota"),
    ],
)
def test_invalid_configurations_are_one_line(text: str, says: str) -> None:
    with pytest.raises(QuotaError) as caught:
        QuotaConfig.parse(text)
    assert says in str(caught.value)
    assert "\n" not in str(caught.value)


def test_quota_file_reloads_on_change_and_keeps_quotas_when_invalid(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "quotas.toml"
    path.write_text("[identities.a]\nrate = 1\n")
    q = Quotas(clock=Clock())
    qf = QuotaFile(str(path), q)
    assert q.config.identities["a"].rate == 1
    assert not qf.check()
    path.write_text("[identities.a]\nrate = 22\n")
    os.utime(path, ns=(1, 1))  # a change even within the file system's time resolution
    assert qf.check()
    assert q.config.identities["a"].rate == 22
    path.write_text("[identities.a]\nrate = nope\n")
    with caplog.at_level(logging.WARNING, logger="keyroute.http.quotas"):
        assert not qf.check()
    assert q.config.identities["a"].rate == 22
    (record,) = [r for r in caplog.records if r.name == "keyroute.http.quotas"]
    assert "keeping the previous quotas" in record.getMessage() and "\n" not in record.getMessage()


def test_quota_file_that_does_not_load_at_start_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(QuotaError, match="cannot read the quota file"):
        QuotaFile(str(tmp_path / "missing.toml"), Quotas())
    (tmp_path / "bad.toml").write_text("[identities.a]\nrate = 0\n")
    with pytest.raises(QuotaError, match="positive"):
        QuotaFile(str(tmp_path / "bad.toml"), Quotas())


def test_the_documented_quota_file_parses_as_it_says() -> None:
    import re

    doc = (Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text(encoding="utf-8")
    (block,) = [b for b in re.findall(r"^```toml\n(.*?)^```", doc, re.M | re.S) if "[identities." in b]
    config = QuotaConfig.parse(block)
    assert config.of("reporting") is not None and config.of("reporting").rate_of("bookings") == 50
    assert config.of("reporting").rate_of("trips") == 200
    assert config.of("someone").rate_of("bookings") == 20
