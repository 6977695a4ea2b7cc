"""`${NAME}` references in a spec (Kafka and Schema Registry secrets): read from the environment, or from a
folder of files (a Kubernetes Secret mounted as a volume) so that no secret sits in a process's environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyroute.keys.schema_registry import SECRETS_DIR_VARIABLE, resolve_env
from keyroute.storage.live import LiveSpecError


def test_a_reference_is_read_from_the_environment_first(tmp_path: Path) -> None:
    (tmp_path / "KAFKA_PASSWORD").write_text("from-the-file\n")
    environ = {"KAFKA_PASSWORD": "from-the-env", SECRETS_DIR_VARIABLE: str(tmp_path)}
    assert resolve_env("kafka setting 'sasl.password'", "${KAFKA_PASSWORD}", environ, LiveSpecError) == "from-the-env"


def test_a_reference_not_in_the_environment_is_the_file_of_its_name_in_the_secrets_folder(tmp_path: Path) -> None:
    (tmp_path / "KAFKA_PASSWORD").write_text("s3cr3t\n")  # as `kubectl create secret --from-file` keeps it
    (tmp_path / "TWO_LINES").write_text("a\nb\n\n")
    environ = {SECRETS_DIR_VARIABLE: str(tmp_path)}
    assert resolve_env("x", "${KAFKA_PASSWORD}", environ, LiveSpecError) == "s3cr3t"
    assert resolve_env("x", "${TWO_LINES}", environ, LiveSpecError) == "a\nb\n"  # one trailing newline only
    assert resolve_env("x", "plain text", environ, LiveSpecError) == "plain text"  # not a reference


def test_a_reference_found_nowhere_or_unreadable_is_one_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(LiveSpecError, match=r"^kafka setting 'sasl.password' names \$\{MISSING\}, which is not set$"):
        resolve_env("kafka setting 'sasl.password'", "${MISSING}", {}, LiveSpecError)
    environ = {SECRETS_DIR_VARIABLE: str(tmp_path)}
    with pytest.raises(LiveSpecError, match=rf"names \$\{{MISSING\}}, which is neither set nor a file in {tmp_path}$"):
        resolve_env("kafka setting 'sasl.password'", "${MISSING}", environ, LiveSpecError)
    (tmp_path / "A_FOLDER").mkdir()
    with pytest.raises(LiveSpecError, match=r"names \$\{A_FOLDER\}: .*A_FOLDER cannot be read \(.+\)$"):
        resolve_env("kafka setting 'sasl.password'", "${A_FOLDER}", environ, LiveSpecError)
