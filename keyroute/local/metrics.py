"""A local replica's state per partition as Prometheus metrics, rendered at scrape time from
`LocalReplica.status()` (the read path bumps nothing)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from keyroute.local.replica import LocalReplica


class ReplicaCollector(Collector):
    """keyroute_local_* gauges of one LocalReplica."""

    def __init__(self, replica: LocalReplica) -> None:
        self._replica = replica

    def describe(self) -> list[Any]:
        # Unchecked: several replicas in one process each register their own collector.
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replica = self._replica
        applying = GaugeMetricFamily(
            "keyroute_local_applying", "1 when this process applies (holds the data directory's lock), else 0"
        )
        applying.add_metric([], 1.0 if replica.applying else 0.0)
        yield applying
        labels = ["store", "partition"]
        version = GaugeMetricFamily("keyroute_local_partition_version", "version held per partition", labels=labels)
        offset = GaugeMetricFamily(
            "keyroute_local_live_offset", "last applied offset per live partition held", labels=labels
        )
        lag = GaugeMetricFamily(
            "keyroute_local_live_lag_records",
            "records of the topic partition not applied yet, as the applying process last saw them",
            labels=labels,
        )
        for store, partitions in replica.status().items():
            for partition, row in partitions.items():
                values = [store, str(partition)]
                version.add_metric(values, row["version"])
                if "offset" in row:
                    offset.add_metric(values, row["offset"])
                if row.get("lag_records") is not None:
                    lag.add_metric(values, row["lag_records"])
        yield version
        yield offset
        yield lag


def register(replica: LocalReplica, registry: CollectorRegistry) -> ReplicaCollector:
    collector = ReplicaCollector(replica)
    registry.register(collector)
    return collector


def unregister(collector: ReplicaCollector, registry: CollectorRegistry) -> None:
    registry.unregister(collector)
