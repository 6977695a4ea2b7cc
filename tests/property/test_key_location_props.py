"""One way to locate a key: every place that locates one gives what the definition gives.

The definition is `StoreLocator.locate_key` (keyroute.keys.key_location): the partitioner's hash of the key's
serialized bytes and the partition of that hash (keyroute.keys.partitioner, itself cross-checked against
Kafka's clients in test_partitioner_props.py). The copies pinned to it here: `StoreLocator.locate` and
`serving_of` (which hash string keys inline), `PartitionMap.locate` (a node's reads and admin route), the
router's `RoutingTable`, and the router's read path, which hashes plain keys inline (`Proxy.read`: the node
it sends a read to is the one serving the definition's partition).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from hypothesis import example, given, settings
from hypothesis import strategies as st

from keyroute.cluster.partition_map import PartitionMap
from keyroute.http.upstream import UpstreamResponse
from keyroute.keys.key_format import KeyFormat, parse_key
from keyroute.keys.key_location import StoreLocator
from keyroute.keys.partitioner import Partitioner, key_hash, partition_for
from keyroute.router.proxy import HedgeSettings, Proxy
from keyroute.router.routing_table import RoutingTable
from tests.unit.router.fakes import build_map, read_result, store_record

STORE = "s"
partitioners = st.sampled_from(list(Partitioner))
# Small counts are where real stores live; a locator holds a tuple per partition, so the largest are not tried
# here (the partitioner's own properties try the whole int32 range).
partition_counts = st.integers(1, 64) | st.integers(1, 50_000)
string_keys = st.text(max_size=40) | st.text(alphabet=st.characters(max_codepoint=0x7F), max_size=40)
int_keys = st.integers(-(1 << 63), (1 << 63) - 1).map(str)
stores = st.one_of(
    st.tuples(st.just(KeyFormat.STRING), partitioners, partition_counts, st.lists(string_keys, max_size=20)),
    st.tuples(st.just(KeyFormat.INT64), partitioners, partition_counts, st.lists(int_keys, max_size=20)),
)


def _map(key_format: KeyFormat, partitioner: Partitioner, partitions: int, served: bool) -> PartitionMap:
    """A map of one store; `served`: each partition p served by its own node, n<p>."""
    record = store_record(STORE, partitions, key_format, partitioner)
    serving = {f"n{p}": {STORE: [p]} for p in range(partitions)} if served else {}
    return build_map([record], serving)


def _definition(key_format: KeyFormat, partitioner: Partitioner, partitions: int, text: str) -> tuple[int, int]:
    data = parse_key(key_format, text).data
    return key_hash(partitioner, data), partition_for(partitioner, data, partitions)


# The common kind, which locators and the router hash inline, always tried (half the keys' hashes have bit 31
# set: a sign slip moves them, but for partition counts that are powers of two).
PLAIN = (KeyFormat.STRING, Partitioner.MURMUR2, 3, [f"k{i}" for i in range(10)] + ["東京", ""])


@settings(max_examples=300, deadline=None)
@given(stores)
@example(PLAIN)
def test_every_locator_gives_the_definition_s_hash_and_partition(
    store: tuple[KeyFormat, Partitioner, int, list[str]],
) -> None:
    key_format, partitioner, partitions, texts = store
    m = _map(key_format, partitioner, partitions, served=False)
    locator = StoreLocator.of_map(m, STORE)
    assert locator is not None and m.locator(STORE) == locator
    table = RoutingTable.of(m)
    record = m.stores[STORE]
    for text in texts:
        hash_value, partition = _definition(key_format, partitioner, partitions, text)
        key = parse_key(key_format, text)
        for location in (
            locator.locate_key(key),
            locator.locate(text),
            m.locate(record, key),
            table.locate(STORE, text),
        ):
            assert (location.hash, location.partition, location.key) == (hash_value, partition, key.text), text
        assert locator.serving_of(text)[0] == partition and table.serving_of(STORE, text)[0] == partition


class _Recorder:
    """An `Upstream` that answers every read 200 at once and keeps the URLs asked."""

    def __init__(self) -> None:
        self.urls: list[str] = []

    async def get(self, url: str, headers: Mapping[str, str]) -> UpstreamResponse:
        self.urls.append(url)
        return UpstreamResponse(200, [(b"content-type", b"application/json")], b"{}")

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        raise AssertionError("no batch here")

    async def aclose(self) -> None:
        pass


@settings(max_examples=100, deadline=None)
@given(
    st.one_of(
        st.tuples(st.just(KeyFormat.STRING), partitioners, st.integers(1, 24), st.lists(string_keys, max_size=12)),
        st.tuples(st.just(KeyFormat.INT64), partitioners, st.integers(1, 24), st.lists(int_keys, max_size=12)),
    )
)
@example(PLAIN)
def test_the_router_sends_each_read_to_the_node_serving_the_definition_s_partition(
    store: tuple[KeyFormat, Partitioner, int, list[str]],
) -> None:
    key_format, partitioner, partitions, texts = store
    upstream = _Recorder()
    proxy = Proxy(upstream, on_stale_map=lambda: None, hedge=HedgeSettings(after_s=0))
    proxy.install(RoutingTable.of(_map(key_format, partitioner, partitions, served=True)))

    async def read_all() -> None:
        for text in texts:
            outcome = await read_result(proxy, STORE, text)
            assert not isinstance(outcome, Exception), outcome

    asyncio.run(read_all())
    assert len(upstream.urls) == len(texts)
    for text, url in zip(texts, upstream.urls, strict=True):
        partition = _definition(key_format, partitioner, partitions, text)[1]
        assert url.startswith(f"http://n{partition}:8000/"), (text, url)
