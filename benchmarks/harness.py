"""What every benchmark script needs, written once: a free port, a ZooKeeper of its own, waiting for a
condition, and its section of RESULTS.md.

A script imports it as `harness` (run as a script, this folder is first on sys.path; a script that takes the
folder off the path, because one of its names hides a package, imports this first). It imports nothing
from keyroute until a ZooKeeper is asked for, so importing it first is safe.

    harness.free_port()                      a TCP port free on 127.0.0.1 now
    with harness.zookeeper(work) as zk:      a ZooKeeper server in work/zookeeper, started, stopped after
    harness.wait(predicate, 30, "the node")  poll until predicate() is true (errors meanwhile: not yet)
    harness.write_section(SECTION, text)     replace (or add) one `## ` section of RESULTS.md
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keyroute.dev.zookeeper_server import EmbeddedZooKeeper

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def free_port() -> int:
    """A TCP port nothing listens on at 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def zookeeper_server(work: Path, name: str = "zookeeper", **options: Any) -> EmbeddedZooKeeper:
    """An embedded ZooKeeper server (not started) on a free port, its data in `work`/`name`; `options`: the
    server's own (say, `tls`)."""
    from keyroute.dev.zookeeper_server import EmbeddedZooKeeper

    return EmbeddedZooKeeper(port=free_port(), data_dir=work / name, **options)


@contextmanager
def zookeeper(work: Path, name: str = "zookeeper", **options: Any) -> Iterator[EmbeddedZooKeeper]:
    """`zookeeper_server(work, name, **options)`, started for the `with` block and stopped after it."""
    server = zookeeper_server(work, name, **options).start()
    try:
        yield server
    finally:
        server.stop()


def wait(
    predicate: Callable[[], Any],
    timeout_s: float,
    what: str,
    interval_s: float = 0.05,
    not_yet: tuple[type[BaseException], ...] = (Exception,),
) -> Any:
    """Poll `predicate` every `interval_s` until it returns something true, and return that; an exception of
    `not_yet` meanwhile counts as not yet. SystemExit (one line, naming `what` and the last error) after
    `timeout_s`: a benchmark that cannot start has nothing to measure."""
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except not_yet as exc:
            last = exc
        if time.monotonic() > deadline:
            said = "" if last is None else f" (last error: {last!r})"
            raise SystemExit(f"benchmark: timed out after {timeout_s:g}s waiting for {what}{said}")
        time.sleep(interval_s)


def write_section(section: str, text: str, results: Path = RESULTS) -> None:
    """Replace the `## ` section headed `section` of RESULTS.md (up to the next `## ` heading) with `text`,
    or add `text` at the end; every other section stays as it is."""
    current = results.read_text(encoding="utf-8") if results.exists() else "# Benchmark results\n"
    found = re.search(rf"^{re.escape(section)}\n.*?(?=^## |\Z)", current, re.MULTILINE | re.DOTALL)
    if found:
        updated = current[: found.start()] + text.rstrip("\n") + "\n\n" + current[found.end() :]
    else:
        updated = current.rstrip("\n") + "\n\n" + text
    results.write_text(updated.rstrip("\n") + "\n", encoding="utf-8")
