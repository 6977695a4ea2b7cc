"""keyroute.pipeline.spark_errors: Spark's exceptions as the pipeline's errors, with Spark's first line."""

from __future__ import annotations

from keyroute.pipeline.spark_errors import spark_message


def test_spark_message_keeps_the_first_line_only() -> None:
    exc = RuntimeError("[UNRESOLVED_COLUMN] cannot resolve `x`\n  at org.apache.spark...\n")
    assert spark_message(exc) == "[UNRESOLVED_COLUMN] cannot resolve `x`"
    assert spark_message(RuntimeError("x" * 1000)).endswith("…")
