"""keyroute.http.forwarding: relayed headers, batch-get bodies and entries, and the per-node batch failover
loop that routers and nodes share (its send function injected, so no sockets here)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pytest

from keyroute.api import BadRequest, KeyNotFound, PartitionUnavailable, PayloadTooLarge
from keyroute.http.forwarding import (
    HOP_BY_HOP,
    ForwardedBatch,
    batch_body,
    batch_path,
    encode_entry,
    error_entry,
    forward_batch,
    found_entry,
    parse_batch_answer,
    parse_batch_body,
    parse_batch_request,
    passthrough_headers,
    path_segment,
    results_body,
)

# -- headers and paths ------------------------------------------------------------------------------------


def test_passthrough_headers_drop_hop_by_hop_and_connection_named_ones_and_lowercase_names() -> None:
    kept = passthrough_headers(
        [
            (b"Connection", b"close, X-A"),
            (b"X-A", b"1"),
            (b"X-Keyroute-Node", b"n"),
            (b"Transfer-Encoding", b"chunked"),
            (b"Keep-Alive", b"timeout=5"),
            (b"Content-Length", b"12"),
            (b"Date", b"today"),
            (b"Server", b"them"),
            (b"Set-Cookie", b"a=1"),
            (b"Set-Cookie", b"b=2"),
            (b"Content-Encoding", b"gzip"),
            (b"Retry-After", b"2"),
        ]
    )
    # Repeated headers stay repeated, in order; the body is relayed as received, so its coding with it.
    assert kept == [
        (b"x-keyroute-node", b"n"),
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
        (b"content-encoding", b"gzip"),
        (b"retry-after", b"2"),
    ]


def test_the_hop_by_hop_set_is_rfc_9110_plus_what_our_server_sets_again() -> None:
    rfc_9110 = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding"}
    assert rfc_9110 | {b"upgrade", b"content-length", b"date", b"server"} <= HOP_BY_HOP
    assert all(name == name.lower() for name in HOP_BY_HOP)


@pytest.mark.parametrize(
    ("text", "segment"),
    [
        ("k", "k"),
        ("a/b c", "a%2Fb%20c"),
        ("x?#%+", "x%3F%23%25%2B"),
        ("東", "%E6%9D%B1"),
        (".", "%2E"),
        ("..", "%2E%2E"),
    ],
)
def test_a_path_segment_survives_every_client_and_server_on_the_way(text: str, segment: str) -> None:
    assert path_segment(text) == segment


def test_the_batch_path_names_the_store_as_one_segment() -> None:
    assert batch_path("a/b") == "/stores/a%2Fb/batch-get"


# -- bodies and entries ------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [b"", b"{", b"[]", b'{"keys": "k"}', b'{"key": []}', b"\xff", b"null"])
def test_a_malformed_batch_body_is_bad_request(body: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_batch_body(body, 10)


def test_a_batch_body_gives_its_keys_as_json_gave_them() -> None:
    assert parse_batch_body(b'{"keys": ["a", 1, null, true, 1.5]}', 10) == ["a", 1, None, True, 1.5]
    assert parse_batch_body(b'{"keys": []}', 10) == []


def test_a_batch_over_max_keys_is_413_too_many_keys_and_0_is_no_limit() -> None:
    assert parse_batch_body(b'{"keys": ["a", "b", "c"]}', 3) == ["a", "b", "c"]
    with pytest.raises(PayloadTooLarge) as caught:
        parse_batch_body(b'{"keys": ["a", "b", "c", "d"]}', 3)
    assert (caught.value.status, caught.value.code) == (413, "too_many_keys")
    assert len(parse_batch_body(json.dumps({"keys": ["k"] * 5000}).encode(), 0)) == 5000


def test_a_batch_request_body_round_trips_through_the_parser() -> None:
    texts = ["a", "東京", 'quote"d', "\ud800"]  # a lone surrogate: valid JSON text, not UTF-8
    assert parse_batch_body(batch_body(texts), 0) == texts


@pytest.mark.parametrize(
    ("written", "read"),
    [("14571", 14571), ("14571.0", 14571), ("1.4571e4", 14571), ("1e3", 1000), ("0.0", 0), ("-0.0", 0),
     # Read exactly, never through a binary float (which would give ...992).
     ("9007199254740993.0", 9007199254740993), ("9223372036854775807.0", (1 << 63) - 1)],
)  # fmt: skip
def test_an_integral_json_number_is_an_integer_in_every_integer_field_of_a_batch_body(written: str, read: int) -> None:
    # JSON Schema 2020-12 counts 14571.0 as an integer, and the OpenAPI document says `integer`.
    body = f'{{"keys": [{written}], "min_offset": {written}, "min_offsets": {{"8525082": {written}}}}}'.encode()
    parsed = parse_batch_request(body, 10)
    assert parsed.keys == [read] and type(parsed.keys[0]) is int
    assert parsed.bounds is not None and parsed.bounds.every == read and parsed.bounds.partitions == {8525082: read}


@pytest.mark.parametrize(
    ("bound", "shown"),
    [("14571.5", "14571.5"), ("1e-3", "0.001"), ("true", "True"), ("-1", "-1"), ("-1.0", "-1"),
     ("9223372036854775808", "9223372036854775808"), ("9223372036854775808.0", "9223372036854775808"),
     ('"5"', "'5'"), ("null", "None")],
)  # fmt: skip
def test_a_bound_with_a_fraction_a_boolean_or_out_of_range_is_a_clear_400(bound: str, shown: str) -> None:
    body = f'{{"keys": ["a"], "min_offsets": {{"3": {bound}}}}}'.encode()
    with pytest.raises(BadRequest) as refused:
        parse_batch_request(body, 10)
    assert refused.value.status == 400 and refused.value.code == "bad_request"
    assert refused.value.message == (
        f"min_offsets[3] must be an offset: an integer from 0 to 9223372036854775807, got {shown}"
    )


def test_a_key_with_a_fraction_is_left_to_the_caller_as_the_float_it_is() -> None:
    assert parse_batch_request(b'{"keys": [5.5, "5.0", 5.0]}', 10).keys == [5.5, "5.0", 5]


def test_a_found_entry_keeps_the_stored_value_bytes_as_they_are() -> None:
    value = b'{"b": 1,   "a": [1.50, "\\u00e9"]}'
    entry = found_entry("東京", 3, 7, value)
    assert entry.endswith(b', "value": ' + value + b"}")
    assert json.loads(entry) == {"key": "東京", "status": 200, "partition": 3, "version": 7, "value": json.loads(value)}


def test_an_error_entry_carries_the_errors_status_code_and_message() -> None:
    assert error_entry(17, KeyNotFound("gone")) == {
        "key": 17,
        "status": 404,
        "error": "key_not_found",
        "message": "gone",
    }


def test_an_entry_with_a_lone_surrogate_is_encoded_as_ascii_json() -> None:
    entry = error_entry("\ud800x", PartitionUnavailable("busy"))
    encoded = encode_entry(entry)
    assert encoded.isascii() and json.loads(encoded) == entry
    assert encode_entry({"key": "東"}) == '{"key":"東"}'.encode()  # compact, and UTF-8 where it can be


def test_the_results_body_holds_the_encoded_entries_in_order() -> None:
    body = results_body([found_entry("a", 0, 1, b"2"), encode_entry(error_entry("b", KeyNotFound("no")))])
    assert [e["key"] for e in json.loads(body)["results"]] == ["a", "b"]
    assert json.loads(results_body([])) == {"results": []}


def test_a_usable_batch_answer_has_one_object_with_an_integer_status_per_key() -> None:
    good = {"results": [{"key": "a", "status": 200, "value": 1}, {"key": "b", "status": 404}]}
    assert parse_batch_answer(json.dumps(good).encode(), 2) == good["results"]
    for unusable, count in [
        (b"not json", 1),
        (b'{"nothing": []}', 1),
        (b'{"results": {}}', 1),
        (b"[]", 1),
        (json.dumps(good).encode(), 3),  # an entry missing
        (b'{"results": [1]}', 1),
        (b'{"results": [{"key": "a"}]}', 1),
        (b'{"results": [{"key": "a", "status": "200"}]}', 1),
        (b'{"results": [{"key": "a", "status": true}]}', 1),
    ]:
        assert parse_batch_answer(unusable, count) is None, unusable


# -- the failover loop -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replica:
    url: str
    version: int = 1


A, B, C = Replica("http://a"), Replica("http://b"), Replica("http://c")


class Nodes:
    """The injected send: each node answers by a rule, and every request is recorded."""

    def __init__(self, **rules: Any) -> None:
        self.rules = rules  # node letter -> "down" | "refuse" | "found" | a callable(texts) -> entries
        self.sent: list[tuple[str, list[str], int]] = []
        self.barrier: asyncio.Barrier | None = None

    async def send(self, replica: Replica, texts: list[str], round_number: int) -> list[dict[str, Any]] | None:
        name = replica.url[-1]
        self.sent.append((name, texts, round_number))
        if self.barrier is not None:
            await self.barrier.wait()
        rule = self.rules.get(name, "found")
        if rule == "down":
            return None
        if rule == "refuse":
            return [
                {"key": t, "status": 503, "error": "partition_unavailable", "message": f"{name} moved"} for t in texts
            ]
        if callable(rule):
            return list(rule(texts))
        return [{"key": t, "status": 200, "value": name} for t in texts]


def forward(nodes: Nodes, texts: dict[int, str], replicas: dict[int, list[Replica]]) -> ForwardedBatch:
    return asyncio.run(forward_batch(texts, replicas, nodes.send))


def test_one_request_per_node_in_parallel_with_that_nodes_keys_in_index_order() -> None:
    nodes = Nodes()
    nodes.barrier = asyncio.Barrier(2)  # each node waits for the other's request: passes only in parallel
    texts = {0: "k0", 2: "k2", 3: "k3", 5: "k5"}
    done = forward(nodes, texts, {0: [B, A], 2: [A, B], 3: [B], 5: [A]})
    assert sorted(nodes.sent) == [("a", ["k2", "k5"], 0), ("b", ["k0", "k3"], 0)]
    assert {i: e["value"] for i, e in done.entries.items()} == {0: "b", 2: "a", 3: "b", 5: "a"}
    assert done.failovers == 0


def test_replicas_with_one_url_at_different_versions_get_one_request() -> None:
    nodes = Nodes()
    done = forward(nodes, {0: "x", 1: "y"}, {0: [Replica("http://a", 1)], 1: [Replica("http://a", 2)]})
    assert nodes.sent == [("a", ["x", "y"], 0)]
    assert [e["status"] for e in done.entries.values()] == [200, 200]


def test_keys_of_a_failed_node_move_to_their_next_replica_in_the_next_round() -> None:
    nodes = Nodes(a="down")
    done = forward(nodes, {0: "x", 1: "y", 2: "z"}, {0: [A, B], 1: [A, C], 2: [B]})
    assert sorted(nodes.sent) == [("a", ["x", "y"], 0), ("b", ["x"], 1), ("b", ["z"], 0), ("c", ["y"], 1)]
    assert {i: e["value"] for i, e in done.entries.items()} == {0: "b", 1: "c", 2: "b"}
    assert done.failovers == 2


def test_entries_a_node_refuses_with_503_move_on_while_its_other_entries_stand() -> None:
    def half(texts: list[str]) -> list[dict[str, Any]]:
        return [{"key": t, "status": 503 if t == "x" else 404} for t in texts]

    nodes = Nodes(a=half)
    done = forward(nodes, {0: "x", 1: "y"}, {0: [A, B], 1: [A, B]})
    assert nodes.sent == [("a", ["x", "y"], 0), ("b", ["x"], 1)]
    assert (done.entries[0]["value"], done.entries[1]["status"]) == ("b", 404)
    assert done.failovers == 1


def test_a_key_every_replica_refuses_ends_with_the_last_refusal() -> None:
    nodes = Nodes(a="refuse", b="refuse")
    done = forward(nodes, {0: "x"}, {0: [A, B]})
    assert done.entries[0]["status"] == 503 and done.entries[0]["message"] == "b moved"


def test_a_key_whose_replicas_all_fail_gets_a_503_partition_unavailable_entry() -> None:
    nodes = Nodes(a="down", b="down")
    done = forward(nodes, {0: "x"}, {0: [A, B]})
    assert done.entries[0]["key"] == "x" and done.entries[0]["status"] == 503
    assert done.entries[0]["error"] == "partition_unavailable" and "'x'" in done.entries[0]["message"]
    assert [round_number for _, _, round_number in nodes.sent] == [0, 1] and done.failovers == 1
    # A refusal is kept over a failure that comes after it.
    nodes = Nodes(a="refuse", b="down")
    assert forward(nodes, {0: "x"}, {0: [A, B]}).entries[0]["message"] == "a moved"


def test_nothing_to_forward_sends_nothing() -> None:
    nodes = Nodes()
    assert forward(nodes, {}, {}) == ForwardedBatch({}, 0) and nodes.sent == []
