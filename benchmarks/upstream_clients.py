"""Which HTTP client can carry the router's data path: client CPU and latency per request, same target.

Run from the repository root: `.venv/bin/python benchmarks/upstream_clients.py [--write]`; --write records
the table in the "## Router" section of benchmarks/RESULTS.md. aiohttp is measured when it is installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import harness  # benchmarks/harness.py (imported while this folder is still on the path)

# Run as a script, this folder comes first on sys.path, and its router.py would shadow the router package.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import datetime  # noqa: E402
import importlib.util  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections.abc import Awaitable, Callable, Mapping  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import httptools  # noqa: E402
import httpx  # noqa: E402
import uvloop  # noqa: E402

from keyroute.http.fast_upstream import FastUpstream  # noqa: E402
from keyroute.http.upstream import UpstreamResponse, UpstreamUnavailable  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Router"
SUBSECTION = "### Upstream clients"
STORE = "bench"
# What the router sends with every read (router/proxy_settings.py `ProxySettings.node_headers`).
HEADERS = {"x-keyroute-router": "1", "accept-encoding": "identity", "x-request-id": "bench-0123456789abcdef"}

HTTPX = "httpx.AsyncClient (`HttpxUpstream`, as the router uses it today)"
AIOHTTP = "aiohttp.ClientSession"
FAST = "`FastUpstream` (asyncio Protocol + httptools)"

Get = Callable[[str, Mapping[str, str]], Awaitable[UpstreamResponse]]


# -- the target: a node-shaped Starlette app on uvicorn (httptools, uvloop), in its own process ----------


def serve(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def get_key(request: Request) -> Response:
        key = request.path_params["key"]
        body = (
            f'{{"store":"{STORE}","key":"{key}","partition":3,"version":1,'
            f'"value":{{"customer":42,"route":"R3","fare":73.5}}}}'
        ).encode()
        headers = {
            "x-keyroute-partition": "3",
            "x-keyroute-node": "n1",
            "x-keyroute-version": "1",
            "x-keyroute-hops": "0",
        }
        return Response(body, media_type="application/json", headers=headers)

    app = Starlette(routes=[Route("/stores/{store}/keys/{key}", get_key, methods=["GET"])])
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        http="httptools",
        loop="uvloop",
        log_level="warning",
        access_log=False,
    )


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the target server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("the target server did not start within 30 s")


# -- httpx behind the members' interface ------------------------------------------------------------------

# A pool large enough for a router's fan-out to a few dozen nodes; idle connections are kept for reuse
# because a fresh TCP connection per read would cost more than the read.
POOL_MAX_CONNECTIONS = 512
POOL_MAX_KEEPALIVE = 256
POOL_KEEPALIVE_EXPIRY_S = 30.0


class HttpxUpstream:
    """`Upstream` (keyroute.http.upstream) over one shared `httpx.AsyncClient` (keep-alive pool, explicit
    timeouts), configured as the router's wire was before `FastUpstream` replaced it."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    @classmethod
    def create(
        cls,
        timeout_s: float,
        connect_timeout_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> HttpxUpstream:
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(
                max_connections=POOL_MAX_CONNECTIONS,
                max_keepalive_connections=POOL_MAX_KEEPALIVE,
                keepalive_expiry=POOL_KEEPALIVE_EXPIRY_S,
            ),
            transport=transport,
            # Nodes are addressed by the URL they advertise; a redirect would be a misconfiguration.
            follow_redirects=False,
            # The client's environment (HTTP_PROXY, .netrc) must not reroute traffic inside the cluster.
            trust_env=False,
        )
        return cls(client)

    async def get(self, url: str, headers: Mapping[str, str]) -> UpstreamResponse:
        return await self._send("GET", url, None, headers)

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        return await self._send("POST", url, body, headers)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _send(self, method: str, url: str, body: bytes | None, headers: Mapping[str, str]) -> UpstreamResponse:
        try:
            # Non-streaming request: httpx reads the whole body and closes the response, also on errors.
            response = await self._client.request(method, url, content=body, headers=headers)
        except httpx.PoolTimeout as exc:
            raise UpstreamUnavailable(f"no free connection to {url} ({exc!r})", node_fault=False) from exc
        except httpx.TransportError as exc:
            # ConnectError, ReadError, RemoteProtocolError, timeouts...: reads are idempotent, so retriable.
            raise UpstreamUnavailable(f"{type(exc).__name__}: {exc}") from exc
        except httpx.InvalidURL as exc:
            raise UpstreamUnavailable(f"invalid node URL {url!r}: {exc}") from exc
        raw_headers = response.headers.raw
        if "content-encoding" in response.headers:
            # httpx has already decoded the body, so the coding header no longer describes it.
            raw_headers = [(k, v) for k, v in raw_headers if k.lower() != b"content-encoding"]
        return UpstreamResponse(response.status_code, raw_headers, response.content)


# -- the contenders ---------------------------------------------------------------------------------------


@dataclass
class Contender:
    name: str
    get: Get
    close: Callable[[], Awaitable[None]]


async def contenders() -> list[Contender]:
    found: list[Contender] = []
    upstream = HttpxUpstream.create(5.0, 1.0)
    found.append(Contender(HTTPX, upstream.get, upstream.aclose))
    if importlib.util.find_spec("aiohttp") is not None:
        import aiohttp

        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=512, limit_per_host=256, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=5.0, connect=1.0),
            auto_decompress=False,
        )

        async def aiohttp_get(url: str, headers: Mapping[str, str]) -> UpstreamResponse:
            # What an aiohttp-based `Upstream` would do: whole body, raw headers.
            async with session.get(url, headers=headers, allow_redirects=False) as response:
                body = await response.read()
                return UpstreamResponse(response.status, response.raw_headers, body)

        found.append(Contender(AIOHTTP, aiohttp_get, session.close))
    fast = FastUpstream(5.0, 1.0)
    found.append(Contender(FAST, fast.get, fast.aclose))
    return found


# -- measuring --------------------------------------------------------------------------------------------


@dataclass
class Sample:
    cpu_us: float
    p50_us: float
    p99_us: float
    per_s: float


async def run_one(get: Get, urls: list[str], concurrency: int) -> Sample:
    """`len(urls)` reads through `get` from `concurrency` workers; the process's CPU time per read."""
    latencies: list[float] = []
    todo = iter(urls)
    perf = time.perf_counter

    async def worker() -> None:
        for url in todo:
            start = perf()
            response = await get(url, HEADERS)
            latencies.append(perf() - start)
            if response.status != 200 or not response.body.startswith(b'{"store"'):
                raise SystemExit(f"unexpected answer {response.status} {response.body[:80]!r}")

    cpu, wall = time.process_time(), perf()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu, perf() - wall
    latencies.sort()
    return Sample(
        cpu_us=cpu / len(urls) * 1e6,
        p50_us=latencies[len(latencies) // 2] * 1e6,
        p99_us=latencies[int(len(latencies) * 0.99)] * 1e6,
        per_s=len(urls) / wall,
    )


async def measure(
    base: str, requests: int, concurrencies: list[int], rounds: int
) -> dict[tuple[str, int], list[Sample]]:
    found = await contenders()
    rng = random.Random(20240229)
    samples: dict[tuple[str, int], list[Sample]] = {}
    try:
        urls = [f"{base}/stores/{STORE}/keys/K{rng.randrange(100_000):06d}" for _ in range(requests)]
        for contender in found:  # warm up: connections, code paths, the server's caches
            await run_one(contender.get, urls[:500], max(concurrencies))
        for round_index in range(rounds):
            # Interleaved, so machine noise (other work on this machine) hits every contender alike.
            for concurrency in concurrencies:
                for contender in found:
                    sample = await run_one(contender.get, urls, concurrency)
                    samples.setdefault((contender.name, concurrency), []).append(sample)
            print(f"round {round_index + 1}/{rounds} done", file=sys.stderr, flush=True)
    finally:
        for contender in found:
            await contender.close()
    return samples


def median(samples: list[Sample], field: str) -> float:
    return statistics.median(getattr(s, field) for s in samples)


def table(samples: dict[tuple[str, int], list[Sample]]) -> str:
    lines = [
        "| client | concurrency | client CPU µs/request | p50 latency µs | p99 latency µs | requests/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (name, concurrency), found in sorted(
        samples.items(), key=lambda item: (item[0][1], _order(item[0][0]))
    ):
        lines.append(
            f"| {name} | {concurrency} | {median(found, 'cpu_us'):,.0f} | {median(found, 'p50_us'):,.0f}"
            f" | {median(found, 'p99_us'):,.0f} | {median(found, 'per_s'):,.0f} |"
        )
    return "\n".join(lines)


def conclusion(samples: dict[tuple[str, int], list[Sample]]) -> str:
    """Which client the figures choose: the least client CPU per request, with the others as multiples."""
    concurrencies = sorted({c for _, c in samples})
    cpu = {key: median(found, "cpu_us") for key, found in samples.items()}
    top = max(concurrencies)
    best = min((name for name, c in cpu if c == top), key=lambda name: cpu[(name, top)])
    parts = []
    for c in concurrencies:
        others = ", ".join(
            f"{_short(name)} {cpu[(name, c)] / cpu[(best, c)]:.1f}x"
            for name in (HTTPX, AIOHTTP, FAST)
            if name != best and (name, c) in cpu
        )
        parts.append(f"at concurrency {c}, {cpu[(best, c)]:,.0f} µs ({others} that)")
    return f"Choice for the router's data path: {_short(best)}, the least client CPU: {'; '.join(parts)}."


def _short(name: str) -> str:
    return {HTTPX: "httpx", AIOHTTP: "aiohttp", FAST: "`FastUpstream`"}[name]


def _order(name: str) -> int:
    return [HTTPX, AIOHTTP, FAST].index(name)


def versions() -> str:
    found = [
        f"Python {platform.python_version()}",
        f"uvloop {uvloop.__version__}",
        f"httpx {httpx.__version__}",
    ]
    if importlib.util.find_spec("aiohttp") is not None:
        import aiohttp

        found.append(f"aiohttp {aiohttp.__version__}")
    found.append(f"httptools {httptools.__version__}")
    sniffio = "installed" if importlib.util.find_spec("sniffio") is not None else "not installed"
    found.append(f"sniffio {sniffio}")
    return ", ".join(found)


def section(samples: dict[tuple[str, int], list[Sample]], args: argparse.Namespace, command: str) -> str:
    load = os.getloadavg()[0]
    return "\n".join(
        [
            SUBSECTION,
            "",
            f"`{command}` on {datetime.date.today().isoformat()}: {args.requests:,} GETs per measurement"
            " of a node-shaped JSON answer (~110 bytes, four `x-keyroute-*` headers) from a Starlette app on"
            " uvicorn (httptools, uvloop) in its own process, keep-alive, the router's request headers;"
            f" concurrency {', '.join(map(str, args.concurrency))} from one uvloop event loop; median of"
            f" {args.rounds} interleaved rounds. Client CPU = the client process's CPU time / requests"
            " (includes the benchmark's own loop, the same for every client).",
            f"Machine: {os.cpu_count()} CPUs, {platform.machine()}, load average {load:.1f} at the end"
            f" (other work shares the cores); {versions()}.",
            "",
            table(samples),
            "",
            conclusion(samples),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000, help="requests per measurement (default: 4000)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32], help="default: 1 32")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: 5)")
    parser.add_argument("--write", action="store_true", help=f"record the table in {RESULTS.name}")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0

    server, base = start_server()
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            samples: dict[tuple[str, int], Any] = runner.run(
                measure(base, args.requests, args.concurrency, args.rounds)
            )
    finally:
        server.terminate()
        server.wait(timeout=10)
    text = section(samples, args, harness.command(argv))
    print(text)
    if args.write:
        harness.write_subsection(SECTION, SUBSECTION, text)
        print(f"wrote {SUBSECTION!r} under {SECTION!r} in {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
