"""The SparkSession a build runs in: local by default, quiet, UTC, Arrow on.

One place decides Spark's settings, so the CLI, the demo and the tests compute stores the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

from pyspark.errors import PySparkException
from pyspark.logger import PySparkLogger
from pyspark.sql import SparkSession

from keyroute.pipeline.spark_errors import spark_message

DEFAULT_MASTER = "local[*]"

# What a quiet driver JVM logs: errors only, one line each (no stack traces: the build reports each failure
# itself, in one line), and none from the SQL query context logger, which repeats a failed expression's
# error as a multi-kilobyte JSON document.
QUIET_LOG4J2 = """\
status = error
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yyyy-MM-dd HH:mm:ss} spark %p %c{1}: %m%n
appender.console.layout.alwaysWriteExceptions = false
rootLogger.level = error
rootLogger.appenderRef.console.ref = console
logger.query_context.name = SQLQueryContextLogger
logger.query_context.level = off
"""
# Lines the JVM's launcher prints before any logging is configured (the JDK's notice about the incubator
# module Spark enables, log4j's own start-up notes): dropped from a quiet build's output.
_LAUNCH_NOISE = re.compile(
    rb"^(WARNING: Using incubator modules|Using Spark's default log4j profile|Setting default log level to|"
    rb"To adjust logging level use|Setting Spark log level to)"
)


def create_session(
    master: str | None = None,
    local_dir: Path | None = None,
    app_name: str = "keyroute-pipeline",
    shuffle_partitions: int = 8,
    quiet: bool = True,
    progress: bool = False,
    secret_file: Path | None = None,
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """Start (or join) a SparkSession for building stores.

    `local_dir` holds Spark's scratch files and its (unused) warehouse, so nothing lands in the working
    directory. In local mode the Python workers run this very interpreter, so they import the same
    keyroute as the driver (pyspark would otherwise start $PYSPARK_PYTHON or the first `python3` on PATH).
    `quiet`: the driver JVM logs errors only, in one line each, and its launcher's start-up notes are dropped
    (Spark's own logging, WARN and stack traces included, otherwise). `progress`: Spark's console progress
    bar for each stage (for a terminal). `secret_file`: Spark's RPC authenticated and encrypted
    (`security_conf`). `conf`: more settings (a spec's `[spark]` table, which may also name
    the warehouse directory); a session already running with another value of one it cannot change is
    refused (SparkConfError), as `set_conf` says.
    """
    master = master or DEFAULT_MASTER
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "true" if progress else "false")
        .config("spark.log.level", "ERROR" if quiet else "WARN")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
    )
    for key, value in security_conf(secret_file, master).items():
        builder = builder.config(key, value)
    if local_dir is not None:
        local_dir = local_dir.resolve()
        local_dir.mkdir(parents=True, exist_ok=True)
        builder = builder.config("spark.local.dir", str(local_dir)).config(
            "spark.sql.warehouse.dir", str(local_dir / "warehouse")
        )
    conf = conf or {}
    # A session already running in this process is joined, and takes `conf` as a running session does.
    joined = bool(conf) and SparkSession.getActiveSession() is not None
    for name, value in {} if joined else conf.items():
        builder = builder.config(name, value)
    with warnings.catch_warnings():
        # Starting a context imports pyspark.testing, which warns about pandas 3 at import time. The pipeline
        # never goes through pandas (its UDF is Arrow-only), so that warning is noise for our users.
        warnings.filterwarnings(
            "ignore", message="PySpark does not yet fully support pandas", category=FutureWarning
        )
        if quiet and SparkSession.getActiveSession() is None:
            config = Path(tempfile.gettempdir()) / f"keyroute-log4j2-{os.getuid()}.properties"
            config.write_text(QUIET_LOG4J2, encoding="utf-8")
            builder = builder.config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={config.as_uri()}")
            with _launch_noise_dropped():
                session = builder.getOrCreate()
        else:
            session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR" if quiet else "WARN")
    if quiet:
        # pyspark logs a failed expression's error again, as a JSON document, before raising it; the build
        # reports it itself. py4j says at INFO when its connection closes.
        for name in ("SQLQueryContextLogger", "DataFrameQueryContextLogger"):
            PySparkLogger.getLogger(name).setLevel(logging.CRITICAL + 1)
        logging.getLogger("py4j").setLevel(max(logging.WARNING, logging.getLogger("py4j").getEffectiveLevel()))
    # The context's own master: getOrCreate may have returned a session started elsewhere.
    if (session.sparkContext.master or "").startswith("local"):
        session.sparkContext.pythonExec = sys.executable
    if joined:
        set_conf(session, conf)
    return session


def security_conf(secret_file: Path | None, master: str) -> dict[str, str]:
    """Spark's settings for a shared secret in `secret_file`: every RPC connection between the driver and its
    executors authenticated with it (`spark.authenticate`), encrypted (AES, `spark.network.crypto`), and
    shuffle and spill files encrypted on disk. On Kubernetes the driver and each executor read the file
    themselves (a Secret mounted at the same path in every pod), so the secret is in no pod spec; Spark takes
    files there only, so any other master is given the secret as a setting."""
    if secret_file is None:
        return {}
    conf = {
        "spark.authenticate": "true",
        "spark.network.crypto.enabled": "true",
        "spark.network.crypto.saslFallback": "false",
        "spark.io.encryption.enabled": "true",
    }
    if master.startswith("k8s://"):
        path = str(secret_file.resolve())
        return conf | {"spark.authenticate.secret.driver.file": path, "spark.authenticate.secret.executor.file": path}
    return conf | {"spark.authenticate.secret": secret_file.read_text(encoding="utf-8").strip()}


class SparkConfError(ValueError):
    """A setting the running SparkSession has another value of, and cannot change while it runs."""


def set_conf(session: SparkSession, conf: Mapping[str, str]) -> dict[str, str | None]:
    """Set each setting of `conf` the running session has another value of, and return their values before
    (None: unset). Spark decides which it takes at run time (SQL settings, catalogs: spark.sql.catalog.NAME
    and its options, spark.hadoop.*); one it cannot change (static SQL settings such as the warehouse or the
    catalog implementation, the context's such as spark.jars) is SparkConfError, with nothing changed."""
    previous: dict[str, str | None] = {}
    for name, value in conf.items():
        current = session.conf.get(name, None)
        if _same(current, value):
            continue
        try:
            session.conf.set(name, value)
        except PySparkException as exc:
            restore_conf(session, previous)
            reason = spark_message(exc)
            if (exc.getCondition() or "").startswith("CANNOT_MODIFY"):
                running = "without it" if current is None else f"with {current!r}"
                reason = f"the Spark session already runs {running}, and Spark cannot change it in a running session"
            raise SparkConfError(f"[spark] {name!r} = {value!r}: {reason}") from exc
        previous[name] = current
    return previous


def restore_conf(session: SparkSession, previous: Mapping[str, str | None]) -> None:
    """Put back the settings `set_conf` changed, as it returned them."""
    for name, value in previous.items():
        if value is None:
            session.conf.unset(name)
        else:
            session.conf.set(name, value)


def _same(current: str | None, wanted: str) -> bool:
    """Whether a setting's value is the wanted one; a local path and its file: URI are the same."""
    if current is None:
        return False
    return _as_path(current) == _as_path(wanted)


def _as_path(value: str) -> str:
    if value.startswith("file:"):
        value = "/" + value[len("file:") :].lstrip("/")
    return value.rstrip("/") or value


@contextlib.contextmanager
def _launch_noise_dropped() -> Iterator[None]:
    """While open, the standard error a child process inherits is a pipe into a thread that passes on all
    but `_LAUNCH_NOISE` lines to the real standard error: the driver JVM started meanwhile keeps that pipe
    for its lifetime. Partial lines (a progress bar's carriage returns) pass on at once."""
    try:
        sys.stderr.flush()
        real = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2 (an embedding host): nothing to filter
        yield
        return
    read_end, write_end = os.pipe()
    threading.Thread(target=forward_stderr, args=(read_end, real), name="spark-stderr", daemon=True).start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)


def forward_stderr(read_end: int, out: int) -> None:
    """Copy what is written to the pipe `read_end` to the descriptor `out`, whole lines at a time, without the
    JVM's launch noise (a progress line, ending in a carriage return, goes as it comes); until the pipe closes."""
    pending = b""
    while chunk := os.read(read_end, 65536):
        *lines, pending = (pending + chunk).split(b"\n")
        kept = b"".join(line + b"\n" for line in lines if not _LAUNCH_NOISE.match(line))
        if b"\r" in pending:
            kept, pending = kept + pending, b""
        if kept:
            with contextlib.suppress(OSError):
                os.write(out, kept)
    if pending:
        with contextlib.suppress(OSError):
            os.write(out, pending)
