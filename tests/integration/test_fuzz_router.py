"""Thousands of hypothesis-made requests against a live cluster (router and two nodes on keyroute's HTTP
server, real ZooKeeper): odd methods, paths, keys, headers and bodies. No 5xx but the documented 503s, every
error is the JSON `{"error", "message"}` with no traceback, and afterwards every key still reads back
exactly."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote_from_bytes

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from keyroute.api import MAX_JSON_DEPTH, MAX_JSON_NUMBER_CHARS
from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import (
    ADMIN_TOKEN,
    ROWS,
    SECRET,
    STORE,
    SmallCluster,
    expected,
    key_path,
    small_cluster,
)
from tests.request_bodies import DEEP_BODIES

pytestmark = pytest.mark.integration

EXAMPLES = 520
REQUESTS_PER_EXAMPLE = 10
DOCUMENTED_503 = {"overloaded", "partition_unavailable"}
KNOWN = sorted(ROWS)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
key_texts = st.one_of(
    st.sampled_from(KNOWN),
    st.text(max_size=40),
    st.sampled_from(["", ".", "..", "...", "%", "%2", "%zz", "a/b", "\x00", "\ud800", "k" * 1024, "k" * 1025]),
    st.integers(min_value=1000, max_value=6000).map(lambda n: "x" * n),
)
raw_segments = st.one_of(
    key_texts.map(lambda t: quote_from_bytes(t.encode("utf-8", "surrogatepass"), safe="")),
    st.binary(max_size=30).map(lambda b: quote_from_bytes(b, safe="")),  # often invalid UTF-8
    st.sampled_from(
        ["%FF", "%C3%28", "%ED%A0%80", "..", ".", "%2E%2E", "%2e", "a%2Fb", "%00", "%25%25", "~!$&'()*+,;=:@"]
    ),
)
stores = st.sampled_from([STORE, STORE, "nope", "%FF", "..", "b%2Fookings", "x" * 2000])
paths = st.one_of(
    st.tuples(stores, raw_segments).map(lambda t: f"/stores/{t[0]}/keys/{t[1]}"),
    st.tuples(stores, raw_segments, raw_segments).map(lambda t: f"/stores/{t[0]}/keys/{t[1]}/{t[2]}"),
    stores.map(lambda s: f"/stores/{s}/batch-get"),
    st.sampled_from(
        [
            "/admin/partition-map",
            "/admin/route?store=bookings&key=C001",
            "/admin/route?store=bookings",
            "/admin/route?store=%FF&key=%FF",
            "/%61dmin/partition-map",
            "/healthz",
            "/readyz",
            "/metrics",
            "/openapi.json",
            "/",
            "/stores",
            "/stores/",
            "/stores/bookings",
            "/stores/bookings/keys",
            "/stores/bookings/keys/",
            "//stores/bookings/keys/C001",
            "/stores/bookings/../keys/C001",
        ]
    ),
    st.lists(raw_segments, max_size=5).map(lambda parts: "/" + "/".join(parts)),
)
methods = st.sampled_from(["GET", "GET", "GET", "POST", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"])
forged_headers = st.dictionaries(
    st.sampled_from(
        [
            "x-keyroute-hops",
            "x-keyroute-router",
            "x-keyroute-partition",
            "x-keyroute-generation",
            "x-keyroute-forwarded-by",
            "x-keyroute-auth",
            "x-keyroute-node",
            "x-request-id",
            "authorization",
            "content-type",
            "accept-encoding",
            "x-forwarded-host",
            "forwarded",
            "accept",
            "cookie",
            "connection",
            "upgrade",
            "te",
            "expect",
            "content-encoding",
            "keyroute_admin",
        ]
    ),
    st.one_of(
        st.sampled_from(["1", "0", "-1", "2", "abc", "", "http://127.0.0.1:1", f"Bearer {ADMIN_TOKEN}", "Bearer x"]),
        st.sampled_from(
            [
                "application/avro",
                "application/avro;q=0",
                "*/*;q=abc",
                "application/json;q=1e999",
                "keep-alive, upgrade",
                "close",
                "websocket",
                "h2c",
                "100-continue",
                "gzip",
                "trailers",
                "a=b; c",
                "=",
                ";;;",
                "a\tb",
                "keyroute_admin=" + "x" * 500,
            ]
        ),
        st.text(
            alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=60
        ).map(lambda v: v.strip(" \t")),
    ),
    max_size=4,
)
# Large values are drawn by name and built at send time (hypothesis would otherwise print them whole).
LARGE_HEADERS = {
    "none": {},
    "one huge": {"x-filler": "h" * 40_000},
    "two big": {"x-a": "a" * 8000, "x-b": "b" * 8000},
}
LARGE_BODIES = {
    "beyond max_body_bytes": b'{"keys": ["' + b"z" * (2 * 1024 * 1024) + b'"]}',
    "beyond max_batch_keys": json.dumps({"keys": [f"C{i:03d}" for i in range(1001)]}).encode(),
    "a long key": b'{"keys": ["' + b"z" * 5000 + b'"]}',
    "nested arrays": DEEP_BODIES[0],
    "nested objects": DEEP_BODIES[1],
    "a 10,000-digit number": b'{"keys": [' + b"7" * 10_000 + b"]}",
}
huge_headers = st.sampled_from(["none", "none", "none", "none", "one huge", "two big"])
batch_bodies = st.one_of(
    st.lists(key_texts | st.integers() | json_values, max_size=12).map(lambda keys: {"keys": keys}),
    json_values,
    st.fixed_dictionaries({"keys": json_values}),
).map(lambda obj: json.dumps(obj).encode("utf-8"))
bodies = st.one_of(
    st.none(),
    batch_bodies,
    batch_bodies,
    st.binary(max_size=200),
    st.sampled_from([b"{", b'{"keys": [', b"\xff\xfe", b"null"]),
    st.sampled_from(sorted(LARGE_BODIES)),
)
# Which server gets the request: mostly the router, sometimes a node directly.
TARGETS = 10
requests = st.tuples(st.integers(0, TARGETS - 1), methods, paths, forged_headers, huge_headers, bodies)


class Checker:
    def __init__(self, cluster: SmallCluster) -> None:
        self.targets = [cluster.router_url] * (TARGETS - 2) + list(cluster.node_urls.values())
        self.clients = {url: httpx.Client(base_url=url, timeout=20, trust_env=False) for url in set(self.targets)}
        self.sent = 0
        self.statuses: dict[int, int] = {}

    def close(self) -> None:
        for client in self.clients.values():
            client.close()

    def send(
        self, target_no: int, method: str, path: str, headers: dict[str, str], large: str, body: bytes | str | None
    ) -> None:
        extra = LARGE_HEADERS[large]
        if isinstance(body, str):
            body = LARGE_BODIES[body]
        target = self.targets[target_no]
        client = self.clients[target]
        raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in {**headers, **extra}.items()]
        request = client.build_request(method, target + "/", content=body, headers=raw_headers)
        request.url = request.url.copy_with(raw_path=path.encode("ascii"))
        response = client.send(request)
        self.sent += 1
        self.statuses[response.status_code] = self.statuses.get(response.status_code, 0) + 1
        context = (method, target, path[:200], response.status_code, response.text[:300])
        text = response.text
        assert "Traceback" not in text and 'File "' not in text, context
        if response.status_code >= 500:
            assert response.status_code == 503, context
        if response.status_code >= 400 and method != "HEAD":
            assert response.headers["content-type"].startswith("application/json"), context
            payload = response.json()
            assert isinstance(payload, dict), context
            assert isinstance(payload.get("error"), str) and isinstance(payload.get("message"), str), context
            if response.status_code == 503:
                assert payload["error"] in DOCUMENTED_503, context
                assert "retry-after" in response.headers, context
        if response.status_code == 200 and method == "GET" and path.startswith(f"/stores/{STORE}/keys/"):
            data = response.json()
            assert data == expected(data["key"]), context


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, module_zk_settings: ZkSettings) -> Iterator[SmallCluster]:
    """One cluster for the module: its tests only send requests, and each checks afterwards that every key
    still answers and that no log holds a traceback."""
    args = ["--cluster-secret", SECRET, "--admin-token", ADMIN_TOKEN]
    with small_cluster(tmp_path_factory.mktemp("fuzz-router"), module_zk_settings, extra_args=args) as c:
        yield c


def test_fuzzed_requests_get_json_errors_and_leave_the_cluster_answering(cluster: SmallCluster) -> None:
    checker = Checker(cluster)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(st.lists(requests, min_size=REQUESTS_PER_EXAMPLE, max_size=REQUESTS_PER_EXAMPLE))
    # The limits, asked for once for certain (to the router and to a node); the generated requests reach
    # them only by chance.
    @example(
        [
            (target, "POST", f"/stores/{STORE}/batch-get", {}, "none", body)
            for target in (0, TARGETS - 1)
            for body in sorted(LARGE_BODIES)
        ]
        + [(0, "GET", key_path("k" * 2000), {}, "none", None), (0, "GET", key_path("C001"), {}, "one huge", None)]
    )
    def fuzz(batch: list[tuple[int, str, str, dict[str, str], str, bytes | str | None]]) -> None:
        for request in batch:
            checker.send(*request)

    try:
        fuzz()
        assert checker.sent >= 5000, checker.sent
        # The fuzzing reached the interesting answers, not only 404s.
        statuses: Any = checker.statuses
        for status in (200, 400, 401, 404, 405, 413, 414, 431):
            assert statuses.get(status, 0) > 0, (status, statuses)
    finally:
        checker.close()
    for proc in cluster.procs:
        assert "Traceback" not in proc.output(), proc.args[0]
    with httpx.Client(timeout=10, trust_env=False) as http:
        cluster.check_every_key(http)
        for url in cluster.node_urls.values():
            for key in KNOWN[:10]:
                r = http.get(url + key_path(key))
                assert r.status_code == 200 and r.json() == expected(key)
        batch = http.post(cluster.router_url + f"/stores/{STORE}/batch-get", json={"keys": KNOWN})
        assert [e["value"] for e in batch.json()["results"]] == [ROWS[k] for k in KNOWN]


def test_nested_bodies_and_odd_numbers_are_400_naming_the_limit_on_routers_and_nodes_and_log_no_traceback(
    cluster: SmallCluster,
) -> None:
    # An outside fuzzer's find: each of these was a 500 and a ~40-line RecursionError traceback in both logs.
    odd = {
        b'{"keys": [' + b"7" * 10_000 + b"]}": f"at most {MAX_JSON_NUMBER_CHARS} are allowed",
        b'{"keys": ["C001", NaN]}': "NaN is not a JSON number",
        b'{"keys": [-Infinity]}': "-Infinity is not a JSON number",
        b'{"keys": [1e999999]}': "beyond the range of a double",
        **{body: f"more than {MAX_JSON_DEPTH} deep" for body in DEEP_BODIES},
    }
    with httpx.Client(timeout=30, trust_env=False) as http:
        for url in [cluster.router_url, *cluster.node_urls.values()]:
            for body, words in odd.items():
                r = http.post(url + f"/stores/{STORE}/batch-get", content=body)
                assert r.status_code == 400 and r.json()["error"] == "bad_request", (url, r.text[:300])
                assert words in r.json()["message"], (url, r.json())
        # The limit is the limit, not a lower one: a body at the limit is read.
        body = b'{"keys": ["C001", ' + b"[" * (MAX_JSON_DEPTH - 2) + b"1" + b"]" * (MAX_JSON_DEPTH - 2) + b"]}"
        r = http.post(cluster.router_url + f"/stores/{STORE}/batch-get", content=body)
        assert r.status_code == 200 and r.json()["results"][0]["value"] == ROWS["C001"], r.text[:300]
        assert r.json()["results"][1]["status"] == 400
        cluster.check_every_key(http)
    for proc in cluster.procs:
        assert "Traceback" not in proc.output(), (proc.args[0], proc.output()[-3000:])
