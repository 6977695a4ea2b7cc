"""A replica inside the application: a store's partitions held in the process and read without a hop.

    from keyroute.local import LocalReplica

    with LocalReplica(zk="zk:2181/keyroute", stores=["bookings"], data_dir="/var/cache/keyroute") as replica:
        replica.wait_ready()
        v = replica.get("bookings", "C000042")   # keyroute.client's Value

The replica learns the stores from ZooKeeper (read only), loads their partitions from the snapshot location
exactly as a node does (keyroute.replica: links, checksums, make-before-break version swaps), applies a live
store's topic with the node's applier (offsets in the same transaction as the rows), and answers `get`,
`get_many`, `history`, `windows` and `range` with the client's types and errors. Worker processes of one host
share one data directory: one applies, the others read (`keyroute.local.shared`).

    replica.py   LocalReplica: the reads and the view they use
    holder.py    the applying side: map, loads, live appliers, swaps
    shared.py    the data directory shared by a host's worker processes: the lock, the view file
    kafka.py     `follow_assignment`: hold the partitions a consumer group assigns this process
    metrics.py   the state per partition as Prometheus metrics
"""

from keyroute.local.kafka import follow_assignment
from keyroute.local.replica import LocalReplica, NotHeld

__all__ = ["LocalReplica", "NotHeld", "follow_assignment"]
