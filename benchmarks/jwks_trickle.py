"""What a trickling JWT key server and tokens with unknown key ids cost other callers: their reads' p50/p99
through a router and on a node, without and with 10 unknown-kid tokens a second, side by side in one run.

Run from the repository root: `.venv/bin/python benchmarks/jwks_trickle.py [--write] [--rounds 3]`
(`--quick`: a smoke run of the plumbing, not figures). It builds a store without Spark, starts ZooKeeper, one
node and one router on 127.0.0.1, each with a token file and a JWT issuer whose keys (`--jwt-jwks-url`, with
`--jwt-jwks-allow-http`) come from a key server of its own in this process (tests/jwks_server.py) that,
once both have started, answers one byte a second. Other callers read single keys with a static token, on
kept-alive connections (`--readers` threads, `--reads` reads per measurement, each timed). "quiet": nobody
else. "10/s unknown kid": meanwhile a thread sends each process 10 tokens a second naming key ids not in the
set (every one must be 401). Such a measurement starts once a fetch that round's tokens asked for is in
progress on that process (an unknown kid asks for one at most every 30 s, and each is abandoned at its 5 s
deadline), a quiet one once none is; each counts how many of its reads were answered while a fetch was in
progress (the key server's begun/ended marks bracket the read). --write records the figures in
benchmarks/RESULTS.md.

Wanted: the reads' p99 with unknown-kid tokens within 1.5x of the quiet p99 on each process, and reads
answered during the fetches (before, a fetch for an unknown kid ran on the event loop: a key server sending
a byte every 1.5 s froze a node for 9 s every 30 s).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md
import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for tests.jwks_server; benchmarks/ stays first

from router import (  # noqa: E402  benchmarks/router.py: the store, processes, readiness, RESULTS.md
    STORE,
    Service,
    http_json,
    key_text,
    published_store,
    start_service,
    wait_until,
)
from tests.jwks_server import JwksServer  # noqa: E402

SECTION = "## JWT key server trickling, unknown key ids (benchmarks/jwks_trickle.py)"
QUIET, ATTACK = "quiet", "10/s unknown kid"
SECRET = "bench-cluster-secret"
TOKEN = "bench-reader-token"
ISSUER = "https://issuer.bench"
UNKNOWN_PER_S = 10.0


@dataclass
class Measurement:
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    during_fetch: int = 0  # reads answered while this process's key fetch was in progress

    @property
    def p50_ms(self) -> float:
        return _quantile(self.latencies_s, 0.5) * 1e3

    @property
    def p99_ms(self) -> float:
        return _quantile(self.latencies_s, 0.99) * 1e3


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the figures in benchmarks/RESULTS.md")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reads", type=int, default=1000, help="reads per measurement, over all reader threads")
    parser.add_argument("--readers", type=int, default=4, help="reader threads (each its own kept-alive connection)")
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a smoke run: one round, few reads")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.reads, args.keys = 1, 200, 1_000
    with tempfile.TemporaryDirectory(prefix="keyroute-jwks-") as folder:
        figures, notes = measure(args, Path(folder))
    command = ".venv/bin/python benchmarks/jwks_trickle.py" + (f" --rounds {args.rounds}" if args.rounds != 3 else "")
    command += f" --reads {args.reads}" if args.reads != 1000 else ""
    command += " --write" if args.write else ""
    text = section(figures, notes, args, command)
    print(text)
    if args.write and not args.quick:
        harness.write_section(SECTION, text)
    return 0


def measure(args: argparse.Namespace, work: Path) -> tuple[dict[tuple[str, str], list[Measurement]], dict[str, int]]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = {**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key())), "kid": "k1", "use": "sig"}
    (work / "tokens.toml").write_text(f'[[tokens]]\nname = "reader"\ntoken = "{TOKEN}"\nstores = ["{STORE}"]\n')
    exp = int(time.time()) + 24 * 3600
    unknown = [
        "Bearer " + jwt.encode({"iss": ISSUER, "sub": "x", "exp": exp}, key, "RS256", {"kid": f"unknown-{i}"})
        for i in range(200)
    ]
    figures: dict[tuple[str, str], list[Measurement]] = {}
    notes = {"unknown_sent": 0, "unknown_not_401": 0}
    with ExitStack() as stack:
        zk_settings, _ = published_store(stack, work, args.keys, args.partitions)
        issuers = {name: stack.enter_context(JwksServer([jwk])) for name in ("router", "node")}
        connect = zk_settings.connect_string
        keyroute = [sys.executable, "-m", "keyroute"]

        def access(name: str) -> list[str]:
            return [
                *("--cluster-secret", SECRET, "--access-tokens", str(work / "tokens.toml")),
                *("--jwt-issuer", ISSUER, "--jwt-jwks-url", issuers[name].url, "--jwt-jwks-allow-http"),
            ]

        port = harness.free_port()
        node = start_service(
            "node",
            [*keyroute, "node", "--zk", connect, "--node-id", "n1", "--port", str(port), *access("node")]
            + ["--data-dir", str(work / "data-n1")],
            work,
            f"http://127.0.0.1:{port}",
        )
        stack.callback(node.stop)
        port = harness.free_port()
        router = start_service(
            "router",
            [*keyroute, "router", "--zk", connect, "--port", str(port), *access("router")],
            work,
            f"http://127.0.0.1:{port}",
        )
        stack.callback(router.stop)
        services = {"router": router, "node": node}
        wait_until(lambda: _complete(router.url), 180, "every partition served", list(services.values()))
        for server in issuers.values():
            server.trickle = True  # from now on: a byte a second
        paths = [f"/stores/{STORE}/keys/{key_text(i)}" for i in range(args.keys)]
        for round_ in range(args.rounds):
            for scenario in (QUIET, ATTACK) if round_ % 2 == 0 else (ATTACK, QUIET):
                stop = threading.Event()
                attacker = None
                if scenario == ATTACK:
                    attacker = threading.Thread(target=_attack, args=(services, unknown, stop, notes), daemon=True)
                    attacker.start()
                try:
                    for name, service in services.items():
                        marks = issuers[name].trickle_marks
                        if scenario == ATTACK:  # a fetch of this round's, in progress
                            begun = marks()[0]
                            wait_until(
                                lambda marks=marks, begun=begun: marks()[0] > max(begun, marks()[1]),
                                120,
                                f"the {name}'s key fetch in progress",
                                list(services.values()),
                            )
                        else:  # none in progress (one an earlier round asked for has ended)
                            wait_until(
                                lambda marks=marks: marks()[0] == marks()[1],
                                60,
                                f"the {name}'s key fetch to end",
                                list(services.values()),
                            )
                        m = _read(service.url, paths, args.reads, args.readers, issuers[name])
                        figures.setdefault((name, scenario), []).append(m)
                        print(
                            f"round {round_ + 1} {name} {scenario}: p50 {m.p50_ms:.2f} ms p99 {m.p99_ms:.2f} ms,"
                            f" {m.during_fetch} reads during a fetch, errors {m.errors}",
                            file=sys.stderr,
                        )
                finally:
                    stop.set()
                    if attacker is not None:
                        attacker.join(timeout=60)
        wait_until(  # the fetches in progress end (abandoned) before they are counted
            lambda: all(s.trickle_marks()[0] == s.trickle_marks()[1] for s in issuers.values()),
            60,
            "the key fetches in progress to end",
            list(services.values()),
        )
        notes["abandoned"] = sum(server.counts()[2] for server in issuers.values())
        notes["served_whole"] = sum(server.counts()[1] for server in issuers.values())
    return figures, notes


def _complete(url: str) -> bool:
    status, body = http_json(url + "/readyz")
    return status == 200 and isinstance(body, dict) and body.get("complete") is True


def _attack(services: dict[str, Service], tokens: list[str], stop: threading.Event, notes: dict[str, int]) -> None:
    """UNKNOWN_PER_S tokens a second to each process, each naming a key id not in the set."""
    connections = {name: _connection(s.url) for name, s in services.items()}
    i = 0
    next_at = time.monotonic()
    while not stop.is_set():
        for name, conn in connections.items():
            try:
                conn.request(
                    "GET",
                    f"/stores/{STORE}/keys/{key_text(i % 100)}",
                    headers={"authorization": tokens[i % len(tokens)]},
                )
                answer = conn.getresponse()
                answer.read()
                notes["unknown_not_401"] += answer.status != 401
            except (OSError, http.client.HTTPException):
                notes["unknown_not_401"] += 1
                connections[name] = conn = _connection(services[name].url)
            notes["unknown_sent"] += 1
            i += 1
        next_at += 1 / UNKNOWN_PER_S
        stop.wait(max(0.0, next_at - time.monotonic()))
    for conn in connections.values():
        conn.close()


def _connection(url: str) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=60)


def _read(url: str, paths: list[str], reads: int, readers: int, issuer: JwksServer) -> Measurement:
    """`reads` single-key reads with the static token over `readers` kept-alive connections, each timed."""
    m = Measurement()
    lock = threading.Lock()
    per_reader = max(1, reads // readers)

    def reader(offset: int) -> None:
        conn = _connection(url)
        latencies, errors, during = [], 0, 0
        try:
            for i in range(per_reader):
                path = paths[(offset * 7919 + i * 104_729) % len(paths)]
                begun, _ = issuer.trickle_marks()
                started = time.perf_counter()
                try:
                    conn.request("GET", path, headers={"authorization": f"Bearer {TOKEN}"})
                    answer = conn.getresponse()
                    body = answer.read()
                    ok = answer.status == 200 and json.loads(body).get("key") == path.rsplit("/", 1)[1]
                except (OSError, http.client.HTTPException, ValueError):
                    ok = False
                    conn.close()
                    conn = _connection(url)
                latencies.append(time.perf_counter() - started)
                _, ended = issuer.trickle_marks()
                errors += not ok
                during += begun > ended
        finally:
            conn.close()
        with lock:
            m.latencies_s += latencies
            m.errors += errors
            m.during_fetch += during

    threads = [threading.Thread(target=reader, args=(n,)) for n in range(readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return m


def section(
    figures: dict[tuple[str, str], list[Measurement]], notes: dict[str, int], args: argparse.Namespace, command: str
) -> str:
    def median(name: str, scenario: str, attr: str) -> float:
        return statistics.median(getattr(m, attr) for m in figures[(name, scenario)])

    rows = [
        "| reads of other callers | p50 ms | p99 ms | reads during a key fetch | errors |",
        "|---|---|---|---|---|",
    ]
    verdicts = []
    for name, label in (("router", "through the router"), ("node", "on the node")):
        for scenario in (QUIET, ATTACK):
            runs = figures[(name, scenario)]
            p50, p99 = median(name, scenario, "p50_ms"), median(name, scenario, "p99_ms")
            rows.append(
                f"| {label}, {scenario} | {p50:.2f} | {p99:.2f}"
                f" | {sum(m.during_fetch for m in runs):,} of {sum(len(m.latencies_s) for m in runs):,}"
                f" | {sum(m.errors for m in runs)} |"
            )
        quiet, attacked = median(name, QUIET, "p99_ms"), median(name, ATTACK, "p99_ms")
        verdicts.append(
            f"- p99 {label} with unknown-kid tokens: {attacked:.2f} ms against {quiet:.2f} ms quiet,"
            f" {attacked / quiet:.2f}x, target <= 1.5x: **{'met' if attacked <= 1.5 * quiet else 'not met'}**."
        )
    return "\n".join(
        [
            SECTION,
            "",
            f"`{command}`",
            "",
            f"{os.cpu_count()} cores shared with other work (other test suites and benchmarks running), load average"
            f" {os.getloadavg()[0]:.1f} at the end: the figures are noisy. One node and one router, {args.keys:,} keys"
            f" in {args.partitions} partitions, each process fetching its JWT keys from a key server of its own that"
            " answers one byte a second. Other callers: a static token, single-key reads on"
            f" {args.readers} kept-alive connections, {args.reads:,} reads per measurement, medians of"
            f" {args.rounds} rounds (the order alternating). With unknown-kid tokens ({UNKNOWN_PER_S:g}/s to each"
            f" process, {notes['unknown_sent']:,} sent, {notes['unknown_not_401']} not answered 401), each"
            " measurement starts once a fetch that round's tokens asked for is in progress on that process (a"
            ' quiet one once none is); "reads during a key fetch" counts the reads answered while one was in'
            f" progress. Fetches abandoned at their 5 s deadline: {notes['abandoned']}; answered whole:"
            f" {notes['served_whole']} (the ones at start). The readers, the unknown-kid sender and the key servers"
            " run in one Python process beside the router and the node. Before, such a fetch ran on the event"
            " loop with a 2 s timeout per network operation: at a byte a second it would never time out, and"
            " every read of that process would wait for the whole trickled answer.",
            "",
            *rows,
            "",
            *verdicts,
            "",
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
