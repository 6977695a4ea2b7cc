"""One set of error answers for routers' and nodes' apps (keyroute.http.error_answers): an API error, a
path or method no route has, and an unexpected failure are answered alike by both, a node's with its
X-Keyroute-Node."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from keyroute.api import HEADER_NODE, HEADER_REQUEST_ID, BadRequest
from keyroute.http.error_answers import INTERNAL_ERROR, exception_handlers
from keyroute.router.app import create_app as create_router_app
from keyroute.runtime.settings import NodeSettings, RouterSettings
from keyroute.state_node.app import create_app as create_node_app
from tests.unit.router.fakes import StaticMapSource


async def _bad(request: Request) -> Response:
    raise BadRequest("no good", {"X-Extra": "1"})


async def _broken(request: Request) -> Response:
    raise RuntimeError("disk on fire at /secret/path")


def _get(app: Starlette, method: str, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.request(method, path, headers=headers)

    return asyncio.run(ask())


def test_each_kind_of_error_is_its_json_answer_with_the_app_s_headers_and_the_request_id() -> None:
    app = Starlette(
        routes=[Route("/bad", _bad), Route("/broken", _broken)],
        exception_handlers=exception_handlers({"X-Own": "me"}),
    )
    bad = _get(app, "GET", "/bad", {HEADER_REQUEST_ID: "req-1"})
    assert (bad.status_code, bad.json()) == (400, {"error": "bad_request", "message": "no good"})
    assert bad.headers["x-extra"] == "1" and bad.headers["x-own"] == "me" and bad.headers[HEADER_REQUEST_ID] == "req-1"
    missing = _get(app, "GET", "/nowhere")
    assert (missing.status_code, missing.json()["error"]) == (404, "not_found")
    assert missing.headers["x-own"] == "me" and missing.headers[HEADER_REQUEST_ID]
    not_allowed = _get(app, "DELETE", "/bad")
    assert (not_allowed.status_code, not_allowed.json()["error"]) == (405, "method_not_allowed")
    assert set(not_allowed.headers["allow"].split(", ")) == {"GET", "HEAD"}
    broken = _get(app, "GET", "/broken")
    assert (broken.status_code, broken.json()) == (500, INTERNAL_ERROR)
    assert "secret" not in broken.text and broken.headers["x-own"] == "me"


@pytest.mark.parametrize("service", ["router", "node"])
def test_routers_and_nodes_answer_errors_alike(service: str, tmp_path: Path) -> None:
    if service == "router":
        app = create_router_app(RouterSettings(), map_source=StaticMapSource(None), first_map_wait_s=0)
    else:
        app = create_node_app(NodeSettings("n7", str(tmp_path)))
    missing = _get(app, "GET", "/nowhere", {HEADER_REQUEST_ID: "req-2"})
    assert missing.status_code == 404 and missing.json() == {"error": "not_found", "message": "Not Found"}
    assert missing.headers[HEADER_REQUEST_ID] == "req-2"
    not_allowed = _get(app, "POST", "/healthz")
    assert not_allowed.status_code == 405 and not_allowed.json()["error"] == "method_not_allowed"
    # The lifespan has not run: the quotas it makes are missing, and the handler fails.
    broken = _get(app, "GET", "/admin/quotas")
    assert (broken.status_code, broken.json()) == (500, INTERNAL_ERROR)
    for answer in (missing, not_allowed, broken):
        assert (answer.headers.get(HEADER_NODE) == "n7") is (service == "node")
