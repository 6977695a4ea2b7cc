"""The router over HTTP: its app and data plane on keyroute's HTTP server (127.0.0.1), asking fake nodes on a
local server over the wire it uses in production (FastUpstream): endpoints, JSON errors, readiness, and the
map hand-over."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from keyroute.auth.security import member_token
from keyroute.cluster.partition_map import PartitionMap
from keyroute.cluster.zk import ZkAccessError, ZkUnavailableError
from keyroute.http.admission import RequestGuard
from keyroute.http.lifespan import StartupError
from keyroute.http.server import HttpServer
from keyroute.http.upstream import Upstream, UpstreamResponse
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner, key_hash, partition_for
from keyroute.router import app as router_app
from keyroute.router import service
from keyroute.router.app import create_app
from keyroute.runtime.settings import AccessSettings, RequestLimits, RouterSettings
from tests.unit.router.fakes import FakeCluster, FakeNode, StaticMapSource, build_map, node_url, store_record
from tests.util import wait_until

SETTINGS = RouterSettings(max_batch_keys=5, unavailable_retry_after_s=2, limits=RequestLimits(max_body_bytes=20_000))
STORES = [store_record("s", 4), store_record("n", 2, key_format=KeyFormat.INT64)]
FULL = {"a": {"s": [0, 1], "n": [0, 1]}, "b": {"s": [2, 3]}}


@dataclass
class Router:
    client: httpx.AsyncClient
    source: StaticMapSource
    cluster: FakeCluster
    app: Any = None

    async def push(self, new_map: PartitionMap) -> None:
        self.source.push(new_map)
        await asyncio.sleep(0)  # the map reaches the loop through call_soon_threadsafe


def router_server(app: Any, settings: RouterSettings) -> HttpServer:
    """The router's server as the router process builds it, around `app`."""
    return service.server(settings, app)


@asynccontextmanager
async def router(
    initial: PartitionMap | None,
    *nodes: FakeNode,
    settings: RouterSettings = SETTINGS,
    upstream: Upstream | None = None,
) -> AsyncIterator[Router]:
    """A router on 127.0.0.1 (on this event loop) and a client for it; the nodes answer on a server of their
    own (FakeCluster), which the router reaches over its own wire unless `upstream` replaces it."""
    source = StaticMapSource(initial)
    cluster = FakeCluster(*nodes)
    wire = upstream if upstream is not None else cluster.upstream()
    app = create_app(settings, map_source=source, upstream=wire, first_map_wait_s=0 if initial is None else 5)
    server = router_server(app, settings)
    await server.start(port=0)
    try:
        await asyncio.sleep(0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", trust_env=False) as client:
            yield Router(client, source, cluster, app)
    finally:
        await server.stop(grace_s=5)
    assert source.stopped


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())  # type: ignore[arg-type]


def nodes(*keys: str) -> tuple[FakeNode, FakeNode]:
    values = {("s", k): {"v": k} for k in keys}
    return FakeNode("a", values), FakeNode("b", values)


def test_a_key_read_passes_the_nodes_answer_through() -> None:
    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes("a/b 東京?#+%")) as r:
            resp = await r.client.get("/stores/s/keys/a%2Fb%20%E6%9D%B1%E4%BA%AC%3F%23%2B%25")
            assert resp.status_code == 200
            assert resp.json()["value"] == {"v": "a/b 東京?#+%"}
            assert resp.headers["content-type"] == "application/json"
            assert resp.headers["x-keyroute-hops"] == "0"
            node = "a" if partition_for(Partitioner.MURMUR2, "a/b 東京?#+%".encode(), 4) < 2 else "b"
            assert resp.headers["x-keyroute-node"] == node
            assert r.cluster[node].received[0].key == "a/b 東京?#+%"

    run(scenario)


def test_a_key_read_carries_the_request_id_and_a_head_read_the_length_of_the_answer() -> None:
    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes("k1")) as r:
            resp = await r.client.get("/stores/s/keys/k1", headers={"x-request-id": "abc-123"})
            assert resp.status_code == 200 and resp.json()["value"] == {"v": "k1"}
            assert resp.headers.get_list("x-request-id") == ["abc-123"]
            assert int(resp.headers["content-length"]) == len(resp.content)
            node = resp.headers["x-keyroute-node"]
            assert r.cluster[node].received[-1].headers["x-request-id"] == "abc-123"  # the node got it too
            generated = await r.client.get("/stores/s/keys/k1")
            assert generated.headers["x-request-id"] not in ("", "abc-123")
            head = await r.client.head("/stores/s/keys/k1")
            assert head.status_code == 200 and head.content == b""
            assert head.headers["content-length"] == str(len(resp.content))
            assert head.headers["x-keyroute-node"] == node
            assert r.cluster[node].received[-1].method == "GET"  # a HEAD is a GET to the node

    run(scenario)


def test_errors_are_json_with_code_and_message() -> None:
    async def scenario() -> None:
        async with router(build_map(STORES, {"a": {"s": [0, 1, 2]}}), *nodes()) as r:
            unserved = next(
                k for k in (f"k{i}" for i in range(99)) if partition_for(Partitioner.MURMUR2, k.encode(), 4) == 3
            )
            served = next(
                k for k in (f"k{i}" for i in range(99)) if partition_for(Partitioner.MURMUR2, k.encode(), 4) == 0
            )
            cases: list[tuple[str, str, int, str, Any]] = [
                ("GET", "/stores/nope/keys/k", 404, "store_not_found", None),
                ("GET", f"/stores/s/keys/{served}", 404, "key_not_found", None),
                ("GET", "/stores/n/keys/abc", 400, "bad_key", None),
                ("GET", "/stores/n/keys/9223372036854775808", 400, "bad_key", None),
                ("GET", "/stores/s/keys/%FF", 400, "bad_key", None),
                ("GET", f"/stores/s/keys/{unserved}", 503, "partition_unavailable", None),
                ("GET", "/no/such/route", 404, "not_found", None),
                ("GET", "/stores/s/keys/a/b", 404, "not_found", None),
                ("DELETE", "/stores/s/keys/k", 405, "method_not_allowed", None),
                ("GET", "/stores/s/batch-get", 405, "method_not_allowed", None),
                ("POST", "/stores/s/batch-get", 400, "bad_request", b"not json"),
                ("POST", "/stores/s/batch-get", 400, "bad_request", b'{"keys": 1}'),
                (
                    "POST",
                    "/stores/s/batch-get",
                    413,
                    "too_many_keys",
                    json.dumps({"keys": list("abcdef")}).encode(),
                ),
                (
                    "POST",
                    "/stores/s/batch-get",
                    413,
                    "body_too_large",
                    b'{"keys": ["' + b"x" * 30_000 + b'"]}',
                ),
                ("POST", "/stores/nope/batch-get", 404, "store_not_found", b'{"keys": ["k"]}'),
                ("GET", "/admin/route?store=s", 400, "bad_request", None),
                ("GET", "/admin/route?store=nope&key=k", 404, "store_not_found", None),
            ]
            for method, path, status, code, body in cases:
                resp = await r.client.request(method, path, content=body)
                assert resp.status_code == status, (method, path, resp.text)
                assert resp.headers["content-type"] == "application/json", path
                assert resp.json()["error"] == code, path
                assert resp.json()["message"], path
            unavailable = await r.client.get(f"/stores/s/keys/{unserved}")
            assert unavailable.headers["retry-after"] == "2"
            not_allowed = await r.client.delete("/stores/s/keys/k")
            assert "GET" in not_allowed.headers["allow"]

    run(scenario)


class Broken:
    """An `Upstream` with a bug: every request raises what no wire should (not UpstreamUnavailable)."""

    def __init__(self) -> None:
        self.closed = False

    async def get(self, url: str, headers: Mapping[str, str]) -> UpstreamResponse:
        raise RuntimeError(f"secret internals of GET {url}")

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        raise RuntimeError(f"secret internals of POST {url}")

    async def aclose(self) -> None:
        self.closed = True


def test_an_unexpected_failure_is_a_json_500_without_a_traceback() -> None:
    broken = Broken()

    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes("k"), upstream=broken) as r:
            resp = await r.client.get("/stores/s/keys/k")
            assert resp.status_code == 500
            assert resp.json() == {"error": "internal_error", "message": "internal error"}
            assert "secret" not in resp.text and "Traceback" not in resp.text
        assert broken.closed  # the app closes the wire it was given

    run(scenario)


def test_batch_get_through_the_app() -> None:
    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes("x", "y")) as r:
            # A lone surrogate can only arrive as a JSON escape; it is a bad key, echoed back escaped.
            body = json.dumps({"keys": ["x", "nope", "y", "\ud800"]}).encode()
            resp = await r.client.post("/stores/s/batch-get", content=body)
            assert resp.status_code == 200
            results = resp.json()["results"]
            assert [e["key"] for e in results] == ["x", "nope", "y", "\ud800"]
            assert [e["status"] for e in results] == [200, 404, 200, 400]
            # Values passed on as compact as a single read's (not re-spaced by the router).
            assert b'"value":{"v":"x"}' in resp.content and b", " not in resp.content
            # A key in no form the store's keys take: its entry names the forms that are.
            resp = await r.client.post("/stores/s/batch-get", json={"keys": [1.5, None, "x"]})
            assert [e["message"] for e in resp.json()["results"][:2]] == [
                "store 's' has string keys: a batch-get key is a JSON string, not 1.5",
                "store 's' has string keys: a batch-get key is a JSON string, not null",
            ]
            resp = await r.client.post("/stores/n/batch-get", json={"keys": [1.5]})
            [entry] = resp.json()["results"]
            assert (entry["status"], entry["error"]) == (400, "bad_key")
            assert entry["message"] == "store 'n' has int64 keys: a batch-get key is a JSON string or integer, not 1.5"

    run(scenario)


def test_readyz_means_the_router_can_proxy_whatever_partitions_are_served() -> None:
    """Ready once a map is there (and while ZooKeeper is away, stale); a partition without a serving replica
    answers its own 503s and never takes the router out of the load balancer: the body says which stores
    are loading or degraded."""

    async def scenario() -> None:
        async with router(None, *nodes()) as r:
            resp = await r.client.get("/readyz")
            assert resp.status_code == 503 and resp.json()["ready"] is False and resp.json()["stale"] is True
            # Store s is fully served, n is loading its first version: ready.
            await r.push(build_map(STORES, {"a": {"s": [0, 1, 2, 3]}}, generation=10))
            resp = await r.client.get("/readyz")
            assert resp.status_code == 200 and resp.json()["stores_loading"] == ["n"]
            complete = build_map(STORES, FULL, generation=11)
            await r.push(complete)
            resp = await r.client.get("/readyz")
            assert resp.status_code == 200
            assert resp.json() == {
                "ready": True,
                "stale": False,
                "generation": 11,
                "complete": True,
                "stores_loading": [],
                "stores_degraded": [],
            }
            await r.push(complete.marked_stale(True))  # what MapWatcher publishes on SUSPENDED
            resp = await r.client.get("/readyz")
            assert resp.status_code == 200 and resp.json()["stale"] is True
            # A store that was fully served lost a partition: still ready (the other partitions are served),
            # the store is listed as degraded.
            await r.push(build_map(STORES, {"a": {"s": [0, 1, 2]}, "b": {"n": [0, 1]}}, generation=12))
            resp = await r.client.get("/readyz")
            assert resp.status_code == 200 and resp.json()["stores_degraded"] == ["s"]
            assert resp.json()["complete"] is False
            assert (await r.client.get("/healthz")).json() == {"status": "ok"}

    run(scenario)


def test_admin_endpoints_describe_the_map_and_one_keys_route() -> None:
    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes()) as r:
            pmap = (await r.client.get("/admin/partition-map", params={"detail": "all"})).json()
            assert pmap["router"] is True and pmap["generation"] == 7 and pmap["complete"] is True
            assert pmap["stores"]["s"]["partition_map"][2]["serving"][0]["node"] == "b"
            route = (await r.client.get("/admin/route", params={"store": "n", "key": "-5"})).json()
            data = (-5).to_bytes(8, "big", signed=True)
            assert route == {
                "store": "n",
                "key": "-5",
                "hash": key_hash(Partitioner.MURMUR2, data),
                "partition": partition_for(Partitioner.MURMUR2, data, 2),
                "assigned": [],
                "serving": [{"node": "a", "url": node_url("a"), "version": 1}],
                "last_known": [],
            }

    run(scenario)


def test_a_misroute_asks_the_map_source_to_refresh_and_shows_in_metrics() -> None:
    a, b = nodes("k")
    a.hops = b.hops = "1"

    async def scenario() -> None:
        async with router(build_map(STORES, FULL), a, b) as r:
            resp = await r.client.get("/stores/s/keys/k")
            assert resp.status_code == 200 and resp.headers["x-keyroute-hops"] == "1"
            assert r.source.refreshes == 1
            metrics = (await r.client.get("/metrics")).text
            assert "keyroute_router_misroutes_total 1" in metrics
            assert "keyroute_router_map_generation 7" in metrics

    run(scenario)


SECURED = dataclasses.replace(
    SETTINGS,
    access=AccessSettings(cluster_secret="s3cret", admin_token="adm1n", metrics_require_token=True),
)


def test_admin_endpoints_need_the_admin_token_when_one_is_configured() -> None:
    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes("k"), settings=SECURED) as r:
            for path in ("/admin/partition-map", "/admin/route?store=s&key=k", "/metrics", "/%61dmin/partition-map"):
                missing = await r.client.get(path)
                assert missing.status_code == 401, path
                assert missing.json()["error"] == "unauthorized" and missing.json()["message"]
                assert missing.headers["www-authenticate"] == "Bearer"
                wrong = await r.client.get(path, headers={"authorization": "Bearer nope"})
                assert wrong.status_code == 401 and "invalid_token" in wrong.headers["www-authenticate"]
                latin = await r.client.get(path, headers={"authorization": "Bearer \xe9t\xe9".encode("latin-1")})
                assert latin.status_code == 401
                right = await r.client.get(path, headers={"authorization": "bearer adm1n"})
                assert right.status_code == 200, (path, right.text)
            # Probes, reads and the API document stay open.
            for path in ("/healthz", "/readyz", "/openapi.json", "/stores/s/keys/k"):
                assert (await r.client.get(path)).status_code == 200, path

    run(scenario)


def test_an_admin_logs_in_with_a_form_and_a_cookie_never_with_a_token_in_a_url() -> None:
    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes("k"), settings=SECURED) as r:
            http = r.client
            form = await http.get("/admin/login")
            assert form.status_code == 200 and form.headers["content-type"].startswith("text/html")
            assert 'name="token"' in form.text and 'method="post"' in form.text
            assert form.headers["cache-control"] == "no-store" and "default-src 'none'" in form.headers[
                "content-security-policy"
            ]

            wrong = await http.post("/admin/login", data={"token": "wr0ng"})
            assert wrong.status_code == 401 and wrong.json()["error"] == "unauthorized"
            assert "set-cookie" not in wrong.headers and "wr0ng" not in wrong.text
            page = await http.post("/admin/login", data={"token": "wr0ng"}, headers={"accept": "text/html"})
            assert page.status_code == 401 and "not the admin token" in page.text and "wr0ng" not in page.text
            assert (await http.post("/admin/login", data={"token": ""})).status_code == 401
            empty = await http.post("/admin/login", content=b"")  # not the form: no `token` field
            assert empty.status_code == 400 and empty.json()["error"] == "bad_request"

            ok = await http.post("/admin/login", data={"token": "adm1n"})
            assert ok.status_code == 303 and ok.headers["location"] == "/admin/ui"
            cookie = ok.headers["set-cookie"]
            attributes = {part.strip().split("=")[0].lower() for part in cookie.split(";")}
            assert {"httponly", "path", "max-age", "samesite"} <= attributes and "secure" not in attributes
            assert "path=/admin" in cookie.lower() and "samesite=strict" in cookie.lower()
            name, _, value = cookie.split(";")[0].partition("=")
            assert name == "keyroute_admin" and value and "adm1n" not in value
            http.cookies.clear()  # sent by hand below, so that every request says what it carries
            session = {"cookie": f"keyroute_admin={value}"}
            for path in ("/admin/partition-map", "/admin/route?store=s&key=k", "/admin/ui"):
                assert (await http.get(path, headers=session)).status_code == 200, path
            assert (await http.get("/admin/partition-map", headers={"cookie": "keyroute_admin=1.x"})).status_code == 401

            # Behind a TLS-terminating proxy, the cookie is Secure.
            tls = await http.post("/admin/login", data={"token": "adm1n"}, headers={"x-forwarded-proto": "https"})
            assert "secure" in {part.strip().lower() for part in tls.headers["set-cookie"].split(";")}
            http.cookies.clear()

            # The page without a session, or with the token in its URL: the login form, the token never echoed.
            for target, headers in (
                ("/admin/ui", {}),
                ("/admin/ui?token=adm1n", {}),
                ("/admin/ui?token=adm1n", session),
            ):
                answer = await http.get(target, headers=headers)
                assert answer.status_code == 303 and answer.headers["location"] == "/admin/login", target
                assert "adm1n" not in answer.text and "adm1n" not in str(answer.headers)
            assert (await http.get("/admin/partition-map?token=adm1n")).status_code == 401

            out = await http.post("/admin/logout", headers=session)
            assert out.status_code == 303 and out.headers["location"] == "/admin/login"
            cleared = out.headers["set-cookie"].lower()
            assert cleared.startswith("keyroute_admin=") and ("max-age=0" in cleared or "expires=" in cleared)

    run(scenario)


def test_without_an_admin_token_the_login_leads_straight_to_the_page() -> None:
    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes()) as r:
            form, login = await r.client.get("/admin/login"), await r.client.post("/admin/login", data={"token": "x"})
            for answer in (form, login):
                assert answer.status_code == 303 and answer.headers["location"] == "/admin/ui"
                assert "set-cookie" not in answer.headers
            # A request that is not the form is refused all the same (an outside fuzzer's find: it was a 303).
            empty = await r.client.post("/admin/login")
            assert empty.status_code == 400 and "`token`" in empty.json()["message"]
            assert (await r.client.get("/admin/ui")).status_code == 200

    run(scenario)


ADMIN_CALLER, READER = "0ps-t0ken", "re4der-t0ken"


def with_callers(tmp_path: Path, admin_token: str = "") -> RouterSettings:
    """Access control on (a token file with an admin caller and a reader), with or without an admin token."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[[tokens]]\nname = "ops"\nsha256 = "{hashlib.sha256(ADMIN_CALLER.encode()).hexdigest()}"\n'
        'stores = "*"\nadmin = true\n\n'
        f'[[tokens]]\nname = "reader"\ntoken = "{READER}"\nstores = ["s"]\n',
        encoding="utf-8",
    )
    access = AccessSettings(cluster_secret="s3cret", admin_token=admin_token, access_tokens=str(tokens))
    return dataclasses.replace(SETTINGS, access=access)


@pytest.mark.parametrize("admin_token", ["", "adm1n"])
def test_with_access_control_an_admin_caller_logs_in_and_the_page_does_not_loop(
    tmp_path: Path, admin_token: str
) -> None:
    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes("k"), settings=with_callers(tmp_path, admin_token)) as r:
            http = r.client
            # Without a session the page goes to the login form, and the form is shown (not sent back).
            answer = await http.get("/admin/ui")
            assert answer.status_code == 303 and answer.headers["location"] == "/admin/login"
            form = await http.get("/admin/login")
            assert form.status_code == 200 and 'name="token"' in form.text
            # A reader's token, or none, does not log in.
            for token in (READER, "wr0ng", ""):
                refused = await http.post("/admin/login", data={"token": token})
                assert refused.status_code == 401 and "set-cookie" not in refused.headers, token
            ok = await http.post("/admin/login", data={"token": ADMIN_CALLER})
            assert ok.status_code == 303 and ok.headers["location"] == "/admin/ui"
            name, _, value = ok.headers["set-cookie"].split(";")[0].partition("=")
            assert name == "keyroute_admin" and value and ADMIN_CALLER not in value
            http.cookies.clear()
            session = {"cookie": f"keyroute_admin={value}"}
            for path in ("/admin/ui", "/admin/partition-map", "/admin/route?store=s&key=k"):
                assert (await http.get(path, headers=session)).status_code == 200, path
            # Another caller's name in the cookie, or another MAC, is no session.
            prefix, expires, _named, mac = value.split(".")
            other = base64.urlsafe_b64encode(b"reader").rstrip(b"=").decode()
            for forged in (f"{prefix}.{expires}.{other}.{mac}", f"{prefix}.{expires}.{_named}.{'0' * len(mac)}"):
                denied = await http.get("/admin/partition-map", headers={"cookie": f"keyroute_admin={forged}"})
                assert denied.status_code == 401, forged

    run(scenario)


@pytest.mark.parametrize("metrics_open", [False, True])
def test_with_access_control_metrics_need_an_admin_caller_unless_opened(tmp_path: Path, metrics_open: bool) -> None:
    settings = with_callers(tmp_path)
    settings = dataclasses.replace(settings, access=dataclasses.replace(settings.access, metrics_open=metrics_open))

    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes("k"), settings=settings) as r:
            answers = {
                who: (await r.client.get("/metrics", headers=headers)).status_code
                for who, headers in (
                    ("nobody", {}),
                    ("reader", {"authorization": f"Bearer {READER}"}),
                    ("ops", {"authorization": f"Bearer {ADMIN_CALLER}"}),
                )
            }
            expected = {"nobody": 200, "reader": 200, "ops": 200} if metrics_open else {
                "nobody": 401, "reader": 403, "ops": 200}  # fmt: skip
            assert answers == expected
            assert (await r.client.get("/healthz")).status_code == 200

    run(scenario)


def test_without_metrics_require_token_metrics_stay_open() -> None:
    settings = dataclasses.replace(SETTINGS, access=AccessSettings(admin_token="adm1n"))

    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes(), settings=settings) as r:
            assert (await r.client.get("/metrics")).status_code == 200
            assert (await r.client.get("/admin/partition-map")).status_code == 401

    run(scenario)


def test_the_router_proves_membership_to_nodes_and_never_passes_a_clients_member_headers() -> None:
    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes("k", "j"), settings=SECURED) as r:
            forged = {
                "x-keyroute-hops": "1",
                "x-keyroute-router": "evil",
                "x-keyroute-partition": "3",
                "x-keyroute-generation": "999999",
                "x-keyroute-forwarded-by": "someone",
                "x-keyroute-auth": "forged",
            }
            assert (await r.client.get("/stores/s/keys/k", headers=forged)).status_code == 200
            resp = await r.client.post("/stores/s/batch-get", json={"keys": ["k", "j"]}, headers=forged)
            assert [e["status"] for e in resp.json()["results"]] == [200, 200]
            received = [x for node in ("a", "b") for x in r.cluster[node].received]
            assert received
            for x in received:
                assert x.headers["x-keyroute-auth"] == member_token("s3cret")
                assert x.headers["x-keyroute-router"] == "1"
                for name in ("x-keyroute-hops", "x-keyroute-partition", "x-keyroute-generation"):
                    assert name not in x.headers
                assert "x-keyroute-forwarded-by" not in x.headers

    run(scenario)


def test_during_a_rotation_the_router_proves_membership_with_the_first_secret() -> None:
    rotating = dataclasses.replace(SETTINGS, access=AccessSettings(cluster_secret="new-s3cret,s3cret"))

    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes("k"), settings=rotating) as r:
            assert (await r.client.get("/stores/s/keys/k")).status_code == 200
            received = [x for node in ("a", "b") for x in r.cluster[node].received]
            assert received and all(x.headers["x-keyroute-auth"] == member_token("new-s3cret") for x in received)

    run(scenario)


def test_keys_over_the_limit_are_refused_before_any_node_is_asked() -> None:
    settings = dataclasses.replace(SETTINGS, limits=RequestLimits(max_key_bytes=8, max_body_bytes=20_000))

    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes("k", "東京"), settings=settings) as r:
            for segment in ("123456789", "%E6%9D%B1%E4%BA%AC%E6%9D%B1", "x" * 5000):
                resp = await r.client.get(f"/stores/s/keys/{segment}")
                assert resp.status_code == 414 and resp.json()["error"] == "key_too_long", segment
            assert (await r.client.get("/stores/s/keys/%E6%9D%B1%E4%BA%AC")).status_code == 200  # 6 bytes
            resp = await r.client.post("/stores/s/batch-get", json={"keys": ["k", "123456789", "東京東京", "東京"]})
            results = resp.json()["results"]
            assert [e["status"] for e in results] == [200, 400, 400, 200]
            assert results[1] == {
                "key": "123456789",
                "status": 400,
                "error": "key_too_long",
                "message": "the key is longer than 8 bytes",
            }
            assert all("123456789" not in (x.keys or []) for n in ("a", "b") for x in r.cluster[n].received)
            # The batch limit still counts every key, long or not.
            resp = await r.client.post("/stores/s/batch-get", json={"keys": ["123456789"] * 6})
            assert resp.status_code == 413 and resp.json()["error"] == "too_many_keys"

    run(scenario)


def test_oversized_headers_are_431_json() -> None:
    settings = dataclasses.replace(SETTINGS, limits=RequestLimits(max_header_bytes=2000))

    async def scenario() -> None:
        async with router(build_map(STORES, FULL), *nodes("k"), settings=settings) as r:
            resp = await r.client.get("/stores/s/keys/k", headers={"x-filler": "y" * 2000})
            assert resp.status_code == 431 and resp.json()["error"] == "headers_too_large"
            assert (await r.client.get("/stores/s/keys/k", headers={"x-filler": "y" * 1000})).status_code == 200

    run(scenario)


def test_the_guard_refuses_beyond_the_concurrency_limit_at_once_and_lets_probes_through() -> None:
    gate = asyncio.Event()
    entered = 0

    async def slow_app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal entered
        entered += 1
        await gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = RequestGuard(slow_app, max_concurrent_requests=2, retry_after_s=3)

    async def scenario() -> None:
        transport = httpx.ASGITransport(guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            held = [asyncio.create_task(client.get("/stores/s/keys/k")) for _ in range(2)]
            while entered < 2:
                await asyncio.sleep(0)
            refused = await asyncio.wait_for(client.get("/stores/s/keys/k"), timeout=5)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "3"
            assert refused.json()["error"] == "overloaded" and refused.json()["message"]
            assert refused.headers["x-request-id"]
            assert guard.admission.overloaded == 1 and guard.admission.active == 2
            probe = asyncio.create_task(client.get("/healthz"))  # counted past the limit, not refused
            while entered < 3:
                await asyncio.sleep(0)
            gate.set()
            assert [t.status_code for t in await asyncio.gather(*held, probe)] == [200, 200, 200]
            assert guard.admission.active == 0
            assert (await client.get("/stores/s/keys/k")).status_code == 200

    run(scenario)


class LateMapSource(StaticMapSource):
    """Delivers its first map from another thread, `delay_s` after start (as the ZooKeeper watcher does)."""

    def __init__(self, initial: PartitionMap | None, delay_s: float) -> None:
        super().__init__(None)
        self.late = initial
        self.delay_s = delay_s

    def start(self, on_map: Callable[[PartitionMap], None]) -> None:
        super().start(on_map)
        if self.late is not None:
            threading.Timer(self.delay_s, on_map, args=(self.late,)).start()


def test_startup_waits_for_the_first_map_so_the_first_read_is_answered() -> None:
    async def scenario() -> None:
        source = LateMapSource(build_map(STORES, FULL), delay_s=0.3)
        app = create_app(SETTINGS, map_source=source, upstream=FakeCluster(*nodes("k1")).upstream())
        server = router_server(app, SETTINGS)
        await server.start(port=0)  # listens once the lifespan's startup is over
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", trust_env=False) as client:
                first = await client.get("/stores/s/keys/k1")
                assert first.status_code == 200 and first.json()["value"] == {"v": "k1"}
        finally:
            await server.stop(grace_s=5)

    run(scenario)


def test_startup_gives_up_waiting_for_a_map_and_says_it_is_not_ready(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        source = StaticMapSource(None)  # ZooKeeper reachable, no map yet
        app = create_app(
            SETTINGS, map_source=source, upstream=FakeCluster(*nodes("k1")).upstream(), first_map_wait_s=0.2
        )
        server = router_server(app, SETTINGS)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger=router_app.__name__):
            await server.start(port=0)  # listens once the lifespan's startup is over
        try:
            # Startup is over without a map, after the wait it was given (not the default's 5 s).
            assert time.monotonic() - started >= 0.2
            assert "no partition map within 0.2 s of starting: answering 503 until one arrives" in caplog.text
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", trust_env=False) as client:
                assert (await client.get("/readyz")).status_code == 503
                early = await client.get("/stores/s/keys/k1")
                assert early.status_code == 503 and early.json()["error"] == "no_partition_map"
                # The map arrives later: the router takes it and is ready.
                source.push(build_map(STORES, FULL))

                async def ready() -> bool:
                    return (await client.get("/readyz")).status_code == 200

                await wait_until(ready, message="ready once the map arrives")
                first = await client.get("/stores/s/keys/k1")
                assert first.status_code == 200 and first.json()["value"] == {"v": "k1"}
        finally:
            await server.stop(grace_s=5)

    run(scenario)


class UnreachableAtFirst(StaticMapSource):
    """ZooKeeper unreachable for the first `failures` starts (each fails at once here), then a map."""

    def __init__(self, initial: PartitionMap, failures: int, error: Exception | None = None) -> None:
        super().__init__(None)
        self.late = initial
        self.failures = failures
        self.error = error
        self.attempts = 0

    def start(self, on_map: Callable[[PartitionMap], None]) -> None:
        self.attempts += 1
        if self.error is not None:
            raise self.error
        if self.attempts <= self.failures:
            raise ZkUnavailableError("cannot reach ZooKeeper at zk:2181 within 15 s (connection refused)")
        super().start(on_map)
        on_map(self.late)


def test_a_router_without_zookeeper_answers_503_and_keeps_trying_until_a_map_arrives(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(router_app, "_RECONNECT_PAUSE_S", (0.05, 0.1))

    async def scenario() -> None:
        source = UnreachableAtFirst(build_map(STORES, FULL), failures=3)
        wire = FakeCluster(*nodes("k1")).upstream()
        app = create_app(SETTINGS, map_source=source, upstream=wire, first_map_wait_s=0.1)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
                if source.attempts <= 3:  # still unreachable: not ready, and the proxy knows no map yet
                    assert (await client.get("/readyz")).status_code == 503
                    assert app.state.proxy.table.unknown_store("s").code == "no_partition_map"
                await wait_until(lambda: source.attempts == 4, timeout_s=5)
                await wait_until(lambda: app.state.proxy.table.ready, timeout_s=5)
                assert (await client.get("/readyz")).status_code == 200

    run(scenario)


def test_credentials_zookeeper_refuses_stop_the_router_at_start_with_one_line() -> None:
    async def scenario() -> None:
        refused = ZkAccessError("digest:router may not read zk:2181/keyroute")
        app = create_app(SETTINGS, map_source=UnreachableAtFirst(build_map(STORES, FULL), 0, refused))
        with pytest.raises(StartupError, match="may not read"):
            async with app.router.lifespan_context(app):
                pass

    run(scenario)
