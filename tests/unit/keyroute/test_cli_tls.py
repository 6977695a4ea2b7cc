"""The TLS options of `keyroute router` and `keyroute node`: from the command line or KEYROUTE_*, into the
settings; a half-given pair, a CA without a certificate or an http:// advertised address with TLS on are
one-line errors; a node's clients' CA and a router's id."""

from __future__ import annotations

import pytest

from keyroute import cli

NODE = ["node", "--zk", "zk:2181", "--node-id", "n1", "--data-dir", "/tmp/d", "--port", "8080"]
ROUTER = ["router", "--zk", "zk:2181", "--port", "8080"]


def test_tls_options_come_from_the_command_line_or_the_environment() -> None:
    env = {"KEYROUTE_TLS_CERT": "/tls/tls.crt", "KEYROUTE_TLS_KEY": "/tls/tls.key", "KEYROUTE_MEMBER_CA": "/ca.pem"}
    args = cli.build_parser(env).parse_args([*ROUTER, "--tls-client-ca", "/clients.pem"])
    tls = cli.http_settings_of(args).tls
    assert (tls.cert, tls.key, tls.client_ca, tls.member_ca) == (
        "/tls/tls.crt",
        "/tls/tls.key",
        "/clients.pem",
        "/ca.pem",
    )
    node = cli.http_settings_of(cli.build_parser(env).parse_args(NODE), advertise_url="")
    assert node.url == "https://127.0.0.1:8080" and node.tls.client_ca == ""
    assert cli.http_settings_of(cli.build_parser({}).parse_args(NODE)).url == "http://127.0.0.1:8080"


def test_nodes_take_a_clients_ca_and_routers_an_id() -> None:
    env = {"KEYROUTE_TLS_CERT": "/tls/tls.crt", "KEYROUTE_TLS_KEY": "/tls/tls.key", "KEYROUTE_MEMBER_CA": "/ca.pem"}
    node = cli.build_parser({**env, "KEYROUTE_TLS_CLIENT_CA": "/clients.pem"}).parse_args(NODE)
    assert cli.http_settings_of(node).tls.client_ca == "/clients.pem"
    assert cli.build_parser({}).parse_args([*ROUTER, "--router-id", "r7"]).router_id == "r7"
    assert cli.build_parser({"KEYROUTE_ROUTER_ID": "r8"}).parse_args(ROUTER).router_id == "r8"
    assert cli.build_parser({}).parse_args(ROUTER).router_id == ""


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tls-cert", "/a.crt"], "--tls-cert and --tls-key go together: give both or neither"),
        (["--member-ca", "/ca.pem"], "--tls-client-ca and --member-ca need --tls-cert and --tls-key"),
    ],
)
def test_incomplete_tls_options_are_one_line(extra: list[str], message: str) -> None:
    args = cli.build_parser({}).parse_args([*ROUTER, *extra])
    with pytest.raises(SystemExit) as exited:
        cli.http_settings_of(args)
    assert str(exited.value.code) == f"keyroute router: {message}"


def test_an_http_advertised_address_with_tls_is_refused() -> None:
    args = cli.build_parser({}).parse_args([*NODE, "--tls-cert", "/a.crt", "--tls-key", "/a.key"])
    with pytest.raises(SystemExit) as exited:
        cli.http_settings_of(args, advertise_url="http://n1:8080")
    assert str(exited.value.code) == "keyroute node: --advertise-url http://n1:8080 is http://, but --tls-cert is HTTPS"
    assert cli.http_settings_of(args, advertise_url="https://n1:8080").url == "https://n1:8080"


def test_metrics_open_comes_from_the_command_line_or_the_environment() -> None:
    for argv, env, wanted in (
        ([*ROUTER], {}, False),
        ([*ROUTER, "--metrics-open"], {}, True),
        ([*NODE], {"KEYROUTE_METRICS_OPEN": "true"}, True),
    ):
        access = cli.limits_of(cli.build_parser(env).parse_args(argv))["access"]
        assert access.metrics_open is wanted, (argv, env)
