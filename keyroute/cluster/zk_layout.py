"""Where keyroute keeps its records in ZooKeeper (all paths relative to the chroot).

/stores/{store}            persistent  StoreRecord: partitions, partitioner, key format, current version,
                                       versions retained for a rollback (version -> snapshot)
/nodes/{node_id}           ephemeral   NodeRecord: the URL a node advertises (liveness), leaving flag
/controller                            kazoo Election recipe: the node that writes the assignment
/placement                 persistent  the assignment's root: its generation, and the generation of each
                                       store's record (keyroute.cluster.placement_records)
/placement/{store}         persistent  one store's desired replicas per partition, preferred first
/assigned/{node_id}        persistent  one node's share of the assignment: its partitions per store, so a
                                       node reads its own record rather than every store's
/assignment                persistent  the whole assignment in one record: the layout before /placement,
                                       read only until the first controller writes /placement
/serving/{node_id}         ephemeral   ServingRecord: partitions a node has loaded, at which version
/cluster                   persistent  the cluster's identity: a random id and its creation time
                                       (keyroute.cluster.cluster_identity), created by the first node to join
/policy                    persistent  the cluster's security policy (keyroute.cluster.cluster_policy): what every
                                       router and node must have configured to serve; written only by
                                       `keyroute cluster policy set` (none: nothing is asked)
/live/{node_id}            ephemeral   the state of every live partition a node holds (offset, lag, state,
                                       counters; keyroute.cluster.live_status reads them), throttled
/deleted/{store}           persistent  a store's tombstone (`keyroute store delete`): the versions deleted and
                                       when. Only a tombstone lets a node drop a store's partitions and files
                                       (of the versions up to the highest it names); a store record that
                                       vanishes without one is absence, not deletion. Publishing the store
                                       again removes it; a new deletion writes it anew (never rewritten).
/restarting/{node_id}      persistent  a planned restart (keyroute.state_node.restarts): written by a node that
                                       stops for a restart before its /nodes record goes, with the time and
                                       the grace it asked for; the controller keeps the node's partitions
                                       where they are until the grace ends. The node deletes it on return, the
                                       controller once the grace ended without it.
/routers/{router_id}       ephemeral   a router that is up: {"url", "started_at"} (keyroute.router.registry); quotas
                                       are split among them. The reader identity routers use may create and
                                       delete children here (and only here)
/draining/{node_id}        persistent  a drain request (`keyroute node-drain`): the node's next stop is a
                                       departure (its partitions are handed over), not a restart
/cursor-key                persistent  32 random bytes range and timeline cursors are signed with
                                       (keyroute.auth.cursor_key), created by the first node to join
"""

from __future__ import annotations

from collections.abc import Callable

STORES = "/stores"
NODES = "/nodes"
CONTROLLER = "/controller"
ASSIGNMENT = "/assignment"
PLACEMENT = "/placement"
ASSIGNED = "/assigned"
SERVING = "/serving"
LIVE = "/live"
CLUSTER = "/cluster"
POLICY = "/policy"
DELETED = "/deleted"
RESTARTING = "/restarting"
DRAINING = "/draining"
ROUTERS = "/routers"
CURSOR_KEY = "/cursor-key"

PERSISTENT_ROOTS = (
    STORES,
    NODES,
    CONTROLLER,
    SERVING,
    LIVE,
    PLACEMENT,
    ASSIGNED,
    DELETED,
    RESTARTING,
    DRAINING,
    ROUTERS,
)

# The roots whose children are ephemeral records of live sessions (the controller's: the election's contenders).
EPHEMERAL_PARENTS = (NODES, CONTROLLER, SERVING, LIVE, ROUTERS)


def _child(root: str) -> Callable[[str], str]:
    """The path of `root`'s child named by the argument: one rule for every root that holds a record per
    store or per node."""
    prefix = root + "/"

    def path(name: str) -> str:
        return f"{prefix}{name}"

    return path


# Per store.
store_path = _child(STORES)
deleted_path = _child(DELETED)
placement_path = _child(PLACEMENT)
# Per node.
assigned_path = _child(ASSIGNED)
node_path = _child(NODES)
serving_path = _child(SERVING)
live_path = _child(LIVE)
restarting_path = _child(RESTARTING)
draining_path = _child(DRAINING)
# Per router.
router_path = _child(ROUTERS)
