"""Log output for every keyroute process (text for a terminal, JSON lines for Kubernetes) and request ids.

A request's id (the client's `X-Request-ID` when acceptable, else a new one) lives in a context variable
while the request is handled, so every log line about it carries `request_id` without being passed along.
"""

from __future__ import annotations

import contextvars
import itertools
import json
import logging
import secrets
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import IO, Any

FORMATS = ("text", "json")

# The id of the request being handled on this task, if any.
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("keyroute_request_id", default=None)
# Where an app keeps the request's id in the ASGI scope, for its error handlers.
SCOPE_REQUEST_ID = "keyroute.request_id"
MAX_REQUEST_ID_CHARS = 128

# New ids: a random per-process prefix and a counter; unique across processes, and cheaper than uuid4.
_PREFIX = secrets.token_hex(6)
_SEQUENCE = itertools.count(1)

# Attributes every LogRecord has: anything else on a record came from `extra=` and is logged as a field.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
    "request_id",
}


# `new_request_id()`: the prefix and the next number in hex. Made of C-level callables (a bound `%` mapped over
# the counter; `%x` is a fifth cheaper than `format`'s `{:x}`): a new id costs no Python frame, once per request
# that comes without one.
new_request_id: Callable[[], str] = map(f"{_PREFIX}-%x".__mod__, _SEQUENCE).__next__
# The same ids for a compiled caller that makes them itself (keyroute.http.protocol: REQUEST_ID_PREFIX and the
# hex digits of next(REQUEST_ID_NUMBERS), cheaper there than a call of new_request_id): one sequence, so
# every id this process makes is new.
REQUEST_ID_PREFIX = f"{_PREFIX}-"
REQUEST_ID_NUMBERS = _SEQUENCE


def acceptable_request_id(value: str | None) -> bool:
    """1 to 128 visible ASCII characters (no spaces or control characters: it goes into headers and logs)."""
    return (
        value is not None
        and 0 < len(value) <= MAX_REQUEST_ID_CHARS
        and value.isascii()
        and value.isprintable()
        and " " not in value
    )


def bind_request_id(scope: MutableMapping[str, Any], supplied: str | None) -> str:
    """The id of the request with ASGI `scope`: the one already bound, the client's `supplied` one when
    acceptable, else a new one. Kept in the scope (error handlers answer with it) and in REQUEST_ID."""
    request_id: str | None = scope.get(SCOPE_REQUEST_ID)
    if request_id is None:
        request_id = supplied if supplied is not None and acceptable_request_id(supplied) else new_request_id()
        scope[SCOPE_REQUEST_ID] = request_id
    REQUEST_ID.set(request_id)
    return request_id


def _request_id(record: logging.LogRecord) -> str | None:
    explicit: str | None = getattr(record, "request_id", None)
    return explicit or REQUEST_ID.get()


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, then request_id, the fixed `fields` (node, service)
    and anything passed with `extra=`; exc and stack when the record has them."""

    def __init__(self, fields: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self._fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = _request_id(record)
        if request_id:
            out["request_id"] = request_id
        out.update(self._fields)
        for name, value in record.__dict__.items():
            if name not in _RECORD_ATTRS and not name.startswith("_"):
                out[name] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        # Newlines inside values are escaped by JSON: one record is always one line.
        return json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message`, with ` [request_id=...]` when the line is about a request."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        line = super().formatMessage(record)
        request_id = _request_id(record)
        return f"{line} [request_id={request_id}]" if request_id else line


def _timestamp(created: float) -> str:
    seconds = int(created)
    millis = int((created - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def configure(
    format: str = "text",
    level: str | int = "INFO",
    *,
    fields: Mapping[str, Any] | None = None,
    stream: IO[str] | None = None,
) -> logging.Handler:
    """Send every log record to `stream` (stderr) as text or JSON lines; replaces the root's handlers.

    `fields` are added to every JSON line (the node id, say). Returns the handler installed.
    """
    if format not in FORMATS:
        raise ValueError(f"log format {format!r}: expected one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter(fields) if format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO) if isinstance(level, str) else level)
    # kazoo logs every connection state change at INFO; warnings and errors are what an operator needs.
    logging.getLogger("kazoo").setLevel(logging.WARNING)
    # httpx (key fetches, the Kubernetes API) and httpx2 (the Schema Registry client) log every request at INFO:
    # noise beside keyroute's own lines, shown only when debugging.
    for name in _PER_REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if root.level <= logging.DEBUG else logging.WARNING)
    # Of those warnings, the ones per connection retry (every ~2 s while ZooKeeper is away) are debug: the
    # map watcher says each loss and return once (keyroute.cluster.map_watcher). On the handler, so that the
    # loggers' own filters (keyroute.cluster.zk keeps the last reason while connecting) still see them.
    handler.addFilter(_kazoo_retries)
    return handler


# HTTP client libraries that log one INFO line per request.
_PER_REQUEST_LOGGERS = ("httpx", "httpx2")


# kazoo's warnings on each failed attempt to (re)connect.
_RETRY_WARNINGS = ("Connection dropped: ", "Connection time-out: ", "Transition to CONNECTING", "Cannot resolve ")


def _kazoo_retries(record: logging.LogRecord) -> bool:
    """kazoo's per-retry warnings as debug records: kept only when the root logs debug."""
    if record.levelno != logging.WARNING or record.name != "kazoo.client":
        return True
    if not str(record.msg).startswith(_RETRY_WARNINGS):
        return True
    record.levelno, record.levelname = logging.DEBUG, "DEBUG"
    return logging.getLogger().isEnabledFor(logging.DEBUG)


def describe(exc: BaseException) -> str:
    """A failure as a log line names it: the exception's text, or its class name when the text is empty (kazoo's
    `ConnectionLoss()` and `KazooTimeoutError()`, asyncio's `TimeoutError()`), so no line reads "failed: " or
    "failed ()". Every line that reports a caught failure formats it with this."""
    text = str(exc).strip()
    return text or type(exc).__name__
