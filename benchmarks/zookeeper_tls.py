"""ZooKeeper over TLS beside plaintext, on one embedded server serving both ports: what a keyroute process
pays to connect (TCP, the TLS handshake with a client certificate, the session; `keyroute.cluster.zk.connect`)
and for one read once connected (a 200-byte znode, the size of a store record). The reference is the
plaintext port of the same server, measured in the same run, interleaved round by round; medians.

    .venv/bin/python benchmarks/zookeeper_tls.py [--connects 20] [--reads 2000] [--rounds 5]

Prints one Markdown table (benchmarks/RESULTS.md, "ZooKeeper over TLS").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md
import trustme

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keyroute.cluster import zk  # noqa: E402
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper, ServerTls  # noqa: E402
from keyroute.runtime.settings import ZkSettings, ZkTls  # noqa: E402

PATH = "/bench"


def connect_us(settings: ZkSettings, n: int) -> float:
    """Median µs of connect + close."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        client = zk.connect(settings, ensure_layout=False)
        times.append(time.perf_counter() - start)
        zk.close(client)
    return statistics.median(times) * 1e6


def read_us(settings: ZkSettings, n: int) -> tuple[float, float]:
    """(median µs per read, client CPU µs per read) on one session."""
    client = zk.connect(settings, ensure_layout=False)
    try:
        times = []
        cpu = time.process_time()
        for _ in range(n):
            start = time.perf_counter()
            client.get(PATH)
            times.append(time.perf_counter() - start)
        cpu = time.process_time() - cpu
    finally:
        zk.close(client)
    return statistics.median(times) * 1e6, cpu / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connects", type=int, default=20)
    parser.add_argument("--reads", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ca = trustme.CA()
        ca.cert_pem.write_to_path(folder / "ca.crt")
        for name, identity in (("server", "127.0.0.1"), ("client", "keyroute-writer")):
            cert = ca.issue_cert(identity)
            cert.cert_chain_pems[0].write_to_path(folder / f"{name}.crt")
            cert.private_key_pem.write_to_path(folder / f"{name}.key")
        plain_port, tls_port = harness.free_port(), harness.free_port()
        tls = ServerTls(tls_port, folder / "server.crt", folder / "server.key", folder / "ca.crt")
        with EmbeddedZooKeeper(plain_port, folder / "zk", tls=tls):
            plain = ZkSettings(hosts=f"127.0.0.1:{plain_port}")
            secure = dataclasses.replace(
                plain,
                hosts=f"127.0.0.1:{tls_port}",
                tls=ZkTls(folder / "ca.crt", folder / "client.crt", folder / "client.key"),
            )
            setup = zk.connect(plain, ensure_layout=False)
            setup.create(PATH, b"x" * 200)
            zk.close(setup)
            results: dict[str, list[tuple[float, float, float]]] = {"plaintext": [], "TLS": []}
            for _ in range(args.rounds):
                for label, settings in (("plaintext", plain), ("TLS", secure)):
                    results[label].append((connect_us(settings, args.connects), *read_us(settings, args.reads)))
    print(
        f"{args.rounds} rounds, {args.connects} connects and {args.reads} reads per round and port; "
        f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.1f} at the end\n"
    )
    print("| port | connect µs (median) | read µs (median) | client CPU µs/read |")
    print("| --- | ---: | ---: | ---: |")
    for label, rows in results.items():
        connect, read, cpu = (statistics.median(column) for column in zip(*rows, strict=True))
        print(f"| {label} | {connect:,.0f} | {read:,.0f} | {cpu:,.0f} |")


if __name__ == "__main__":
    main()
