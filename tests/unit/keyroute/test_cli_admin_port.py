"""`--admin-port` / KEYROUTE_ADMIN_PORT on `keyroute router` and `keyroute node`: read from the command line or
the environment, a bad value a one-line usage error, the same port as --port refused."""

from __future__ import annotations

import pytest

from keyroute import cli

NODE = ["node", "--zk", "zk:2181", "--node-id", "n1", "--data-dir", "/tmp/d", "--port", "8080"]
ROUTER = ["router", "--zk", "zk:2181", "--port", "8080"]


@pytest.mark.parametrize("command", [NODE, ROUTER], ids=["node", "router"])
def test_the_admin_port_comes_from_the_option_or_its_variable(command: list[str]) -> None:
    parse = cli.build_parser
    assert parse({}).parse_args(command).admin_port is None
    assert parse({"KEYROUTE_ADMIN_PORT": ""}).parse_args(command).admin_port is None
    assert parse({"KEYROUTE_ADMIN_PORT": "8081"}).parse_args(command).admin_port == 8081
    args = parse({"KEYROUTE_ADMIN_PORT": "8081"}).parse_args([*command, "--admin-port", "9091"])
    assert args.admin_port == 9091
    settings = cli.http_settings_of(args)
    assert (settings.port, settings.admin_port) == (8080, 9091)


@pytest.mark.parametrize("value", ["abc", "0", "65536", "-1"])
def test_a_bad_admin_port_is_a_one_line_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.build_parser({"KEYROUTE_ADMIN_PORT": value}).parse_args(ROUTER)
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("keyroute router: error: argument --admin-port: ") and repr(value) in last


def test_the_admin_port_must_differ_from_the_data_port() -> None:
    args = cli.build_parser({}).parse_args([*ROUTER, "--admin-port", "8080"])
    with pytest.raises(SystemExit) as exited:
        cli.http_settings_of(args)
    assert str(exited.value.code) == "keyroute router: --admin-port must differ from --port (8080)"
