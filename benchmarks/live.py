"""Live stores end to end: how soon a produced event can be read through the router, how fast nodes apply
a backlog, and whether the state they end with is exactly the fold of every event produced.

Run from the repository root: `.venv/bin/python benchmarks/live.py [--write]`; --write records the figures
in the "## Live stores" section of benchmarks/RESULTS.md (other sections are left as they are).

Everything runs on this machine, in real processes: the embedded ZooKeeper, a Kafka-protocol broker
(librdkafka's mock cluster, in a child process), `keyroute pipeline build` publishing two live-only stores on
one topic (`latest` by ts, and an aggregate: count(*), sum(qty), max_by(price, ts)), three nodes
(replication factor 2) and a router. A producer process writes events at a fixed rate, keyed and
partitioned as Kafka's Java client does (murmur2), with an occasional tombstone.

1. Freshness: every `--sample-every`-th event is watched: a reader polls the router for its key until the
   answer holds that event (or a later one); produced -> first read that returns it, p50/p99. Background
   readers read random keys meanwhile. Midway, one node is killed with SIGKILL and restarted on its data.
2. Exactness: after the producer stops, every node is read directly (batch-get of every key it serves,
   bounded by `min_offsets` = the last produced offset of each partition) and every answer is compared,
   key by key, with an independent fold of every event produced (plain Python here, not keyroute's).
3. Catch-up: a backlog of `--backlog` events is produced first, then one node is started on a fresh store
   of each mode; time until it serves every partition (caught up), records/s.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import platform
import random
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md
import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from keyroute.dev.kafka_mock import MockKafka  # noqa: E402
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper  # noqa: E402
from keyroute.keys.partitioner import Partitioner, partition_for  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Live stores"
PARTITIONS = 6
# The mock broker answers a fetch only when fetch.wait.max.ms is over, even when records arrive meanwhile (a
# Kafka broker answers as soon as fetch.min.bytes are there): the stores ask for a short wait, through the
# spec's `kafka` table, so that the mock's wait does not stand in for the nodes' freshness.
FETCH_WAIT_MS = 10
# Samples produced from the kill -9 until this long after the restart are set apart in the figures.
KILL_WINDOW_S = 10.0
# A reader's pooled connection idle this long is closed rather than reused (the router closes them at 5 s).
IDLE_REUSE_S = 4.0
LATEST, AGGREGATE = "live_latest", "live_totals"


# -- plumbing ---------------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def pid_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` so far (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


Proc = harness.Proc  # `python -m keyroute ...` of this tree, its output in a log file


# -- the broker: its own process, so its CPU is told apart from the readers' -----------------------------


def _broker_main(topics: dict[str, int], conn: Any) -> None:
    with MockKafka() as kafka:
        for topic, partitions in topics.items():
            kafka.create_topic(topic, partitions)
        conn.send(kafka.bootstrap_servers)
        conn.recv()  # until the benchmark says stop


class Broker:
    """librdkafka's mock cluster in a child process, with the topics given."""

    def __init__(self, topics: dict[str, int]) -> None:
        self._conn, child = multiprocessing.Pipe()
        self.process = multiprocessing.Process(target=_broker_main, args=(topics, child), daemon=True)
        self.process.start()
        self.bootstrap_servers: str = self._conn.recv()

    def cpu_s(self) -> float:
        return pid_cpu_s(self.process.pid)

    def close(self) -> None:
        self._conn.send("stop")
        self.process.join(10)


# -- the events ---------------------------------------------------------------------------------------------


def key_of(i: int) -> str:
    return f"acct-{i:06d}"


def event(rng: random.Random, seq: int, keys: int) -> tuple[str, dict[str, Any] | None]:
    """Event `seq` of the stream: (key, value or None for a tombstone); the same seed gives the same stream."""
    key = key_of(rng.randrange(keys))
    if rng.random() < 0.002:
        return key, None
    return key, {"ts": seq, "seq": seq, "qty": rng.randrange(1, 100), "price": rng.randrange(1, 10_000) / 100}


def fold(events: list[tuple[str, dict[str, Any] | None]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The expected state of both stores after these events, in topic order, written independently of
    keyroute: latest by ts (every ts distinct), and count(*)/sum(qty)/max_by(price, ts); a tombstone
    deletes the key from both."""
    latest: dict[str, Any] = {}
    totals: dict[str, Any] = {}
    for key, value in events:
        if value is None:
            latest.pop(key, None)
            totals.pop(key, None)
            continue
        if key not in latest or latest[key]["ts"] < value["ts"]:
            latest[key] = value
        held = totals.get(key)
        if held is None:
            totals[key] = {"trades": 1, "volume": value["qty"], "last_price": value["price"], "_ts": value["ts"]}
        else:
            held["trades"] += 1
            held["volume"] += value["qty"]
            if value["ts"] >= held["_ts"]:
                held["last_price"], held["_ts"] = value["price"], value["ts"]
    return latest, {k: {n: v for n, v in t.items() if n != "_ts"} for k, t in totals.items()}


def produce(
    bootstrap: str,
    topic: str,
    seed: int,
    start_seq: int,
    count: int,
    rate: float,
    keys: int,
    sample_every: int,
    samples: Any,
    done: Any,
) -> None:
    """A producer process: `count` events from `start_seq` at `rate`/s (0: as fast as it can). Sampled
    events go to `samples` as (key, seq, wall time just before produce) once delivered; the last delivered
    offset per partition goes to `done` at the end."""
    import confluent_kafka

    producer = confluent_kafka.Producer(
        {
            "bootstrap.servers": bootstrap,
            "partitioner": "murmur2_random",
            "linger.ms": 2,
            "log_level": 3,
            "queue.buffering.max.messages": 1_000_000,
        }
    )
    rng = random.Random(seed)
    for _ in range(start_seq):
        event(rng, 0, keys)
    last: dict[int, int] = {}

    def delivered(err: Any, msg: Any, key: str, seq: int, t0: float | None) -> None:
        if err is not None:
            raise SystemExit(f"undelivered event {seq}: {err}")
        last[msg.partition()] = max(last.get(msg.partition(), -1), msg.offset())
        if t0 is not None:
            samples.put((key, seq, t0, time.time()))

    began = time.monotonic()
    for n in range(count):
        seq = start_seq + n
        if rate:
            ahead = began + n / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        key, value = event(rng, seq, keys)
        sampled = value is not None and seq % sample_every == 0
        t0 = time.time() if sampled else None
        payload = None if value is None else json.dumps(value).encode()
        while True:
            try:
                producer.produce(
                    topic,
                    key=key.encode(),
                    value=payload,
                    on_delivery=lambda err, msg, key=key, seq=seq, t0=t0: delivered(err, msg, key, seq, t0),
                )
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    producer.flush(60)
    done.put(last)


def bare_consumer(bootstrap: str, topic: str, ready: Any, stop: Any, results: Any) -> None:
    """The reference: a consumer process that does nothing with the records (confluent-kafka, assigned every
    partition from its end, the stores' fetch.wait.max.ms). Per record: its receipt time minus the record's
    timestamp (CreateTime, stamped by the producer's client in produce()), in ms; the percentiles go to
    `results` once `stop` is set."""
    import confluent_kafka

    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bare-{os.getpid()}",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": FETCH_WAIT_MS,
            "log_level": 3,
        }
    )
    consumer.assign([confluent_kafka.TopicPartition(topic, p, confluent_kafka.OFFSET_END) for p in range(PARTITIONS)])
    delays: list[float] = []
    signalled = False
    while not stop.is_set():
        msg = consumer.poll(0.05)  # returns as soon as a record is there (consume(n, t) would wait for n or t)
        if not signalled:
            ready.set()  # assigned and fetching: the producer may start
            signalled = True
        if msg is not None and msg.error() is None:
            delays.append(time.time() * 1000 - msg.timestamp()[1])
    consumer.close()
    results.put(
        {
            "records": len(delays),
            "p50_ms": percentile(delays, 50) if delays else float("nan"),
            "p99_ms": percentile(delays, 99) if delays else float("nan"),
        }
    )


def expected_events(seed: int, count: int, keys: int) -> list[tuple[str, dict[str, Any] | None]]:
    rng = random.Random(seed)
    return [event(rng, seq, keys) for seq in range(count)]


# -- the cluster ------------------------------------------------------------------------------------------


def spec(bootstrap: str, topic: str, stores: tuple[str, ...]) -> str:
    text = ""
    if LATEST in stores:
        text += f"""
[stores.{LATEST}]
key = "account"
partitions = {PARTITIONS}
replication_factor = 2
mode = "latest"
order_by = "ts"

[stores.{LATEST}.live]
topic = "{topic}"
bootstrap_servers = "{bootstrap}"
start = "earliest"
kafka = {{ "fetch.wait.max.ms" = {FETCH_WAIT_MS} }}
"""
    if AGGREGATE in stores:
        text += f"""
[stores.{AGGREGATE}]
key = "account"
partitions = {PARTITIONS}
replication_factor = 2
mode = "aggregate"
aggregations = {{ trades = "count(*)", volume = "sum(qty)", last_price = "max_by(price, ts)" }}

[stores.{AGGREGATE}.live]
topic = "{topic}"
bootstrap_servers = "{bootstrap}"
start = "earliest"
kafka = {{ "fetch.wait.max.ms" = {FETCH_WAIT_MS} }}
"""
    return text


@dataclass
class Cluster:
    work: Path
    zk: str
    nodes: dict[str, tuple[Proc, str, Path]] = field(default_factory=dict)
    router: Proc | None = None
    router_url: str = ""

    def build(self, spec_text: str, name: str) -> float:
        path = self.work / f"{name}.toml"
        path.write_text(spec_text)
        began = time.monotonic()
        with open(self.work / "pipeline.log", "ab") as out:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "keyroute",
                    "pipeline",
                    "build",
                    "--spec",
                    str(path),
                    "--zk",
                    self.zk,
                    "--output",
                    str(self.work / "snapshots"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                check=True,
            )
        return time.monotonic() - began

    def start_node(self, node_id: str) -> str:
        port = harness.free_port()
        data = self.work / f"data-{node_id}"
        args = [
            "node",
            "--zk",
            self.zk,
            "--node-id",
            node_id,
            "--port",
            str(port),
            "--data-dir",
            str(data),
            "--zk-session-timeout-s",
            "4",
        ]
        url = f"http://127.0.0.1:{port}"
        self.nodes[node_id] = (Proc(args, self.work / f"{node_id}.log"), url, data)
        return url

    def restart_node(self, node_id: str) -> None:
        _, url, data = self.nodes[node_id]
        port = url.rsplit(":", 1)[1]
        args = [
            "node",
            "--zk",
            self.zk,
            "--node-id",
            node_id,
            "--port",
            port,
            "--data-dir",
            str(data),
            "--zk-session-timeout-s",
            "4",
        ]
        self.nodes[node_id] = (Proc(args, self.work / f"{node_id}.log"), url, data)

    def start_router(self) -> str:
        port = harness.free_port()
        self.router = Proc(["router", "--zk", self.zk, "--port", str(port)], self.work / "router.log")
        self.router_url = f"http://127.0.0.1:{port}"
        return self.router_url

    def serving(self, store: str, replicas: int) -> bool:
        m = httpx.get(self.router_url + "/admin/partition-map?detail=all", timeout=5).json()
        entries = m["stores"].get(store, {}).get("partition_map", [])
        return len(entries) == PARTITIONS and all(len(e["serving"]) >= replicas for e in entries)

    def close(self) -> None:
        if self.router is not None:
            self.router.stop()
        for proc, _, _ in self.nodes.values():
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc, _, _ in self.nodes.values():
            proc.stop()


# -- 1. freshness -----------------------------------------------------------------------------------------


class RawClient:
    """A bare HTTP/1.1 keep-alive client over one connection: far less of the machine's CPU per read than
    httpx, so the readers disturb what they measure as little as possible (the machine has 2 cores)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.last_used = time.monotonic()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    async def get(self, path: str) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        try:
            self.writer.write(f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
            head = await self.reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            return status, await self.reader.readexactly(length)
        except (OSError, asyncio.IncompleteReadError, ValueError):
            self.writer.close()
            self.writer = None
            raise


async def watch(
    router: str,
    samples: Any,
    stop: threading.Event,
    latencies: list[tuple[float, float, float]],
    failures: list[str],
    poll_s: float,
    background_rps: float,
    keys: int,
) -> dict[str, Any]:
    """Poll the router for every sampled event until an answer holds it; background reads meanwhile."""
    counts: dict[str, Any] = {"reads": 0, "errors": 0, "background": 0, "error_kinds": {}}

    def failed(kind: str) -> None:
        counts["errors"] += 1
        counts["error_kinds"][kind] = counts["error_kinds"].get(kind, 0) + 1

    host, port = router.removeprefix("http://").rsplit(":", 1)
    idle: list[RawClient] = []

    async def get(path: str) -> tuple[int, bytes]:
        # The router closes a connection idle for 5 s (keep_alive_timeout_s): as HTTP clients do, a pooled
        # connection idle that long is not reused.
        client = None
        while idle:
            candidate = idle.pop()
            if time.monotonic() - candidate.last_used < IDLE_REUSE_S:
                client = candidate
                break
            candidate.close()
        client = client or RawClient(host, int(port))
        status, body = await client.get(path)
        client.last_used = time.monotonic()
        idle.append(client)
        return status, body

    async def one(key: str, seq: int, t0: float, acked: float) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                status, body = await get(f"/stores/{LATEST}/keys/{quote(key, safe='')}")
                counts["reads"] += 1
                if status == 200 and json.loads(body)["value"]["seq"] >= seq:
                    now = time.time()
                    latencies.append((now - t0, now - acked, t0))
                    return
                if status not in (200, 404):
                    failed(f"{status} {body[:80].decode(errors='replace')}")
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                failed(type(exc).__name__)
            await asyncio.sleep(poll_s)
        failures.append(f"event {seq} of {key} not readable within 30 s")

    async def background() -> None:
        rng = random.Random(5)
        while not stop.is_set():
            key = key_of(rng.randrange(keys))
            try:
                status, _ = await get(f"/stores/{AGGREGATE}/keys/{quote(key, safe='')}")
                counts["background"] += 1
                if status not in (200, 404):
                    failed(f"{status} {_[:80].decode(errors='replace')}")
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                failed(type(exc).__name__)
            await asyncio.sleep(1 / background_rps)

    tasks: set[asyncio.Task[None]] = set()
    bg = [asyncio.create_task(background()) for _ in range(4)]
    loop = asyncio.get_running_loop()
    while not stop.is_set() or not samples.empty():
        try:
            key, seq, t0, acked = await loop.run_in_executor(None, samples.get, True, 0.2)
        except Exception:  # queue.Empty
            continue
        task = asyncio.create_task(one(key, seq, t0, acked))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    for task in bg:
        task.cancel()
    await asyncio.gather(*bg, return_exceptions=True)
    return counts


# -- 2. exactness -------------------------------------------------------------------------------------------


def compare(cluster: Cluster, store: str, expected: dict[str, Any], last: dict[int, int], keys: int) -> dict[str, int]:
    """Every node, directly, for every key of the partitions it serves, against the independent fold."""
    by_partition: dict[int, list[str]] = {p: [] for p in range(PARTITIONS)}
    for i in range(keys):
        key = key_of(i)
        by_partition[partition_for(Partitioner.MURMUR2, key.encode(), PARTITIONS)].append(key)
    m = httpx.get(cluster.router_url + "/admin/partition-map?detail=all", timeout=5).json()
    nodes = {name: url for name, (_, url, _) in cluster.nodes.items()}
    checked = wrong = 0
    for entry in m["stores"][store]["partition_map"]:
        p = entry["partition"]
        for replica in entry["serving"]:
            url = nodes[replica["node"]]
            keys_of_p = by_partition[p]
            results: list[dict[str, Any]] = []
            for start in range(0, len(keys_of_p), 500):  # under the nodes' --max-batch-keys
                body = {"keys": keys_of_p[start : start + 500], "min_offsets": {str(p): last.get(p, -1)}}

                def answered(url: str = url, body: dict[str, Any] = body) -> list[dict[str, Any]] | None:
                    answer = httpx.post(f"{url}/stores/{store}/batch-get", json=body, timeout=30)
                    answer.raise_for_status()
                    got = answer.json()["results"]
                    return None if any(r.get("error") == "not_up_to_bound" for r in got) else got

                results += harness.wait(answered, 120, f"{store} p{p} on {replica['node']} up to offset {last.get(p)}")
            for key, result in zip(keys_of_p, results, strict=True):
                want = expected.get(key)
                got = result.get("value") if result.get("status", 200) == 200 and "value" in result else None
                checked += 1
                if got != want:
                    wrong += 1
                    if wrong <= 5:
                        log(f"MISMATCH {store} {key} on {replica['node']}: {got!r} != {want!r}")
    return {"checked": checked, "wrong": wrong}


# -- 3. catch-up --------------------------------------------------------------------------------------------


def catch_up(work: Path, zk_server: EmbeddedZooKeeper, kafka: Broker, args: argparse.Namespace) -> dict[str, Any]:
    topic = "backlog"
    samples, done = multiprocessing.Queue(), multiprocessing.Queue()
    began = time.monotonic()
    producer = multiprocessing.Process(
        target=produce, args=(kafka.bootstrap_servers, topic, 9, 0, args.backlog, 0, args.keys, 10**12, samples, done)
    )
    producer.start()
    producer.join()
    produced_s = time.monotonic() - began
    log(f"backlog of {args.backlog:,} events produced in {produced_s:.1f} s")
    results: dict[str, Any] = {"produce_s": produced_s}
    for store in (LATEST, AGGREGATE):
        sub = work / f"catchup-{store}"
        sub.mkdir()
        cluster = Cluster(sub, f"{zk_server.connect_string}/catchup-{store}")
        try:
            cluster.start_router()
            cluster.build(spec(kafka.bootstrap_servers, topic, (store,)), store)
            began = time.monotonic()
            cluster.start_node("n1")
            harness.wait(lambda s=store, c=cluster: c.serving(s, 1), 1800, f"{store} caught up", interval_s=0.1)
            seconds = time.monotonic() - began
            results[store] = {"seconds": seconds, "per_s": args.backlog / seconds}
            log(f"{store}: caught up on {args.backlog:,} events in {seconds:.1f} s ({args.backlog / seconds:,.0f}/s)")
        finally:
            cluster.close()
    return results


# -- main -------------------------------------------------------------------------------------------------


def one_rate(
    work: Path, zk_server: EmbeddedZooKeeper, kafka: Broker, args: argparse.Namespace, rate: float
) -> dict[str, Any]:
    """A fresh cluster (chroot, topic, nodes, router) producing at `rate`: freshness, then exactness."""
    topic = f"events-{rate:g}"
    sub = work / topic
    sub.mkdir()
    out: dict[str, Any] = {"rate": rate}
    cluster = Cluster(sub, f"{zk_server.connect_string}/{topic}")
    try:
        cluster.start_router()
        build_s = cluster.build(spec(kafka.bootstrap_servers, topic, (LATEST, AGGREGATE)), "stores")
        log(f"published both live stores in {build_s:.1f} s")
        for i in range(3):
            cluster.start_node(f"node-{i}")
        for store in (LATEST, AGGREGATE):
            harness.wait(lambda s=store: cluster.serving(s, 2), 120, f"{store} served by 2 replicas", interval_s=0.2)
        total = int(rate * args.duration_s)
        sample_every = max(1, round(args.sample_every * rate / 5000))  # about the same samples/s at any rate
        samples, done = multiprocessing.Queue(), multiprocessing.Queue()
        producer = multiprocessing.Process(
            target=produce,
            args=(kafka.bootstrap_servers, topic, args.seed, 0, total, rate, args.keys, sample_every, samples, done),
        )
        stop = threading.Event()
        latencies: list[tuple[float, float, float]] = []
        failures: list[str] = []
        counts: dict[str, Any] = {}

        def reader() -> None:
            counts.update(
                asyncio.run(
                    watch(
                        cluster.router_url,
                        samples,
                        stop,
                        latencies,
                        failures,
                        args.poll_ms / 1000,
                        args.background_rps,
                        args.keys,
                    )
                )
            )

        watcher = threading.Thread(target=reader)
        bare_ready, bare_stop, bare_results = multiprocessing.Event(), multiprocessing.Event(), multiprocessing.Queue()
        bare = multiprocessing.Process(
            target=bare_consumer, args=(kafka.bootstrap_servers, topic, bare_ready, bare_stop, bare_results)
        )
        bare.start()
        if not bare_ready.wait(60):
            raise RuntimeError("the bare consumer did not start")
        log(f"producing {total:,} events at {rate:,.0f}/s for {args.duration_s:.0f} s")

        def cpu_by_part() -> dict[str, float]:
            own = resource.getrusage(resource.RUSAGE_SELF)
            return {
                "nodes": sum(pid_cpu_s(proc.popen.pid) for proc, _, _ in cluster.nodes.values()),
                "router": pid_cpu_s(cluster.router.popen.pid if cluster.router else None),
                "producer": pid_cpu_s(producer.pid),
                "bare consumer": pid_cpu_s(bare.pid),
                "readers (this process)": own.ru_utime + own.ru_stime,
            }

        broker_cpu, began = kafka.cpu_s(), time.monotonic()
        producer.start()
        watcher.start()
        cpu_start = cpu_by_part()
        time.sleep(args.duration_s / 2)
        victim = "node-1"
        killed_at = time.time()
        cpu_killed = pid_cpu_s(cluster.nodes[victim][0].popen.pid)
        cluster.nodes[victim][0].kill9()
        log(f"killed {victim} (SIGKILL)")
        time.sleep(3)
        cluster.restart_node(victim)
        restarted_at = time.time()
        log(f"restarted {victim} on its data")
        seen = cpu_by_part()
        while producer.is_alive():  # its CPU is read while it runs: the process is gone after the join
            seen = cpu_by_part()
            producer.join(0.5)
        producer.join()
        cpu_end = {**cpu_by_part(), "producer": seen["producer"]}
        produce_s = time.monotonic() - began
        broker_share = (kafka.cpu_s() - broker_cpu) / produce_s
        cpu_end["nodes"] += cpu_killed  # the killed incarnation's CPU up to its kill
        shares = {part: (cpu_end[part] - cpu_start[part]) / produce_s for part in cpu_start}
        last = done.get(timeout=60)
        stop.set()
        watcher.join()
        bare_stop.set()
        reference = bare_results.get(timeout=60)
        bare.join(10)
        produced = [t for t, _, _ in latencies]
        after_ack = [t for _, t, _ in latencies]
        # Samples produced away from the kill: before it, or more than KILL_WINDOW_S after the restart.
        away = [t for t, _, t0 in latencies if t0 < killed_at or t0 > restarted_at + KILL_WINDOW_S]
        out["freshness"] = {
            "events": total,
            "samples": len(latencies),
            "failures": failures,
            **counts,
            "p50_ms": percentile(produced, 50) * 1000,
            "p99_ms": percentile(produced, 99) * 1000,
            "max_ms": max(produced) * 1000,
            "mean_ms": statistics.fmean(produced) * 1000,
            "ack_p50_ms": percentile(after_ack, 50) * 1000,
            "ack_p99_ms": percentile(after_ack, 99) * 1000,
            "away_samples": len(away),
            "away_p50_ms": percentile(away, 50) * 1000 if away else float("nan"),
            "away_p99_ms": percentile(away, 99) * 1000 if away else float("nan"),
            "bare": reference,
            "produce_s": produce_s,
            "broker_cpu": broker_share,
            "cpu_shares": shares,
            "sample_every": sample_every,
        }
        log(
            f"a bare consumer: {reference}; away from the kill: {len(away)} samples, "
            f"p50 {out['freshness']['away_p50_ms']:.1f} ms, p99 {out['freshness']['away_p99_ms']:.1f} ms; "
            f"read errors {counts.get('error_kinds')}"
        )
        log(f"producing took {produce_s:.1f} s; the broker process used {broker_share:.0%} of a core meanwhile")
        log(
            f"freshness: {out['freshness']['p50_ms']:.1f} ms p50, {out['freshness']['p99_ms']:.1f} ms p99 "
            f"over {len(latencies)} samples, {len(failures)} failures, {counts.get('errors')} read errors"
        )
        for store in (LATEST, AGGREGATE):
            harness.wait(
                lambda s=store: cluster.serving(s, 2),
                120,
                f"{store} served by 2 replicas after the restart",
                interval_s=0.2,
            )
        latest, totals = fold(expected_events(args.seed, total, args.keys))
        out["exact"] = {
            LATEST: compare(cluster, LATEST, latest, last, args.keys),
            AGGREGATE: compare(cluster, AGGREGATE, totals, last, args.keys),
        }
        log(f"exactness: {out['exact']}")
    finally:
        cluster.close()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="keyroute-live-bench-"))
    zk_server = harness.zookeeper_server(work)
    zk_server.start()
    kafka = Broker({"backlog": PARTITIONS, **{f"events-{rate:g}": PARTITIONS for rate in args.rates}})
    out: dict[str, Any] = {"runs": []}
    try:
        for rate in args.rates:
            out["runs"].append(one_rate(work, zk_server, kafka, args, rate))
        if args.backlog:
            out["catch_up"] = catch_up(work, zk_server, kafka, args)
    finally:
        kafka.close()
        zk_server.stop()
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return out


def section(out: dict[str, Any], args: argparse.Namespace, command: str) -> str:
    date = datetime.date.today().isoformat()
    lines = [
        SECTION,
        "",
        f"`{command}` on {date}. Machine: {os.cpu_count()} CPUs, {platform.machine()}, Python "
        f"{platform.python_version()}; 1-minute load average {os.getloadavg()[0]:.1f} at the end. Everything on "
        "this machine: embedded ZooKeeper, librdkafka's mock cluster (a Kafka-protocol broker, in a process of its "
        f"own), two live-only stores on one topic of {PARTITIONS} partitions (`latest` by ts; `aggregate` "
        "count(*), sum(qty), max_by(price, ts)) published by `keyroute pipeline build`, 3 nodes (replication "
        "factor 2), 1 router; a producer process (confluent-kafka, murmur2 partitioner, linger.ms 2) at a fixed "
        f"rate over {args.keys:,} keys, 0.2% tombstones. The stores set `fetch.wait.max.ms = {FETCH_WAIT_MS}` "
        "in their `kafka` table: the mock broker holds every fetch for that long even when records arrive "
        "(a Kafka broker answers as soon as there are records), so its default wait would be measured instead "
        "of the nodes.",
        "",
        "### Produced -> readable through the router",
        "",
        f"Per rate, a fresh cluster; {args.duration_s:g} s of events at that rate (the producer paces itself and "
        "falls behind when the machine is saturated: 'produced in' shows it); about 25 watched events per second: "
        f"a reader polls the router every {args.poll_ms:g} ms until the answer holds the event (the poll interval "
        "bounds the resolution; the clock starts just before the producer's `produce()`; 'from the broker's ack' "
        "starts it at the producer's delivery report instead, when the broker has the event: what is left is "
        "keyroute's part); "
        f"{args.background_rps * 4:,.0f} background reads/s of the aggregate store meanwhile. Midway node-1 is "
        "killed with SIGKILL and restarted "
        f"3 s later on its data directory; 'away from the kill' leaves out the samples produced from the kill "
        f"until {KILL_WINDOW_S:g} s after the restart. Readers use a bare keep-alive HTTP client, to take as little "
        "of the 2 cores as they can. **The reference**, in the same run: a bare consumer process (confluent-kafka, "
        "every partition, the stores' fetch.wait.max.ms, doing nothing with the records): receipt time minus each "
        "record's timestamp, which the producer's client stamps in produce(): what this machine and this broker "
        "give any consumer, before keyroute does anything.",
        "",
        "| events/s asked | events | produced in s | broker CPU (share of a core) | samples | p50 ms | p99 ms | max ms "
        "| from the broker's ack: p50 ms | p99 ms | away from the kill: samples | p50 ms | p99 ms "
        "| **a bare consumer**: p50 ms | p99 ms | not readable in 30 s | read errors (non-200/404) "
        "| p50 <= 100 ms | p99 <= 500 ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | --- | --- |",
        *(
            f"| {r['rate']:,.0f} | {f['events']:,} | {f['produce_s']:.1f} | {f['broker_cpu']:.0%} | {f['samples']:,} "
            f"| {f['p50_ms']:.1f} | {f['p99_ms']:.1f} | {f['max_ms']:.1f} "
            f"| {f['ack_p50_ms']:.1f} | {f['ack_p99_ms']:.1f} "
            f"| {f['away_samples']:,} | {f['away_p50_ms']:.1f} | {f['away_p99_ms']:.1f} "
            f"| {f['bare']['p50_ms']:.1f} | {f['bare']['p99_ms']:.1f} "
            f"| {len(f['failures'])} "
            f"| {f.get('errors', 0)} "
            f"| {'met' if f['p50_ms'] <= 100 else 'MISSED'} | {'met' if f['p99_ms'] <= 500 else 'MISSED'} |"
            for r in out["runs"]
            for f in [r["freshness"]]
        ),
        "",
        *(
            f"- {r['rate']:,.0f} events/s: keyroute's p50"
            f" {r['freshness']['p50_ms'] / r['freshness']['bare']['p50_ms']:.1f}x"
            f" and p99 {r['freshness']['p99_ms'] / r['freshness']['bare']['p99_ms']:.1f}x the bare consumer's"
            f" ({r['freshness']['bare']['records']:,} records timed); away from the kill p50"
            f" {r['freshness']['away_p50_ms'] / r['freshness']['bare']['p50_ms']:.1f}x, p99"
            f" {r['freshness']['away_p99_ms'] / r['freshness']['bare']['p99_ms']:.1f}x. Read errors:"
            f" {', '.join(f'{n} x {k}' for k, n in r['freshness']['error_kinds'].items()) or 'none'}."
            f" CPU while producing (share of a core): broker {r['freshness']['broker_cpu']:.0%}, "
            + ", ".join(f"{part} {share:.0%}" for part, share in r["freshness"]["cpu_shares"].items())
            + f" (of {os.cpu_count()} cores)."
            for r in out["runs"]
        ),
        "",
        "### Final state vs an independent fold",
        "",
        "After the producer stopped (and after the kill -9 and restart): every node read directly (batch-get of "
        "every key of each partition it serves, `min_offsets` = that partition's last produced offset), every "
        "answer compared with a plain-Python fold of every event produced (not keyroute's code).",
        "",
        "| events/s asked | store | answers compared | wrong |",
        "| ---: | --- | ---: | ---: |",
        *(
            f"| {r['rate']:,.0f} | {s} | {e['checked']:,} | {e['wrong']} |"
            for r in out["runs"]
            for s, e in r["exact"].items()
        ),
        "",
    ]
    if "catch_up" in out:
        c = out["catch_up"]
        lines += [
            "### Catch-up: one node applying a backlog",
            "",
            f"{args.backlog:,} events produced first (in {c['produce_s']:.1f} s, as fast as the producer goes), then "
            "a live-only store published from the topic's start and ONE node started: node start -> every partition "
            "served (caught up: lag under the store's catch_up_records); the node's apply rate is events / time "
            "(process start and ZooKeeper join included).",
            "",
            "| store | seconds | events/s |",
            "| --- | ---: | ---: |",
            *(f"| {s} | {c[s]['seconds']:.1f} | {c[s]['per_s']:,.0f} |" for s in (LATEST, AGGREGATE)),
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rates",
        type=lambda t: [float(x) for x in t.split(",")],
        default=[5000.0, 2500.0, 1000.0],
        help="events produced per second, one cluster run per rate (comma-separated)",
    )
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--sample-every", type=int, default=200)
    parser.add_argument("--poll-ms", type=float, default=10.0)
    parser.add_argument("--background-rps", type=float, default=50.0, help="per background reader (4 of them)")
    parser.add_argument("--backlog", type=int, default=1_000_000, help="catch-up backlog (0: skip)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--write", action="store_true", help="record the figures in benchmarks/RESULTS.md")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs of every process)")
    args = parser.parse_args(argv)
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/live.py", *(argv or sys.argv[1:])])
    out = run(args)
    text = section(out, args, command)
    print(text)
    if args.write:
        harness.write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
