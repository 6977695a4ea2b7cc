"""Spark's and py4j's exceptions turned into the pipeline's own errors, naming the store."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from py4j.protocol import Py4JError
from pyspark.errors import PySparkException

from keyroute.pipeline.errors import DataError, PipelineError

_SPARK_MESSAGE_CHARS = 400


@contextmanager
def spark_errors(store: str, doing: str, error: type[PipelineError] = DataError) -> Iterator[None]:
    """Turn Spark's and py4j's exceptions into `error` naming the store, with Spark's first line."""
    try:
        yield
    except (PySparkException, Py4JError) as exc:
        raise error(store, f"Spark failed while {doing}: {spark_message(exc)}") from exc


def spark_message(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= _SPARK_MESSAGE_CHARS else text[:_SPARK_MESSAGE_CHARS] + "…"
