"""`keyroute demo`: the whole system on one machine with generated sample data.

Embedded ZooKeeper, the Spark pipeline, three state nodes (replication 2), a router and keyroute's development
Schema Registry, each its own process, and a Kafka-protocol broker (librdkafka's mock cluster, in this
process) with producers writing quotes (JSON) to the topic the live store `quotes` follows and ticks (Avro,
with confluent-kafka's AvroSerializer and that registry) to the topic the live store `ticks` follows.
Ctrl-C, SIGTERM and SIGHUP (a closed terminal) stop them all, router first, ZooKeeper last, and leave nothing behind.

A state node that dies once the demo is up (`keyroute demo kill-node N`, a `kill -9` of its PID, a crash) does not
end the demo: that is what the demo is for. The demo says so, reads go on from the other replicas (every demo
store has two), the map page names the node that died, and after `restart_after_s` the demo starts it again on
the same port and data directory, where it takes its partitions back from its disk. The demo's other
processes (ZooKeeper, the router, the Schema Registry) have no replica: one of them dying ends the demo.

If the demo's own process dies without cleaning up (kill -9, an out-of-memory kill), its children go with
it: on Linux each is started through a few lines of Python that ask the kernel for SIGKILL when their
parent dies (prctl PR_SET_PDEATHSIG) and then exec the real command, which keeps the setting. A launcher
rather than subprocess's `preexec_fn`, which is not safe once the process has threads (the quotes producer
and librdkafka's); the kernel rather than children watching their parent, which every kind of child (the
JVM of ZooKeeper included) would have to do itself.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn
from urllib.parse import quote

from keyroute.dev import sample_data
from keyroute.dev.kafka_mock import MockKafka
from keyroute.dev.zookeeper_server import is_serving, terminate


@dataclass(frozen=True, slots=True)
class DemoSettings:
    router_port: int = 8080
    workdir: Path = Path(".keyroute-demo")
    events: int = 120_000
    nodes: int = 3
    host: str = "127.0.0.1"
    ready_timeout_s: float = 180.0
    quotes_per_s: float = 20.0
    live_partitions: int = 6
    # Long enough for the node's ZooKeeper session to expire first, so that the page shows it gone.
    restart_after_s: float = 20.0


# The demo's processes and their PIDs (`keyroute demo kill-node` reads it), in the demo's work directory.
PIDS_FILE = "pids.json"


class DemoError(RuntimeError):
    pass


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _port_in_use(host: str, port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex((host, port)) == 0


# Run in a child before its real command: SIGKILL when the parent (the demo) dies, then exec the command.
# PR_SET_PDEATHSIG survives exec; the getppid check covers a demo that died before the prctl.
_LAUNCHER = """\
import ctypes, os, signal, sys
parent = int(sys.argv[1])
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:
        sys.exit(1)
os.execv(sys.executable, [sys.executable, "-m", "keyroute", *sys.argv[2:]])
"""


def _launch(args: list[str]) -> list[str]:
    """The command line that runs `keyroute ARGS` as a child that dies with this process."""
    return [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *args]


_SPEC_HEADER = """\
# The stores of `keyroute demo`, built from the sample events in events/ (relative paths are taken
# relative to this file). A template for a cluster of your own: see "Your first cluster" in README.md.

"""
_LIVE_HEADER = """\
# quotes and ticks follow topics on the demo's own Kafka-protocol broker, and ticks' Avro schemas are in the
# demo's development Schema Registry; both stop with the demo: outside the demo, remove these stores or point
# bootstrap_servers (and schema_registry.url) at a Kafka cluster (and Schema Registry) of yours.
"""


class _Processes:
    """Child processes in their own sessions, so the demo decides the order they stop in."""

    def __init__(self, logs: Path, pids: Path | None = None) -> None:
        self.logs = logs
        self.pids = pids
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.args: dict[str, list[str]] = {}

    def start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen(
            _launch(args),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.children = [(n, p) for n, p in self.children if n != name]
        self.children.append((name, proc))
        self.args[name] = args
        self._write_pids()
        return proc

    def restart(self, name: str) -> subprocess.Popen[bytes]:
        """Start `name` again as it was first started (a node: the same port and data directory)."""
        return self.start(name, self.args[name])

    def pid(self, name: str) -> int:
        return next(proc.pid for n, proc in self.children if n == name)

    def dead(self) -> list[str]:
        return [name for name, proc in self.children if proc.poll() is not None]

    def exit_status(self, name: str) -> str:
        code = next(proc.returncode for n, proc in self.children if n == name)
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with status {code}"

    def _write_pids(self) -> None:
        if self.pids is not None:
            body = {name: proc.pid for name, proc in self.children}
            tmp = self.pids.with_suffix(".tmp")
            tmp.write_text(json.dumps(body, indent=1) + "\n")
            tmp.replace(self.pids)

    def stop_all(self, timeout_s: float = 20.0) -> None:
        for _name, proc in reversed(self.children):
            terminate(proc, timeout_s)
        self.children.clear()
        if self.pids is not None:
            self.pids.unlink(missing_ok=True)


def _get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _wait(what: str, predicate, timeout_s: float, procs: _Processes) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = procs.dead()
        if dead:
            raise DemoError(f"{', '.join(dead)} stopped unexpectedly; see {procs.logs}")
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise DemoError(f"timed out waiting for {what}; see the logs in {procs.logs}")


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _say(text: str, error: bool = False) -> None:
    """Print, unless the terminal is gone (after SIGHUP): then the rest of the output goes nowhere, and
    stopping goes on."""
    stream = sys.stderr if error else sys.stdout
    try:
        print(text, file=stream, flush=True)
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):  # what is still buffered, and Python's flush at exit, go there too
            os.dup2(devnull, fd)
        os.close(devnull)


def _stop_on_signals() -> None:
    """SIGTERM (a supervisor) and SIGHUP (a closed terminal, `tmux kill-session`) clean up exactly as Ctrl-C
    does; a signal ignored on purpose (`nohup keyroute demo`, or `&` in a script for SIGINT) stays ignored."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _interrupt)


def run(settings: DemoSettings) -> int:
    _stop_on_signals()
    host = settings.host
    if _port_in_use(host, settings.router_port):
        _say(f"keyroute demo: port {settings.router_port} is taken; pass --port", error=True)
        return 1
    work = settings.workdir
    if work.exists():
        shutil.rmtree(work)
    logs = work / "logs"
    logs.mkdir(parents=True)
    procs = _Processes(logs, work / PIDS_FILE)
    zk_port = _free_port(host)
    zk = f"{host}:{zk_port}/keyroute-demo"
    kafka: MockKafka | None = None
    feeding = threading.Event()
    try:
        _say(f"starting ZooKeeper on {host}:{zk_port} ...")
        procs.start(
            "zookeeper", ["zookeeper", "--port", str(zk_port), "--host", host, "--data-dir", str(work / "zookeeper")]
        )
        _wait("ZooKeeper", lambda: is_serving(host, zk_port), 60, procs)

        _say(f"generating {settings.events:,} bookings and trades, {max(1, settings.events // 2):,} trips ...")
        files = sample_data.generate(work / "events", events=settings.events)
        registry_port = _free_port(host)
        registry = f"http://{host}:{registry_port}"
        _say(f"starting keyroute's development Schema Registry on {registry} ...")
        procs.start("schema-registry", ["schema-registry", "--host", host, "--port", str(registry_port)])
        _wait("the schema registry", lambda: _get(registry + "/subjects")[0] == 200, 60, procs)
        _say("starting a Kafka-protocol broker (librdkafka's mock cluster) and the quotes and ticks producers ...")
        kafka = MockKafka()
        for topic in (sample_data.LIVE_TOPIC, sample_data.AVRO_TOPIC):
            kafka.create_topic(topic, settings.live_partitions)
        for records in (_quotes(), _ticks(registry)):
            feeder = threading.Thread(
                target=_produce, args=(kafka.bootstrap_servers, settings.quotes_per_s, feeding, records), daemon=True
            )
            feeder.start()
        spec = work / "stores.toml"
        spec.write_text(
            _SPEC_HEADER
            + sample_data.spec_toml(files, relative_to=work)
            + "\n"
            + sample_data.timeline_spec_toml(files, relative_to=work)
            + "\n"
            + _LIVE_HEADER
            + sample_data.live_spec_toml(kafka.bootstrap_servers, settings.live_partitions, registry_url=registry)
        )
        _say(f"the stores are described in {spec} (a template for a cluster of your own)")

        _say("running the Spark pipeline ...")
        node_ports = [_free_port(host) for _ in range(settings.nodes)]
        for i, port in enumerate(node_ports):
            procs.start(
                f"node-{i}",
                ["node", "--zk", zk, "--node-id", f"node-{i}", "--host", host, "--port", str(port),
                 "--data-dir", str(work / f"node-{i}")],
            )
        build = subprocess.run(
            _launch(["pipeline", "build", "--spec", str(spec), "--zk", zk, "--output", str(work / "snapshots")]),
            stdout=subprocess.PIPE,
            stderr=open(logs / "pipeline.log", "ab"),
            stdin=subprocess.DEVNULL,
            check=False,
        )
        if build.returncode != 0:
            raise DemoError(f"the pipeline failed; see {logs / 'pipeline.log'}")
        for line in build.stdout.decode().splitlines():
            _say(f"  published {line}")

        procs.start("router", ["router", "--zk", zk, "--host", host, "--port", str(settings.router_port)])
        router = f"http://{host}:{settings.router_port}"
        _wait("the router to have a complete map", lambda: _get(router + "/readyz")[0] == 200,
              settings.ready_timeout_s, procs)
        _print_banner(router, zk, node_ports, host, work, procs)
        _supervise(procs, settings, router)
    except KeyboardInterrupt:
        _say("\nstopping ...")
        return 0
    except DemoError as exc:
        _say(f"keyroute demo: {exc}", error=True)
        return 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second Ctrl-C must not cut this short
            signal.signal(signum, signal.SIG_IGN)
        procs.stop_all()
        feeding.set()
        if kafka is not None:
            kafka.close()
        _say("all demo processes stopped.")


def _supervise(procs: _Processes, settings: DemoSettings, router: str) -> NoReturn:
    """Until Ctrl-C: a node that dies is said and started again `restart_after_s` later; any other process
    that dies ends the demo (DemoError)."""
    restart_at: dict[str, float] = {}
    while True:
        for name in procs.dead():
            if not name.startswith("node-"):
                raise DemoError(f"{name} stopped unexpectedly ({procs.exit_status(name)}); see {procs.logs}")
            if name not in restart_at:
                restart_at[name] = time.monotonic() + settings.restart_after_s
                _say(
                    f"\n{name} (pid {procs.pid(name)}) died: {procs.exit_status(name)}. Reads go on from the other "
                    f"replicas; {router}/admin/ui names it. The demo starts it again in "
                    f"{settings.restart_after_s:.0f} s (its log: {procs.logs / (name + '.log')})."
                )
            elif time.monotonic() >= restart_at[name]:
                del restart_at[name]
                proc = procs.restart(name)
                _say(f"{name} started again (pid {proc.pid}): it takes its partitions back from its disk.")
        time.sleep(0.5)


def kill_node(workdir: Path, index: int) -> int:
    """`keyroute demo kill-node N`: SIGKILL the running demo's node-N, as a crash would (the demo restarts it)."""
    name = f"node-{index}"
    try:
        pids = json.loads((workdir / PIDS_FILE).read_text())
    except (OSError, ValueError):
        _say(f"keyroute demo kill-node: no running demo in {workdir} (run `keyroute demo` first, or pass its "
             "--workdir)", error=True)
        return 1
    pid = pids.get(name)
    nodes = sorted(n for n in pids if n.startswith("node-"))
    if not isinstance(pid, int):
        _say(f"keyroute demo kill-node: the demo has no {name}; its nodes: {', '.join(nodes)}", error=True)
        return 1
    try:
        # The PID must still be that node's (a PID is reused once its process is gone).
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        command = None
    if command is not None and name.encode() not in command:
        _say(f"keyroute demo kill-node: {name} (pid {pid}) is not running; the demo starts it again soon",
             error=True)
        return 1
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        _say(f"keyroute demo kill-node: {name} (pid {pid}) is not running; the demo starts it again soon",
             error=True)
        return 1
    _say(f"killed {name} (pid {pid}) with SIGKILL; the demo says so and starts it again")
    return 0


Records = Callable[[random.Random, int], tuple[str, bytes, bytes]]


def _quotes() -> Records:
    def quote(rng: random.Random, n: int) -> tuple[str, bytes, bytes]:
        return (sample_data.LIVE_TOPIC, *sample_data.quote(rng, n))

    return quote


def _ticks(registry_url: str) -> Records:
    """Ticks as confluent-kafka's AvroSerializer writes them; their schema is registered now, before the build
    (which checks that the topic's value subject has the store's columns)."""
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    client = SchemaRegistryClient({"url": registry_url})
    schema = json.dumps(sample_data.TICK_SCHEMA)
    client.register_schema(f"{sample_data.AVRO_TOPIC}-value", Schema(schema, "AVRO"))
    serializer = AvroSerializer(client, schema)
    ctx = SerializationContext(sample_data.AVRO_TOPIC, MessageField.VALUE)

    def tick(rng: random.Random, n: int) -> tuple[str, bytes, bytes]:
        key, record = sample_data.tick(rng, n)
        return sample_data.AVRO_TOPIC, key, serializer(record, ctx)

    return tick


def _produce(bootstrap_servers: str, per_s: float, stop: threading.Event, records: Records) -> None:
    """Records for a live store, keyed by asset and partitioned as Kafka's Java client does (murmur2)."""
    import confluent_kafka

    producer = confluent_kafka.Producer(
        {"bootstrap.servers": bootstrap_servers, "partitioner": "murmur2_random", "linger.ms": 5, "log_level": 3}
    )
    rng = random.Random(11)
    n = 0
    while not stop.wait(1.0 / per_s):
        topic, key, value = records(rng, n)
        producer.produce(topic, key=key, value=value)
        producer.poll(0)
        n += 1
    producer.flush(2.0)


def _print_banner(router: str, zk: str, node_ports: list[int], host: str, work: Path, procs: _Processes) -> None:
    customer = sample_data.SPECIAL_CUSTOMERS[1]
    busy = sample_data.customer_id(sample_data.BUSY_CUSTOMER)
    lines = [
        "",
        "keyroute demo is up.",
        f"  router      {router}",
        f"  map page    {router}/admin/ui      # open it in a browser: the partition map, live",
        *(
            f"  node-{i}      http://{host}:{port}      pid {procs.pid(f'node-{i}')}"
            for i, port in enumerate(node_ports)
        ),
        f"  zookeeper   {zk}",
        f"  files       {work}      # logs/ has one log per process",
        f"  spec        {work / 'stores.toml'}      # the stores above: a template for your own cluster",
        "",
        "try:",
        f"  curl -s {router}/stores/bookings/keys/{sample_data.customer_id(42)}",
        f"  curl -s {router}/stores/bookings/keys/{quote(customer, safe='')}      # key {customer!r}",
        f"  curl -s {router}/stores/positions/keys/{sample_data.asset_id(7)}",
        f"  curl -si {router}/stores/quotes/keys/{sample_data.asset_id(7)}    # live: run it twice, watch "
        "the value and X-Keyroute-Offset move",
        f"  curl -s {router}/stores/ticks/keys/{sample_data.asset_id(7)}      # live, from Avro records",
        f"  curl -s -X POST {router}/stores/bookings/batch-get -H 'content-type: application/json' "
        f"-d '{json.dumps({'keys': [sample_data.customer_id(1), 'a/b', 'nobody']})}'",
        f"  curl -s '{router}/stores/trips/keys/{busy}/history?from=2024-06-01T00:00:00Z&to=2024-07-01T00:00:00Z"
        "&limit=5'",
        f"  curl -s '{router}/stores/fares_5m/keys/{busy}/windows?from=2024-06-11T10:00:00Z&to=2024-06-11T11:00:00Z'",
        f"  curl -s '{router}/admin/route?store=bookings&key={sample_data.customer_id(42)}'",
        f"  curl -s {router}/admin/partition-map",
        "",
        "see a node fail while reads go on (the map page names it; the demo starts it again):",
        "  keyroute demo kill-node 1      # SIGKILL node-1, as a crash would (or: kill -9 PID)",
        "",
        "Ctrl-C stops everything.",
    ]
    _say("\n".join(lines))
