"""The node's data plane (keyroute.state_node.dataplane) on keyroute's HTTP server over real sockets: a read of a
key held here is answered at once, without a task, exactly as `keyroute.state_node.reads.read_key` gives it;
admission refuses before anything is read; a failing answer is a logged JSON 500 and the connection goes
on; a read behind a request of the admin app waits for that answer, in order."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from keyroute.api import MAX_JSON_DEPTH, BadKey, PartitionUnavailable, found_body, json_depth
from keyroute.http.dataplane import Call
from keyroute.http.exchange import ServerLimits
from keyroute.keys.key_format import KeyFormatError, parse_key
from keyroute.runtime.settings import RequestLimits
from keyroute.state_node.dataplane import NodeDataPlane
from keyroute.state_node.reads import Forward, _found_json, read_key
from tests.request_bodies import DEEP_BODIES, bodies
from tests.unit.node.fakes import (
    GENERATION,
    HELD,
    KEY_LOCAL,
    KEY_REMOTE,
    LOCAL_P,
    ME,
    SERVING,
    Client,
    Nodes,
    key_in,
    unreachable,
)

MISSING = key_in("s", LOCAL_P, prefix="zz")


@pytest.fixture
def spawned(client_for: Nodes) -> Iterator[list[str]]:
    """The raw paths of the requests the data plane answered in a task of their own (the nodes the test starts
    serve with a data plane that notes them)."""
    paths: list[str] = []

    class Spying(NodeDataPlane):
        def spawn(self, call: Call, work: Any) -> None:
            paths.append(call.request.path.decode())
            super().spawn(call, work)

    client_for.plane = Spying
    yield paths


def exchange_raw(
    port: int, data: bytes, heads: frozenset[int] = frozenset()
) -> list[tuple[int, dict[bytes, bytes], list[bytes], bytes]]:
    """`data` sent on one connection (the last request says `Connection: close`); every answer read back as
    (status, headers by name, header names in order, body); `heads`: the indexes of HEAD requests."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    answers = []
    while received:
        head, _, rest = received.partition(b"\r\n\r\n")
        status_line, *lines = head.split(b"\r\n")
        pairs = [tuple(line.split(b": ", 1)) for line in lines]
        headers = dict(pairs)
        length = 0 if len(answers) in heads else int(headers[b"content-length"])
        answers.append((int(status_line.split()[1]), headers, [name for name, _ in pairs], rest[:length]))
        received = rest[length:]
    return answers


def test_every_path_under_stores_is_the_data_planes_and_nothing_else(
    client_for: Nodes,
) -> None:
    client, _ = client_for(SERVING, HELD, unreachable)
    plane = NodeDataPlane(client.node, client.admission)
    for method in ("GET", "HEAD", "POST", "DELETE"):
        assert plane.accepts(method, b"/stores/s/keys/k") and plane.accepts(method, b"/stores/")
    for path in (b"/stores", b"/storesx/s/keys/k", b"/healthz", b"/admin/route", b"/metrics", b"/"):
        assert not plane.accepts("GET", path)


def test_a_held_key_is_answered_at_once_exactly_as_read_key_gives_it(client_for: Nodes, spawned: list[str]) -> None:
    client, _ = client_for(SERVING, HELD, unreachable)
    node = client.node
    found_answer = read_key(node, "s", KEY_LOCAL, False)
    missing_answer = read_key(node, "s", MISSING, False)
    assert isinstance(found_answer, tuple) and isinstance(missing_answer, tuple)
    raw = (
        f"GET /stores/s/keys/{KEY_LOCAL} HTTP/1.1\r\nHost: x\r\nX-Request-ID: rid-1\r\n\r\n"
        f"HEAD /stores/s/keys/{KEY_LOCAL} HTTP/1.1\r\nHost: x\r\nX-Request-ID: rid-2\r\n\r\n"
        f"GET /stores/s/keys/{MISSING} HTTP/1.1\r\nHost: x\r\nX-Request-ID: rid-3\r\nConnection: close\r\n\r\n"
    ).encode()
    found, head, missing = exchange_raw(client.port, raw, heads=frozenset({1}))
    framing = {b"content-length", b"date", b"x-request-id", b"connection"}
    for (status, headers, names, body), expected, request_id in (
        (found, found_answer, b"rid-1"),
        (missing, missing_answer, b"rid-3"),
    ):
        assert status == expected[0]
        assert [(n, headers[n]) for n in names if n not in framing] == expected[1]
        assert body == expected[2] and headers[b"content-length"] == str(len(body)).encode()
        assert headers[b"x-request-id"] == request_id
    # The answers themselves, as clients have always had them.
    assert found[3] == (
        f'{{"store": "s", "key": "{KEY_LOCAL}", "partition": {LOCAL_P}, "version": 1, "value": {{"v":1}}}}'.encode()
    )
    assert json.loads(missing[3]) == {"error": "key_not_found", "message": f"key {MISSING!r} is not in store 's'"}
    for _, headers, _, _ in (found, missing):
        assert {k: headers[k] for k in (b"content-type", b"x-keyroute-partition", b"x-keyroute-node")} == {
            b"content-type": b"application/json",
            b"x-keyroute-partition": str(LOCAL_P).encode(),
            b"x-keyroute-node": ME.encode(),
        }
        assert (headers[b"x-keyroute-version"], headers[b"x-keyroute-hops"]) == (b"1", b"0")
        assert headers[b"x-keyroute-generation"] == str(GENERATION).encode()
    # HEAD: the same answer without its body, its length still said.
    assert head[0] == 200 and head[3] == b"" and head[1][b"content-length"] == found[1][b"content-length"]
    assert [n for n in head[2] if n not in framing] == [n for n in found[2] if n not in framing]
    assert spawned == []  # no task for any of them
    # Each answer timed from its admission, by status class (and store: labelled as the reads are counted).
    metrics = client.get("/metrics").text
    store = re.search(r'keyroute_node_requests_total\{kind="key",outcome="found",store="([^"]+)"\}', metrics)
    assert store is not None
    for code_class, n in (("2xx", 2), ("4xx", 1)):
        assert f'request_duration_seconds_count{{code_class="{code_class}",store="{store[1]}"}} {n}.0' in metrics


def test_a_read_behind_an_app_request_is_answered_after_it_in_order(client_for: Nodes, spawned: list[str]) -> None:
    client, _ = client_for(SERVING, HELD, unreachable)
    path = f"/stores/s/keys/{KEY_LOCAL}"
    raw = (
        "GET /readyz HTTP/1.1\r\nHost: x\r\nX-Request-ID: one\r\n\r\n"
        f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Request-ID: two\r\n\r\n"
        f"GET /stores/s/keys/{MISSING} HTTP/1.1\r\nHost: x\r\n\r\n"
        "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Request-ID: five\r\nConnection: close\r\n\r\n"
    ).encode()
    answers = exchange_raw(client.port, raw)
    assert [a[0] for a in answers] == [200, 200, 404, 200, 200]
    assert json.loads(answers[0][3])["node"] == ME and json.loads(answers[3][3]) == {"status": "ok"}
    body = client.get(path).content
    assert answers[1][3] == answers[4][3] == body
    assert [a[1][b"x-request-id"] for a in (answers[0], answers[1], answers[4])] == [b"one", b"two", b"five"]
    assert spawned == []  # answered at once, and held back until the app's answer before them went out


def test_a_forwarded_read_is_answered_from_a_task_and_releases_its_admission(
    client_for: Nodes, spawned: list[str]
) -> None:
    def peer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"far": True}, headers={"x-keyroute-node": "n2"})

    client, seen = client_for(SERVING, HELD, peer)
    r = client.get(f"/stores/s/keys/{KEY_REMOTE}", headers={"x-request-id": "fwd-1"})
    assert r.status_code == 200 and r.json() == {"far": True} and r.headers["x-keyroute-forwarded-by"] == ME
    assert r.headers.get_list("x-request-id") == ["fwd-1"] and seen[0].headers["x-request-id"] == "fwd-1"
    assert spawned == [f"/stores/s/keys/{KEY_REMOTE}"]
    assert client.admission.active == 0
    r = client.post("/stores/s/batch-get", json={"keys": [KEY_LOCAL]})  # held here: answered at once
    assert r.json()["results"][0]["status"] == 200 and len(spawned) == 1 and client.admission.active == 0


def test_a_held_key_read_is_refused_by_the_admission_checks_before_it_is_answered(
    client_for: Nodes, spawned: list[str]
) -> None:
    # The server's own bound on request heads is above admission's here, so that admission's check decides.
    limits = RequestLimits(max_header_bytes=4000)
    client, _ = client_for(SERVING, HELD, unreachable, limits=limits, server_limits=ServerLimits(65536))
    admission = client.admission
    path = f"/stores/s/keys/{KEY_LOCAL}"
    admission.active = admission.max_concurrent_requests  # as many requests in progress as allowed
    try:
        busy = client.get(path, headers={"x-request-id": "busy-1"})
        batch = client.post("/stores/s/batch-get", json={"keys": [KEY_LOCAL]})
    finally:
        admission.active = 0
    oversized = client.get(path, headers={"x-request-id": "big-1", "x-padding": "p" * 4001})
    after = client.get(path)
    assert busy.status_code == batch.status_code == 503 and busy.json()["error"] == "overloaded"
    assert busy.headers["x-request-id"] == "busy-1" and busy.headers["x-keyroute-node"] == ME
    assert busy.headers["retry-after"] == "1"
    assert oversized.status_code == 431 and oversized.json()["error"] == "headers_too_large"
    assert oversized.headers["x-request-id"] == "big-1" and oversized.headers["x-keyroute-node"] == ME
    assert "connection" not in oversized.headers  # refused by admission: the connection goes on
    assert (admission.overloaded, admission.headers_too_large) == (2, 1)
    assert after.status_code == 200 and admission.active == 0
    metrics = client.get("/metrics").text
    assert 'keyroute_node_refused_requests_total{reason="overloaded"} 2.0' in metrics
    assert 'keyroute_node_refused_requests_total{reason="headers_too_large"} 1.0' in metrics
    assert spawned == []


def test_a_local_answer_that_fails_is_a_json_500_and_the_connection_goes_on(
    client_for: Nodes, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    client, _ = client_for(SERVING, HELD, unreachable)
    path = f"/stores/s/keys/{KEY_LOCAL}"
    expected = client.get(path)

    held = HELD[("s", LOCAL_P)]

    def broken(key: bytes) -> bytes | None:
        raise RuntimeError("a bug in the local answer")

    with httpx.Client(base_url=client.url, trust_env=False, timeout=10) as http:
        monkeypatch.setattr(held, "get", broken)  # the partition's read fails (a stand-in's, not the product's)
        failed = http.get(path, headers={"x-request-id": "oops-1"})
        monkeypatch.undo()
        after = http.get(path)  # on the same kept-alive connection
        assert after.extensions["network_stream"] is failed.extensions["network_stream"]
    assert failed.status_code == 500
    assert failed.json() == {"error": "internal_error", "message": "internal error"}
    assert failed.headers["x-request-id"] == "oops-1" and failed.headers["x-keyroute-node"] == ME
    assert b"Traceback" not in failed.content
    assert after.status_code == 200 and after.content == expected.content
    assert client.admission.active == 0
    logged = [r for r in caplog.records if r.exc_info and "a bug in the local answer" in str(r.exc_info[1])]
    assert logged and logged[0].request_id == "oops-1"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("method", "path", "status", "code", "allow"),
    [
        ("POST", f"/stores/s/keys/{KEY_LOCAL}", 405, "method_not_allowed", "GET, HEAD"),
        ("DELETE", f"/stores/s/keys/{KEY_LOCAL}", 405, "method_not_allowed", "GET, HEAD"),
        ("GET", "/stores/s/batch-get", 405, "method_not_allowed", "POST"),
        ("PUT", "/stores/s/batch-get", 405, "method_not_allowed", "POST"),
        ("GET", "/stores/s/keys/a/b", 404, "not_found", None),
        ("GET", "/stores/s/keys", 404, "not_found", None),
        ("GET", "/stores/s/deeper/keys/k", 404, "not_found", None),
        ("GET", "/stores//keys/k", 404, "not_found", None),
        ("POST", "/stores/s/batch-get/more", 404, "not_found", None),
        ("GET", "/stores/", 404, "not_found", None),
    ],
)
def test_other_paths_under_stores_are_json_404_or_405(
    method: str, path: str, status: int, code: str, allow: str | None, client_for: Nodes
) -> None:
    client: Client
    client, _ = client_for(SERVING, HELD, unreachable)
    r = client.request(method, path)
    assert r.status_code == status and r.json()["error"] == code and r.json()["message"]
    assert r.headers["content-type"] == "application/json" and r.headers["x-keyroute-node"] == ME
    assert r.headers.get("allow") == allow
    assert client.admission.active == 0


def test_a_batch_bound_written_as_an_integral_float_is_the_integer_and_a_fraction_is_refused(
    client_for: Nodes,
) -> None:
    # An outside fuzzer's find: the OpenAPI document says `integer`, and JSON Schema counts 14571.0 as one.
    client, _ = client_for(SERVING, HELD, unreachable)

    def batch_get(bound: str) -> httpx.Response:
        body = f'{{"keys": ["{KEY_LOCAL}"], "min_offsets": {{"{LOCAL_P}": {bound}}}}}'
        return client.post("/stores/s/batch-get", content=body, headers={"content-type": "application/json"})

    as_float, as_integer = batch_get("14571.0"), batch_get("14571")
    assert as_float.status_code == as_integer.status_code == 200 and as_float.content == as_integer.content
    # The bound was read (store s follows no topic, so the key's entry says so), not refused with the batch.
    assert [e["error"] for e in as_float.json()["results"]] == ["not_live"]
    refused = batch_get("14571.5")
    assert refused.status_code == 400 and refused.json() == {
        "error": "bad_request",
        "message": f"min_offsets[{LOCAL_P}] must be an offset: an integer from 0 to 9223372036854775807, got 14571.5",
    }
    assert refused.headers["x-keyroute-node"] == ME and client.admission.active == 0


def test_any_batch_body_is_answered_entry_by_entry_or_refused_with_a_4xx_json_error(client_for: Nodes) -> None:
    # An outside fuzzer's find: 100,000 nested `[` were a 500 and a RecursionError traceback in the log.
    client, _ = client_for(SERVING, HELD, unreachable)
    max_keys = client.node.settings.max_batch_keys

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(bodies(max_keys))
    @example(DEEP_BODIES[0])
    @example(DEEP_BODIES[1])
    def check(body: bytes) -> None:
        r = client.post("/stores/s/batch-get", content=body, headers={"content-type": "application/json"})
        assert r.status_code in (200, 400, 413) and r.headers["content-type"] == "application/json", r.text[:300]
        answer = r.json()
        if r.status_code != 200:
            assert answer["error"] in ("bad_request", "too_many_keys") and answer["message"]
            if json_depth(body) > MAX_JSON_DEPTH:
                assert f"more than {MAX_JSON_DEPTH} deep" in answer["message"]
            return
        keys = json.loads(body)["keys"]
        assert len(answer["results"]) == len(keys)
        for key, entry in zip(keys, answer["results"], strict=True):
            assert entry["key"] == key or not isinstance(key, str)
            assert entry["status"] in (200, 400, 404, 503), entry  # 503: the other replicas cannot be reached
            assert entry["status"] != 200 or entry["key"] == KEY_LOCAL and entry["value"] == {"v": 1}

    check()
    assert client.admission.active == 0


def test_a_key_read_is_located_as_the_partition_map_locates_it_whatever_its_text(client_for: Nodes) -> None:
    """`read_key` locates a string key hashed with murmur2 by the store's locator (its bytes are its UTF-8), any
    other through `PartitionMap.locate`: both give the partition the map gives, answered here (held) or sent
    on to the nodes serving it, and a key that is no string of the format a 400."""
    client, _ = client_for(SERVING, HELD, unreachable)
    node = client.node
    m = node.ownership.map

    @settings(max_examples=200, deadline=None)
    @given(st.one_of(st.text(max_size=24), st.from_regex(r"-?[0-9]{1,19}", fullmatch=True)), st.booleans())
    @example(KEY_LOCAL, False)
    @example("\ud800", False)
    def check(text: str, forwarded: bool) -> None:
        for store in ("s", "ints"):
            record = m.stores[store]
            try:
                location = m.locate(record, parse_key(record.key_format, text))
            except KeyFormatError:
                with pytest.raises(BadKey):
                    read_key(node, store, text, forwarded)
                continue
            try:
                answer = read_key(node, store, text, forwarded)
            except PartitionUnavailable:  # nobody serves it, or it was forwarded here already
                assert forwarded or not location.serving
                continue
            if isinstance(answer, Forward):
                assert (answer.partition, answer.endpoints) == (location.partition, location.serving)
                continue
            assert isinstance(answer, tuple)
            status, headers, body = answer
            assert dict(headers)[b"x-keyroute-partition"] == str(location.partition).encode()
            if status == 200:
                assert json.loads(body)["key"] == location.key
            else:
                assert status == 404 and repr(location.key) in json.loads(body)["message"]

    check()


@settings(max_examples=300, deadline=None)
@given(
    st.text(st.characters(blacklist_categories=("Cs",))),
    st.text(st.characters(blacklist_categories=("Cs",))),
    st.integers(0, 100_000),
    st.integers(0, 2**63 - 1),
    st.binary(max_size=64),
)
@example('quote " back\\slash', "\x00\n\u2028 é 😀", 0, 1, b'{"v":1}')
def test_a_found_key_is_written_as_the_api_writes_it(
    store: str, key: str, partition: int, version: int, value: bytes
) -> None:
    """A key read's 200 body is written by the read path's own (compiled) copy of `keyroute.api.found_body`:
    the same bytes, whatever the store's and the key's text."""
    assert _found_json(store, key, partition, version, value) == found_body(store, key, partition, version, value)
