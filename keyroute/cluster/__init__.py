"""Cluster: ZooKeeper access and layout, the partition map and its placement records, the map watcher,
the cluster's identity and policy, and live-consumption status as recorded in ZooKeeper.
"""
