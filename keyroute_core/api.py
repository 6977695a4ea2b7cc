"""The HTTP data API shared by routers and nodes: header names, error codes, answer bodies.

    ApiError                       status + code + human message (+ headers); rendered as JSON
     ├── StoreNotFound             404 store_not_found
     ├── KeyNotFound               404 key_not_found
     ├── BadKey                    400 bad_key (does not fit the store's key format)
     ├── BadRequest                400 bad_request
     ├── NotFound                  404 not_found (no such route)
     ├── PayloadTooLarge           413 too_many_keys
     ├── BodyTooLarge              413 body_too_large
     └── PartitionUnavailable      503 partition_unavailable, with Retry-After
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote_to_bytes

HEADER_PARTITION = "x-keyroute-partition"
HEADER_NODE = "x-keyroute-node"
HEADER_VERSION = "x-keyroute-version"
HEADER_HOPS = "x-keyroute-hops"
HEADER_GENERATION = "x-keyroute-generation"
HEADER_FORWARDED_BY = "x-keyroute-forwarded-by"
HEADER_REQUEST_ID = "x-request-id"
# Set by routers on requests to nodes: the node may still forward once (the router's view may be stale).
HEADER_ROUTER = "x-keyroute-router"

KEYS_PREFIX = "/stores/"


class ApiError(Exception):
    status = 500
    code = "internal_error"

    def __init__(self, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message}


class StoreNotFound(ApiError):
    status = 404
    code = "store_not_found"


class KeyNotFound(ApiError):
    status = 404
    code = "key_not_found"


class BadKey(ApiError):
    status = 400
    code = "bad_key"


class BadRequest(ApiError):
    status = 400
    code = "bad_request"


class PayloadTooLarge(ApiError):
    status = 413
    code = "too_many_keys"


class NotFound(ApiError):
    status = 404
    code = "not_found"


class BodyTooLarge(ApiError):
    status = 413
    code = "body_too_large"


class PartitionUnavailable(ApiError):
    status = 503
    code = "partition_unavailable"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, {"Retry-After": str(retry_after_s)})


def error_json(code: str, message: str) -> bytes:
    return json.dumps({"error": code, "message": message}, ensure_ascii=False).encode("utf-8")


def key_path_segment(raw_path: bytes) -> tuple[str, str] | None:
    """(store, key) from the raw request path `/stores/{store}/keys/{key}`, or None if it is not one.

    The raw path is used because servers percent-decode `path`, which would turn a key's `%2F` into a
    separator. Raises BadKey when the key's percent-encoding is not UTF-8.
    """
    parts = raw_path.split(b"/")
    if len(parts) != 5 or parts[0] != b"" or parts[1] != b"stores" or parts[3] != b"keys" or not parts[2]:
        return None
    try:
        store = unquote_to_bytes(parts[2]).decode("utf-8")
        key = unquote_to_bytes(parts[4]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadKey("the key is not valid UTF-8 after percent-decoding") from exc
    return store, key


def found_body(store: str, key: str, partition: int, version: int, value_json: bytes) -> bytes:
    """The 200 answer, built around the stored value bytes so the value is never re-parsed."""
    head = json.dumps(
        {"store": store, "key": key, "partition": partition, "version": version}, ensure_ascii=False
    ).encode("utf-8")
    return head[:-1] + b', "value": ' + value_json + b"}"
