"""The state node: joins the cluster, loads the partitions assigned to it into LMDB and answers reads.

One node at a time is elected controller and writes the assignment; every node forwards (at most one hop)
a read for a partition it does not serve.
"""
