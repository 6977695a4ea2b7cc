"""Reads of several stores at once (`get_stores`, `get_many_stores`): their plans, run by `Client` and
`AsyncClient` as every other read's.

Through the router, one request: the router reads co-located stores from one node. Direct, each store's key
goes to the node preferred for its partition, the stores that node serves together in one request (all of
them for co-located stores), every node at the same time; what a node does not answer goes to the router.
The answer's stores (`{"stores": {...}}`) become, per store, a `Value` or the `KeyrouteError` its entry says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

import httpx

from keyroute.client._errors import KeyrouteError, error_of_answer, error_of_entry
from keyroute.client._models import Answer, Value, body_of
from keyroute.client._plans import MAP_DUE, Call, Parallel, Plan
from keyroute.client._urls import key_segment, key_text

StoreValues = dict[str, Value | KeyrouteError]
Offsets = Mapping[str, int] | None
Fields = Iterable[str] | str | Mapping[str, Iterable[str] | str] | None
_JSON = {"accept": "application/json"}


def stores_path(stores: Sequence[str], key: Any = None) -> str:
    """/stores/{a,b}/read, and /{key} for one key."""
    path = "/stores/" + ",".join(quote(store, safe="") for store in stores) + "/read"
    return path if key is None else path + "/" + key_segment(key)


def _fields_text(fields: Iterable[str] | str) -> str:
    return fields if isinstance(fields, str) else ",".join(fields)


def stores_params(stores: Sequence[str], min_offset: Offsets, fields: Fields, bounds: bool = True) -> dict[str, str]:
    """The query of a read of `stores`: each store's bound (`min_offset`, a GET's), the projection of every
    store (`fields` a text or a list) or per store (a mapping store -> fields), of those read only."""
    params: dict[str, str] = {}
    if bounds and min_offset:
        offsets = [f"{store}:{offset}" for store, offset in min_offset.items() if store in stores]
        if offsets:
            params["min_offset"] = ",".join(offsets)
    if fields is None:
        return params
    if isinstance(fields, Mapping):
        for store, wanted in fields.items():
            if store in stores:
                params[f"fields.{store}"] = _fields_text(wanted)
    else:
        params["fields"] = _fields_text(fields)
    return params


def value_of_entry(store: str, entry: Mapping[str, Any]) -> Value | KeyrouteError:
    """A store's entry as a Value (found) or the error it says."""
    if entry.get("status") != 200:
        return error_of_entry(entry)
    offset = entry.get("offset")
    return Value(
        store,
        str(entry["key"]),
        int(entry["partition"]),
        int(entry["version"]),
        entry["value"],
        entry.get("node"),
        None if offset is None else int(offset),
    )


def _stores_of(answer: Answer) -> dict[str, Any]:
    if answer.status_code != 200:
        raise error_of_answer(answer)
    stores: dict[str, Any] = body_of(answer)["stores"]
    return stores


def _observe(client: Any, answer: Answer) -> None:
    """A node passed some store on (hops 1): the map is behind, read again."""
    if answer.raw(b"x-keyroute-hops") == b"1":
        client.stats["misroutes"] += 1
        client._reload = True


def _node_plan(client: Any, url: str, method: str, path: str, options: dict[str, Any]) -> Plan[Answer | None]:
    """A node's 200 answer to one request; None when it failed or answered anything else (the router then
    answers for it)."""
    answer = yield Call(url, method, path, options)
    if isinstance(answer, httpx.TransportError):
        client._node_failed(url)
        return None
    _observe(client, answer)
    return answer if answer.status_code == 200 else None  # type: ignore[no-any-return]


# -- one key ----------------------------------------------------------------------------------------------


def get_stores_plan(
    client: Any, key: Any, stores: Sequence[str], min_offset: Offsets, fields: Fields
) -> Plan[StoreValues]:
    stores = tuple(stores)
    if not stores:
        raise ValueError("name at least one store")
    entries: dict[str, Any] = {}
    rest = list(stores)
    if client.routing == "direct":
        if client._map_due():
            yield MAP_DUE
        groups: dict[str, list[str]] = {}
        rest = []
        for store in stores:
            replicas = client._replicas(store, key)
            if replicas:
                groups.setdefault(replicas[0], []).append(store)
            else:
                rest.append(store)
        plans = [_node_stores_plan(client, url, key, group, min_offset, fields) for url, group in groups.items()]
        for group, found in zip(groups.values(), (yield Parallel(plans)), strict=True):
            if found is None:
                rest += group
            else:
                entries.update(found)
        client.stats["direct"] += len(stores) - len(rest)
    if rest:
        client._via_router()
        answer = yield from client._send_plan(
            "GET", stores_path(rest, key), params=stores_params(rest, min_offset, fields), headers=_JSON
        )
        entries.update(_stores_of(answer))
    return {store: value_of_entry(store, entries[store]) for store in stores}


def _node_stores_plan(
    client: Any, url: str, key: Any, stores: list[str], min_offset: Offsets, fields: Fields
) -> Plan[dict[str, Any] | None]:
    """One node's entries for the stores it serves the key's partition of; None when it failed (the router
    then reads them)."""
    options = {"params": stores_params(stores, min_offset, fields), "headers": _JSON}
    answer = yield from _node_plan(client, url, "GET", stores_path(stores, key), options)
    if answer is None:
        return None
    found: dict[str, Any] = body_of(answer)["stores"]
    if any(entry.get("status") == 503 for entry in found.values()):
        return None  # not served there now: the router knows where
    return found


# -- many keys --------------------------------------------------------------------------------------------

Pair = tuple[int, str]  # (index of the key, store)


def get_many_stores_plan(
    client: Any, keys: Iterable[Any], stores: Sequence[str], min_offset: Offsets, fields: Fields
) -> Plan[list[StoreValues]]:
    stores = tuple(stores)
    if not stores:
        raise ValueError("name at least one store")
    texts = [key_text(key) for key in keys]
    entries: list[dict[str, Any]] = [{} for _ in texts]
    rest: list[Pair] = [(i, store) for i in range(len(texts)) for store in stores]
    if client.routing == "direct" and texts:
        yield MAP_DUE
        groups: dict[str, list[Pair]] = {}
        rest = []
        for i, text in enumerate(texts):
            for store in stores:
                replicas = client._replicas(store, text)
                if replicas:
                    groups.setdefault(replicas[0], []).append((i, store))
                else:
                    rest.append((i, store))
        plans = [_pairs_plan(client, url, texts, pairs, min_offset, fields) for url, pairs in groups.items()]
        for pairs, found in zip(groups.values(), (yield Parallel(plans)), strict=True):
            if found is None:
                rest += pairs
                continue
            for i, store in pairs:
                entries[i][store] = found[(texts[i], store)]
        client.stats["direct"] += len(texts) * len(stores) - len(rest)
    if rest:
        client.stats["via_router"] += len({i for i, _ in rest})
        found = yield from _pairs_plan(client, None, texts, rest, min_offset, fields)
        if found is None:
            raise KeyrouteError(502, "bad_gateway", "the router's answer to a multi-store batch was not usable")
        for i, store in rest:
            entries[i][store] = found[(texts[i], store)]
    return [{store: value_of_entry(store, got[store]) for store in stores} for got in entries]


def _pairs_plan(
    client: Any, url: str | None, texts: list[str], pairs: list[Pair], min_offset: Offsets, fields: Fields
) -> Plan[dict[tuple[str, str], Any] | None]:
    """The entries, by (key text, store), of one request for `pairs` (to the node at `url`, or the router
    when None: retried, its errors raised); None when a node failed or did not answer them all."""
    keys: dict[str, list[str]] = {}
    for i, store in pairs:
        keys.setdefault(store, []).append(texts[i])
    stores = list(keys)
    body: dict[str, Any] = {"keys": keys}
    if min_offset:
        bounds = {store: offset for store, offset in min_offset.items() if store in keys}
        if bounds:
            body["min_offset"] = bounds
    options = {"params": stores_params(stores, None, fields, bounds=False), "json": body, "headers": _JSON}
    if url is None:
        answer = yield from client._send_plan("POST", stores_path(stores), **options)
        if answer.status_code != 200:
            raise error_of_answer(answer)
    else:
        answer = yield from _node_plan(client, url, "POST", stores_path(stores), options)
        if answer is None:
            return None
    found = {
        (result["key"], store): entry
        for result in body_of(answer)["results"]
        for store, entry in result["stores"].items()
    }
    if url is not None and any(entry.get("status") == 503 for entry in found.values()):
        return None
    return found
