"""Avro answers (keyroute.formats.avro_answers): every JSON answer a read gives comes back from its Avro
envelope as exactly the same Python values, over every value type a store holds; Accept negotiation."""

from __future__ import annotations

import io
import json
import math
from typing import Any

import fastavro
import pytest

from keyroute.formats import avro_answers
from keyroute.formats.avro_answers import (
    ANSWER_SCHEMA,
    SCHEMA_ID,
    NotAcceptable,
    answer_type,
    avro_answer,
    decode_answer,
    encode_answer,
    encode_body,
    found_avro,
    found_entry_avro,
    is_avro,
    results_avro,
    schema_document,
)

# Every kind of value a column holds, as JSON gives it.
VALUE = {
    "int": 42,
    "negative": -7,
    "int64_min": -(2**63),
    "int64_max": 2**63 - 1,
    "big": 2**63,
    "huge": -(10**30),
    "float": 1.5,
    "whole_float": 3.0,
    "tiny": 5e-324,
    "string": "Zürich 東京 \x00",
    "empty": "",
    "null": None,
    "true": True,
    "false": False,
    "object": {"a": [1, {"b": None}], "c": "d"},
    "array": [1, "two", 3.5, None],
    "empty_object": {},
    "timestamp": "2024-06-01T12:30:00.123456Z",
    "date": "2024-06-01",
}

KEY_ANSWER = {"store": "bookings", "key": "C001", "partition": 3, "version": 7, "value": VALUE}
HISTORY_ANSWER = {
    "store": "trips",
    "key": "a/b",
    "partition": 0,
    "version": 2,
    "next": "v1.abc",
    "rows": [
        {"ts": "2024-06-01T00:00:00Z", "seq": 1, "fare": 9.5},
        {"ts": "2024-06-01", "seq": 2, "fare": None},
        {"ts": 1717200000000000, "seq": 3, "fare": 2**64},
    ],
}
WINDOWS_ANSWER = {
    "store": "per10",
    "key": "東京",
    "partition": 1,
    "version": 1,
    "windows": [{"start": "2024-06-01T00:00:00Z", "end": "2024-06-01T00:10:00Z", "value": {"n": 3, "total": 7.5}}],
}
BATCH_ANSWER = {
    "results": [
        {"key": "C001", "status": 200, "partition": 3, "version": 7, "node": "n1", "value": VALUE},
        {"key": "C002", "status": 200, "partition": 1, "version": 7, "offset": 12, "node": "n2", "value": {"x": 1}},
        {"key": "nobody", "status": 404, "error": "key_not_found", "message": "key 'nobody' is not in store"},
        {"key": "nobody", "status": 404, "offset": 3, "error": "key_not_found", "message": "m"},
        {"key": [1, 2], "status": 400, "error": "bad_request", "message": "not a key"},
        {"key": 12, "status": 400, "error": "bad_key", "message": "not an int64"},
        {"key": 1.5, "status": 400, "error": "bad_request", "message": "a float"},
        {"key": "C003", "status": 503, "error": "partition_unavailable", "message": "no node serves it"},
    ]
}


def typed(value: Any) -> Any:
    """`value` with every leaf's type beside it: an integer stays an integer, a float a float, a bool a bool."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    return type(value).__name__, value


@pytest.mark.parametrize(
    "answer",
    [
        KEY_ANSWER,
        HISTORY_ANSWER,
        WINDOWS_ANSWER,
        BATCH_ANSWER,
        {"results": []},
        {**HISTORY_ANSWER, "rows": []},
        {**KEY_ANSWER, "value": 5},  # a value that is not an object
        {**KEY_ANSWER, "value": None},
        {**KEY_ANSWER, "value": [1, 2]},
        {**KEY_ANSWER, "key": ""},
    ],
    ids=["key", "history", "windows", "batch", "empty-batch", "no-rows", "scalar", "null", "array", "empty-key"],
)
def test_every_answer_decodes_to_the_values_json_gives(answer: dict[str, Any]) -> None:
    from_json = json.loads(json.dumps(answer))
    assert encode_answer(from_json) == reference_bytes(from_json)  # what fastavro writes
    decoded = decode_answer(encode_answer(from_json))
    assert decoded == from_json
    assert typed(decoded) == typed(from_json)
    # From the JSON body's bytes, as a node encodes it, the same.
    assert typed(decode_answer(encode_body(json.dumps(answer).encode()))) == typed(from_json)


# fastavro's generic writer, the reference the hand-written encoder must match byte for byte: the JSON answer
# as the record it writes (every union's branch named in tuple notation).
_REFERENCE = fastavro.parse_schema(json.loads(json.dumps(ANSWER_SCHEMA)))


def _ref_field(value: Any) -> Any:
    kind = type(value)
    if kind is dict or kind is list or (kind is int and not -(2**63) <= value < 2**63):
        return _ref_nested(value)
    return value


def _ref_nested(value: Any) -> Any:
    return "keyroute.Nested", {"json": json.dumps(value, ensure_ascii=False, separators=(",", ":"))}


def _ref_value(value: Any) -> Any:
    if type(value) is not dict:
        return _ref_nested(value)
    return "map", {column: _ref_field(item) for column, item in value.items()}


def reference_bytes(answer: dict[str, Any]) -> bytes:
    record: dict[str, Any] = {k: answer[k] for k in ("store", "key", "partition", "version", "next") if k in answer}
    if "value" in answer:
        record["value"] = _ref_value(answer["value"])
    for name in ("rows", "windows"):
        if name in answer:
            record[name] = "array", [_ref_value(row) for row in answer[name]]
    if "results" in answer:
        entries = []
        for entry in answer["results"]:
            out = {k: v for k, v in entry.items() if k != "value"}
            out["key"] = _ref_field(entry.get("key"))
            if "value" in entry:
                out["value"] = _ref_value(entry["value"])
            entries.append(out)
        record["results"] = "array", entries
    out = io.BytesIO()
    fastavro.schemaless_writer(out, _REFERENCE, record)
    return out.getvalue()


def test_the_envelope_is_plain_avro_any_reader_reads() -> None:
    data = encode_answer(KEY_ANSWER)
    schema = fastavro.parse_schema(json.loads(json.dumps(ANSWER_SCHEMA)))
    record = fastavro.schemaless_reader(io.BytesIO(data), schema, None)
    assert record["store"] == "bookings" and record["partition"] == 3 and record["version"] == 7
    assert record["rows"] is None and record["results"] is None
    value = record["value"]
    assert value["int"] == 42 and value["float"] == 1.5 and value["null"] is None and value["true"] is True
    assert value["timestamp"] == VALUE["timestamp"]
    assert json.loads(value["object"]["json"]) == VALUE["object"]  # Nested: the JSON text
    assert json.loads(value["big"]["json"]) == 2**63


def test_a_json_body_is_encoded_from_its_bytes_also_where_orjson_stops() -> None:
    body = b'{"store":"s","key":"k","partition":0,"version":1,"value":{"n":123456789012345678901234567890,"f":NaN}}'
    decoded = decode_answer(encode_body(body))
    assert decoded["value"]["n"] == 123456789012345678901234567890
    assert math.isnan(decoded["value"]["f"])
    assert decode_answer(encode_body(b'{"value":{"n":-1000000000000000000000000000000}}')) == {
        "value": {"n": -(10**30)}  # an integer, not the float orjson reads it as
    }
    nested = b'{"value":{"o":{"n":[100000000000000000000000]},"f":1e30,"g":-2.5e300}}'
    assert typed(decode_answer(encode_body(nested))) == typed(json.loads(nested))
    plain = b'{"store":"s","key":"k","partition":0,"version":1,"value":{"a":1}}'
    assert decode_answer(encode_body(plain)) == json.loads(plain)


def test_only_a_200_becomes_avro_and_it_names_its_schema() -> None:
    headers = [(b"content-type", b"application/json"), (b"x-keyroute-node", b"n1")]
    body = json.dumps(KEY_ANSWER).encode()
    status, out, data = avro_answer(200, headers, body, b"application/avro")
    assert status == 200 and decode_answer(data) == KEY_ANSWER
    assert out == [
        (b"x-keyroute-node", b"n1"),
        (b"content-type", b"application/avro"),
        (b"x-keyroute-schema-id", SCHEMA_ID.encode()),
    ]
    error = b'{"error":"key_not_found","message":"m"}'
    assert avro_answer(404, headers, error, b"application/avro") == (404, headers, error)
    # Text Avro cannot hold (a lone surrogate, escaped in JSON): the answer stays JSON, and says so.
    lone = b'{"store":"s","key":"\\ud800","partition":0,"version":1,"value":{}}'
    assert avro_answer(200, headers, lone, b"application/avro") == (200, headers, lone)


def test_the_schema_id_is_the_avro_fingerprint_of_the_canonical_form() -> None:
    canonical = fastavro.schema.to_parsing_canonical_form(fastavro.parse_schema(json.loads(json.dumps(ANSWER_SCHEMA))))
    assert fastavro.schema.fingerprint(canonical, "CRC-64-AVRO") == SCHEMA_ID
    assert len(SCHEMA_ID) == 16
    # A store's published schema only documents its columns: the same schema, the same id.
    document = schema_document("bookings", ("fare", "seat"))
    assert "'fare', 'seat'" not in document["doc"] and "fare, seat" in document["doc"]
    parsed = fastavro.parse_schema(document)
    assert fastavro.schema.fingerprint(fastavro.schema.to_parsing_canonical_form(parsed), "CRC-64-AVRO") == SCHEMA_ID


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        (None, None),
        (b"*/*", None),
        (b"application/json", None),
        (b"application/*", None),  # a tie: JSON
        (b"text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8", None),  # a browser
        (b"application/avro", b"application/avro"),
        (b"Application/Avro", b"application/avro"),
        (b"application/avro, application/json;q=0.5", b"application/avro"),
        (b"application/json, application/avro;q=0.9", None),
        (b"application/avro;q=0.9, */*;q=0.1", b"application/avro"),
        (b"application/vnd.keyroute.bookings+avro", b"application/vnd.keyroute.bookings+avro"),
        (b"application/avro;q=0.5, application/vnd.keyroute.bookings+avro", b"application/vnd.keyroute.bookings+avro"),
        (b"application/json;q=0, */*", b"application/avro"),
    ],
)
def test_accept_chooses_json_unless_it_prefers_avro(accept: bytes | None, expected: bytes | None) -> None:
    assert answer_type(accept, "bookings") == expected


@pytest.mark.parametrize(
    "accept",
    [b"text/html", b"application/xml", b"application/vnd.keyroute.other+avro", b"application/json;q=0, text/*"],
)
def test_an_accept_offering_neither_is_406_naming_what_is_offered(accept: bytes) -> None:
    with pytest.raises(NotAcceptable) as caught:
        answer_type(accept, "bookings")
    error = caught.value
    assert error.status == 406 and error.code == "not_acceptable"
    for offered in ("application/json", "application/avro", "application/vnd.keyroute.bookings+avro"):
        assert offered in error.message


def test_negotiation_is_remembered_per_accept_and_store() -> None:
    avro_answers._negotiate.cache_clear()
    for _ in range(3):
        answer_type(b"application/avro", "bookings")
    assert avro_answers._negotiate.cache_info().hits == 2


@pytest.mark.parametrize(
    "value_json",
    [
        json.dumps(VALUE).encode(),
        b'{"a":1}',
        b"{}",
        b'{"n":100000000000000000000000,"f":1.5}',
        b'{"o":{"n":[100000000000000000000000]}}',
        b"5",
    ],
)
def test_a_key_answer_written_from_the_stored_value_is_the_json_answer_s_avro(value_json: bytes) -> None:
    from keyroute.api import found_body

    avro = found_avro("bookings", "C001", 3, 7, value_json)
    assert is_avro(avro)
    assert avro == encode_body(found_body("bookings", "C001", 3, 7, value_json))
    assert typed(decode_answer(avro)) == typed(json.loads(found_body("bookings", "C001", 3, 7, value_json)))


def test_text_avro_cannot_hold_is_nested_in_a_value_else_the_answer_is_json_or_406() -> None:
    from keyroute.api import found_body

    # A lone surrogate (JSON escapes it, UTF-8 cannot hold it) in a value: Nested, exact.
    lone = b'{"note":"\\ud800","o":{"n":"\\udfff"}}'
    answer = found_avro("bookings", "C001", 3, 7, lone)
    assert is_avro(answer)
    assert decode_answer(answer) == json.loads(found_body("bookings", "C001", 3, 7, lone))
    # In a column's name: a key read answers JSON, a batch-get 406.
    named = b'{"\\ud800":1}'
    assert found_avro("bookings", "C001", 3, 7, named) == found_body("bookings", "C001", 3, 7, named)
    with pytest.raises(NotAcceptable, match="application/json"):
        found_entry_avro("C001", 3, 7, named)
    with pytest.raises(NotAcceptable):
        results_avro([b'{"key":"x","status":400,"error":"bad_key","message":"\\ud800"}'])


def test_a_batch_answer_from_entries_avro_already_and_json_is_the_json_answer_s_avro() -> None:
    from keyroute.http.forwarding import encode_entry, found_entry, results_body

    found = [
        ("C001", 3, 7, json.dumps(VALUE).encode(), None, "n1"),
        ("C002", 1, 7, b'{"a":1}', 12, "n2"),
        ("C003", 0, 7, b'{"f":1e30,"n":100000000000000000000000,"o":{"g":-1e300}}', None, None),
    ]
    errors = [
        encode_entry({"key": "nobody", "status": 404, "error": "key_not_found", "message": "m", "offset": 3}),
        encode_entry({"key": "x", "status": 503, "error": "partition_unavailable", "message": "no node"}),
    ]
    entries = [found_entry(*found[0]), errors[0], found_entry(*found[1]), errors[1], found_entry(*found[2])]
    as_json = results_body(entries)
    avro = [found_entry_avro(*f) for f in found]
    mixed = results_avro([avro[0], errors[0], avro[1], errors[1], avro[2]])
    assert mixed == encode_body(as_json)
    assert typed(decode_answer(mixed)) == typed(json.loads(as_json))
    assert results_avro([]) == encode_body(b'{"results":[]}')
