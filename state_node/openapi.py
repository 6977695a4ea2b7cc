"""The operations only a node serves, for its OpenAPI document (keyroute.http.openapi writes the document
from the routes: state_node/dataplane.py's and state_node/app.py's, each of which names its operation here
or in keyroute.http.openapi): one partition's part of a key range, and the partition map, a key's route,
the quotas and readiness as a node sees them.
"""

from __future__ import annotations

from keyroute.http.openapi import (
    ADMIN,
    ADMIN_SECURITY,
    ALWAYS,
    GUARD,
    INFO_DESCRIPTION,
    INTERNAL,
    MAP_GENERATION,
    NOT_ALLOWED,
    QUOTA,
    QUOTA_IDENTITIES,
    ROUTE_FIELDS,
    STORE,
    Operation,
    Schema,
    array_of_objects,
    error,
    json_answer,
    query,
    quota_buckets,
    quotas_operation,
    readyz_operation,
    route_operation,
    string_headers,
)
from keyroute.storage.ranges import MAX_LIMIT

INFO = {
    "title": "keyroute node",
    "version": "1",
    "description": "A state node: it answers the reads of the partitions it serves and passes any other on, "
    "once, to a node that serves it. " + INFO_DESCRIPTION,
}
_HEX = "the serialized key in hex"

PARTITION_RANGE = Schema(
    "PartitionRange",
    {
        "type": "object",
        "required": ["store", "partition", "version", "more", "keys"],
        "properties": {
            "store": {"type": "string"},
            "partition": {"type": "integer", "minimum": 0},
            "version": {"type": "integer", "minimum": 1},
            "more": {"type": "boolean", "description": "keys of the range may follow the last one"},
            "keys": array_of_objects(["key", "value"], {"key": {"type": "string"}, "value": {}}),
        },
    },
)
GET_PARTITION_RANGE = Operation(
    "getPartitionRange",
    "One partition's part of a key range, in the store's key order, for a router to merge (nodes only)",
    parameters=(
        STORE,
        {
            "name": "partition",
            "in": "path",
            "required": True,
            "schema": {"type": "string"},
            "description": "the partition's number",
        },
        query("from_key", f"the first key of the range (inclusive): {_HEX}"),
        query("to_key", f"the end of the range (exclusive): {_HEX}"),
        query("after", f"only keys after this one: {_HEX}"),
        query(
            "limit",
            "at most this many keys; `more` says whether others follow",
            {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_LIMIT,
            },
        ),
        query("version", "answer only from this version of the partition", {"type": "integer", "minimum": 1}),
    ),
    responses={
        "200": json_answer(
            PARTITION_RANGE,
            "the partition's keys in the range",
            string_headers(
                ("X-Keyroute-Partition", "the partition"),
                ("X-Keyroute-Node", "this node"),
                ("X-Keyroute-Version", "the version read"),
            ),
        ),
        "400": error(
            "`bad_request`: a partition the store lacks, or an unknown, repeated or malformed parameter; "
            "`wrong_store_kind`: the store's keys have no order"
        ),
        "404": error("`store_not_found`"),
        "410": error("`cursor_expired`: `version` is no longer the version this node serves"),
        **NOT_ALLOWED,
        **QUOTA,
        **GUARD,
        "503": error(
            "`overloaded` or `partition_unavailable` (this node does not serve the partition): retry after "
            "`Retry-After` seconds",
            retry_after=True,
        ),
        **INTERNAL,
    },
)

# -- admin ------------------------------------------------------------------------------------------------

PARTITION_MAP = Schema(
    "NodePartitionMap",
    {
        "type": "object",
        "description": "the whole partition map as this node sees it (stores, nodes, and per partition the "
        "assigned replicas and the serving nodes with versions; live stores' reports), with `node`, "
        "`controller` (whether this node is the controller), `leaving`, and `local`: per store, every "
        "partition this node holds or wants, its version and state",
        "required": ["generation", "node", "controller", "leaving", "local"],
        "properties": {
            "generation": {"type": "integer", "description": MAP_GENERATION},
            "stores": {"type": "object"},
            "nodes": {"type": "object"},
            "node": {"type": "string"},
            "controller": {"type": "boolean"},
            "leaving": {"type": "boolean"},
            "local": {"type": "object"},
        },
    },
)
_ETAG = string_headers(
    ("ETag", "the map and assignment generations, staleness, the live status read and what is local to the node")
)
GET_PARTITION_MAP = Operation(
    "partitionMap",
    "The node's whole view of the partition map, and what it holds itself",
    description="The whole document (`generation`, `assignment_generation`, `age_s`, `stale`, `complete`; "
    "every node with its URL, `leaving` flag and partitions served per store; every store with its partitions, "
    "partitioner, key format, current and retained versions, and for every partition the assigned replicas and "
    "the nodes serving it, with versions), plus `local`, the state of every partition the node holds (a node "
    "follows only its own share of the assignment: for this page and `/admin/route` it reads the whole "
    "assignment from ZooKeeper when asked). Live stores add their replicas' reports. Every answer carries an "
    "`ETag` (generations, live status read, and a digest of what is local); a request whose `If-None-Match` "
    "names it is answered 304 before the document is built.",
    security=ADMIN_SECURITY,
    responses={
        "200": json_answer(PARTITION_MAP, "the node's current view", _ETAG),
        "304": {"description": "the view is still the one If-None-Match names", "headers": _ETAG},
        **ADMIN,
        **ALWAYS,
    },
)
ROUTE = Schema(
    "NodeRoute",
    {
        "type": "object",
        "required": ["store", "key", "partitioner", "hash", "partition", "partitions", "version", "assigned"],
        "properties": {
            **ROUTE_FIELDS,
            "partitioner": {"type": "string"},
            "partitions": {"type": "integer"},
            "version": {"type": "integer"},
            "local": {
                "type": "object",
                "description": "this node, and the version of the partition it holds (null: none)",
                "properties": {"node": {"type": "string"}, "version": {"type": ["integer", "null"]}},
            },
            "map_stale": {"type": "boolean"},
        },
    },
)
GET_ROUTE = route_operation(ROUTE, "Hash, partition, assigned and serving nodes for one key, and the version held here")
QUOTAS = Schema(
    "NodeQuotas",
    {
        "type": "object",
        "required": ["identities", "buckets"],
        "properties": {
            "identities": QUOTA_IDENTITIES,
            "buckets": quota_buckets(
                "node", nodes={"type": "integer", "description": "the nodes serving the store, sharing it"}
            ),
        },
    },
)
GET_QUOTAS = quotas_operation(
    QUOTAS,
    "Each identity's rate against its quota, per store, for the reads callers make to this node directly",
    "As a router's, without `routers`: each bucket's `nodes` says how many nodes serve its store "
    "(its `share` is the quota divided by them).",
)
READINESS = Schema(
    "NodeReadiness",
    {
        "type": "object",
        "required": ["node", "status", "stale", "generation", "pending", "updating", "failed"],
        "properties": {
            "node": {"type": "string"},
            "status": {"enum": ["ready", "not_ready"]},
            "stale": {"type": "boolean"},
            "map_stale": {"type": "boolean"},
            "generation": {"type": "integer", "description": MAP_GENERATION},
            "leaving": {"type": "boolean"},
            "pending": {"type": "array", "description": "partitions assigned and not served yet"},
            "updating": {"type": "array", "description": "partitions loading a new version"},
            "failed": {"type": "object", "description": "partitions whose load failed, with the error"},
            "degraded": {"type": "array"},
            "checked_at": {"type": "number"},
            "reason": {"type": "string", "description": "why a node that serves no read is not ready"},
        },
    },
)
READYZ = readyz_operation(
    READINESS,
    "The node serves everything assigned to it (also while ZooKeeper is away: the body says the map is stale)",
    "200 once the node serves everything assigned to it, at the published version or (while a new "
    "version loads, or after its load failed) another one; the body lists `pending`, `updating` and `failed`.",
    "not ready: a partition assigned to it is not served yet, or the node does not satisfy the cluster "
    "policy (`reason`)",
)
