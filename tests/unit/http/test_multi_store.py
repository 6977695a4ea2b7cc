"""The multi-store read's wire format (keyroute.http.multi_store): the stores a path names, the query's
options, the batch body, and the answers routers and nodes write."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyroute.api import BadRequest, KeyNotFound, NotUpToBound, PayloadTooLarge
from keyroute.http.multi_store import (
    MAX_STORES,
    entry_of_answer,
    error_entry_bytes,
    json_text,
    key_answer,
    parse_options,
    parse_read_request,
    parse_stores,
    read_body,
    results_answer,
    stores_segment,
)

STORES = ("profile", "balance", "trips")


def test_the_stores_are_names_joined_by_commas_each_once() -> None:
    assert parse_stores("profile,balance") == ("profile", "balance")
    assert parse_stores("one") == ("one",)
    for bad, word in [
        ("a,,b", "joined by ','"),
        (",a", "joined by ','"),
        ("a,b,a", "'a' named more than once"),
        (",".join(f"s{i}" for i in range(MAX_STORES + 1)), f"at most {MAX_STORES}"),
    ]:
        with pytest.raises(BadRequest, match=word):
            parse_stores(bad)
    assert stores_segment(["a.b", "..", "x y"]) == "a.b,%2E%2E,x%20y"


def test_options_give_each_store_its_bound_and_projection() -> None:
    options = parse_options(b"min_offset=trips:14571,balance:3&fields=name&fields.trips=legs.n,last", STORES)
    assert dict(options.min_offsets) == {"trips": 14571, "balance": 3}
    assert {store: p.text for store, p in options.fields.items()} == {
        "profile": "name",
        "balance": "name",
        "trips": "legs.n,last",
    }
    # What is passed on asks the same again, of the stores named.
    again = parse_options(options.query().lstrip("?").encode(), STORES)
    assert again == options
    assert parse_options(options.query(["trips"]).lstrip("?").encode(), STORES).min_offsets == {"trips": 14571}
    assert "min_offset" not in options.query(bounds=False)
    assert parse_options(b"", STORES).min_offsets == {} and parse_options(b"", STORES).query() == ""


@pytest.mark.parametrize(
    ("query", "word"),
    [
        (b"min_offset=5", "store:offset"),
        (b"min_offset=nope:5", "not one of the stores"),
        (b"min_offset=trips:-1", "min_offset must be an offset"),
        (b"min_offset=trips:1,trips:2", "given twice"),
        (b"fields.nope=a", "not one of the stores"),
        (b"fields=", "name at least one field"),
        (b"fields=a&fields=b", "given twice"),
        (b"limit=3", "unknown query parameter 'limit'"),
        (b"fields=%ff", "malformed"),
    ],
)
def test_a_malformed_query_is_a_bad_request_naming_it(query: bytes, word: str) -> None:
    with pytest.raises(BadRequest, match=word):
        parse_options(query, STORES)


def test_a_batch_body_reads_every_key_of_a_list_in_every_store() -> None:
    request = parse_read_request(b'{"keys": ["k1", 7, "k1"], "min_offset": {"trips": 9.0}}', STORES, 0)
    assert {store: list(keys) for store, keys in request.keys.items()} == {s: ["k1", 7, "k1"] for s in STORES}
    assert [row.key for row in request.rows] == ["k1", 7, "k1"]  # one row per key, duplicates too
    assert request.rows[2].at == tuple((store, 2) for store in STORES)
    assert request.min_offsets == {"trips": 9} and request.size == 9


def test_an_object_body_gives_each_store_its_keys_and_one_row_per_distinct_key() -> None:
    body = json.dumps({"keys": {"trips": ["a", "b"], "profile": ["b", "c"]}}).encode()
    request = parse_read_request(body, STORES, 0)
    assert [(row.key, row.at) for row in request.rows] == [
        ("a", (("trips", 0),)),
        ("b", (("trips", 1), ("profile", 0))),
        ("c", (("profile", 1),)),
    ]
    assert request.size == 4


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"[]", BadRequest),
        (b'{"keys": "k"}', BadRequest),
        (b'{"keys": [1.5]}', BadRequest),
        (b'{"keys": [null]}', BadRequest),
        (b'{"keys": [true]}', BadRequest),
        (b'{"keys": {"nope": ["k"]}}', BadRequest),
        (b'{"keys": {"trips": "k"}}', BadRequest),
        (b'{"keys": [], "min_offset": 5}', BadRequest),
        (b'{"keys": [], "min_offset": {"trips": -1}}', BadRequest),
        (b'{"keys": [], "extra": 1}', BadRequest),
        (b"not json", BadRequest),
        (b'{"keys": ["a", "b"]}', PayloadTooLarge),  # 2 keys x 3 stores: past 5 reads
    ],
)
def test_a_malformed_body_is_refused(body: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        parse_read_request(body, STORES, 5)


@given(st.lists(st.text(min_size=0, max_size=8), max_size=4), st.text(max_size=12))
def test_answers_are_the_json_of_their_entries(stores: list[str], key: str) -> None:
    entries = [(store, error_entry_bytes(key, KeyNotFound(f"no {key!r}"), offset=3)) for store in dict.fromkeys(stores)]
    answer = json.loads(key_answer(key, entries))
    assert answer["key"] == key
    assert list(answer["stores"]) == list(dict.fromkeys(stores))
    for entry in answer["stores"].values():
        assert entry == {"key": key, "status": 404, "error": "key_not_found", "message": f"no {key!r}", "offset": 3}
    assert json.loads(results_answer([key_answer(key, entries)] * 2))["results"] == [answer, answer]
    assert json.loads(json_text(key)) == key


def test_a_lone_surrogate_in_a_key_is_escaped() -> None:
    assert json.loads(json_text("a\ud800b")) == "a\ud800b"


def test_a_single_reads_answer_becomes_an_entry() -> None:
    headers = [(b"x-keyroute-node", b"n2"), (b"x-keyroute-offset", b"41")]
    found = b'{"store": "s", "key": "k", "partition": 3, "version": 2, "value": {"a": 1}}'
    assert entry_of_answer("k", 200, headers, found) == {
        "key": "k",
        "status": 200,
        "partition": 3,
        "version": 2,
        "offset": 41,
        "node": "n2",
        "value": {"a": 1},
    }
    missing: dict[str, Any] = entry_of_answer("k", 404, headers[:1], b'{"error": "expired", "message": "old"}')
    assert missing == {"key": "k", "status": 404, "error": "expired", "message": "old", "node": "n2"}
    assert entry_of_answer("k", 200, [], b"nonsense")["status"] == 502


def test_a_body_the_router_sends_reads_back_as_it_was_meant() -> None:
    body = read_body({"trips": ["a"], "profile": ["a", "b"]}, {"trips": 5})
    request = parse_read_request(body, STORES, 0)
    assert {store: list(keys) for store, keys in request.keys.items()} == {"trips": ["a"], "profile": ["a", "b"]}
    assert request.min_offsets == {"trips": 5}


def test_a_store_behind_its_bound_says_how_far_it_got() -> None:
    entry = json.loads(error_entry_bytes("k", NotUpToBound("behind", 1, offset=41)))
    assert (entry["status"], entry["error"], entry["offset"]) == (503, "not_up_to_bound", 41)
    assert "offset" not in json.loads(error_entry_bytes("k", KeyNotFound("no")))
