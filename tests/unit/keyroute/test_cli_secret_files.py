"""Secret options read from files (`--zk-auth-file`, `--zk-reader-file`, `--cluster-secret-file`,
`--admin-token-file`): the value a mounted Secret file holds reaches the command as if given directly, and a
file that cannot be used is one line on stderr and exit 1."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from keyroute import cli
from keyroute.cli import main


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[argparse.Namespace]:
    """The arguments each command would have started with (the services themselves are not started)."""
    seen: list[argparse.Namespace] = []

    def record(args: argparse.Namespace) -> int:
        seen.append(args)
        return 0

    monkeypatch.setitem(cli.COMMANDS, "node", record)
    monkeypatch.setitem(cli.COMMANDS, "router", record)
    return seen


def _secret(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_each_secret_comes_from_its_file_as_a_kubernetes_secret_volume_holds_it(
    tmp_path: Path, ran: list[argparse.Namespace]
) -> None:
    env = {
        "KEYROUTE_ZK_AUTH_FILE": str(_secret(tmp_path, "writer", "keyroute-writer:w:pass\n")),
        "KEYROUTE_ZK_READER_FILE": str(_secret(tmp_path, "reader", "keyroute-reader:r-pass")),
        "KEYROUTE_CLUSTER_SECRET_FILE": str(_secret(tmp_path, "cluster", "new-secret,old-secret\n")),
        "KEYROUTE_ADMIN_TOKEN_FILE": str(_secret(tmp_path, "admin", "admin-token\r\n")),
    }
    assert main(["node", "--zk", "zk:2181", "--node-id", "n1", "--port", "1", "--data-dir", str(tmp_path)], env) == 0
    [args] = ran
    assert (args.zk_auth.user, args.zk_auth.password) == ("keyroute-writer", "w:pass")
    assert (args.zk_reader.user, args.zk_reader.password) == ("keyroute-reader", "r-pass")
    assert args.cluster_secret == "new-secret,old-secret"
    assert args.admin_token == "admin-token"
    # The settings the services are built from carry the files' values.
    access = cli.limits_of(args)["access"]
    assert (access.cluster_secret, access.admin_token) == ("new-secret,old-secret", "admin-token")
    assert cli.zk_settings_of(args).auth == args.zk_auth


def test_without_the_files_the_options_keep_their_own_values(tmp_path: Path, ran: list[argparse.Namespace]) -> None:
    env = {"KEYROUTE_CLUSTER_SECRET": "from-env"}
    assert main(["router", "--zk", "zk:2181", "--port", "1"], env) == 0
    [args] = ran
    assert args.cluster_secret == "from-env" and args.zk_auth is None and args.admin_token is None


@pytest.mark.parametrize(
    ("option", "content", "said"),
    [
        ("--cluster-secret-file", None, "--cluster-secret-file {path}: cannot read it (No such file or directory)"),
        ("--zk-auth-file", "no-colon-here\n", "--zk-auth-file {path}: "),
        ("--admin-token-file", b"\xff\xfe", "--admin-token-file {path}: cannot read it"),
    ],
)
def test_a_file_that_cannot_be_used_is_one_line_and_exit_1(
    tmp_path: Path,
    ran: list[argparse.Namespace],
    capsys: pytest.CaptureFixture[str],
    option: str,
    content: str | bytes | None,
    said: str,
) -> None:
    path = tmp_path / "secret"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert main(["router", "--zk", "zk:2181", "--port", "1", option, str(path)], {}) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"keyroute router: {said.format(path=path)}") and err.count("\n") == 1, err
    assert "no-colon-here" not in err  # a value that does not parse is never repeated
    assert ran == []


def test_a_secret_given_both_ways_is_refused(
    tmp_path: Path, ran: list[argparse.Namespace], capsys: pytest.CaptureFixture[str]
) -> None:
    env = {"KEYROUTE_ADMIN_TOKEN": "t1", "KEYROUTE_ADMIN_TOKEN_FILE": str(_secret(tmp_path, "admin", "t2"))}
    assert main(["router", "--zk", "zk:2181", "--port", "1"], env) == 1
    assert capsys.readouterr().err == (
        "keyroute router: give --admin-token (KEYROUTE_ADMIN_TOKEN) or --admin-token-file "
        "(KEYROUTE_ADMIN_TOKEN_FILE), not both\n"
    )
    assert ran == []
