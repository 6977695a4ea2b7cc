"""The SparkSession a build runs in: local by default, quiet, UTC, Arrow on.

One place decides Spark's settings, so the CLI, the demo and the tests compute stores the same way.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"


def create_session(
    master: str | None = None,
    local_dir: Path | None = None,
    app_name: str = "keyroute-pipeline",
    shuffle_partitions: int = 8,
) -> SparkSession:
    """Start (or join) a SparkSession for building stores.

    `local_dir` holds Spark's scratch files and its (unused) warehouse, so nothing lands in the working
    directory. In local mode the Python workers run this very interpreter, so they import the same
    keyroute as the driver (pyspark would otherwise start $PYSPARK_PYTHON or the first `python3` on PATH).
    """
    master = master or DEFAULT_MASTER
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.log.level", "WARN")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
    )
    if local_dir is not None:
        local_dir = local_dir.resolve()
        local_dir.mkdir(parents=True, exist_ok=True)
        builder = builder.config("spark.local.dir", str(local_dir)).config(
            "spark.sql.warehouse.dir", str(local_dir / "warehouse")
        )
    with warnings.catch_warnings():
        # Starting a context imports pyspark.testing, which warns about pandas 3 at import time. The pipeline
        # never goes through pandas (its UDF is Arrow-only), so that warning is noise for our users.
        warnings.filterwarnings(
            "ignore", message="PySpark does not yet fully support pandas", category=FutureWarning
        )
        session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    # The context's own master: getOrCreate may have returned a session started elsewhere.
    if (session.sparkContext.master or "").startswith("local"):
        session.sparkContext.pythonExec = sys.executable
    return session
