"""The router's OpenAPI document: valid OpenAPI 3.1, served at /openapi.json, in step with the routes of the
router's app and of its data plane."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
from openapi_spec_validator import validate
from starlette.routing import Route

from keyroute.router import service
from keyroute.router.app import create_app
from keyroute.router.dataplane import ROUTES as DATA_PLANE_ROUTES
from keyroute.router.openapi import OPENAPI, OPENAPI_JSON
from keyroute.runtime.settings import RouterSettings
from tests.unit.router.fakes import StaticMapSource

_HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


def _app_routes() -> dict[str, set[str]]:
    app = create_app(RouterSettings(), map_source=StaticMapSource(None), first_map_wait_s=0)
    routes: dict[str, set[str]] = {}
    for route in app.routes:
        assert isinstance(route, Route)
        # Starlette's `{key:path}` is an OpenAPI `{key}`; HEAD is added by Starlette for every GET.
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)
        routes[path] = {m.lower() for m in (route.methods or ())} - {"head"}
    # Everything under /stores/ is answered by the data plane, not by the app.
    assert not any(path.startswith("/stores/") for path in routes)
    for path, methods in DATA_PLANE_ROUTES.items():
        routes[path] = {m.lower() for m in methods}
    return routes


def test_every_route_of_the_app_and_the_data_plane_is_documented_with_its_methods_and_nothing_else() -> None:
    documented = {path: {m for m in item if m in _HTTP_METHODS} for path, item in OPENAPI["paths"].items()}
    assert documented == _app_routes()


def test_the_document_is_valid_openapi_3_1() -> None:
    validate(OPENAPI)  # raises on any violation of the OpenAPI 3.1 schema
    assert OPENAPI["openapi"].startswith("3.1")
    assert json.loads(OPENAPI_JSON) == OPENAPI


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for value in node.values() for r in _refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in _refs(value)]
    return []


def test_every_reference_resolves_and_every_error_answer_is_the_error_schema() -> None:
    for ref in _refs(OPENAPI):
        target: Any = OPENAPI
        for part in ref.removeprefix("#/").split("/"):
            target = target[part]
        assert isinstance(target, dict), ref
    for path, item in OPENAPI["paths"].items():
        for method, operation in item.items():
            responses = operation["responses"]
            # Every operation documents its success (a 200, or the 303 of the login's redirects) and its errors.
            success = "200" in responses or (path.startswith("/admin/log") and "303" in responses)
            assert success and "500" in responses and "405" in responses, (path, method)
            for status, response in responses.items():
                if int(status) >= 400 and not (path == "/readyz" and status == "503"):
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/Error"}, (path, method, status)


def test_the_documented_error_statuses_cover_what_the_data_api_answers() -> None:
    key = set(OPENAPI["paths"]["/stores/{store}/keys/{key}"]["get"]["responses"])
    assert {"200", "400", "404", "405", "414", "431", "500", "503"} <= key
    batch = set(OPENAPI["paths"]["/stores/{store}/batch-get"]["post"]["responses"])
    assert {"200", "400", "404", "405", "413", "431", "500", "503"} <= batch
    for admin in ("/admin/partition-map", "/admin/route", "/metrics"):
        assert "401" in OPENAPI["paths"][admin]["get"]["responses"]


def test_the_document_is_served_at_openapi_json() -> None:
    async def scenario() -> httpx.Response:
        settings = RouterSettings()
        app = create_app(settings, map_source=StaticMapSource(None), first_map_wait_s=0)
        server = service.server(settings, app)  # the router's server, as the router process builds it
        await server.start(port=0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", trust_env=False) as client:
                return await client.get("/openapi.json")
        finally:
            await server.stop(grace_s=5)

    resp = asyncio.run(scenario())
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    assert resp.json() == OPENAPI
