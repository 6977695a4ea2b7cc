"""`keyroute demo` (what `make demo` runs) as a newcomer runs it: up, answering the printed requests, a live
value moving while they watch, every shell and Python block of README.md run as written against it
(readme_blocks.py), and however it is stopped (Ctrl-C, a closed terminal, a supervisor's SIGTERM, kill -9 of
the demo's own process) leaving no process behind.

One demo for the module (`demo`): its reads, the README's blocks and a killed node share it, and the last of
them stops it with SIGTERM. Three stops come while a demo's pipeline runs (Ctrl-C, a closed terminal's SIGHUP, kill -9),
each on a demo of its own, which also covers Spark's processes."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from keyroute.dev import sample_data
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from tests.integration.readme_blocks import _ANY, _SKIPPED, BLOCKS, Block, Readme, _mismatch, _shown_fields
from tests.util import free_port, wait_for

# A demo (ZooKeeper, Spark, three nodes, a router) takes minutes to start on a busy machine, and the README's
# own cluster runs the pipeline again.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

_UP_TIMEOUT_S = 300.0
_EVENTS = "3000"


class DemoProcess:
    """`keyroute demo` in a session of its own, its output collected line by line."""

    def __init__(self, workdir: Path, read_until: str | None = None) -> None:
        """`read_until`: stop reading the demo's output after the line holding this text (then close it with
        `stop_reading`, as a terminal that is gone)."""
        self.port = free_port()
        self._read_until = read_until
        self.workdir = workdir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "keyroute", "demo", "--port", str(self.port), "--workdir", str(workdir),
             "--events", _EVENTS],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        self.recorded: dict[int, int] = {}
        self.up = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace"))
            if "keyroute demo is up." in self.lines[-1]:
                self.up.set()
            if self._read_until is not None and self._read_until in self.lines[-1]:
                return

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_until(self, text: str) -> None:
        deadline = time.monotonic() + _UP_TIMEOUT_S
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, self.output
            assert time.monotonic() < deadline, self.output
            time.sleep(0.2)

    def wait_up(self) -> None:
        self.wait_until("keyroute demo is up.")

    def wait_exit(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        finally:
            self._reader.join(timeout=10)

    def stop_reading(self) -> None:
        """Close the demo's output, once the reader has stopped (`read_until`)."""
        self._reader.join(timeout=10)
        assert not self._reader.is_alive() and self.proc.stdout is not None
        self.proc.stdout.close()

    def kill(self) -> None:
        """Whatever a failed test left running."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in _survivors(self.recorded):
            with contextlib.suppress(ProcessLookupError):  # it may end on its own meanwhile
                os.kill(int(pid.split(":")[0]), signal.SIGKILL)


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time in clock ticks) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), fields[0], int(fields[19])


def _cmdline(pid: int) -> bytes:
    """A process's command line, empty when it is gone: short-lived helpers (Spark's launcher runs some) may exit
    between being listed and being read."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of every process below `root`."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            found = _stat(int(entry.name))
            if found is not None:
                parents.setdefault(found[0], []).append(int(entry.name))
                starts[int(entry.name)] = found[2]
    below: dict[int, int] = {}
    todo = [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            below[child] = starts[child]
            todo.append(child)
    return below


def _survivors(recorded: dict[int, int]) -> list[str]:
    """The recorded processes still running (the same pid and start time, neither a zombie nor dead)."""
    alive = []
    for pid, start in recorded.items():
        found = _stat(pid)
        if found is not None and found[2] == start and found[1] not in ("Z", "X"):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120]
            except (FileNotFoundError, ProcessLookupError):
                continue
            alive.append(f"{pid}: {command!r}")
    return alive


def _assert_nothing_survives(demo: DemoProcess, recorded: dict[int, int]) -> None:
    deadline = time.monotonic() + 60.0
    while (alive := _survivors(recorded)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"demo processes still running: {alive}"
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", demo.port)) != 0, "the router still listens after the demo stopped"


def _keyroute_children(demo: DemoProcess) -> dict[int, int]:
    """The demo's processes (ZooKeeper, the nodes, the router), recorded before it is signalled."""
    recorded = _descendants(demo.proc.pid)
    commands = [_cmdline(pid) for pid in recorded]
    assert sum(b"ZooKeeperServerMain" in c for c in commands) == 1, commands
    assert sum(b"keyroute\0node" in c for c in commands) == 3, commands
    assert sum(b"keyroute\0router" in c for c in commands) == 1, commands
    assert sum(b"keyroute\0schema-registry" in c for c in commands) == 1, commands
    demo.recorded = recorded
    return recorded


_PIPELINE_RUNS = "running the Spark pipeline"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoProcess]:
    """One demo for the module, in a folder whose `.keyroute-demo/` is its work directory (where the README's
    commands expect it); `test_the_shared_demo_stops_cleanly_on_sigterm` stops it."""
    demo = DemoProcess(tmp_path_factory.mktemp("readme") / ".keyroute-demo")
    try:
        demo.wait_up()
        yield demo
    finally:
        demo.kill()


@pytest.fixture(scope="module")
def readme(demo: DemoProcess, zk_server: EmbeddedZooKeeper) -> Iterator[Readme]:
    bin_dir = str(Path(sys.executable).parent)
    state = Readme(
        folder=demo.workdir.parent,
        replace={
            "127.0.0.1:8080": f"127.0.0.1:{demo.port}",
            **{f"{name}{port}": f"{name}{free}" for port in (8090, 8091, 8092) for free in [free_port()]
               for name in ("127.0.0.1:", "--port ")},
            "127.0.0.1:2181": zk_server.connect_string,
        },
        env={**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PYTHONUNBUFFERED": "1"},
    )
    try:
        yield state
    finally:
        state.stop()


def test_the_demo_comes_up_and_serves_a_live_store(demo: DemoProcess) -> None:
    router = f"http://127.0.0.1:{demo.port}"
    banner = demo.output
    assert f"curl -s {router}/stores/bookings/keys/" in banner
    assert f"/stores/quotes/keys/{sample_data.asset_id(7)}" in banner

    with httpx.Client(base_url=router, timeout=5.0) as client:
        booking = client.get(f"/stores/bookings/keys/{sample_data.customer_id(42)}")
        assert booking.status_code == 200, booking.text
        assert booking.json()["value"]["route"] in sample_data.ROUTES

        # The README's history and windows examples: the busy customer's morning of trips.
        busy = sample_data.customer_id(sample_data.BUSY_CUSTOMER)
        morning = {"from": "2024-06-11T10:00:00Z", "to": "2024-06-11T11:00:00Z"}
        trips = client.get(f"/stores/trips/keys/{busy}/history", params=morning)
        assert trips.status_code == 200, trips.text
        rows = trips.json()["rows"]
        assert len(rows) >= len(sample_data.BUSY_MINUTES)
        assert all(set(row) == {"ts", "route", "fare"} for row in rows), rows
        windows = client.get(f"/stores/fares_5m/keys/{busy}/windows", params=morning)
        assert windows.status_code == 200, windows.text
        counted = [window["value"]["trips"] for window in windows.json()["windows"]]
        assert sum(counted) == len(rows) and len(counted) > 1

        def quote() -> httpx.Response | None:
            found = client.get(f"/stores/quotes/keys/{sample_data.asset_id(7)}")
            return found if found.status_code == 200 else None

        first = wait_for(quote, timeout_s=60.0, message="a quote for ASSET-0007")
        offset = int(first.headers["x-keyroute-offset"])

        def moved() -> httpx.Response | None:
            again = quote()
            return again if again is not None and int(again.headers["x-keyroute-offset"]) > offset else None

        later = wait_for(moved, timeout_s=60.0, message="the quotes partition's offset to move")
        assert later.json()["value"]["seq"] >= first.json()["value"]["seq"]
        assert set(later.json()["value"]) == {"ts", "bid", "seq"}

        # The Avro live store: values written by confluent-kafka's AvroSerializer, answered as JSON.
        assert f"/stores/ticks/keys/{sample_data.asset_id(7)}" in banner

        def tick() -> httpx.Response | None:
            found = client.get(f"/stores/ticks/keys/{sample_data.asset_id(7)}")
            return found if found.status_code == 200 else None

        value = wait_for(tick, timeout_s=60.0, message="a tick for ASSET-0007").json()["value"]
        assert set(value) == {"ts", "price", "volume"} and isinstance(value["volume"], int), value
        assert value["ts"].startswith("2027-01-15T") and value["ts"].endswith("Z"), value


def test_the_skip_table_names_only_lines_the_readme_has() -> None:
    lines = [line.removeprefix("$ ") for block in BLOCKS for line in block.text.splitlines()]
    for start in _SKIPPED:
        assert any(line.startswith(start) for line in lines), f"no README line starts with {start!r} any more"


def test_the_readme_has_the_blocks_this_test_is_about() -> None:
    languages = {block.language for block in BLOCKS}
    assert {"sh", "python"} <= languages
    assert any(block.heading == "Your first cluster" for block in BLOCKS)
    assert any("keyroute demo kill-node" in block.text for block in BLOCKS if block.doc == "README.md")
    assert any(block.doc == "docs/usage.md" for block in BLOCKS)


def test_shown_fields_are_read_as_the_test_checks_them() -> None:
    shown = '{"store": "bookings", "partition": 8, "ready": true, "next": "WzIs...", "keys": [{"key": "C"}], "v": {}}'
    fields = dict(_shown_fields(shown))
    assert fields == {"store": "bookings", "partition": 8, "ready": True, "next": _ANY, "keys": _ANY, "v": _ANY}
    assert _mismatch('{"store": "bookings", "keys": []}\n__status__=200', '{"store": "bookings", "next": "x..."}')
    assert _mismatch('{"ready": true, "complete": false}\n__status__=200', '{"ready": true, "complete": true}')
    assert _mismatch('{"ready": true, "complete": true}\n__status__=200', '{"ready": true, "complete": true}') is None


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.id)
def test_a_readme_block_runs_as_written(block: Block, readme: Readme) -> None:
    skipped = readme.run(block)
    if skipped.startswith("SKIPPED "):
        pytest.skip(skipped.removeprefix("SKIPPED "))
    if skipped:
        print(f"lines not run in README block {block.id}: {skipped}")


def test_a_killed_demo_node_is_said_named_on_the_page_and_restarted_while_reads_go_on(demo: DemoProcess) -> None:
    """The demo's headline: `keyroute demo kill-node 1` (a SIGKILL, as a crash) does not end the demo; reads of
    keys on every partition keep answering 200 from the other replicas; the demo says so; the map page's summary
    names node-1 with what it held; the demo starts it again and it serves once more. On the shared demo, after
    the README's blocks (one of which kills node-1 too): it waits for any restart they left pending."""
    router = f"http://127.0.0.1:{demo.port}"
    pids_file = demo.workdir / "pids.json"
    assert "keyroute demo kill-node 1" in demo.output
    pid_line = next(line for line in demo.lines if line.strip().startswith("node-1 "))
    printed_pid = int(pid_line.rsplit("pid", 1)[1])

    def settled() -> bool:
        """Every death of node-1 the demo said is followed by its restart, and the summary shows it up."""
        died = sum("node-1 (pid " in line and ") died: " in line for line in demo.lines)
        restarted = sum("node-1 started again (pid " in line for line in demo.lines)
        summary = httpx.get(router + "/admin/partition-map", timeout=10.0).json()
        return died == restarted and summary["nodes"].get("node-1", {}).get("state") == "up"

    wait_for(settled, timeout_s=120.0, message="node-1 up, with no restart pending")
    old_pid = int(json.loads(pids_file.read_text())["node-1"])
    # The pid the demo printed is node-1's: the one running, or one the demo has since said died.
    assert old_pid == printed_pid or f"node-1 (pid {printed_pid}) died: " in demo.output, demo.output
    statuses: list[int] = []
    stop = threading.Event()

    def read() -> None:
        keys = [sample_data.customer_id(i) for i in range(1, 49)]
        with httpx.Client(base_url=router, timeout=10.0) as client:
            while not stop.is_set():
                for key in keys:
                    statuses.append(client.get(f"/stores/bookings/keys/{key}").status_code)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        said = len(demo.lines)
        killed = subprocess.run(
            [sys.executable, "-m", "keyroute", "demo", "kill-node", "1", "--workdir", str(demo.workdir)],
            capture_output=True, text=True, timeout=60,
        )
        assert killed.returncode == 0, killed.stderr
        assert f"killed node-1 (pid {old_pid})" in killed.stdout
        demo.wait_until(f"node-1 (pid {old_pid}) died: killed by SIGKILL")

        def named() -> dict | None:
            summary = httpx.get(router + "/admin/partition-map", timeout=10.0).json()
            found = [d for d in summary.get("departed", []) if d["node"] == "node-1"]
            return found[0] if found and summary["nodes"].get("node-1", {}).get("state") == "gone" else None

        departed = wait_for(named, timeout_s=60.0, message="the summary to name node-1 gone")
        assert departed["state"] == "gone" and departed["held_partitions"] > 0, departed

        def restarted() -> int | None:
            lines = [line for line in demo.lines[said:] if "node-1 started again (pid " in line]
            return int(lines[0].split("(pid ", 1)[1].split(")", 1)[0]) if lines else None

        new_pid = wait_for(restarted, timeout_s=120.0, message="the demo to start node-1 again")

        def back() -> bool:
            summary = httpx.get(router + "/admin/partition-map", timeout=10.0).json()
            listed = {d["node"]: d["state"] for d in summary.get("departed", [])}
            return summary["nodes"].get("node-1", {}).get("state") == "up" and listed.get("node-1") == "back"

        wait_for(back, timeout_s=120.0, message="node-1 to be back")
    finally:
        stop.set()
        reader.join(timeout=30)
    assert demo.proc.poll() is None, demo.output
    assert len(statuses) > 100 and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    assert new_pid != old_pid and int(json.loads(pids_file.read_text())["node-1"]) == new_pid


def test_the_shared_demo_stops_cleanly_on_sigterm(demo: DemoProcess, readme: Readme) -> None:
    """A supervisor's SIGTERM once the demo is up (after its reads and the README's blocks): exit 0, every
    process it started gone, the router's port closed."""
    readme.stop()  # the README's own cluster: not the demo's processes
    recorded = _keyroute_children(demo)
    demo.proc.send_signal(signal.SIGTERM)
    code = demo.wait_exit()
    assert code == 0, demo.output
    assert "all demo processes stopped." in demo.output
    # What the demo prints is keyroute's: no HTTP client's line per request (the Schema Registry client's).
    assert "HTTP Request:" not in demo.output, demo.output
    _assert_nothing_survives(demo, recorded)
    log_dir = demo.workdir / "logs"
    assert json.dumps(sorted(p.name for p in log_dir.iterdir()))  # every process kept a log


@pytest.mark.parametrize(
    "signum", [signal.SIGINT, signal.SIGHUP, signal.SIGKILL], ids=["ctrl-c", "closed-terminal", "kill-9"]
)
def test_a_signal_while_the_pipeline_runs_stops_every_demo_process(tmp_path: Path, signum: int) -> None:
    """While the pipeline runs, so that its Spark JVM and Spark's Python workers go too (and the test does
    not wait for a whole start). Ctrl-C runs the demo's clean-up; kill -9 runs none: each child learns of
    its parent's death from the kernel, the Spark JVM from its driver's closed pipe. SIGHUP, as a closed
    terminal or `tmux kill-session` sends it: the terminal is gone too, so the demo's output goes nowhere
    (here: a pipe nobody reads any more) and stopping must not depend on it."""
    closed_terminal = signum == signal.SIGHUP
    demo = DemoProcess(tmp_path / "demo", read_until=_PIPELINE_RUNS if closed_terminal else None)
    try:
        demo.wait_until(_PIPELINE_RUNS)

        def building() -> dict[int, int] | None:
            below = _descendants(demo.proc.pid)
            commands = [_cmdline(pid) for pid in below]
            pipeline = any(b"keyroute\0pipeline" in c for c in commands)
            return below if pipeline and any(b"org.apache.spark.deploy.SparkSubmit" in c for c in commands) else None

        recorded = demo.recorded = wait_for(
            building, timeout_s=120.0, interval_s=0.1, message="the pipeline and its Spark JVM to start"
        )
        commands = [_cmdline(pid) for pid in recorded]
        assert sum(b"ZooKeeperServerMain" in c for c in commands) == 1, commands
        assert sum(b"keyroute\0node" in c for c in commands) == 3, commands
        if closed_terminal:
            demo.stop_reading()  # the demo's next write fails (EPIPE), as on a terminal that is gone
        demo.proc.send_signal(signum)
        code = demo.wait_exit()
        if signum == signal.SIGKILL:
            assert code == -signal.SIGKILL
        elif closed_terminal:
            assert code == 0
        else:
            assert code == 0, demo.output
            assert "all demo processes stopped." in demo.output
        _assert_nothing_survives(demo, recorded)
    finally:
        demo.kill()
