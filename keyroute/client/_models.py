"""What the client reads and returns: `Answer` (one HTTP answer, whichever wire carried it), `Value` (a key's
value as read) and the bodies of answers (JSON or Avro)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs

import httpx
import orjson

from keyroute.formats.avro_answers import AVRO, decode_answer


class Answer:
    """One HTTP answer as the client's decisions read it: `status_code`, its head (`head`: the header lines as
    received, each after a CRLF, ending with one), the body (`content`, any content coding undone) and the
    target it answers (path and query, as sent). Made by the client's own wires, or from an httpx response
    (`of_httpx`: a caller's transport). Headers are looked up in the head as it came, not parsed into a
    mapping first: a read looks up four or five."""

    __slots__ = ("content", "head", "lowered", "status_code", "target")

    def __init__(self, status_code: int, head: bytes, content: bytes, target: str) -> None:
        self.status_code = status_code
        self.head = head
        self.lowered = head.lower()  # the same length: offsets found in it hold in `head`
        self.content = content
        self.target = target

    @classmethod
    def of_httpx(cls, response: httpx.Response) -> Answer:
        return cls(
            response.status_code,
            head_of(response.headers.raw),
            response.content,
            response.request.url.raw_path.decode("ascii"),
        )

    def raw(self, name: bytes) -> bytes | None:
        """The value of header `name` (lower-case) as bytes, None when the answer has none (the first, when
        it has several)."""
        lowered = self.lowered
        at = lowered.find(b"\r\n" + name + b":")
        if at < 0:
            return None
        start = at + len(name) + 3
        return self.head[start : lowered.find(b"\r\n", start)].strip()

    def header(self, name: str) -> str | None:
        """The value of header `name` (lower-case), None when the answer has none."""
        value = self.raw(name.encode("ascii"))
        return None if value is None else value.decode("latin-1")

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    @property
    def reason_phrase(self) -> str:
        try:
            return HTTPStatus(self.status_code).phrase
        except ValueError:
            return ""

    @property
    def path(self) -> str:
        """The request's path, percent-encoded as sent."""
        return self.target.partition("?")[0]

    @property
    def params(self) -> dict[str, list[str]]:
        """The request's query parameters."""
        return parse_qs(self.target.partition("?")[2], keep_blank_values=True)

    def __repr__(self) -> str:
        return f"<Answer {self.status_code} to {self.target}>"


def head_of(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A head as `Answer` holds it, of (name, value) pairs."""
    return b"".join([b"\r\n" + name + b": " + value for name, value in headers]) + b"\r\n"


@dataclass(frozen=True, slots=True)
class Value:
    """A key's value as read: where it came from, and for a live store the offset it reflects."""

    store: str
    key: str
    partition: int
    version: int
    value: Any
    node: str | None = None
    offset: int | None = None


_AVRO = AVRO.encode("ascii")


def body_of(answer: Answer) -> Any:
    """A read's answer as the dict its JSON parses to, whether it came as JSON or as Avro (the same values)."""
    if b"avro" in answer.lowered:  # else no content type of the answer can be Avro's
        kind = answer.raw(b"content-type") or b""
        if kind.startswith(_AVRO) or kind.split(b";", 1)[0].endswith(b"+avro"):
            return decode_answer(answer.content)
    return loads(answer.content)


# A run of 19 digits or more: an integer orjson may not hold (it reads one beyond 64 bits as a float).
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def loads(text: bytes) -> Any:
    """The values of a JSON text exactly as `json.loads` gives them: orjson's (several times faster) unless
    the text has a number it may not hold as the standard library does, or anything orjson refuses (NaN,
    a lone surrogate)."""
    if _LONG_DIGITS.search(text) is None:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return json.loads(text)


def value_of_answer(answer: Answer) -> Value:
    """The Value a key read's answer carries (its node and, for a live store, its offset from the headers)."""
    body = body_of(answer)
    offset = body.get("offset")
    if offset is None:
        offset = answer.header("x-keyroute-offset")
    return value_of(body, answer.header("x-keyroute-node"), offset)


def value_of(body: Mapping[str, Any], node: str | None, offset: Any) -> Value:
    return Value(
        str(body["store"]),
        str(body["key"]),
        int(body["partition"]),
        int(body["version"]),
        body["value"],
        node,
        None if offset is None else int(offset),
    )
