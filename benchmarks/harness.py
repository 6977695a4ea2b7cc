"""What every benchmark script needs, written once: a free port, a ZooKeeper of its own, keyroute processes,
waiting for a condition, a working folder, its command line and its section of RESULTS.md.

A script imports it as `harness` (run as a script, this folder is first on sys.path; a script that takes the
folder off the path, because one of its names hides a package, imports this first). It imports nothing
from keyroute until a ZooKeeper is asked for, so importing it first is safe.

    harness.free_port()                      a TCP port free on 127.0.0.1 now
    with harness.zookeeper(work) as zk:      a ZooKeeper server in work/zookeeper, started, stopped after
    harness.wait(predicate, 30, "the node")  poll until predicate() is true (errors meanwhile: not yet)
    harness.Proc(["node", ...], log)         `python -m keyroute node ...` of this tree, its output in `log`
    harness.stop(popen)                      SIGTERM, then SIGKILL if it does not end in time
    with harness.work_dir(prefix, keep):     a temporary folder, removed after unless `keep`
    harness.command(argv)                    the command line as typed, for RESULTS.md
    harness.write_section(SECTION, text)     replace (or add) one `## ` section of RESULTS.md
    harness.write_subsection(S, SUB, text)   replace (or add) one `### ` subsection of a section
    harness.record(SECTION, text, write)     print the text and, with --write, put it in RESULTS.md
    bench = harness.script("router.py")      another script as a module (router.py: several build on it)
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keyroute.dev.zookeeper_server import EmbeddedZooKeeper

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
# The repository: where `python -m keyroute` imports this work tree's keyroute from.
ROOT = HERE.parent


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


def write_subsection(section: str, subsection: str, text: str, results: Path = RESULTS) -> None:
    """Replace the `### ` subsection headed `subsection` of the `## ` section `section` of RESULTS.md with
    `text`, or add it at the end of that section (the section itself at the end when there is none)."""
    current = results.read_text(encoding="utf-8") if results.exists() else "# Benchmark results\n"
    found = re.search(rf"^{re.escape(section)}\n.*?(?=^## |\Z)", current, re.MULTILINE | re.DOTALL)
    body = found.group(0) if found else f"{section}\n\n"
    sub_re = re.compile(rf"^{re.escape(subsection)}\n.*?(?=^### |\Z)", re.MULTILINE | re.DOTALL)
    if sub_re.search(body):
        body = sub_re.sub(lambda _: text.rstrip("\n") + "\n\n", body, count=1)
    else:
        body = body.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n\n"
    if found:
        updated = current[: found.start()] + body + current[found.end() :]
    else:
        updated = current.rstrip("\n") + "\n\n" + body
    results.write_text(updated.rstrip("\n") + "\n", encoding="utf-8")


def record(section: str, text: str, write: bool) -> None:
    """The figures' text on stdout and, when `write` (a script's --write), as `section` of RESULTS.md."""
    print(text)
    if write:
        write_section(section, text)
        print(f"wrote {section!r} to {RESULTS}", file=sys.stderr)


def command(argv: list[str] | None) -> str:
    """The command line as typed from the repository root, e.g. `.venv/bin/python benchmarks/router.py
    --quick` (`argv`: the script's arguments when given, else its own)."""
    python = Path(sys.executable)
    if python.is_relative_to(Path.cwd()):
        python = python.relative_to(Path.cwd())
    script = Path(sys.argv[0])
    return shlex.join([str(python), str(script), *(sys.argv[1:] if argv is None else argv)])


@contextmanager
def work_dir(prefix: str, keep: bool = False) -> Iterator[Path]:
    """A new temporary folder for the `with` block (logs, stores, ZooKeeper's data), removed after it unless
    `keep` (a script's --keep), in which case where it is is said on stderr."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work
    finally:
        if keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def stop(popen: subprocess.Popen[bytes], timeout_s: float = 30.0, sig: int = signal.SIGTERM) -> None:
    """Stop a process as an operator would: `sig` (SIGTERM), and SIGKILL when it has not ended `timeout_s`
    later."""
    if popen.poll() is None:
        popen.send_signal(sig)
        try:
            popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


class Proc:
    """A `python -m keyroute ARGS` process of this work tree (run from the repository), its output appended
    to `log`."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.args = args
        self.log = log
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "keyroute", *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def terminate(self) -> None:
        """SIGTERM, without waiting (a node drains meanwhile)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def kill9(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self, timeout_s: float = 30.0) -> None:
        stop(self.popen, timeout_s)


def script(file_name: str) -> ModuleType:
    """Another script of this folder as a module, loaded once, named after its file with `_bench` (router.py:
    `router_bench`), for the scripts that build on it: run from this folder, `router` or `pipeline` would be
    the product's own packages. (Its dataclasses look their module up in sys.modules, so it is put there.)"""
    name = Path(file_name).stem + "_bench"
    loaded = sys.modules.get(name)
    if loaded is None:
        spec = importlib.util.spec_from_file_location(name, HERE / file_name)
        assert spec is not None and spec.loader is not None
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded
        spec.loader.exec_module(loaded)
    return loaded
