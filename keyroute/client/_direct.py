"""Direct routing's partition map: a locator per store, from a router's routing view (`GET /routing`) or, from
an older router, its whole partition map (`GET /admin/partition-map?detail=all`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from keyroute.client._urls import key_text
from keyroute.keys.key_format import KeyFormat, KeyFormatError
from keyroute.keys.key_location import Endpoint, KeyLocation, StoreLocator
from keyroute.keys.key_schema import KeySchema
from keyroute.keys.partitioner import Partitioner

PARTITION_MAP_PATH = "/admin/partition-map"
# The routing view (router/map_views.py): compact, versioned, incremental by map generation. A router that
# does not have it (404) is asked for its whole partition map instead, as before.
ROUTING_PATH = "/routing"
ROUTING_FORMAT = 1


class _DirectMap:
    """The partition map as a direct-routing client uses it: its map generation and a locator per store,
    from a router's routing view (`GET /routing`) or, from an older router, its `GET /admin/partition-map`."""

    __slots__ = ("_urls", "map_generation", "stores")

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self._urls: dict[tuple[str, int], tuple[tuple[Endpoint, ...], tuple[str, ...]]] = {}
        self.map_generation = int(doc["generation"])
        self.stores = {name: StoreLocator.of_description(name, store) for name, store in doc["stores"].items()}

    @classmethod
    def of_routing(cls, doc: Mapping[str, Any], previous: _DirectMap | None) -> _DirectMap:
        """The map a routing view gives: its stores replace `previous`'s of the same name; a partial view
        (`since`, or asked for some stores) keeps `previous`'s others that the router still names. Raises
        KeyError, TypeError or ValueError when `doc` is not a routing view this client reads."""
        if int(doc["format"]) != ROUTING_FORMAT:
            raise ValueError(f"routing view format {doc['format']!r}")
        nodes = [(str(node_id), str(url)) for node_id, url in doc["nodes"]]
        stores: dict[str, StoreLocator] = {}
        if previous is not None:
            named = set(doc["store_names"])
            stores = {name: locator for name, locator in previous.stores.items() if name in named}
        by_version: dict[int, list[Endpoint]] = {}
        for name, store in doc["stores"].items():
            stores[name] = _locator_of_routing(name, store, nodes, by_version)
        direct_map = cls.__new__(cls)
        direct_map._urls = {}
        direct_map.map_generation = int(doc["generation"])
        direct_map.stores = stores
        return direct_map

    def urls(self, store: str, key: Any) -> tuple[str, ...]:
        """The URLs of the nodes serving the key's partition, preferred first (none for an unknown store, or
        a key the router must judge)."""
        locator = self.stores.get(store)
        if locator is None:
            return ()
        try:
            partition, serving = locator.serving_of(key_text(key))
        except (KeyFormatError, TypeError):
            return ()
        cached = self._urls.get((store, partition))
        if cached is None or cached[0] is not serving:
            cached = self._urls[store, partition] = (serving, tuple(ep.url for ep in serving))
        return cached[1]

    def locate(self, store: str, key: Any) -> KeyLocation | None:
        """Where the key lives (None: an unknown store, or a key the router must judge)."""
        locator = self.stores.get(store)
        if locator is None:
            return None
        try:
            return locator.locate(key_text(key))
        except (KeyFormatError, TypeError):
            return None


def _locator_of_routing(
    name: str, store: Mapping[str, Any], nodes: list[tuple[str, str]], by_version: dict[int, list[Endpoint]]
) -> StoreLocator:
    """One store of a routing view; `by_version` holds the node table's endpoints per version, shared by
    the stores of one view (a partition's replicas are indices into it)."""

    def at(version: int) -> list[Endpoint]:
        endpoints = by_version.get(version)
        if endpoints is None:
            endpoints = by_version[version] = [Endpoint(node_id, url, version) for node_id, url in nodes]
        return endpoints

    replicas = store["replicas"]
    of_version = at(int(store["version"])).__getitem__
    serving = [tuple(map(of_version, indices)) for indices in replicas]
    for p, v in store.get("versions", {}).items():
        p = int(p)
        if 0 <= p < len(serving):
            serving[p] = tuple(map(at(int(v)).__getitem__, replicas[p]))
    return StoreLocator(
        name,
        int(store["partitions"]),
        Partitioner(store["partitioner"]),
        KeyFormat(store["key_format"]),
        (),
        tuple(serving),
        None if store.get("key_schema") is None else KeySchema.from_dict(store["key_schema"]),
    )
