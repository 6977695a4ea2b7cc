"""`keyroute partition`: the partition of each key, as a Kafka producer computes it."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from keyroute.cli.options import (
    _Parser,
)
from keyroute.keys.key_format import KeyFormat, KeyFormatError, parse_key
from keyroute.keys.key_schema import KeySchema, KeySchemaLookupError, check_key_schema, fetch_key_schema
from keyroute.keys.partitioner import MAX_PARTITIONS, Partitioner, key_hash, partition_for
from keyroute.keys.schema_registry import RegistrySettings


def add_partition(p: _Parser, sub: Any) -> list[argparse.ArgumentParser]:
    """`keyroute partition`."""
    part = sub.add_parser("partition", help="print the partition of each key (arguments or stdin lines)")
    p.option(part, "--partitions", type=int, required=True, help="number of partitions of the topic/store")
    p.option(part, "--partitioner", default="murmur2", help="murmur2 | crc32 | fnv1a")
    p.option(
        part,
        "--key-format",
        default="string",
        help="string | int16 | int32 | int64 | uuid | bytes | avro | protobuf | json_schema",
    )
    p.option(part, "--key-schema-id", type=int, help="Schema Registry keys: the id the producer's serializer writes")
    p.option(part, "--key-schema", type=Path, help="Schema Registry keys: a file holding the key schema's text")
    p.option(part, "--schema-registry", help="Schema Registry keys: the registry URL to read the key schema from")
    p.option(part, "--key-subject", help="Schema Registry keys: the subject whose latest schema keys are written in")
    p.option(part, "--key-message", default="", help="Protobuf keys: the key message's full name (default: the first)")
    part.add_argument("keys", nargs="*", metavar="KEY", help="keys; when none are given, one per stdin line")
    return [part]


def _stdin_keys() -> Iterable[str]:
    data = sys.stdin.buffer.read()
    if not data:
        return []
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the final terminator ends the last key, it does not start an empty one
    keys = []
    for line in lines:
        if line.endswith(b"\r"):
            line = line[:-1]
        keys.append(line.decode("utf-8", "surrogateescape"))
    return keys


def _partition_key_schema(args: argparse.Namespace, key_format: KeyFormat) -> KeySchema | None:
    """The key schema `keyroute partition` serializes keys with: from --key-schema-id and --key-schema, or read
    from --schema-registry (by --key-subject or --key-schema-id). Raises ValueError, saying what is missing."""
    given = [flag for flag, value in _key_schema_flags(args) if value]
    if not key_format.registered:
        if given:
            raise ValueError(f"{given[0]} applies to --key-format avro, protobuf or json_schema")
        return None
    if args.schema_registry:
        if args.key_schema is not None or (args.key_subject is None) == (args.key_schema_id is None):
            raise ValueError("with --schema-registry give --key-subject or --key-schema-id (one of them)")
        registry = RegistrySettings.parse({"url": args.schema_registry}, "--schema-registry")
        return fetch_key_schema(key_format, registry, args.key_subject, args.key_schema_id, args.key_message)
    if args.key_schema is None or args.key_schema_id is None or args.key_subject is not None:
        raise ValueError(
            f"{key_format.value} keys need --key-schema-id N --key-schema FILE, or --schema-registry URL with "
            "--key-subject S (or --key-schema-id N)"
        )
    schema = KeySchema(key_format, args.key_schema_id, args.key_schema.read_text("utf-8").strip(), args.key_message)
    try:
        check_key_schema(schema)
    except ValueError as exc:
        raise ValueError(f"--key-schema {str(args.key_schema)!r}: {exc}") from None
    return schema


def _key_schema_flags(args: argparse.Namespace) -> list[tuple[str, object]]:
    return [
        ("--key-schema-id", args.key_schema_id is not None),
        ("--key-schema", args.key_schema),
        ("--schema-registry", args.schema_registry),
        ("--key-subject", args.key_subject),
        ("--key-message", args.key_message),
    ]


def cmd_partition(args: argparse.Namespace) -> int:
    try:
        partitioner = Partitioner.parse(args.partitioner)
        key_format = KeyFormat.parse(args.key_format)
    except ValueError as exc:
        print(f"keyroute partition: {exc}", file=sys.stderr)
        return 2
    if not 1 <= args.partitions <= MAX_PARTITIONS:
        print(
            f"keyroute partition: --partitions must be from 1 to {MAX_PARTITIONS} (a Kafka topic's partition "
            f"count is a 32-bit integer), got {args.partitions}",
            file=sys.stderr,
        )
        return 2
    try:
        key_schema = _partition_key_schema(args, key_format)
    except (KeySchemaLookupError, OSError, ValueError) as exc:
        print(f"keyroute partition: {exc}", file=sys.stderr)
        return 1
    keys = args.keys if args.keys else _stdin_keys()
    failed = 0
    out = sys.stdout
    for text in keys:
        try:
            key = parse_key(key_format, text, key_schema)
        except KeyFormatError as exc:
            failed += 1
            shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            error = {"key": shown, "error": "bad_key", "message": str(exc)}
            out.write(json.dumps(error, ensure_ascii=False) + "\n")
            continue
        record = {
            "key": key.text,
            "partition": partition_for(partitioner, key.data, args.partitions),
            "hash": key_hash(partitioner, key.data),
        }
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()
    return 1 if failed else 0
