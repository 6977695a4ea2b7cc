"""keyroute.pipeline.session: the spec's [spark] settings on a running session. Settings it takes are set and
put back; one it cannot take refuses the lot, changing nothing. A stand-in session plays Spark's rules, as
RuntimeConfig enforces them (a static setting cannot be set while the session runs)."""

from __future__ import annotations

from typing import Any

import pytest
from pyspark.errors import PySparkException

from keyroute.pipeline.session import SparkConfError, restore_conf, set_conf


class Refused(PySparkException):
    def __init__(self, condition: str, message: str) -> None:
        super().__init__(message=message)
        self.condition = condition

    def getCondition(self) -> str:  # noqa: N802 (pyspark's name)
        return self.condition


class Conf:
    STATIC = ("spark.sql.warehouse.dir", "spark.jars.packages")

    def __init__(self, values: dict[str, str]) -> None:
        self.values = dict(values)

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def set(self, name: str, value: str) -> None:
        if name in self.STATIC:
            raise Refused(
                "CANNOT_MODIFY_STATIC_CONFIG", f'Cannot modify the value of the static Spark config: "{name}"'
            )
        if name == "spark.sql.shuffle.partitions" and not value.isdigit():
            raise Refused("INVALID_CONF_VALUE", f"The value '{value}' in the config \"{name}\" is invalid.\nmore")
        self.values[name] = value

    def unset(self, name: str) -> None:
        self.values.pop(name, None)


class Session:
    def __init__(self, values: dict[str, str]) -> None:
        self.conf = Conf(values)


RUNNING = {"spark.sql.warehouse.dir": "file:/data/warehouse", "spark.sql.ansi.enabled": "true"}


def test_settings_a_running_session_takes_are_set_and_put_back() -> None:
    session = Session(RUNNING)
    wanted = {
        "spark.sql.warehouse.dir": "/data/warehouse/",  # the same directory: nothing to change
        "spark.sql.ansi.enabled": "false",
        "spark.sql.catalog.lake": "org.apache.iceberg.spark.SparkCatalog",
    }
    previous = set_conf(session, wanted)  # type: ignore[arg-type]
    assert session.conf.values == {
        **RUNNING,
        "spark.sql.ansi.enabled": "false",
        "spark.sql.catalog.lake": wanted["spark.sql.catalog.lake"],
    }
    assert previous == {"spark.sql.ansi.enabled": "true", "spark.sql.catalog.lake": None}
    restore_conf(session, previous)  # type: ignore[arg-type]
    assert session.conf.values == RUNNING


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        (
            "spark.sql.warehouse.dir",
            "/elsewhere",
            "the Spark session already runs with 'file:/data/warehouse', and Spark cannot change it in a running "
            "session",
        ),
        (
            "spark.jars.packages",
            "io.delta:delta-spark_2.13:4.0.0",
            "the Spark session already runs without it, and Spark cannot change it in a running session",
        ),
        (
            "spark.sql.shuffle.partitions",
            "many",
            "[INVALID_CONF_VALUE] The value 'many' in the config \"spark.sql.shuffle.partitions\" is invalid.",
        ),
    ],
)
def test_a_setting_the_session_cannot_take_refuses_all_and_changes_nothing(name: str, value: str, reason: str) -> None:
    session = Session(RUNNING)
    with pytest.raises(SparkConfError) as err:
        set_conf(session, {"spark.sql.ansi.enabled": "false", name: value})  # type: ignore[arg-type]
    assert str(err.value).startswith(f"[spark] {name!r} = {value!r}: {reason}")
    assert "\n" not in str(err.value)
    assert session.conf.values == RUNNING
