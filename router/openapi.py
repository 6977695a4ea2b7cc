"""The operations only a router serves, for its OpenAPI document (keyroute.http.openapi writes the document
from the routes: router/dataplane.py's and router/app.py's, each of which names its operation here or in
keyroute.http.openapi): a whole store's key range, the partition-map views and page, a key's route, the
quotas and readiness as a router sees them.
"""

from __future__ import annotations

from typing import Any

from keyroute.http.openapi import (
    ADMIN,
    ADMIN_SECURITY,
    ALWAYS,
    ENDPOINT,
    GUARD,
    INFO_DESCRIPTION,
    INT0,
    INTERNAL,
    LIMIT,
    MAP_GENERATION,
    NOT_ALLOWED,
    QUOTA,
    QUOTA_IDENTITIES,
    ROUTE_FIELDS,
    STORE,
    Operation,
    Schema,
    array_of_objects,
    batch_get,
    error,
    json_answer,
    query,
    quota_buckets,
    quotas_operation,
    readyz_operation,
    route_operation,
    string_headers,
    text_answer,
)
from keyroute.router.map_views import DEFAULT_LIMIT, FILTER_STATES, MAX_LIMIT, MAX_WAIT_S

INFO = {
    "title": "keyroute router",
    "version": "1",
    "description": "One-hop reads of partitioned state: each key is routed to a node serving its partition, "
    "partitioned exactly as Kafka's default partitioner. " + INFO_DESCRIPTION,
}

# A router answers a key its store cannot take as that key's entry (a node refuses the batch).
BATCH_GET = batch_get(any_key=True)
RANGE = Schema(
    "Range",
    {
        "type": "object",
        "required": ["store", "keys"],
        "properties": {
            "store": {"type": "string"},
            "keys": array_of_objects(
                ["key", "partition", "value"],
                {
                    "key": {"type": "string"},
                    "partition": {"type": "integer", "minimum": 0},
                    "value": {"description": "the key's value (a history or windowed store's latest)"},
                },
            ),
            "next": {"type": "string", "description": "present when more keys follow: the next page's cursor"},
        },
    },
)
GET_RANGE = Operation(
    "getRange",
    "The keys of a range, in the store's key order, with their values (routers only)",
    parameters=(
        STORE,
        query("from_key", "the first key of the range (inclusive), in the key's text form"),
        query("to_key", "the end of the range (exclusive)"),
        query("prefix", "string keys: the keys starting with this text (instead of from_key/to_key)"),
        query("limit", "at most this many keys; `next` then continues the read", LIMIT),
        query("cursor", "the `next` of the previous page, with the same store and bounds"),
    ),
    responses={
        "200": json_answer(RANGE, "the keys in order: bytes of the serialized key; integers numerically"),
        "400": error(
            "`bad_key`: a bound does not fit the key format; `bad_request`: an unknown, repeated or "
            "malformed parameter, from_key after to_key, a prefix on keys that are not strings, or "
            "`limit` out of range; `bad_cursor`: the cursor is malformed, altered or continues "
            "another range"
        ),
        "404": error("`store_not_found`"),
        "410": error("`cursor_expired`: the cursor continues a version no longer served"),
        **NOT_ALLOWED,
        **QUOTA,
        **GUARD,
        "503": error(
            "`overloaded` or `partition_unavailable` (no replica of some partition answered): retry "
            "after `Retry-After` seconds",
            retry_after=True,
        ),
        **INTERNAL,
    },
)

# -- the partition map's views ----------------------------------------------------------------------------

VIEW_HEADERS = string_headers(
    ("ETag", "the map and assignment generations this view is of"),
    ("X-Keyroute-Map-Age-S", "seconds since the router's map last changed (a quiet cluster's map grows old: fine)"),
)
NOT_MODIFIED = {"description": "the map is still the one If-None-Match names", "headers": VIEW_HEADERS}


def view_answers(schema: Schema, description: str, bad_request: str) -> dict[str, Any]:
    """A map view's answers: the view with its ETag, 304 while If-None-Match names it, 400 `bad_request`."""
    return {
        "200": json_answer(schema, description, VIEW_HEADERS),
        "304": NOT_MODIFIED,
        "400": error(f"`bad_request`: {bad_request}; it is named"),
    }


PARTITION_MAP = Schema(
    "PartitionMap",
    {
        "type": "object",
        "description": "`view` says which: `summary` (the default), `detail` (`partitions`, `matched`, "
        "and `next` when more pages follow) or, with `detail=all`, the whole document without `view`: "
        "stores (partitions, partitioner, key format, version), nodes, and per partition "
        "the assigned replicas and the serving nodes with versions; the map generation, the assignment "
        "generation and the map's age. A live "
        "store says `live` (and `topic`), and each of its partitions lists under `live` every replica's "
        "report: node, version, offset, lag_records, lag_ms, state, applied, skipped, error",
        "required": ["generation"],
        "properties": {
            "view": {"enum": ["summary", "detail"]},
            "stores": {"type": "object"},
            "nodes": {"type": "object"},
            "generation": {"type": "integer", "description": MAP_GENERATION},
            "router": {"type": "boolean"},
        },
    },
)
GET_PARTITION_MAP = Operation(
    "partitionMap",
    "The partition map: a summary, filtered and paged detail, or the whole document",
    description="Without parameters, a summary that does not grow with partitions (per store its "
    "counts of partitions served, under-replicated, unserved, loading and lagging, live lag max and "
    "p99, and a heat strip; per node its zone, state and partition counts; totals and problems). "
    "With `store`, `node`, `state` or `partition` (combined: all must hold), the matching "
    "partitions, paged by `limit` and `cursor`. `detail=all`: the whole document (every store's "
    "every partition). Every answer carries an `ETag` (the map and assignment generations) and "
    "honours `If-None-Match` (304). `since` with `wait_s` is a long poll: it answers when the map "
    "passes generation `since` (or its ETag is no longer the `If-None-Match` given), else after "
    "`wait_s` seconds.",
    security=ADMIN_SECURITY,
    parameters=(
        query("detail", "`all`: the whole document", {"enum": ["all"]}),
        query("store", "only this store's partitions"),
        query("node", "only partitions this node is assigned or serves"),
        query("state", "only partitions in this state", {"enum": list(FILTER_STATES)}),
        query("partition", "only this partition (of `store`, else of every store)", INT0),
        query(
            "limit",
            f"partitions per page (default {DEFAULT_LIMIT})",
            {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
        ),
        query("cursor", "the `next` of the previous page"),
        query("since", "the map generation the caller has (long poll)", INT0),
        query("wait_s", "how long a long poll may wait", {"type": "number", "minimum": 0, "maximum": MAX_WAIT_S}),
    ),
    responses={
        **view_answers(PARTITION_MAP, "the router's current view", "a parameter is unknown, repeated or out of range"),
        **ADMIN,
        **ALWAYS,
    },
)
ROUTING = Schema(
    "Routing",
    {
        "type": "object",
        "required": ["format", "generation", "nodes", "stores", "store_names"],
        "properties": {
            "format": {"type": "integer", "description": "raised on a change older clients cannot read"},
            "generation": {"type": "integer", "description": MAP_GENERATION},
            "assignment_generation": {"type": "integer"},
            "stale": {"type": "boolean"},
            "since": {"type": "integer", "description": "present when only changed stores are given"},
            "store_names": {"type": "array", "items": {"type": "string"}},
            "nodes": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
            "stores": {"type": "object"},
        },
    },
)
GET_ROUTING = Operation(
    "routing",
    "What a client needs to send each key to a node serving it (direct routing)",
    description="Per store its shape, partitioner, key format and version, and per partition the "
    "serving replicas (preferred first) as indices into `nodes` ([node id, URL] pairs). `since`: "
    "only the stores whose routing changed after that map generation (all of them when the router "
    "does not know that far back: `since` is then absent from the answer); `store` (repeatable): "
    "only those stores. ETag and If-None-Match (304) as the partition map. Open like the data API: "
    "it says no more than reads through the router and the nodes' own answers already show.",
    parameters=(
        query("since", "the map generation the caller has", INT0),
        query("store", "only this store (repeat for several)"),
    ),
    responses={
        **view_answers(ROUTING, "the routing view", "a parameter is unknown or out of range"),
        **ALWAYS,
    },
)
PARTITION_MAP_PAGE = Operation(
    "partitionMapPage",
    "The partition map as a page for people (self-contained HTML, updating itself)",
    description="With an admin token and no session, 303 to `/admin/login` (a `token` in its URL is never "
    "honoured: 303 to `/admin/login` as well).",
    security=({"adminToken": []}, {"adminSession": []}, {}),
    responses={
        "200": text_answer("text/html", "the page"),
        "303": {"description": "to `/admin/login`: no session (or an admin token in the URL, never honoured)"},
        **ALWAYS,
    },
)

# -- a key's route, quotas, readiness --------------------------------------------------------------------------

QUOTAS = Schema(
    "Quotas",
    {
        "type": "object",
        "required": ["routers", "identities", "buckets"],
        "properties": {
            "routers": {"type": "integer", "description": "routers up, sharing every quota"},
            "identities": QUOTA_IDENTITIES,
            "buckets": quota_buckets("router"),
        },
    },
)
GET_QUOTAS = quotas_operation(
    QUOTAS,
    "Each identity's rate against its quota, per store, on this router",
    "`routers` (routers up, sharing every quota), `identities` (the quota file) and `buckets`, one "
    "per identity and store read since the quotas last changed: `quota` (reads per second, cluster-wide), "
    "`share` (this router's), `used` (the part of the last burst spent: the recent rate against the share), "
    "`reads` (admitted, by cost) and `rejected` (429s); the admin page shows it as a table.",
)
ROUTE = Schema(
    "Route",
    {
        "type": "object",
        "required": ["store", "key", "hash", "partition", "assigned", "serving"],
        "properties": {**ROUTE_FIELDS, "last_known": {"type": "array", "items": ENDPOINT}},
    },
)
GET_ROUTE = route_operation(
    ROUTE,
    "Hash, partition, assigned and serving nodes for one key",
    "`last_known`: the nodes that served the partition last (asked when nobody serves it now).",
)
READINESS = Schema(
    "Readiness",
    {
        "type": "object",
        "required": ["ready", "stale", "generation", "complete", "stores_loading"],
        "properties": {
            "ready": {"type": "boolean"},
            "stale": {"type": "boolean"},
            "generation": {"type": "integer", "description": MAP_GENERATION},
            "complete": {"type": "boolean"},
            "stores_loading": {
                "type": "array",
                "items": {"type": "string"},
                "description": "stores never fully served yet",
            },
            "stores_degraded": {
                "type": "array",
                "items": {"type": "string"},
                "description": "stores fully served once, missing a partition now",
            },
            "cluster": {"const": "empty", "description": "present while the chroot holds no cluster at all"},
            "cluster_message": {
                "type": "string",
                "description": "with `cluster`: the ZooKeeper address, the chroot and the chroots that hold a cluster",
            },
            "reason": {"type": "string", "description": "why a router that serves no read is not ready"},
        },
    },
)
READYZ = readyz_operation(
    READINESS,
    "The router has a partition map to route with (stale while ZooKeeper is away)",
    "200 once the router has a partition map to route with; it stays 200, marked stale, while "
    "ZooKeeper is away. A partition without a serving replica answers its own 503s and never makes the router "
    "unready. While the chroot holds no cluster at all (no cluster record, no node, no store: often a mistyped "
    '`--zk`) the body says `"cluster": "empty"` with a `cluster_message` (said once in the log too); the router '
    "stays ready, as it is before anything is published.",
    "not ready: no partition map read yet, or the router does not satisfy the cluster policy (`reason`)",
)
