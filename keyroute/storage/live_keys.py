"""Live records whose keys were written by a Schema Registry serializer: checked against the store's key schema.

A record whose key carries another schema id than the one the store's version was built with was
partitioned by its producer from other bytes: it is counted as `key_schema_changed`, not applied (the
operations guide says to re-key the topic or rebuild the store under its new key schema).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keyroute.keys.key_format import KeyFormat, KeyFormatError, key_from_data
from keyroute.keys.key_schema import KeySchema, KeySchemaChanged
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.storage.live import BadRecord, Reason, RecordReader


class SchemaKeyReader(RecordReader):
    """A RecordReader whose keys are framed with the store's key schema id (`KeySchema`)."""

    __slots__ = ("key_schema",)

    def __init__(
        self,
        key_schema: KeySchema,
        partitioner: Partitioner,
        partitions: int,
        partition: int,
        values: Callable[[bytes], dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(key_schema.format, partitioner, partitions, partition, values)
        self.key_schema = key_schema

    def _prove(self, key: bytes) -> None:
        try:
            key_from_data(self.key_format, key, self.key_schema)
        except KeySchemaChanged as exc:
            raise BadRecord(Reason.KEY_SCHEMA_CHANGED, str(exc)) from None
        except KeyFormatError as exc:
            raise BadRecord(Reason.BAD_KEY, str(exc)) from None
        if (owner := partition_for(self.partitioner, key, self.partitions)) != self.partition:
            raise BadRecord(Reason.MISPLACED, f"its key belongs to partition {owner}")


def record_reader(
    key_format: KeyFormat,
    key_schema: KeySchema | None,
    partitioner: Partitioner,
    partitions: int,
    partition: int,
    values: Callable[[bytes], dict[str, Any]] | None = None,
) -> RecordReader:
    """The reader of one live partition's records (`values`: as RecordReader's): keys checked against the key
    schema when the store has one."""
    if key_schema is not None:
        return SchemaKeyReader(key_schema, partitioner, partitions, partition, values)
    return RecordReader(key_format, partitioner, partitions, partition, values)
