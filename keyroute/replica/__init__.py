"""A replica's data: the partitions of a store version held on a local disk, as a node and an in-application
replica (keyroute.local) both hold them. Loading a partition from the snapshot location (hard link, kernel copy
or download, checked against the manifest's size, checksum and partitioner: `fetch`, `store`), reading it
(`store.PartitionStore`), and applying a live store's topic into it with the offset in the same transaction
(`live`, `timeline_writer`).
"""
