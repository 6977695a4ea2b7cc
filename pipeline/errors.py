"""Why a pipeline build failed: every message names the store (or the spec file) and the problem.

    PipelineError            a build failed; nothing of it was published
     +-- SpecError           the store spec is wrong (unknown field, missing key, bad aggregate expression)
     +-- DataError           the source data does not fit the spec (missing column, null or malformed keys)
     |    +-- PartitionAuditError  records are not where the store's partitioner puts their keys
     +-- PublishError        a version could not be written or published (output, ZooKeeper, changed shape)
     +-- TopicError          a live store's Kafka topic cannot be reached or read (broker, unknown topic)
"""

from __future__ import annotations


class PipelineError(Exception):
    """A build failed. `store` is None only for problems that belong to no single store (the spec file)."""

    def __init__(self, store: str | None, problem: str) -> None:
        self.store = store
        self.problem = problem
        super().__init__(f"store {store!r}: {problem}" if store is not None else problem)


class SpecError(PipelineError):
    """The store spec cannot be used as written."""


class DataError(PipelineError):
    """The source data does not fit the store spec."""


class PublishError(PipelineError):
    """A version could not be written to the output or published in ZooKeeper."""


class PartitionAuditError(DataError):
    """Source records are not in the partitions the store's partitioner gives their keys (failed audit)."""


class TopicError(PipelineError):
    """A live store's Kafka topic could not be reached or read when the build asked the cluster about it."""
