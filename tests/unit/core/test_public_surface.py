"""Hashing a key is a pure computation: the keys room loads neither ZooKeeper's client nor Spark."""

from __future__ import annotations

import subprocess
import sys


def test_hashing_a_key_does_not_load_zookeeper_or_spark() -> None:
    code = (
        "import sys; from keyroute.keys.partitioner import Partitioner, partition_for; "
        "assert partition_for(Partitioner.MURMUR2, b'k', 3) in range(3); "
        "assert not [m for m in sys.modules if m.split('.')[0] in ('kazoo', 'pyspark')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
