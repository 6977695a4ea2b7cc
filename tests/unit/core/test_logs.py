"""Log output: one JSON object per line with request ids and extra fields; request-id validation; how a failure
is named in a log line."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.exceptions import ConnectionLoss
from kazoo.handlers.threading import KazooTimeoutError

from keyroute.runtime.logs import (
    REQUEST_ID,
    SCOPE_REQUEST_ID,
    JsonFormatter,
    acceptable_request_id,
    bind_request_id,
    configure,
    describe,
    new_request_id,
)


@pytest.fixture
def restore_root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    text = stream.getvalue()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_json_lines_carry_fields_extra_request_id_and_exceptions(restore_root_logging: None) -> None:
    stream = io.StringIO()
    configure("json", "DEBUG", fields={"service": "node", "node": "n1"}, stream=stream)
    log = logging.getLogger("keyroute.test")

    log.info("loaded %s (%d rows)", "bookings p3", 12, extra={"store": "bookings", "partition": 3})
    token = REQUEST_ID.set("req-42")
    try:
        log.warning("forwarding a read to node %s failed:\n%s", "n2", "ConnectError")
    finally:
        REQUEST_ID.reset(token)
    try:
        raise ValueError("bad snapshot")
    except ValueError:
        log.exception("loading failed", extra={"request_id": "explicit"})
    logging.getLogger("keyroute.quiet").debug("detail")

    first, second, third, fourth = lines(stream)  # a newline inside a message stays inside its line
    assert first["msg"] == "loaded bookings p3 (12 rows)"
    assert first["level"] == "INFO" and first["logger"] == "keyroute.test"
    assert first["store"] == "bookings" and first["partition"] == 3
    assert first["node"] == "n1" and first["service"] == "node"
    assert "request_id" not in first
    assert first["ts"].endswith("Z") and first["ts"][10] == "T"
    assert second["request_id"] == "req-42" and second["msg"].endswith("failed:\nConnectError")
    assert third["level"] == "ERROR" and third["request_id"] == "explicit"
    assert third["exc"].startswith("Traceback") and "ValueError: bad snapshot" in third["exc"]
    assert fourth["level"] == "DEBUG"


def test_text_lines_name_the_request(restore_root_logging: None) -> None:
    stream = io.StringIO()
    configure("text", "INFO", stream=stream)
    log = logging.getLogger("keyroute.test")
    log.debug("not shown")
    token = REQUEST_ID.set("req-7")
    try:
        log.warning("node n2 failed")
    finally:
        REQUEST_ID.reset(token)
    log.info("plain")
    out = stream.getvalue().splitlines()
    assert len(out) == 2
    assert out[0].endswith("WARNING keyroute.test: node n2 failed [request_id=req-7]")
    assert out[1].endswith("INFO keyroute.test: plain")


def test_configure_rejects_unknown_formats_and_replaces_handlers(restore_root_logging: None) -> None:
    with pytest.raises(ValueError, match="log format"):
        configure("xml")
    first = configure("json", stream=io.StringIO())
    second = configure("json", stream=io.StringIO())
    assert logging.getLogger().handlers == [second] and first is not second


def test_formatter_output_is_a_single_json_line_for_any_value() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "odd %s", ("\u2028\n\x00",), None)
    record.path = object()  # not JSON: logged as its text
    out = JsonFormatter().format(record)
    assert "\n" not in out
    assert json.loads(out)["msg"] == "odd \u2028\n\x00"


def test_request_ids_are_validated_or_generated() -> None:
    assert acceptable_request_id("abc-123_ÄÖ") is False  # not ASCII
    assert acceptable_request_id("a" * 128) and not acceptable_request_id("a" * 129)
    assert not acceptable_request_id("") and not acceptable_request_id(None)
    assert not acceptable_request_id("two words") and not acceptable_request_id("tab\there")
    assert acceptable_request_id("0f8fad5b-d9cb-469f-a165-70867728950e")

    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(acceptable_request_id(i) for i in ids)

    async def handle(supplied: str | None) -> tuple[str, str, str | None]:
        scope: dict[str, Any] = {}
        bound = bind_request_id(scope, supplied)
        again = bind_request_id(scope, "something else")  # an error handler later: the same id
        return bound, again, REQUEST_ID.get()

    async def both() -> list[tuple[str, str, str | None]]:
        return list(await asyncio.gather(handle("client-id"), handle("bad\nid"), handle(None)))

    (kept, kept_again, kept_ctx), (replaced, _, _), (made, _, _) = asyncio.run(both())
    assert kept == kept_again == kept_ctx == "client-id"
    assert replaced != "bad\nid" and acceptable_request_id(replaced)
    assert acceptable_request_id(made) and made != replaced
    assert REQUEST_ID.get() is None  # each request's id stays in its own task
    assert SCOPE_REQUEST_ID.startswith("keyroute.")


def test_kazoos_per_retry_warnings_are_debug_records(restore_root_logging: None) -> None:
    kazoo = logging.getLogger("kazoo.client")
    out = io.StringIO()
    configure("text", "INFO", stream=out)
    kazoo.warning("Connection dropped: %s", "socket connection error: Connection refused")
    kazoo.warning("Connection time-out: %s", "timed out")
    kazoo.warning("Transition to CONNECTING")
    kazoo.warning("Session has expired")  # not a retry: kept
    assert [line.split(" ", 3)[2:] for line in out.getvalue().splitlines()] == [
        ["WARNING", "kazoo.client: Session has expired"]
    ]
    debug = io.StringIO()
    configure("text", "DEBUG", stream=debug)
    kazoo.warning("Connection dropped: %s", "socket connection error: Connection refused")
    assert " DEBUG kazoo.client: Connection dropped: socket connection error" in debug.getvalue()


@pytest.mark.parametrize(
    ("exc", "named"),
    [
        (ConnectionLoss(), "ConnectionLoss"),
        (KazooTimeoutError(), "KazooTimeoutError"),
        (TimeoutError(), "TimeoutError"),
        (OSError(), "OSError"),
        (ValueError("  "), "ValueError"),
        (ValueError("bad value"), "bad value"),
        (OSError(28, "No space left on device"), "[Errno 28] No space left on device"),
        (KeyError("k"), "'k'"),
    ],
)
def test_a_failure_is_named_by_its_text_or_else_its_class(exc: BaseException, named: str) -> None:
    assert describe(exc) == named


def test_http_clients_request_lines_are_shown_only_when_debugging(restore_root_logging: None) -> None:
    for level, shown in (("INFO", False), ("DEBUG", True)):
        stream = io.StringIO()
        configure("text", level, stream=stream)
        for name in ("httpx", "httpx2"):  # what the key fetches and the Schema Registry client log with
            logging.getLogger(name).info('HTTP Request: GET http://registry/subjects "HTTP/1.1 200 OK"')
            logging.getLogger(name).warning("a retry")
        out = stream.getvalue()
        assert out.count("a retry") == 2
        assert ("HTTP Request" in out) is shown, (level, out)
