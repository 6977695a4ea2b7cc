"""A node's multi-store read of one key (keyroute.state_node.multi_read): the values it holds are written
straight from their stored bytes (`_held_entry`), byte for byte what the plain way gives (`read_key` with
`_found`, then `_entry_here`), and the whole answer is the plain way's entries in the path's order, whatever
the mix of stores (strings hashed with murmur2, integer keys, a time to live, live, unknown, a key not found)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from keyroute.api import ApiError
from keyroute.cluster.partition_map import Assignment, NodeRecord, PartitionMap, ServingRecord, StoreRecord
from keyroute.http.admission import Admission
from keyroute.http.exchange import Request
from keyroute.http.multi_store import error_entry_bytes, json_text, key_answer
from keyroute.keys.key_format import KeyFormat, KeyFormatError, parse_key
from keyroute.keys.key_location import StoreLocator
from keyroute.keys.partitioner import Partitioner
from keyroute.runtime.metrics import KIND_KEY
from keyroute.runtime.settings import NodeSettings
from keyroute.state_node.app import Node
from keyroute.state_node.dataplane import NodeDataPlane
from keyroute.state_node.multi_read import _entry_here, _found, _held_entry
from keyroute.state_node.reads import read_key
from keyroute.storage.ttl import Ttl

P = 4
ME, OTHER = "n1", "n2"
URLS = {ME: "http://n1.test:1", OTHER: "http://n2.test:2"}
COLUMNS = ("v", "at")
# Stores of every kind a multi-store read meets; "elsewhere" is served by another node only.
RECORDS = {
    "a": StoreRecord("a", P, Partitioner.MURMUR2, KeyFormat.STRING, 3, "/nowhere", COLUMNS),
    "b": StoreRecord("b", P, Partitioner.MURMUR2, KeyFormat.STRING, 5, "/nowhere", COLUMNS),
    "live": StoreRecord("live", P, Partitioner.MURMUR2, KeyFormat.STRING, 2, "/nowhere", COLUMNS, live=True),
    "ints": StoreRecord("ints", P, Partitioner.MURMUR2, KeyFormat.INT64, 1, "/nowhere", COLUMNS),
    "ttl": StoreRecord(
        "ttl", P, Partitioner.MURMUR2, KeyFormat.STRING, 1, "/nowhere", COLUMNS, ttl=Ttl.parse("1 hour", "at")
    ),
}
NOW_S = 1_700_000_000.0
HERE = ("a", "b", "live", "ints", "ttl")


class Live:
    """A live partition as the read path sees it: the offset applied, the lag."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.lag_records = 3


class Held:
    def __init__(self, version: int, rows: dict[bytes, bytes], live: Live | None = None) -> None:
        self.version = version
        self.rows = rows
        self.live = live

    def get(self, key: bytes) -> bytes | None:
        return self.rows.get(key)


class Ownership:
    def __init__(self, m: PartitionMap, held: dict[tuple[str, int], Held]) -> None:
        self.map = m
        self.held = held
        self.leaving = False

    def local(self, store: str, partition: int) -> Held | None:
        return self.held.get((store, partition))


class Exchange:
    """What the data plane uses of a server's exchange (a stand-in the compiled build accepts)."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self._on_done: Any = None
        self.answers: list[tuple[int, list[tuple[bytes, bytes]], bytes]] = []
        self.gone = False
        self.transport = None

    def on_done(self, callback: Any) -> None:
        self._on_done = callback

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.answers.append((status, headers, body))
        if self._on_done is not None:
            self._on_done()


def partition_of(store: str, text: str) -> int:
    record = RECORDS[store]
    return PartitionMap.empty().locate(record, parse_key(record.key_format, text)).partition


def node_of(
    rows: dict[str, dict[str, bytes]],
    node_id: str = ME,
    newer_elsewhere: frozenset[str] = frozenset(),
    offset: int = 17,
) -> Node:
    """A node holding every partition of the stores of HERE (those of `newer_elsewhere` at the version before
    the one another node serves), `rows` per store (key text -> stored value)."""
    serving = {node_id: {s: dict.fromkeys(range(P), RECORDS[s].version) for s in HERE}}
    serving[OTHER] = {s: dict.fromkeys(range(P), RECORDS[s].version) for s in newer_elsewhere}
    urls = {node_id: URLS[ME], OTHER: URLS[OTHER]}
    m = PartitionMap.build(
        RECORDS,
        {n: NodeRecord(n, url) for n, url in urls.items()},
        Assignment(1, {}),
        {n: ServingRecord(n, urls[n], s) for n, s in serving.items()},
        generation=99,
    )
    held: dict[tuple[str, int], Held] = {}
    for store in HERE:
        for p in range(P):
            live = Live(offset) if RECORDS[store].live else None
            older = store in newer_elsewhere  # this node still holds the version before the one served
            held[(store, p)] = Held(RECORDS[store].version - older, {}, live)
        for text, value in rows.get(store, {}).items():
            record = RECORDS[store]
            held[(store, partition_of(store, text))].rows[parse_key(record.key_format, text).data] = value
    settings = NodeSettings(node_id=node_id, data_dir=None)  # type: ignore[arg-type]
    return Node(settings, Ownership(m, held), None, clock=lambda: NOW_S)  # type: ignore[arg-type]


def plain_entry(node: Node, store: str, key: str, forwarded: bool = False) -> bytes:
    """A store's entry the plain way: `read_key` with `_found`, then `_entry_here` (or the entry of the error
    it raises)."""
    try:
        answer = read_key(node, store, key, forwarded, None, found=_found)
    except ApiError as exc:
        return error_entry_bytes(key, exc)
    assert type(answer) is tuple
    return _entry_here(key, json_text(key), answer, node.node_header[1])


def handle(plane: NodeDataPlane, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> Any:
    exchange = Exchange(Request("GET", path.encode(), b"", headers or [], b"", "r1", "1.1"))
    plane.handle(exchange)
    assert len(exchange.answers) == 1
    return exchange.answers[0]


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
).map(lambda v: json.dumps({"v": v}, ensure_ascii=False).encode())
keys = st.text(max_size=12)
node_ids = st.text(st.characters(min_codepoint=33, max_codepoint=0xFF, exclude_characters=","), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=keys,
    value=values,
    store=st.sampled_from(("a", "b", "live")),
    node_id=node_ids,
    offset=st.integers(-1, 2**62),
    forwarded=st.booleans(),
)
@example(key="ключ \"q\" \\ \u2028", value=b'{"v": [1, 2.50, "x"]}', store="live", node_id="n\u00e9", offset=0,
         forwarded=False)  # fmt: skip
def test_a_held_value_is_written_byte_for_byte_as_the_plain_way_writes_it(
    key: str, value: bytes, store: str, node_id: str, offset: int, forwarded: bool
) -> None:
    node = node_of({store: {key: value}}, node_id=node_id, offset=offset)
    locator = StoreLocator.of_map(node.ownership.map, store)
    assert locator is not None and locator.plain
    head = b'{"node":%s,' % json_text(node_id)
    before = node.metrics.local_answers
    fast = _held_entry(node, store, locator, key.encode(), json_text(key), head, node_id, forwarded)
    assert fast is not None
    assert node.metrics.local_answers == before + 1
    assert fast == plain_entry(node, store, key, forwarded)
    assert json.loads(fast)["value"] == json.loads(value)


@settings(max_examples=60, deadline=None)
@given(key=keys, store=st.sampled_from(("a", "live")))
def test_what_is_not_a_held_value_is_left_to_the_plain_way_with_nothing_counted(key: str, store: str) -> None:
    cases = {
        "not found": node_of({}),
        "served newer elsewhere": node_of({store: {key: b"{}"}}, newer_elsewhere=frozenset({store})),
    }
    for node in cases.values():
        locator = StoreLocator.of_map(node.ownership.map, store)
        assert locator is not None
        head = b'{"node":"n1",'
        assert _held_entry(node, store, locator, key.encode(), json_text(key), head, ME, False) is None
        assert node.metrics.local_answers == 0
    not_held = node_of({store: {key: b"{}"}})
    del not_held.ownership.held[(store, partition_of(store, key))]  # type: ignore[attr-defined]
    assert _held_entry(not_held, store, locator, key.encode(), json_text(key), b"{", ME, False) is None


def int_text(key: str) -> str | None:
    try:
        return parse_key(KeyFormat.INT64, key).text
    except KeyFormatError:
        return None


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=st.text(st.characters(codec="utf-8", exclude_characters="/%?#"), max_size=10) | st.integers(-50, 50).map(str),
    stores=st.lists(st.sampled_from((*HERE, "nosuch")), min_size=1, max_size=6, unique=True),
    present=st.sets(st.sampled_from(HERE)),
    fresh=st.booleans(),
    value=values,
)
def test_a_multi_store_answer_is_the_plain_ways_entries_in_the_paths_order(
    key: str, stores: list[str], present: set[str], fresh: bool, value: bytes
) -> None:
    at_ms = int(NOW_S * 1000) - (0 if fresh else 2 * 3600 * 1000)  # "ttl" is 1 hour: fresh, or expired
    stored = json.dumps({"v": json.loads(value)["v"], "at": at_ms}).encode()
    node = node_of({store: {key: stored} for store in present if store != "ints" or int_text(key) is not None})
    plane = NodeDataPlane(node, Admission())
    status, headers, body = handle(plane, f"/stores/{','.join(stores)}/read/{key}")
    assert status == 200
    header = dict(headers)
    assert header[b"x-keyroute-hops"] == b"0"
    assert header[b"x-keyroute-generation"] == b"99"
    assert header[b"x-keyroute-node"] == ME.encode()
    assert body == key_answer(key, [(store, plain_entry(node, store, key)) for store in stores])
    shown = json.loads(body)["stores"]
    assert list(shown) == stores
    for store in present & set(stores):
        if store == "ttl" and not fresh:
            assert shown[store]["error"] == "expired"
        elif store != "ints" or int_text(key) is not None:
            assert shown[store]["status"] == 200
            assert shown[store]["value"] == json.loads(stored)


def test_each_store_read_is_counted_once_with_its_status() -> None:
    node = node_of({"a": {"k": b'{"v":1}'}, "live": {"k": b'{"v":2}'}})
    counted: list[tuple[str, str, int]] = []

    class Counting(NodeDataPlane):  # an interpreted subclass: the compiled class takes no new attribute
        pass

    plane = Counting(node, Admission())
    plane.count = lambda store, kind, status: counted.append((store, kind, status))  # type: ignore[method-assign]
    status, _, body = handle(plane, "/stores/a,b,live,nosuch/read/k")
    assert status == 200
    assert sorted(counted) == sorted(
        [("a", KIND_KEY, 200), ("b", KIND_KEY, 404), ("live", KIND_KEY, 200), ("nosuch", KIND_KEY, 404)]
    )
    assert node.metrics.local_answers == 3  # a, live found; b's partition answered here, its key not found
    entries = json.loads(body)["stores"]
    assert entries["live"]["offset"] == 17 and "offset" not in entries["a"]


def test_the_same_path_read_again_after_the_map_changed_reads_the_new_map() -> None:
    node = node_of({"a": {"k": b'{"v":1}'}})
    plane = NodeDataPlane(node, Admission())
    assert json.loads(handle(plane, "/stores/a,b/read/k")[2])["stores"]["a"]["version"] == 3
    # a map where another node serves a newer version of "a": the read of it is no longer answered here
    node.ownership = node_of({"a": {"k": b'{"v":1}'}}, newer_elsewhere=frozenset({"a"})).ownership
    locator = StoreLocator.of_map(node.ownership.map, "a")
    assert locator is not None
    assert _held_entry(node, "a", locator, b"k", b'"k"', b"{", ME, False) is None
    answer = read_key(node, "a", "k", False)
    assert type(answer) is not tuple  # passed on, as the multi-store read would


@pytest.mark.parametrize("stores", ["a,,b", "a,a", ",".join(["a"] * 17)])
def test_a_malformed_list_of_stores_is_the_requests_400(stores: str) -> None:
    plane = NodeDataPlane(node_of({}), Admission())
    status, _, body = handle(plane, f"/stores/{stores}/read/k")
    assert status == 400
    assert json.loads(body)["error"] == "bad_request"
