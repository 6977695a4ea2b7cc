"""`keyroute zone-from-node` against a real HTTP server standing in for the Kubernetes API server, and the
node's --zone-file / --require-zone."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from keyroute.cli import build_parser, main
from keyroute.http.server import HttpServer
from keyroute.zone import LEGACY_ZONE_LABEL, ZONE_LABEL, ZoneError, node_zone
from tests.util import free_port, serve_in_thread

TOKEN = "sa-token-123"


@dataclass
class FakeApiServer:
    """Node objects by name, as GET /api/v1/nodes/{name} answers them to the right bearer token."""

    url: str = ""
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    status: int = 200  # anything else: answered with a Status object
    seen: list[str] = field(default_factory=list)


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    fake = FakeApiServer()

    async def get_node(request: Request) -> JSONResponse:
        name = request.path_params["name"]
        fake.seen.append(name)
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return JSONResponse({"kind": "Status", "message": "Unauthorized", "code": 401}, status_code=401)
        if fake.status != 200:
            message = f'nodes "{name}" is forbidden: User "system:serviceaccount:ns:default" cannot get'
            return JSONResponse({"kind": "Status", "message": message, "code": fake.status}, status_code=fake.status)
        if name not in fake.nodes:
            return JSONResponse({"kind": "Status", "message": f'nodes "{name}" not found'}, status_code=404)
        return JSONResponse({"kind": "Node", "metadata": {"name": name, "labels": fake.nodes[name]}})

    app = Starlette(routes=[Route("/api/v1/nodes/{name}", get_node)])
    with serve_in_thread(HttpServer(app)) as port:
        fake.url = f"http://127.0.0.1:{port}"
        yield fake


@pytest.fixture
def account(tmp_path: Path) -> Path:
    directory = tmp_path / "serviceaccount"
    directory.mkdir()
    (directory / "token").write_text(TOKEN + "\n")
    return directory


def zone_from_node(api: FakeApiServer, account: Path, output: Path, node: str = "worker-1") -> int:
    env = {"KEYROUTE_NODE_NAME": node, "KEYROUTE_SERVICE_ACCOUNT_DIR": str(account)}
    return main(["zone-from-node", "--output", str(output), "--api-url", api.url], env=env)


def test_the_node_s_zone_label_is_written_to_the_file(api: FakeApiServer, account: Path, tmp_path: Path) -> None:
    api.nodes["worker-1"] = {ZONE_LABEL: "eu-west-1b", LEGACY_ZONE_LABEL: "old", "kubernetes.io/hostname": "w1"}
    out = tmp_path / "zone"
    assert zone_from_node(api, account, out) == 0
    assert out.read_text() == "eu-west-1b\n"
    assert api.seen == ["worker-1"]
    # The node reads it back when --zone is empty.
    assert node_zone("", out, required=True) == "eu-west-1b"
    assert node_zone("given", out, required=True) == "given"


def test_the_legacy_label_is_the_fallback(api: FakeApiServer, account: Path, tmp_path: Path) -> None:
    api.nodes["worker-1"] = {LEGACY_ZONE_LABEL: "us-east-1c"}
    out = tmp_path / "zone"
    assert zone_from_node(api, account, out) == 0
    assert out.read_text() == "us-east-1c\n"


def test_no_label_leaves_an_empty_file_and_one_warning(
    api: FakeApiServer, account: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api.nodes["worker-1"] = {"kubernetes.io/hostname": "w1"}
    out = tmp_path / "zone"
    out.write_text("stale\n")
    assert zone_from_node(api, account, out) == 0
    assert out.read_text() == ""
    warnings = [line for line in capsys.readouterr().err.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "worker-1" in warnings[0] and ZONE_LABEL in warnings[0], warnings


@pytest.mark.parametrize(
    ("status", "node", "token", "expected"),
    [
        (200, "missing-node", TOKEN, 'answered 404: nodes "missing-node" not found'),
        (403, "worker-1", TOKEN, 'answered 403: nodes "worker-1" is forbidden'),
        (200, "worker-1", "wrong", "answered 401: Unauthorized (the pod's service account needs `get` on `nodes`"),
    ],
)
def test_api_errors_are_one_line_and_exit_1(
    api: FakeApiServer,
    account: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    status: int,
    node: str,
    token: str,
    expected: str,
) -> None:
    api.nodes["worker-1"] = {ZONE_LABEL: "eu-west-1b"}
    api.status = status
    (account / "token").write_text(token)
    out = tmp_path / "zone"
    assert zone_from_node(api, account, out, node=node) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("keyroute zone-from-node: GET ") and expected in line, line
    assert not out.exists()


def test_unreachable_api_server_missing_token_or_name_are_one_line(
    account: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "zone"
    down = f"http://127.0.0.1:{free_port()}"
    cases = [
        ({"KEYROUTE_NODE_NAME": "w1", "KEYROUTE_SERVICE_ACCOUNT_DIR": str(account)}, down, "ConnectError"),
        ({"KEYROUTE_NODE_NAME": "w1", "KEYROUTE_SERVICE_ACCOUNT_DIR": str(tmp_path / "none")}, down, "token"),
        ({"KEYROUTE_SERVICE_ACCOUNT_DIR": str(account)}, down, "--node-name (KEYROUTE_NODE_NAME"),
        ({"KEYROUTE_NODE_NAME": "w1"}, "", "KUBERNETES_SERVICE_HOST"),
    ]
    for env, url, expected in cases:
        assert main(["zone-from-node", "--output", str(out), "--api-url", url], env=env) == 1
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith("keyroute zone-from-node: ") and expected in line, line
    assert not out.exists()


def test_the_api_url_defaults_to_the_in_cluster_service() -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    args = build_parser(env).parse_args(["zone-from-node", "--output", "/tmp/z"])
    assert args.api_url == "https://10.96.0.1:443"
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}
    assert build_parser(env).parse_args(["zone-from-node", "--output", "/z"]).api_url == "https://[fd00::1]:6443"
    assert str(build_parser({}).parse_args(["zone-from-node", "--output", "/z"]).service_account_dir) == (
        "/var/run/secrets/kubernetes.io/serviceaccount"
    )


def test_https_needs_the_cluster_ca(account: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {"KEYROUTE_NODE_NAME": "w1", "KEYROUTE_SERVICE_ACCOUNT_DIR": str(account)}
    url = f"https://127.0.0.1:{free_port()}"
    assert main(["zone-from-node", "--output", str(tmp_path / "zone"), "--api-url", url], env=env) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert "cannot read the cluster CA" in line and "ca.crt" in line, line


# -- the node's side ----------------------------------------------------------------------------------------


def node_args(*extra: str) -> list[str]:
    return ["node", "--zk", "127.0.0.1:1/x", "--node-id", "n1", "--port", "1", "--data-dir", "/nonexistent", *extra]


def test_the_zone_file_and_require_zone_read_their_variables(tmp_path: Path) -> None:
    env = {"KEYROUTE_ZONE_FILE": str(tmp_path / "zone"), "KEYROUTE_REQUIRE_ZONE": "true"}
    args = build_parser(env).parse_args(node_args())
    assert args.zone_file == tmp_path / "zone" and args.require_zone is True
    args = build_parser({}).parse_args(node_args())
    assert args.zone_file is None and args.require_zone is False


def test_node_zone_from_file_and_requirement(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("")
    assert node_zone("", empty, required=False) == ""
    assert node_zone("  a  ", None, required=True) == "a"
    with pytest.raises(ZoneError, match=r"--zone \(KEYROUTE_ZONE\) or --zone-file \(KEYROUTE_ZONE_FILE"):
        node_zone("", empty, required=True)
    with pytest.raises(ZoneError, match="cannot read --zone-file"):
        node_zone("", tmp_path / "missing", required=False)
    two = tmp_path / "two"
    two.write_text("a b\n")
    with pytest.raises(ZoneError, match="one zone name"):
        node_zone("", two, required=False)


@pytest.mark.parametrize("zone_file", [None, "empty", "missing"])
def test_a_node_that_requires_a_zone_refuses_to_start_without_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], zone_file: str | None
) -> None:
    (tmp_path / "empty").write_text("")
    extra = ["--zone-file", str(tmp_path / zone_file)] if zone_file else []
    assert main(node_args("--require-zone", *extra), env={}) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("keyroute node: "), line
    if zone_file != "missing":
        assert "--zone (KEYROUTE_ZONE)" in line and "--zone-file (KEYROUTE_ZONE_FILE" in line, line


def test_an_answer_that_is_no_node_is_one_line(
    api: FakeApiServer, account: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api.nodes["worker-1"] = ["not", "labels"]  # type: ignore[assignment]
    out = tmp_path / "zone"
    assert zone_from_node(api, account, out) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.endswith("answered 200 with no Node object"), line
    assert not out.exists()
