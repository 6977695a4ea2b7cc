"""The OpenAPI documents of routers and nodes (keyroute.http.openapi): generated from each service's route
tables, valid OpenAPI 3.1, every route documented with exactly its methods, every error answer the error
schema, and the router's at least as complete as the hand-written document it replaced. (Both are checked
against real servers by schemathesis in tests/integration/test_openapi_conformance.py.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from openapi_spec_validator import validate
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route as StarletteRoute

from keyroute.http import openapi
from keyroute.http.routing import Route, RouteTable
from keyroute.router import openapi as router_openapi
from keyroute.router import service
from keyroute.router.app import create_app as create_router_app
from keyroute.router.dataplane import RouterDataPlane
from keyroute.runtime.settings import NodeSettings, RouterSettings
from keyroute.state_node import openapi as node_openapi
from keyroute.state_node.app import create_app as create_node_app
from keyroute.state_node.dataplane import NodeDataPlane
from tests.unit.router.fakes import StaticMapSource

# The router's hand-written document, as it was when the documents became generated: each operation's
# parameters, request body media types and answers (media types and headers by status).
BEFORE = json.loads((Path(__file__).parent / "openapi_router_before.json").read_text())


def router_app() -> Starlette:
    return create_router_app(RouterSettings(), map_source=StaticMapSource(None), first_map_wait_s=0)


def router_document() -> dict[str, Any]:
    return openapi.document(router_openapi.INFO, openapi.routes_of(RouterDataPlane.routes, router_app().routes))


def node_document(tmp_path: Path) -> dict[str, Any]:
    app = create_node_app(NodeSettings("n1", str(tmp_path)))
    return openapi.document(node_openapi.INFO, openapi.routes_of(NodeDataPlane.routes, app.routes))


@pytest.fixture(params=["router", "node"])
def document(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    return router_document() if request.param == "router" else node_document(tmp_path)


def _methods(item: dict[str, Any]) -> set[str]:
    return {method.upper() for method in item}


def test_every_route_of_the_apps_and_data_planes_is_a_path_with_its_methods_and_nothing_else(tmp_path: Path) -> None:
    for document, app, plane in (
        (router_document(), router_app(), RouterDataPlane.routes),
        (node_document(tmp_path), create_node_app(NodeSettings("n1", str(tmp_path))), NodeDataPlane.routes),
    ):
        expected: dict[str, set[str]] = {}
        for route in plane.routes:
            if "{rest:path}" not in route.template:  # the route that only explains a 404
                expected[route.template] = set(route.methods)
        for app_route in app.routes:
            assert isinstance(app_route, StarletteRoute)
            assert not app_route.path.startswith("/stores/")  # the data plane's
            expected[app_route.path] = set(app_route.methods or ()) - {"HEAD"}
        assert {path: _methods(item) for path, item in document["paths"].items()} == expected
        assert openapi.OPENAPI_PATH in document["paths"]


def test_a_route_without_its_operation_is_refused() -> None:
    async def endpoint(request: Any) -> Response:
        return Response()

    with pytest.raises(ValueError, match="without operations: '/x'"):
        openapi.routes_of(RouterDataPlane.routes, [StarletteRoute("/x", endpoint)])
    table = RouteTable([Route("/stores/{store}/y", ("GET", "POST"), endpoint, None, (openapi.GET_ANSWER_SCHEMA,))])
    with pytest.raises(ValueError, match="methods"):
        openapi.routes_of(table, [])
    other = openapi.Schema("Found", {"type": "string"})
    clash = openapi.Operation("x", "x", responses={"200": openapi.json_answer(other, "x")})
    with pytest.raises(ValueError, match="Found"):
        openapi.document({}, [("/a", (openapi.GET_KEY,)), ("/b", (clash,))])


def test_the_documents_are_valid_openapi_3_1(document: dict[str, Any]) -> None:
    validate(document)  # raises on any violation of the OpenAPI 3.1 schema
    assert document["openapi"].startswith("3.1")
    json.dumps(document)  # nothing but JSON in it (no Schema left unresolved)


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for value in node.values() for r in _refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in _refs(value)]
    return []


def test_every_reference_resolves_and_every_error_answer_is_the_error_schema(document: dict[str, Any]) -> None:
    refs = _refs(document)
    for ref in refs:
        target: Any = document
        for part in ref.removeprefix("#/").split("/"):
            target = target[part]
        assert isinstance(target, dict), ref
    # Every schema written is used, and every one used is written.
    assert {ref.rsplit("/", 1)[1] for ref in refs if "/schemas/" in ref} == set(document["components"]["schemas"])
    for path, item in document["paths"].items():
        for method, operation in item.items():
            responses = operation["responses"]
            # Every operation documents its success (a 200, or the 303 of the login's redirects) and its errors.
            success = "200" in responses or (path.startswith("/admin/log") and "303" in responses)
            assert success and "500" in responses and "405" in responses, (path, method)
            for status, response in responses.items():
                if int(status) >= 400 and not (path == "/readyz" and status == "503"):
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/Error"}, (path, method, status)


def test_the_documented_error_statuses_cover_what_the_data_api_answers(document: dict[str, Any]) -> None:
    paths = document["paths"]
    key = set(paths["/stores/{store}/keys/{key}"]["get"]["responses"])
    assert {"200", "400", "404", "405", "414", "431", "500", "503"} <= key
    batch = set(paths["/stores/{store}/batch-get"]["post"]["responses"])
    assert {"200", "400", "404", "405", "413", "431", "500", "503"} <= batch
    for admin in ("/admin/partition-map", "/admin/route", "/metrics"):
        assert "401" in paths[admin]["get"]["responses"]


def _shape(document: dict[str, Any]) -> dict[str, Any]:
    """Each operation of `document` as BEFORE holds the old document's."""
    shape = {}
    for path, item in document["paths"].items():
        for method, operation in item.items():
            shape[f"{method.upper()} {path}"] = {
                "parameters": {f"{p['in']}:{p['name']}" for p in operation.get("parameters", [])},
                "request_body": set(operation.get("requestBody", {}).get("content", {})),
                "responses": {
                    status: set(answer.get("content", {})) | {"header:" + h for h in answer.get("headers", {})}
                    for status, answer in operation["responses"].items()
                },
            }
    return shape


def test_the_router_s_document_has_everything_the_hand_written_one_had() -> None:
    document = router_document()
    now = _shape(document)
    assert set(BEFORE["operations"]) <= set(now)
    for operation, before in BEFORE["operations"].items():
        after = now[operation]
        assert set(before["parameters"]) <= after["parameters"], operation
        assert set(before["request_body"]) <= after["request_body"], operation
        for status, parts in before["responses"].items():
            assert status in after["responses"], (operation, status)
            assert set(parts) <= after["responses"][status], (operation, status)
    assert set(BEFORE["schemas"]) <= set(document["components"]["schemas"])
    assert set(BEFORE["security_schemes"]) <= set(document["components"]["securitySchemes"])


def test_the_node_documents_its_partition_range_and_what_it_shares_with_the_router(tmp_path: Path) -> None:
    node, router = node_document(tmp_path), router_document()
    assert "/stores/{store}/partitions/{partition}/range" in node["paths"]
    assert "/stores/{store}/range" not in node["paths"] and "/admin/ui" not in node["paths"]
    for path in ("/stores/{store}/keys/{key}", "/stores/{store}/schema", "/healthz"):
        assert node["paths"][path] == router["paths"][path], path
    # A router answers a key its store cannot take as that key's entry, a node refuses the batch.
    for document, items in ((router, {}), (node, {"type": ["string", "integer"]})):
        schemas = document["components"]["schemas"]
        assert schemas["BatchRequest"]["properties"]["keys"]["items"] == items
        assert {**schemas["BatchEntry"]["properties"]["key"], "description": ""} == {**items, "description": ""}
    # A node's login leads to its partition map, a router's to its page.
    assert "`/admin/partition-map`" in node["paths"]["/admin/login"]["post"]["responses"]["303"]["description"]
    assert "`/admin/ui`" in router["paths"]["/admin/login"]["post"]["responses"]["303"]["description"]


def test_the_router_serves_its_document_at_openapi_json() -> None:
    async def scenario() -> httpx.Response:
        settings = RouterSettings()
        app = create_router_app(settings, map_source=StaticMapSource(None), first_map_wait_s=0)
        server = service.server(settings, app)  # the router's server, as the router process builds it
        await server.start(port=0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", trust_env=False) as client:
                return await client.get(openapi.OPENAPI_PATH)
        finally:
            await server.stop(grace_s=5)

    resp = asyncio.run(scenario())
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    assert resp.json() == router_document()
