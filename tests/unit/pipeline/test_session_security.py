"""The Spark settings a build's session gets from a shared secret: RPC authenticated and encrypted, shuffle
files encrypted; the secret read from its file by every pod on Kubernetes, given as a setting elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyroute.cli import build_parser
from keyroute.pipeline.session import security_conf

PROTECTED = {
    "spark.authenticate": "true",
    "spark.network.crypto.enabled": "true",
    "spark.network.crypto.saslFallback": "false",
    "spark.io.encryption.enabled": "true",
}


def test_without_a_secret_nothing_changes() -> None:
    assert security_conf(None, "local[*]") == {}


@pytest.mark.parametrize("master", ["local[*]", "local[2]", "spark://master:7077"])
def test_outside_kubernetes_the_secret_is_a_setting(master: str, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    assert security_conf(secret, master) == PROTECTED | {"spark.authenticate.secret": "s3cret"}


def test_on_kubernetes_driver_and_executors_read_the_mounted_file(tmp_path: Path) -> None:
    secret = tmp_path / "secret"  # need not be readable here: each pod reads it
    conf = security_conf(secret, "k8s://https://kubernetes.default.svc")
    assert conf == PROTECTED | {
        "spark.authenticate.secret.driver.file": str(secret.resolve()),
        "spark.authenticate.secret.executor.file": str(secret.resolve()),
    }
    assert "spark.authenticate.secret" not in conf


def test_an_unreadable_secret_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        security_conf(tmp_path / "missing", "local[*]")


def test_the_build_takes_the_secret_file_from_an_option_or_the_environment() -> None:
    argv = ["pipeline", "build", "--spec", "s.toml", "--zk", "zk:2181", "--output", "/out"]
    env = {"KEYROUTE_SPARK_SECRET_FILE": "/etc/spark/secret"}
    assert build_parser(env).parse_args(argv).spark_secret_file == Path("/etc/spark/secret")
    assert build_parser({}).parse_args(argv).spark_secret_file is None
