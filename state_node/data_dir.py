"""One data directory, one node, one cluster.

A node locks its `--data-dir` before it touches anything in it (`DataDir.open`): an exclusive, non-blocking
`flock` on `{data_dir}/keyroute.lock`, held for the process's life and released by the kernel when the process
dies, so a crash never leaves a stale lock. The lock file names its holder (node id and pid) for the error a
second process gets. `{data_dir}/node.json` records the node id the directory belongs to and the cluster id it
joined: a directory is never used under another node id, nor in a chroot with another cluster's id or none
(ZooKeeper wiped, restored from an old backup, or the wrong chroot: `keyroute store adopt` is the way back).
Every refusal leaves the directory as it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from pathlib import Path

from kazoo.client import KazooClient

from keyroute.cluster.cluster_identity import (
    ClusterId,
    ClusterIdError,
    chroots_with_a_cluster,
    create_cluster_id,
    read_cluster_id,
)
from keyroute.replica.store import MARKER, iter_partition_dirs
from keyroute.runtime.logs import describe
from keyroute.runtime.settings import ZkSettings

log = logging.getLogger(__name__)

LOCK_FILE = "keyroute.lock"
IDENTITY_FILE = "node.json"


class DataDirError(RuntimeError):
    """The node may not use this data directory (in use, another node's, another cluster's): one line."""


class DataDir:
    """A data directory this process holds the lock of, until `close` (or the process's end)."""

    def __init__(self, path: Path, node_id: str, fd: int) -> None:
        self.path = path
        self.node_id = node_id
        self._fd: int | None = fd
        self.cluster_id: str | None = None

    @classmethod
    def open(cls, path: Path, node_id: str) -> DataDir:
        """Lock `path` for `node_id` (creating it if needed) and check the node id it records; raises
        DataDirError, having changed nothing, when another process holds it or it is another node's."""
        path = Path(path)
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DataDirError(f"data directory {path} cannot be used: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder(fd)
            os.close(fd)
            raise DataDirError(f"data directory {path} is in use by {holder}") from None
        held = cls(path, node_id, fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"node_id": node_id, "pid": os.getpid()}).encode("utf-8"), 0)
            recorded = read_identity(path)
            if recorded.get("node_id") not in (None, node_id):
                raise DataDirError(
                    f"data directory {path} belongs to node {recorded['node_id']}, not {node_id}: "
                    "every node needs its own --data-dir"
                )
            held.cluster_id = recorded.get("cluster_id") or None
            if not recorded:
                held._record()
        except BaseException:
            held.close()
            raise
        return held

    def join(self, client: KazooClient, chroot: str, zk: ZkSettings | None = None) -> str:
        """Check the chroot's cluster id against the recorded one and return it. A directory that joined no
        cluster yet adopts the chroot's id (creating it in an empty chroot); one that did refuses a chroot
        with another id or none (DataDirError, nothing changed). With `zk` (where the chroot is), a new
        cluster created while other top-level chroots hold one is said as a likely mistyped --zk."""
        where = chroot or "/"
        found = self._found(client, where)
        if found is None:
            found, created = create_cluster_id(client)
            if created:
                others = chroots_with_a_cluster(zk) if zk is not None else []
                if others:
                    log.warning(
                        "no keyroute cluster at ZooKeeper %s chroot %s: this node created a new cluster %s "
                        "(did you mean %s? these chroots hold a keyroute cluster; check --zk)",
                        zk.hosts if zk is not None else "",
                        where,
                        found.id,
                        ", ".join(others[:5]),
                    )
                else:
                    log.info("chroot %s had no cluster id: this node created cluster %s", where, found.id)
        if self.cluster_id is not None and found.id != self.cluster_id:
            raise self._foreign(where, found.id)
        if self.cluster_id is None:
            self.cluster_id = found.id
            self._record()
            log.info("data directory %s joined cluster %s", self.path, found.id)
        return found.id

    def check(self, client: KazooClient, chroot: str) -> None:
        """`join`'s refusals, reading only: a directory that joined a cluster refuses a chroot with another
        cluster id or none (DataDirError). Run before anything is created in ZooKeeper (`zk.connect`'s
        `check`), so that a refused node leaves ZooKeeper exactly as it found it."""
        if self.cluster_id is None:
            return  # a new directory joins whatever the chroot holds, or creates the cluster: `join`
        where = chroot or "/"
        found = self._found(client, where)
        if found is not None and found.id != self.cluster_id:
            raise self._foreign(where, found.id)

    def _found(self, client: KazooClient, where: str) -> ClusterId | None:
        """The chroot's cluster id; DataDirError when it is unreadable, or missing while this directory
        joined a cluster."""
        try:
            found = read_cluster_id(client)
        except ClusterIdError as exc:
            raise DataDirError(f"{exc} (chroot {where})") from None
        if found is None and self.cluster_id is not None:
            raise DataDirError(
                f"chroot {where} has no cluster id but data directory {self.path} joined cluster "
                f"{self.cluster_id}: ZooKeeper looks wiped or the chroot is wrong; restore it with "
                "`keyroute store adopt --cluster-id` (docs/operations.md) or fix --zk"
            )
        return found

    def _foreign(self, where: str, found: str) -> DataDirError:
        return DataDirError(
            f"chroot {where} belongs to cluster {found} but data directory {self.path} joined cluster "
            f"{self.cluster_id}: refusing to mix two clusters' data (wrong --zk or --data-dir?)"
        )

    def close(self) -> None:
        """Release the lock (the kernel would at the process's end anyway)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _record(self) -> None:
        doc = {"node_id": self.node_id, "cluster_id": self.cluster_id}
        tmp = self.path / (IDENTITY_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path / IDENTITY_FILE)


def held_partitions(path: Path) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
    """(store, version, partitions) of every partition directory under `path` with a complete load's marker:
    what the node record offers the controller as a placement hint (the files are checked when loaded)."""
    held: dict[tuple[str, int], list[int]] = {}
    try:
        for pid, part_dir in iter_partition_dirs(path):
            if (part_dir / MARKER).is_file():
                held.setdefault((pid.store, pid.version), []).append(pid.partition)
    except OSError as exc:
        log.warning("listing the partitions in %s failed: %s", path, describe(exc))
    return tuple((store, version, tuple(sorted(parts))) for (store, version), parts in sorted(held.items()))


def read_identity(path: Path) -> dict[str, str]:
    """What `{path}/node.json` records ({} when absent); DataDirError when it is unreadable."""
    try:
        raw = (Path(path) / IDENTITY_FILE).read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise DataDirError(f"cannot read {Path(path) / IDENTITY_FILE}: {exc.strerror or exc}") from None
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or not isinstance(doc.get("node_id"), str):
            raise ValueError("no node_id")
    except ValueError as exc:
        raise DataDirError(f"{Path(path) / IDENTITY_FILE} is unreadable ({exc}); fix or remove it") from None
    return {k: str(v) for k, v in doc.items() if v is not None}


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says ("node n1 (pid 1234)"), or "another process"."""
    try:
        doc = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"node {doc['node_id']} (pid {int(doc['pid'])})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"
