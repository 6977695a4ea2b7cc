"""The cluster policy in ZooKeeper (keyroute.cluster.cluster_policy), with real processes on the session's ZooKeeper:
`keyroute cluster policy set/show`, its writers' ACL, members that do not satisfy it refusing to start before
they write anything, and a running node and router that stop serving reads when it tightens and serve them
again when it is loosened.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError

from keyroute.cluster import zk, zk_layout
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.runtime.settings import ZkSettings
from tests.integration.test_node import key_url
from tests.integration.test_zk_acl import (
    EXPECTED_ACL,
    READER,
    READER_ENV,
    STORE,
    WRITER_ENV,
    acl_of,
    cli,
    publish_version,
    raw_client,
    values,
    writer_settings,
)
from tests.util import Proc, TcpProxy, free_port, wait_for

pytestmark = pytest.mark.integration

OPEN_ENV: dict[str, str] = {}
ACCESS_CONTROL = "caller access control: set --access-tokens or --jwt-issuer"


def policy(zk_settings: ZkSettings, *args: str, env: dict[str, str] = OPEN_ENV) -> tuple[int, Any, list[str]]:
    """`keyroute cluster policy ARGS --zk ...`: its exit code, its JSON output (None when none) and stderr's lines."""
    done = cli("cluster", "policy", *args, "--zk", zk_settings.connect_string, env=env)
    return done.returncode, json.loads(done.stdout) if done.stdout.strip() else None, done.stderr.splitlines()


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if " ERROR " in line]


@pytest.fixture
def client(zk_settings: ZkSettings) -> Iterator[KazooClient]:
    c = zk.connect(zk_settings)
    yield c
    zk.close(c)


def test_the_policy_is_set_and_shown_as_json_and_bad_input_is_one_line(zk_settings: ZkSettings) -> None:
    code, shown, errors = policy(zk_settings, "show")
    assert (code, shown, len(errors)) == (1, None, 1)
    assert "does not exist" in errors[0] and errors[0].startswith("keyroute cluster policy show: ")

    code, written, errors = policy(
        zk_settings, "set", "--require-access-control", "--member-auth", "mtls", "--require-tls", "zookeeper,client"
    )
    assert code == 0, errors
    assert written["recorded"] is True and written["previous"] is None
    expected = {"require_access_control": True, "member_auth": "mtls", "require_tls": ["client", "zookeeper"]}
    assert {name: written[name] for name in expected} == expected
    assert any("world-writable" in line for line in errors)  # no ZooKeeper identity: said
    code, shown, _ = policy(zk_settings, "show")
    assert code == 0 and {name: shown[name] for name in expected} == expected and shown["recorded"] is True
    assert shown["updated_at"] == written["updated_at"] and shown["chroot"] == zk_settings.chroot

    for bad, named in (
        (("--member-auth", "tls"), "--member-auth takes none, secret, mtls, not 'tls'"),
        (("--require-tls", "client,kafka"), "--require-tls takes"),
    ):
        code, out, errors = policy(zk_settings, "set", *bad)
        assert (code, out, len(errors)) == (1, None, 1), errors
        assert errors[0].startswith("keyroute cluster policy set: ") and named in errors[0]
        assert "Traceback" not in errors[0]
    assert {name: policy(zk_settings, "show")[1][name] for name in expected} == expected  # unchanged

    # The whole policy is set each time: no option, no requirement (the previous one is printed).
    code, loosened, _ = policy(zk_settings, "set")
    assert code == 0 and loosened["previous"]["member_auth"] == "mtls"
    assert (loosened["require_access_control"], loosened["member_auth"], loosened["require_tls"]) == (False, "none", [])


def test_the_policy_is_the_writers_to_change_and_the_readers_to_read(zk_settings: ZkSettings) -> None:
    code, _, errors = policy(zk_settings, "set", "--member-auth", "secret", env=WRITER_ENV)
    assert code == 0 and not any("world-writable" in line for line in errors), errors
    writer = zk.connect(writer_settings(zk_settings))
    try:
        assert acl_of(writer, zk_layout.POLICY) == EXPECTED_ACL
        before = writer.get(zk_layout.POLICY)[0]
    finally:
        zk.close(writer)

    code, out, errors = policy(zk_settings, "set", "--require-access-control", env=READER_ENV)
    assert (code, out, len(errors)) == (1, None, 1), errors
    assert READER.user in errors[0] and "Traceback" not in errors[0]
    code, shown, _ = policy(zk_settings, "show", env=READER_ENV)  # the routers' identity reads it
    assert code == 0 and shown["member_auth"] == "secret" and shown["require_access_control"] is False

    path = zk_settings.chroot + zk_layout.POLICY
    for identity in (READER, None):
        intruder = raw_client(zk_settings, identity)
        try:
            with pytest.raises(NoAuthError):
                intruder.set(path, b'{"member_auth": "none"}')
            with pytest.raises(NoAuthError):
                intruder.delete(path)
        finally:
            zk.close(intruder)
    writer = zk.connect(writer_settings(zk_settings))
    try:
        assert writer.get(zk_layout.POLICY)[0] == before
    finally:
        zk.close(writer)


def _node_args(zk_settings: ZkSettings, node_id: str, port: int, data_dir: Path) -> list[str]:
    return [
        "node",
        "--zk",
        zk_settings.connect_string,
        "--node-id",
        node_id,
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
        "--zk-session-timeout-s",
        "4",
    ]


def _router_args(zk_settings: ZkSettings, port: int) -> list[str]:
    return ["router", "--zk", zk_settings.connect_string, "--port", str(port), "--zk-session-timeout-s", "4"]


def test_a_node_and_a_router_that_do_not_satisfy_the_policy_refuse_to_start_and_write_nothing(
    zk_settings: ZkSettings, client: KazooClient, tmp_path: Path
) -> None:
    code, _, errors = policy(zk_settings, "set", "--require-access-control", "--require-tls", "zookeeper")
    assert code == 0, errors
    wanted = (
        "the cluster policy requires caller access control: set --access-tokens or --jwt-issuer; "
        "TLS to ZooKeeper: set --zk-tls-ca"
    )
    for name, args in (
        ("node n1", _node_args(zk_settings, "n1", free_port(), tmp_path / "n1")),
        ("router", _router_args(zk_settings, free_port())),
    ):
        proc = Proc(args, tmp_path / f"{name}.log").start()
        assert proc.popen is not None
        code = proc.popen.wait(timeout=60)
        output = proc.output()
        assert code == 1, output
        assert error_lines(output) == [line for line in output.splitlines() if wanted in line], output
        (line,) = error_lines(output)
        assert line.endswith(f"{name} did not start: {wanted}"), line
        assert "Traceback" not in output
    # Nothing was written: no registration, no cluster identity, no router record.
    assert client.get_children(zk_layout.NODES) == [] and client.get_children(zk_layout.ROUTERS) == []
    assert client.exists(zk_layout.CLUSTER) is None


def test_a_running_node_and_router_serve_no_read_while_a_tightened_policy_is_unmet(
    zk_settings: ZkSettings, client: KazooClient, tmp_path: Path
) -> None:
    publish_version(client, tmp_path / "snapshots", 1)
    node_port, router_port = free_port(), free_port()
    node_url, router_url = f"http://127.0.0.1:{node_port}", f"http://127.0.0.1:{router_port}"
    node = Proc(_node_args(zk_settings, "n1", node_port, tmp_path / "n1"), tmp_path / "node.log").start()
    router = Proc(_router_args(zk_settings, router_port), tmp_path / "router.log").start()
    http = httpx.Client(timeout=10.0, trust_env=False)
    key, value = next(iter(values(1).items()))
    try:

        def read(base: str) -> httpx.Response:
            assert node.alive and router.alive, node.output() + router.output()
            return http.get(base + key_url(STORE, key))

        for base in (node_url, router_url):
            wait_for(lambda b=base: read(b).status_code == 200, timeout_s=60, message=f"a read at {base}")  # type: ignore[misc]
        assert read(router_url).json()["value"] == value
        assert http.get(router_url + "/admin/partition-map").json()["policy"]["recorded"] is False

        code, _, errors = policy(zk_settings, "set", "--require-access-control")
        assert code == 0, errors
        for base in (node_url, router_url):
            refused = wait_for(
                lambda b=base: (r := read(b)).status_code == 503 and r,  # type: ignore[misc]
                timeout_s=30,
                message=f"{base} to stop serving reads",
            )
            body = refused.json()
            assert body["error"] == "policy_not_satisfied", body
            assert body["message"] == f"the cluster policy requires {ACCESS_CONTROL}"
            assert refused.headers["retry-after"] == "30"
        ready = http.get(node_url + "/readyz")
        assert ready.status_code == 503 and "caller access control" in ready.json()["reason"]
        assert http.get(router_url + "/readyz").status_code == 503
        shown = http.get(router_url + "/admin/partition-map").json()["policy"]
        assert (shown["recorded"], shown["satisfied"], shown["require_access_control"]) == (True, False, True)
        assert shown["unmet"] == [ACCESS_CONTROL]
        # Still a member: the node keeps its registration (it is asked to serve no read, not to leave).
        assert client.exists(zk_layout.node_path("n1")) is not None
        for proc, name in ((node, "node n1"), (router, "router")):
            said = [line for line in proc.output().splitlines() if f"{name} serves no read" in line]
            assert len(said) == 1 and "caller access control" in said[0], proc.output()

        code, _, errors = policy(zk_settings, "set", "--member-auth", "none")
        assert code == 0, errors
        for base in (node_url, router_url):
            wait_for(lambda b=base: read(b).status_code == 200, timeout_s=30, message=f"{base} to serve again")  # type: ignore[misc]
        assert read(node_url).json()["value"] == value
        assert http.get(node_url + "/readyz").status_code == 200
        assert http.get(router_url + "/admin/partition-map").json()["policy"]["satisfied"] is True
    finally:
        http.close()
        for proc in (router, node):
            proc.stop()


def test_a_router_that_reaches_zookeeper_only_after_it_started_serves_no_read_while_the_policy_is_unmet(
    zk_server: EmbeddedZooKeeper, zk_settings: ZkSettings, client: KazooClient, tmp_path: Path
) -> None:
    code, _, errors = policy(zk_settings, "set", "--require-access-control")
    assert code == 0, errors
    relay = TcpProxy((zk_server.host, zk_server.port))
    relay.cut()  # ZooKeeper away when the router starts: it listens after its first-map wait, answering 503
    port = free_port()
    through_relay = dataclasses.replace(zk_settings, hosts=relay.address)
    router = Proc(_router_args(through_relay, port), tmp_path / "router.log").start()
    http = httpx.Client(timeout=10.0, trust_env=False)
    url = f"http://127.0.0.1:{port}"

    def read() -> httpx.Response:
        assert router.alive, router.output()
        return http.get(url + key_url(STORE, "k"))

    try:
        first = wait_for(lambda: read(), timeout_s=60, message="the router to listen")
        assert first.status_code == 503 and first.json()["error"] == "no_partition_map"
        relay.restore()
        refused = wait_for(
            lambda: (r := read()).json()["error"] == "policy_not_satisfied" and r,
            timeout_s=60,
            message="the router to read the policy once ZooKeeper is back",
        )
        assert refused.status_code == 503 and ACCESS_CONTROL in refused.json()["message"]
        assert http.get(url + "/readyz").status_code == 503
        # It runs and registers (its registration follows the map's first read): it only serves no read.
        wait_for(lambda: client.get_children(zk_layout.ROUTERS) != [], timeout_s=30, message="the router registered")

        code, _, errors = policy(zk_settings, "set")
        assert code == 0, errors
        loosened = wait_for(
            lambda: (r := read()).status_code == 404 and r, timeout_s=30, message="the router to serve again"
        )
        assert loosened.json()["error"] == "store_not_found"  # answered: this chroot has no store
        assert http.get(url + "/readyz").status_code == 200
    finally:
        http.close()
        router.stop()
        relay.close()
