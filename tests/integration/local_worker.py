"""One worker process of an application holding a LocalReplica, for the tests that share a data directory
between processes: `python -m tests.integration.local_worker --zk Z --store S --data-dir D` answers one JSON
request per line on stdin with one JSON line on stdout:

    {"op": "get", "store": S, "key": K}   -> {"store", "key", "partition", "version", "value", "offset"}
                                             or {"error": code}
    {"op": "applying"}                    -> {"applying": bool}
    {"op": "status"}                      -> the replica's status (partitions as strings)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from keyroute.client import KeyrouteError
from keyroute.local import LocalReplica
from keyroute.runtime.settings import ZkSettings


def answer(replica: LocalReplica, request: dict[str, Any]) -> dict[str, Any]:
    op = request["op"]
    if op == "get":
        try:
            v = replica.get(request["store"], request["key"])
        except KeyrouteError as exc:
            return {"error": exc.code}
        return {
            "store": v.store,
            "key": v.key,
            "partition": v.partition,
            "version": v.version,
            "value": v.value,
            "offset": v.offset,
        }
    if op == "applying":
        return {"applying": replica.applying}
    if op == "status":
        return {name: {str(p): row for p, row in rows.items()} for name, rows in replica.status().items()}
    return {"error": f"unknown op {op!r}"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zk", required=True)
    parser.add_argument("--store", action="append", required=True)
    parser.add_argument("--data-dir", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    with LocalReplica(ZkSettings.parse(args.zk, session_timeout_s=4.0), args.store, args.data_dir) as replica:
        print(json.dumps({"started": True, "applying": replica.applying}), flush=True)
        for line in sys.stdin:
            print(json.dumps(answer(replica, json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
