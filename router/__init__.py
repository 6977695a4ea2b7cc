"""The router: a stateless HTTP proxy that hashes a key and sends the read straight to a serving node.

Its view of the cluster is the partition map pushed by ZooKeeper watches; it keeps no state of its own.
"""
