"""The partition map's views at 1,000 nodes x 100,000 partitions (100 stores x 1,000, rf 3, every replica
serving), served by a real router process (tests/integration/records_router.py: the map built from records,
no ZooKeeper), every node's URL pointing at one stand-in node process that answers every read at once.

    .venv/bin/python benchmarks/map_view.py [--reads 3000] [--rounds 3] [--pollers 5]

Measures, side by side in one run:
- the summary (default answer), a store's drill-down, the routing view and the whole document: size and the
  router's CPU per request (its /proc utime + stime) the first time (built) and again (kept), and with
  If-None-Match (304);
- today's cost per request of the whole document, in this process: `PartitionMap.describe()` + `json.dumps`;
- the data path's read latency (p50, p99) through that router, one read at a time, without and with
  `--pollers` pages open (each asks the summary and a store's partitions every second with If-None-Match, as
  a page that does not long-poll would: the worst the page does; all pages in one process), rounds
  alternating, medians reported;
- the client's refresh: bytes read and CPU to parse, today's whole map vs the routing view (whole, and
  what changed since the client's generation when nothing did).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keyroute.client._base import _DirectMap  # noqa: E402
from tests.integration.records_router import records_map  # noqa: E402

NODE_BODY = b'{"store":"store-000","key":"k","partition":0,"version":2,"value":{"v":1}}'


# -- a stand-in node: answers every request at once ------------------------------------------------------


class _NodeProtocol(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        answer = (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-keyroute-node: keyroute-node-0000\r\n"
            b"content-length: " + str(len(NODE_BODY)).encode() + b"\r\n\r\n" + NODE_BODY
        )
        while b"\r\n\r\n" in self.buffer:
            _, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
            self.transport.write(answer)  # type: ignore[attr-defined]


def serve_node(port: int) -> None:
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(loop.create_server(_NodeProtocol, "127.0.0.1", port))
    loop.run_until_complete(server.serve_forever())


# -- raw HTTP/1.1 on one keep-alive connection -----------------------------------------------------------


class Conn:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = bytearray()

    def get(self, target: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        lines = [f"GET {target} HTTP/1.1", "host: 127.0.0.1"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self._recv()
        end = self.buffer.index(b"\r\n\r\n")
        head, self.buffer = bytes(self.buffer[:end]), self.buffer[end + 4 :]
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        answer_headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in header_lines)}
        status = int(status_line.split()[1])
        if "content-length" in answer_headers:
            length = int(answer_headers["content-length"])
            while len(self.buffer) < length:
                self.buffer += self._recv()
            body, self.buffer = bytes(self.buffer[:length]), self.buffer[length:]
        elif answer_headers.get("transfer-encoding") == "chunked":
            body = self._chunked()
        else:
            body = b""
        return status, answer_headers, body

    def _chunked(self) -> bytes:
        out = bytearray()
        while True:
            while b"\r\n" not in self.buffer:
                self.buffer += self._recv()
            end = self.buffer.index(b"\r\n")
            size_line, self.buffer = bytes(self.buffer[:end]), self.buffer[end + 2 :]
            size = int(size_line.split(b";")[0], 16)
            while len(self.buffer) < size + 2:
                self.buffer += self._recv()
            out += self.buffer[:size]
            self.buffer = self.buffer[size + 2 :]
            if size == 0:
                return bytes(out)

    def _recv(self) -> bytes:
        data = self.sock.recv(1 << 20)
        if not data:
            raise ConnectionError("closed")
        return data


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(conn: Conn, pid: int, target: str, n: int, headers: dict[str, str] | None = None) -> tuple[float, int, int]:
    """Router CPU per request (ms) over `n` requests, the last answer's status and size."""
    before = cpu_s(pid)
    status, size = 0, 0
    for _ in range(n):
        status, _, body = conn.get(target, headers)
        size = len(body)
    return (cpu_s(pid) - before) * 1000 / n, status, size


def pages(port: int, count: int, stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    """`count` open pages, in one process (on a 2-CPU machine, a process per page would take CPU from the
    router and the reader, which a browser elsewhere does not): each asks the summary and a store's
    partitions every second with the ETag it last got."""
    conns = [Conn(port) for _ in range(count)]
    tags: list[dict[str, str]] = [{} for _ in range(count)]
    while not stop.is_set():
        for conn, tag in zip(conns, tags, strict=True):
            for target in ("/admin/partition-map", "/admin/partition-map?store=store-042&limit=200"):
                headers = {"if-none-match": tag[target]} if target in tag else {}
                _, answer, _ = conn.get(target, headers)
                tag[target] = answer.get("etag", "")
        stop.wait(1.0)


def read_latencies(port: int, reads: int) -> list[float]:
    conn = Conn(port)
    out = []
    for i in range(reads):
        started = time.perf_counter()
        status, _, _ = conn.get(f"/stores/store-000/keys/k{i % 5000}")
        out.append(time.perf_counter() - started)
        assert status == 200, status
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reads", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pollers", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=200, help="requests per cached / 304 measurement")
    args = parser.parse_args()

    node_port, router_port = harness.free_port(), harness.free_port()
    node = multiprocessing.Process(target=serve_node, args=(node_port,), daemon=True)
    node.start()
    router = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.records_router", "--port", str(router_port)]
        + ["--node-url", f"http://127.0.0.1:{node_port}"],
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if Conn(router_port).get("/readyz")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the router did not start")
            time.sleep(0.5)
        pid = router.pid
        conn = Conn(router_port)
        print("1,000 nodes, 100 stores x 1,000 partitions, rf 3; router CPU per request (ms), answer size")
        rows = [
            ("summary", "/admin/partition-map"),
            ("store drill-down (limit 200)", "/admin/partition-map?store=store-042&limit=200"),
            ("routing view", "/routing"),
            ("whole document (?detail=all)", "/admin/partition-map?detail=all"),
        ]
        for name, target in rows:
            first, status, size = measure(conn, pid, target, 1)
            assert status == 200, (target, status)
            repeat = 5 if "detail=all" in target else args.repeat
            again, _, _ = measure(conn, pid, target, repeat)
            _, answer, _ = conn.get(target)
            not_modified, status, _ = measure(conn, pid, target, args.repeat, {"if-none-match": answer["etag"]})
            assert status == 304, (target, status)
            print(f"  {name:32s} {size:>12,d} B  first {first:8.1f}  again {again:7.2f}  304 {not_modified:6.3f}")
        since, status, size = measure(conn, pid, "/routing?since=1", args.repeat)
        print(f"  {'routing view ?since=G (no change)':32s} {size:>12,d} B  each {since:7.2f}")

        # Today's per request cost of the whole document, in this process.
        m = records_map()
        started = time.process_time()
        described = m.describe()
        described_s = time.process_time() - started
        started = time.process_time()
        today = json.dumps({**described, "router": True}).encode()
        dumped_s = time.process_time() - started
        print(
            f"  today, per request: describe() {described_s * 1000:.0f} ms + json.dumps {dumped_s * 1000:.0f} ms"
            f" CPU on the event loop, {len(today):,d} B"
        )

        # The client's refresh: bytes and parse CPU (a new connection: the last one idled out meanwhile).
        conn = Conn(router_port)
        _, _, routing = conn.get("/routing")
        _, _, delta = conn.get("/routing?since=1")
        costs = {}
        base = _DirectMap.of_routing(json.loads(routing), None)
        for name, parse in (
            ("today: whole map", lambda: _DirectMap(json.loads(today))),
            ("routing view", lambda: _DirectMap.of_routing(json.loads(routing), None)),
            ("routing view ?since=G", lambda: _DirectMap.of_routing(json.loads(delta), base)),
        ):
            times = []
            for _ in range(3):
                started = time.process_time()
                parse()
                times.append(time.process_time() - started)
            costs[name] = statistics.median(times)
        sizes = {"today: whole map": len(today), "routing view": len(routing), "routing view ?since=G": len(delta)}
        print("client refresh: bytes read, CPU to parse (median of 3)")
        for name, cost in costs.items():
            print(f"  {name:24s} {sizes[name]:>12,d} B  {cost * 1000:8.1f} ms")

        # The data path, without and with pages polling.
        results: dict[str, list[tuple[float, float]]] = {"no pages": [], f"{args.pollers} pages": []}
        read_latencies(router_port, 500)  # warm-up
        for _ in range(args.rounds):
            for label in results:
                stop = multiprocessing.Event()
                poller = None
                if label != "no pages":
                    poller = multiprocessing.Process(target=pages, args=(router_port, args.pollers, stop), daemon=True)
                    poller.start()
                    time.sleep(1.5)  # past the first answers (whole), into the 304s
                lat = read_latencies(router_port, args.reads)
                stop.set()
                if poller is not None:
                    poller.join(5)
                results[label].append((pct(lat, 0.5), pct(lat, 0.99)))
        print(f"data path through the router, {args.reads} reads one at a time, median of {args.rounds} rounds")
        medians = {}
        for label, values in results.items():
            p50 = statistics.median(v[0] for v in values) * 1000
            p99 = statistics.median(v[1] for v in values) * 1000
            medians[label] = p99
            rounds = ", ".join(f"{v[1] * 1000:.2f}" for v in values)
            print(f"  {label:10s} p50 {p50:.3f} ms  p99 {p99:.3f} ms  (p99 per round: {rounds})")
        a, b = medians.values()
        print(f"  p99 ratio (pages / none): {b / a:.2f}")
    finally:
        router.terminate()
        router.wait(30)
        node.terminate()


if __name__ == "__main__":
    main()
