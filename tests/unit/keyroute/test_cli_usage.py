"""Usage mistakes on the command line: one line saying what is wrong, never argparse's whole usage."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyroute.cli import main


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        main(argv, env=env or {})
    captured = capsys.readouterr()
    assert captured.out == ""
    return int(exited.value.code or 0), captured.err


def test_a_missing_zk_is_one_line_naming_the_option_and_its_variable(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _fails(["router", "--port", "8080"], capsys)
    assert code == 1
    assert err == "keyroute router: --zk (or KEYROUTE_ZK) is required; `keyroute router --help` lists the options\n"
    code, err = _fails(["store", "list"], capsys)
    assert (code, err.count("\n")) == (1, 1) and "keyroute store list: --zk (or KEYROUTE_ZK) is required" in err
    # The variable counts as the option: then another missing one is named alone.
    code, err = _fails(["store", "rollback", "--store", "s"], capsys, env={"KEYROUTE_ZK": "zk:2181"})
    assert (code, err.count("\n")) == (1, 1)
    assert err.startswith("keyroute store rollback: --version (or KEYROUTE_VERSION) is required;")
    assert "usage:" not in err


def test_an_unknown_option_is_said_with_the_closest_one(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _fails(["store", "list", "--zk", "zk:2181", "--zk-auht", "u:p"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("keyroute store list: unrecognized arguments: --zk-auht u:p")
    assert "(--zk-auht is not an option: did you mean --zk-auth?)" in err
    # A misspelt required option: the missing one is named with the misspelling's likely meaning.
    code, err = _fails(["router", "--zk", "zk:2181", "--prot", "8080"], capsys)
    assert code == 1 and "--port (or KEYROUTE_PORT) is required (--prot is not an option: did you mean --port?)" in err
    code, err = _fails(["router", "--zk", "zk:2181", "--port", "1", "--workres=2"], capsys)
    assert code == 2 and "(--workres is not an option: did you mean --workers?)" in err
    # Nothing close: no suggestion.
    code, err = _fails(["router", "--zk", "zk:2181", "--port", "1", "--qqqqqqqq"], capsys)
    assert code == 2 and "did you mean" not in err and "unrecognized arguments: --qqqqqqqq" in err


def test_the_share_per_caller_is_an_option_and_a_variable_and_not_negative(capsys: pytest.CaptureFixture[str]) -> None:
    from keyroute.cli import build_parser, limits_of

    env = {"KEYROUTE_MAX_CONCURRENT_PER_CALLER": "8"}
    args = build_parser(env).parse_args(["router", "--zk", "z:1", "--port", "1"])
    assert limits_of(args)["limits"].max_concurrent_per_caller == 8
    args = build_parser({}).parse_args(["router", "--zk", "z:1", "--port", "1", "--max-concurrent-per-caller", "-1"])
    with pytest.raises(SystemExit) as exited:  # the process prints it as one line and exits 1
        limits_of(args)
    assert exited.value.code == "keyroute router: --max-concurrent-per-caller must not be negative"


def test_an_http_jwks_url_is_refused_in_one_line_unless_allowed(capsys: pytest.CaptureFixture[str]) -> None:
    from keyroute.cli import build_parser, limits_of

    given = ["node", "--zk", "z:1", "--node-id", "n1", "--port", "1", "--data-dir", "d", "--jwt-issuer", "i"]
    args = build_parser({}).parse_args([*given, "--jwt-jwks-url", "http://issuer.test/jwks.json"])
    with pytest.raises(SystemExit) as exited:  # the process prints it as one line and exits 1
        limits_of(args)
    assert str(exited.value.code).startswith("keyroute node: --jwt-jwks-url http://issuer.test/jwks.json is http://")
    assert "--jwt-jwks-allow-http" in str(exited.value.code) and "\n" not in str(exited.value.code)
    env = {"KEYROUTE_JWT_JWKS_ALLOW_HTTP": "1", "KEYROUTE_JWT_JWKS_REFRESH_S": "60"}
    args = build_parser(env).parse_args([*given, "--jwt-jwks-url", "http://issuer.test/jwks.json"])
    access = limits_of(args)["access"]
    assert access.jwt_jwks_allow_http and access.jwt_jwks_refresh_s == 60
    args = build_parser({}).parse_args([*given, "--jwt-jwks-url", "https://issuer.test/jwks.json"])
    assert limits_of(args)["access"].jwt_jwks_refresh_s == 300
    code, err = _fails([*given, "--jwt-jwks-refresh-s", "0"], capsys)
    assert code == 2 and "--jwt-jwks-refresh-s" in err and "expected a number above 0" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["router", "--zk", "zk:2181", "--port", "8080"],
        ["node", "--zk", "zk:2181", "--port", "8081", "--node-id", "n1", "--data-dir", "data"],
    ],
)
def test_a_quota_file_that_cannot_be_read_is_one_line_before_anything_starts(
    argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "quotas.toml"
    try:
        code = main([*argv, "--quota-file", str(missing)], env={})
    except SystemExit as exited:
        code = int(exited.code or 0)
    err = capsys.readouterr().err.splitlines()
    assert code == 1
    refusal = [line for line in err if line.startswith(f"keyroute {argv[0]}: ")]
    assert len(refusal) == 1 and str(missing) in refusal[0], err
