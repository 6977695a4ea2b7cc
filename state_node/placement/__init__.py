"""The controller's placement: which nodes serve each partition of every store, preferred replica first.

seated.py   `assign`, the entry point: seat-based, about linear in the number of replicas
exact.py    `assign_exact`: by min-cost flows (flow.py), for small clusters the seats cannot balance
zones.py    the zone pass both end with (and zone_map, the failure domain of each node)
seats.py    floor/ceiling shares of a count, handed out batch after batch
leaders.py  preferred replicas among replica sets (the seat-based engine's matching)
shape.py    StoreShape, AssignmentError;  replicas.py  moved_replicas and replica order
"""

from keyroute.state_node.placement.exact import assign_exact
from keyroute.state_node.placement.replicas import moved_replicas
from keyroute.state_node.placement.seated import EXACT_LIMIT, assign
from keyroute.state_node.placement.shape import AssignmentError, StoreShape

__all__ = ["EXACT_LIMIT", "AssignmentError", "StoreShape", "assign", "assign_exact", "moved_replicas"]
