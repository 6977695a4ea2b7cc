"""A replica inside the application (keyroute.local) next to the cluster it follows, in one run.

    .venv/bin/python benchmarks/local_replica.py [--rows 1000000] [--write]

On this machine: the embedded ZooKeeper, librdkafka's mock broker, one `keyroute node` process and one
`keyroute router` process. A batch store of `--rows` keys (~100-byte JSON values, 4 partitions) is written as
a ready-to-serve (format 2) version by hand, no Spark, and published; an empty live store follows a topic.

1. Bootstrap: a LocalReplica on an empty data directory, from start to `wait_ready()` (ZooKeeper, the map,
   every partition linked and checksummed as a node loads it), next to `cp` of the same data.mdb files into
   a fresh folder of the same filesystem; both with the files in the page cache (just written), median of
   `--rounds`.
2. Memory: the replica's resident memory (VmRSS, and RssFile: the store's pages mapped in) after reading 1% of
   the keys, next to the store's size on disk.
3. Reads from one thread, random keys: `LocalReplica.get` (p50/p99 per read, reads/s, the thread's CPU per
   read) next to keyroute.client's `Client` in direct mode (one HTTP request to the node per read).
4. Freshness: a record produced, then read in a loop until its value shows, by the replica (in this process)
   and through the node (HTTP, another thread), the same record for both; p50/p99 over `--samples` records.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py (imported while this folder is still on the path)
import httpx

ROOT = Path(__file__).resolve().parents[1]
_HERE = str(Path(__file__).resolve().parent)
while _HERE in sys.path:  # benchmarks/pipeline.py would hide the `pipeline` folder keyroute.pipeline maps
    sys.path.remove(_HERE)

from confluent_kafka import Producer  # noqa: E402

from keyroute.client import Client  # noqa: E402
from keyroute.cluster import zk, zk_layout  # noqa: E402
from keyroute.cluster.partition_map import StoreRecord  # noqa: E402
from keyroute.dev.kafka_mock import MockKafka  # noqa: E402
from keyroute.keys.key_format import KeyFormat  # noqa: E402
from keyroute.keys.partitioner import Partitioner, partition_for  # noqa: E402
from keyroute.local import LocalReplica  # noqa: E402
from keyroute.runtime.settings import ZkSettings  # noqa: E402
from keyroute.storage.live import LiveConfig, Merge  # noqa: E402
from keyroute.storage.lmdb_layout import build_partition_file, build_partition_rows  # noqa: E402
from keyroute.storage.snapshot import FORMAT_2, Manifest, checksum_file, data_file, version_dir, write_manifest  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Local replica (benchmarks/local_replica.py)"
PARTITIONS = 4
LIVE_PARTITIONS = 2


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def wait(predicate: Callable[[], Any], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


Proc = harness.Proc  # `python -m keyroute ...` of this tree, its output in a log file


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def memory_kb() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {name: int(re.search(rf"{name}:\s+(\d+) kB", text).group(1)) for name in ("VmRSS", "RssFile", "RssAnon")}  # type: ignore[union-attr]


def key_of(i: int) -> str:
    return f"C{i:07d}"


def value_of(i: int) -> bytes:
    routes = ("LHR-JFK", "CDG-SFO", "FRA-NRT", "AMS-BOS")
    doc = {"customer": i, "route": routes[i % 4], "fare": round(100 + (i % 9000) / 7, 2), "ts": "2024-06-01T12:00:00Z"}
    return json.dumps(doc, separators=(",", ":")).encode()


def write_batch_store(root: Path, name: str, rows: int) -> tuple[str, int]:
    """A format-2 version 1 of `rows` keys over PARTITIONS partitions; its snapshot path and bytes."""
    snapshot = version_dir(str(root), name, 1)
    per: dict[int, list[tuple[bytes, bytes]]] = {p: [] for p in range(PARTITIONS)}
    for i in range(rows):
        data = key_of(i).encode()
        per[partition_for(Partitioner.MURMUR2, data, PARTITIONS)].append((data, value_of(i)))
    checksums, sizes, counts = {}, {}, []
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        for p in range(PARTITIONS):
            built = build_partition_rows(per[p], Path(scratch))
            dest = snapshot / data_file(p)
            dest.parent.mkdir(parents=True)
            shutil.move(built.path, dest)
            checksums[p] = checksum_file(dest).value
            sizes[p] = dest.stat().st_size
            counts.append(len(per[p]))
    files = {p: (data_file(p),) for p in range(PARTITIONS)}
    manifest = Manifest(
        name, 1, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, ("customer", "route", "fare", "ts"),
        tuple(counts), created_at=time.time(), format=FORMAT_2, files=files, checksums=checksums, bytes=sizes,
    )  # fmt: skip
    write_manifest(snapshot, manifest)
    return str(snapshot), sum(sizes.values())


def write_live_store(root: Path, name: str, topic: str, bootstrap: str) -> str:
    snapshot = version_dir(str(root), name, 1)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        built = build_partition_file([], Path(scratch))
        checksums, sizes = {}, {}
        for p in range(LIVE_PARTITIONS):
            dest = snapshot / data_file(p)
            dest.parent.mkdir(parents=True)
            shutil.copyfile(built.path, dest)
            checksums[p] = checksum_file(dest).value
            sizes[p] = dest.stat().st_size
    merge = Merge("latest", "user", order_by="ts", columns=("ts", "page"))
    live = LiveConfig(topic, bootstrap, merge, (0,) * LIVE_PARTITIONS, catch_up_records=0)
    files = {p: (data_file(p),) for p in range(LIVE_PARTITIONS)}
    manifest = Manifest(
        name, 1, LIVE_PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, ("ts", "page"), (0,) * LIVE_PARTITIONS,
        created_at=time.time(), format=FORMAT_2, files=files, checksums=checksums, bytes=sizes, live=live,
    )  # fmt: skip
    write_manifest(snapshot, manifest)
    return str(snapshot)


def publish(settings: ZkSettings, record: StoreRecord) -> None:
    client = zk.connect(settings)
    try:
        client.create(zk_layout.store_path(record.name), record.to_json(), makepath=True)
    finally:
        zk.close(client)


def measure_bootstrap(settings: ZkSettings, work: Path, snapshot: str, rounds: int) -> dict[str, Any]:
    files = [Path(snapshot) / data_file(p) for p in range(PARTITIONS)]
    cps, boots = [], []
    for r in range(rounds):
        dest = work / f"cp-{r}"
        dest.mkdir()
        start = time.perf_counter()
        subprocess.run(["cp", "-r", *(str(f.parent) for f in files), str(dest)], check=True)
        cps.append(time.perf_counter() - start)
        shutil.rmtree(dest)
    replica = None
    for r in range(rounds):
        if replica is not None:
            replica.close()
        start = time.perf_counter()
        replica = LocalReplica(settings, ["big"], work / f"local-{r}", registry=None).start()
        replica.wait_ready(timeout_s=600)
        boots.append(time.perf_counter() - start)
    return {"cp_s": statistics.median(cps), "boot_s": statistics.median(boots), "replica": replica}


def evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (clean pages nobody maps): a cold start, as after a reboot.
    Otherwise each page fault would also map the cached pages around it (the kernel's fault-around)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # DONTNEED drops clean pages only: the files were just written
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure_memory(replica: LocalReplica, data_dir: Path, rows: int, size: int) -> dict[str, float]:
    """Resident memory after reading 1% of the keys, from a cold page cache: first 1% in key order (10,000
    neighbouring keys, as a tenant's or a prefix's keys are), then 1% at random."""
    files = sorted(data_dir.glob("stores/big/v*/p*/data.mdb"))
    evict(files)
    start = memory_kb()
    count = max(1, rows // 100)
    for i in range(count):
        replica.get("big", key_of(i))
    clustered = memory_kb()
    for i in random.Random(1).sample(range(count, rows), count):
        replica.get("big", key_of(i))
    scattered = memory_kb()
    return {
        "store_mb": size / 2**20,
        "read": count,
        "rss_mb": scattered["VmRSS"] / 1024,
        "clustered_file_mb": (clustered["RssFile"] - start["RssFile"]) / 1024,
        "scattered_file_mb": (scattered["RssFile"] - clustered["RssFile"]) / 1024,
        "anon_mb": (scattered["RssAnon"] - start["RssAnon"]) / 1024,
    }


def measure_reads(read: Callable[[str], Any], keys: list[str], n: int, warm: int = 200) -> dict[str, float]:
    for key in keys[:warm]:
        read(key)
    times: list[float] = []
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    clock = time.perf_counter_ns
    for i in range(n):
        key = keys[i % len(keys)]
        t = clock()
        read(key)
        times.append(clock() - t)
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    return {
        "p50_us": quantile(times, 0.5) / 1000,
        "p99_us": quantile(times, 0.99) / 1000,
        "per_s": n / wall,
        "per_cpu_s": n / cpu,
        "cpu_us": cpu / n * 1e6,
        "n": n,
    }


def measure_freshness(
    replica: LocalReplica, node_url: str, topic: str, bootstrap: str, samples: int
) -> dict[str, float]:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "log_level": 3})
    pause = random.Random(3)
    local: list[float] = []
    remote: list[float] = []
    with httpx.Client(timeout=10, trust_env=False) as http:
        for i in range(samples):
            user = f"u{i % 50}"
            p = partition_for(Partitioner.MURMUR2, user.encode(), LIVE_PARTITIONS)
            seen: dict[str, float] = {}

            def node_poll(user: str = user, ts: int = i + 1, seen: dict[str, float] = seen) -> None:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    r = http.get(f"{node_url}/stores/clicks/keys/{user}")
                    if r.status_code == 200 and r.json()["value"]["ts"] == ts:
                        seen["node"] = time.perf_counter()
                        return

            poller = threading.Thread(target=node_poll)
            # A random pause: each record meets both consumers at a random point of their fetch cycles (produced
            # right after the last one was seen, it would always meet the replica's just-started long poll).
            time.sleep(pause.uniform(0, 0.15))
            start = time.perf_counter()
            producer.produce(topic, key=user.encode(), partition=p,
                             value=json.dumps({"user": user, "ts": i + 1, "page": f"/p{i}"}).encode())  # fmt: skip
            producer.poll(0)
            poller.start()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    if replica.get("clicks", user).value["ts"] == i + 1:
                        local.append(time.perf_counter() - start)
                        break
                except Exception:
                    pass
                time.sleep(0.001)  # about an HTTP read's time: the node's poller asks as often
            poller.join()
            if "node" in seen:
                remote.append(seen["node"] - start)
            producer.flush(10)
    return {
        "local_p50_ms": quantile(local, 0.5) * 1000,
        "local_p99_ms": quantile(local, 0.99) * 1000,
        "node_p50_ms": quantile(remote, 0.5) * 1000,
        "node_p99_ms": quantile(remote, 0.99) * 1000,
        "samples": min(len(local), len(remote)),
    }


def section(command: str, rows: int, boot: dict[str, Any], mem: dict[str, float], local: dict[str, float],
            direct: dict[str, float], fresh: dict[str, float]) -> str:  # fmt: skip
    cpu_ratio = direct["cpu_us"] / local["cpu_us"]
    load = os.getloadavg()[0]
    lines = [
        SECTION,
        "",
        f"`{command}` — {datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores (shared"
        f" with other work while measured: load average {load:.0f} at the end), Python {platform.python_version()},"
        " the pure (not compiled) build.",
        f"A store of {rows:,} keys (~100-byte JSON values, {PARTITIONS} partitions, format 2), one node, one router,"
        " the embedded ZooKeeper and librdkafka's mock broker on this machine.",
        "",
        "| measure | local replica | reference | ratio |",
        "|---|---|---|---|",
        f"| bootstrap of the store from a local snapshot location (start to `wait_ready`) | {boot['boot_s']:.2f} s |"
        f" `cp` of its data.mdb files: {boot['cp_s']:.2f} s | {boot['boot_s'] / boot['cp_s']:.2f}x |",
        f"| `get` p50 / p99, one thread | {local['p50_us']:.1f} µs / {local['p99_us']:.1f} µs |"
        f" `Client` direct mode: {direct['p50_us']:.0f} µs / {direct['p99_us']:.0f} µs |"
        f" {direct['p50_us'] / local['p50_us']:.0f}x faster |",
        f"| gets per second of the reading thread's CPU (one core) | {local['per_cpu_s']:,.0f} |"
        f" {direct['per_cpu_s']:,.0f} | {local['per_cpu_s'] / direct['per_cpu_s']:.0f}x |",
        f"| gets per second of wall-clock time, one thread (the machine shared) | {local['per_s']:,.0f} |"
        f" {direct['per_s']:,.0f} | {local['per_s'] / direct['per_s']:.0f}x |",
        f"| CPU per get (the reading thread) | {local['cpu_us']:.1f} µs | {direct['cpu_us']:.0f} µs |"
        f" {cpu_ratio:.0f}x less |",
        f"| freshness: produced -> readable, p50 / p99 ({fresh['samples']} records) |"
        f" {fresh['local_p50_ms']:.1f} ms / {fresh['local_p99_ms']:.1f} ms |"
        f" through the node: {fresh['node_p50_ms']:.1f} ms / {fresh['node_p99_ms']:.1f} ms |"
        f" {fresh['node_p50_ms'] / fresh['local_p50_ms']:.2f}x |",
        f"| resident memory for 1% of the keys read in key order ({mem['read']:,} gets, cold cache) |"
        f" the store's pages mapped in (RssFile): {mem['clustered_file_mb']:.1f} MB |"
        f" the store on disk: {mem['store_mb']:.0f} MB | {mem['store_mb'] / max(mem['clustered_file_mb'], 0.1):.0f}x"
        " less |",
        f"| ... then 1% more at random ({mem['read']:,} gets) | RssFile +{mem['scattered_file_mb']:.1f} MB;"
        f" private memory (RssAnon) +{mem['anon_mb']:.1f} MB for both; VmRSS {mem['rss_mb']:.0f} MB |"
        f" the store on disk: {mem['store_mb']:.0f} MB | {mem['store_mb'] / max(mem['scattered_file_mb'], 0.1):.1f}x"
        " less |",
        "",
        "Reading the figures: bootstrap links each partition's file from the snapshot location (same filesystem)"
        " and reads it once for its checksum, as a node does; `cp` reads and writes every byte, both from the page"
        " cache. Freshness polls the replica in this process and the node over HTTP for the same record; the"
        " local replica applies with the node's applier, so both see a record after the same consume and commit."
        " Memory: the partitions are memory-mapped without read-ahead, so a read brings in only the pages on its"
        " key's path; a page (4 KiB) holds about 40 of these rows, so 1% of the keys at random fall on about a"
        " third of the leaf pages (and the kernel maps neighbouring pages with each fault: about twice that is"
        " mapped), while 1% in key order touch 1% of them. The process's own memory does not grow with"
        " the store: the mapped pages are the page cache's, shared and reclaimable.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000, help="keys of the batch store (default 1,000,000)")
    parser.add_argument("--rounds", type=int, default=3, help="bootstrap and cp rounds (median; default 3)")
    parser.add_argument("--reads", type=int, default=200_000, help="LocalReplica.get reads (default 200,000)")
    parser.add_argument("--client-reads", type=int, default=3_000, help="direct client reads (default 3,000)")
    parser.add_argument("--samples", type=int, default=200, help="freshness records (default 200)")
    parser.add_argument("--write", action="store_true", help="record the table in benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    command = "python benchmarks/local_replica.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    # On a disk (not a tmpfs: its pages would count as shared memory, not as the file's), removed at the end.
    work = Path(tempfile.mkdtemp(prefix="keyroute-local-bench-"))
    procs: list[Proc] = []
    zk_server = harness.zookeeper_server(work).start()
    kafka = MockKafka()
    replicas: list[LocalReplica] = []
    try:
        settings = ZkSettings(hosts=zk_server.connect_string, chroot="/bench")
        log(f"writing a store of {args.rows:,} keys")
        snapshot, size = write_batch_store(work / "snapshots", "big", args.rows)
        publish(settings, StoreRecord("big", PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot))
        topic = "clicks"
        kafka.create_topic(topic, LIVE_PARTITIONS)
        live_snapshot = write_live_store(work / "snapshots", "clicks", topic, kafka.bootstrap_servers)
        publish(settings, StoreRecord("clicks", LIVE_PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, 1,
                                      live_snapshot, ("ts", "page"), live=True))  # fmt: skip

        log("bootstrap: LocalReplica vs cp")
        boot = measure_bootstrap(settings, work, snapshot, args.rounds)
        replica: LocalReplica = boot.pop("replica")
        replicas.append(replica)
        log("memory after reading 1% of the keys")
        mem = measure_memory(replica, work / f"local-{args.rounds - 1}", args.rows, size)

        node_port, router_port = harness.free_port(), harness.free_port()
        procs.append(Proc(["node", "--zk", settings.connect_string, "--node-id", "n1", "--port", str(node_port),
                           "--data-dir", str(work / "node")], work / "node.log"))  # fmt: skip
        procs.append(Proc(["router", "--zk", settings.connect_string, "--port", str(router_port)], work / "router.log"))
        node_url, router_url = f"http://127.0.0.1:{node_port}", f"http://127.0.0.1:{router_port}"
        log("starting a node and a router")
        wait(lambda: httpx.get(router_url + "/readyz", timeout=5).json().get("complete") is True, 600, "the cluster")

        rng = random.Random(2)
        keys = [key_of(i) for i in rng.sample(range(args.rows), min(args.rows, 20_000))]
        log(f"reads: LocalReplica.get x{args.reads:,}")
        local = measure_reads(lambda key: replica.get("big", key), keys, args.reads)
        log(f"reads: Client direct x{args.client_reads:,}")
        with Client(router_url, routing="direct") as client:
            direct = measure_reads(lambda key: client.get("big", key), keys, args.client_reads)

        log("freshness")
        live = LocalReplica(settings, ["clicks"], work / "local-live", registry=None).start()
        replicas.append(live)
        live.wait_ready(timeout_s=120)
        wait(lambda: httpx.get(node_url + "/stores/clicks/keys/none", timeout=5).status_code == 404, 120, "live node")
        fresh = measure_freshness(live, node_url, topic, kafka.bootstrap_servers, args.samples)

        text = section(command, args.rows, boot, mem, local, direct, fresh)
        print(text)
        if args.write:
            harness.write_section(SECTION, text)
    finally:
        for replica in replicas:
            replica.close()
        for proc in procs:
            proc.stop()
        kafka.close()
        zk_server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
