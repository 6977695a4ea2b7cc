"""What a quiet build lets through of its driver JVM's standard error: everything but the launcher's start-up
notes, a progress bar's partial lines at once."""

from __future__ import annotations

import os
import threading

from keyroute.pipeline.session import forward_stderr


def test_start_up_notes_are_dropped_and_everything_else_passes_on_progress_bars_at_once() -> None:
    jvm_read, jvm_write = os.pipe()
    out_read, out_write = os.pipe()
    forwarder = threading.Thread(target=forward_stderr, args=(jvm_read, out_write))
    forwarder.start()
    os.write(jvm_write, b"WARNING: Using incubator modules: jdk.incubator.vector\n")
    os.write(jvm_write, b"Using Spark's default log4j profile: org/apache/spark/log4j2-defaults.properties\n")
    os.write(jvm_write, b"2026-11-25 10:00:00 spark ERROR Executor: task 3 failed\nSetting default log level to ")
    os.write(jvm_write, b'"WARN".\n[Stage 1:=====>   (2 + 2) / 8]\r')
    # The partial progress line is passed on before any newline arrives.
    seen = b""
    while not seen.endswith(b"\r"):
        seen += os.read(out_read, 4096)
    os.write(jvm_write, b"[Stage 1:=========>(8 + 0) / 8]\r\nlast words")
    os.close(jvm_write)
    forwarder.join(timeout=5)
    os.close(out_write)
    while chunk := os.read(out_read, 4096):
        seen += chunk
    os.close(out_read)
    os.close(jvm_read)
    assert seen == (
        b"2026-11-25 10:00:00 spark ERROR Executor: task 3 failed\n"
        b"[Stage 1:=====>   (2 + 2) / 8]\r"
        b"[Stage 1:=========>(8 + 0) / 8]\r\n"
        b"last words"
    )
