"""What a proxied read costs on a real cluster: direct, through keyroute's routers (new, previous), through nginx.

Run from the repository root:
`.venv/bin/python benchmarks/router.py [--write] [--build compiled|pure] [--previous REV] [--rounds 5]`
(`--quick`: a smoke run of the plumbing, not figures). It installs wrk and nginx with apt-get when they are
missing, builds a store without Spark, starts ZooKeeper, two nodes, a router, a second router with
`--workers 2`, the router of a previous revision REV (default f3c1e03), nginx and two references
(benchmarks/baselines/) on 127.0.0.1, all against the same ZooKeeper and nodes, measures with wrk, stops
everything; --write records the figures in benchmarks/RESULTS.md. Two tables: every setup at saturation, and
every setup at one equal, moderate rate (wrk paced), where the CPU a node spends per read compares like with
like.

Which builds: `--build compiled` (the default) measures the router as it ships. The script builds this work
tree (a copy of its files, uncommitted edits included) and REV each as the image does, `KEYROUTE_COMPILE=1
python -m pip install --no-deps --target DIR` (mypyc compiles setup.py's COMPILED list; build isolation fetches
setuptools and mypy from the configured index; about 1.5 min each), into directories of their own removed at
the end, and runs each router from its DIR with DIR first on PYTHONPATH, having checked that the read path's
modules are DIR's C extensions; a REV with no setup.py with a COMPILED list runs pure from a `git worktree`.
This work tree pure (the venv's editable install) is measured beside them at the highest concurrency; the
nodes are always the editable install. `--build pure`: this work tree's editable install against REV from a
`git worktree` with its own packages first on PYTHONPATH, both pure Python. `--compiled VENV/bin/python`
(implies `--build pure`): (b2) is this work tree compiled into a venv prepared by hand instead of REV.

`--tls` adds the TLS rows in the same run: benchmarks/router_tls.py, with this run's settings, right after the
tables above (the router serving HTTPS and speaking mutual TLS to the nodes, beside nginx as a TLS proxy hop;
its own cluster, as its nodes serve HTTPS); --write records them under their own heading.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.snapshot import Manifest, partition_dir, version_dir, write_manifest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Router"
SUBSECTION = "### Cluster (wrk)"
# With --compiled: (b2) is this work tree compiled with mypyc (setup.py) instead of a previous revision.
COMPILED_SUBSECTION = "### Cluster (wrk): the compiled router"
STORE = "bench"
CHROOT = "/keyroute-bench"

# The targets (issue 5, "Done when"), set on another machine: 120 µs is kept only to translate this
# machine's figure (see the last lines of the report).
TARGET_ROUTER_US = 120.0
TARGET_NODE_RATIO = 1.1
# The data plane's targets, in this run's own terms: the router's CPU per read at most 3x nginx's plain hop
# (d) and no more than the previous revision's; its added p50 at most nginx's added p50 plus 150 µs.
TARGET_VS_NGINX = 3.0
TARGET_ADDED_P50_OVER_NGINX_US = 150.0
# The revision whose router is measured beside this work tree's: the last commit before the data-plane work.
DEFAULT_PREVIOUS = "f3c1e03"
# What nginx's plain proxy hop, and a Starlette app's answer to a read, cost where the targets were set.
NGINX_REFERENCE_US = 20.0
STARLETTE_REFERENCE_US = 32.0

DIRECT = "a. direct to the owning node"
ROUTER = "b. keyroute router -> owner"
PREVIOUS = "b2. previous keyroute router -> owner"
WORKERS = "b3. keyroute router --workers 2 -> owner"
# With --build compiled, (b) and (b3) are this work tree compiled; (b4) is it pure, as the venv runs it.
PURE = "b4. keyroute router, this work tree pure Python -> owner"
NGINX_RR = "c. nginx round-robin, nodes forward"
NGINX_OWNER = "d. nginx -> owner (client-side routing)"
BARE = "e. bare Python proxy -> owner (the floor for a Python hop)"
FRAMEWORK = "f. Starlette app, one fixed answer (no node, no store)"
# The equal-rate table compares (a) to (d); (b3), (b4) are measured at saturation, highest concurrency only,
# (e) and (f) are references measured at saturation only.
SCENARIOS = (DIRECT, ROUTER, PREVIOUS, NGINX_RR, NGINX_OWNER)
SATURATED_SCENARIOS = (DIRECT, ROUTER, PREVIOUS, WORKERS, PURE, NGINX_RR, NGINX_OWNER, BARE, FRAMEWORK)
BASELINES = Path(__file__).resolve().parent / "baselines"

# Picks a random path from a file for every request, and prints wrk's summary as one parseable line.
WRK_SCRIPT = """
local paths = {}
function init(args)
  for line in io.lines(args[1]) do paths[#paths + 1] = line end
  math.randomseed(tonumber(args[2]))
end
function request()
  return wrk.format("GET", paths[math.random(#paths)])
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("KEYROUTE-WRK %d %d %d %d %d %d %d %d %d\\n", summary.requests, summary.duration,
    e.connect, e.read, e.write, e.status, e.timeout, latency:percentile(50), latency:percentile(99)))
end
"""

# Added to WRK_SCRIPT for a paced run: the thread sends args[3] requests per second over all its connections.
# Every request takes the next free slot of one schedule (wrk calls delay() before each request and waits
# that many ms), so the rate holds whatever the latency, as long as a connection is free for every slot;
# slots missed while all connections were busy are dropped, never made up in a burst.
WRK_PACING = """
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } keyroute_timespec;
int clock_gettime(int clock, keyroute_timespec *now);
]]
local now, interval_ms, next_ms = ffi.new("keyroute_timespec"), 0, 0
local function clock_ms()
  ffi.C.clock_gettime(1, now)  -- CLOCK_MONOTONIC
  return tonumber(now.tv_sec) * 1000 + tonumber(now.tv_nsec) / 1e6
end
local load_paths = init
function init(args)
  load_paths(args)
  interval_ms = 1000 / tonumber(args[3])
end
function delay()
  local t = clock_ms()
  local slot = math.max(next_ms, t)
  next_ms = slot + interval_ms
  return math.floor(slot - t + 0.5)
end
"""

NGINX_CONF = """
worker_processes 1;
{user}
pid {work}/nginx.pid;
error_log {work}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {work}/nginx-tmp/body;
  proxy_temp_path {work}/nginx-tmp/proxy;
  fastcgi_temp_path {work}/nginx-tmp/fastcgi;
  uwsgi_temp_path {work}/nginx-tmp/uwsgi;
  scgi_temp_path {work}/nginx-tmp/scgi;
  proxy_http_version 1.1;
  proxy_set_header Connection "";
  upstream every_node {{
{every_node}
    keepalive 64;
  }}
{per_node_upstreams}
  # (c) the seeds' architecture: any node, which forwards what it does not own.
  server {{
    listen 127.0.0.1:{rr_port};
    location / {{ proxy_pass http://every_node; }}
  }}
  # (d) the client put the owner in the path prefix; nginx strips it and passes the read on.
  server {{
    listen 127.0.0.1:{owner_port};
{per_node_locations}
  }}
}}
"""


# -- tools ----------------------------------------------------------------------------------------------


def find_tool(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/usr/bin") / name) if p.exists()), None
    )


def ensure_tools() -> tuple[str, str]:
    """wrk and nginx, installed from Debian's packages when missing (a benchmark machine, not CI)."""
    missing = [name for name in ("wrk", "nginx") if find_tool(name) is None]
    if missing:
        if os.geteuid() != 0:
            raise SystemExit(f"missing {', '.join(missing)}: run `sudo apt-get install -y {' '.join(missing)}`")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in (
            ["apt-get", "update"],
            ["apt-get", "install", "-y", "--no-install-recommends", *missing],
        ):
            print(f"installing: {shlex.join(command)}", file=sys.stderr, flush=True)
            subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    wrk, nginx = find_tool("wrk"), find_tool("nginx")
    assert wrk is not None and nginx is not None
    return wrk, nginx


def tool_versions(wrk: str, nginx: str) -> str:
    nginx_v = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip().split("/")[-1]
    wrk_v = subprocess.run([wrk, "-v"], capture_output=True, text=True).stdout.split()[1]
    return f"wrk {wrk_v}, nginx {nginx_v}"


# -- the store, written by hand in the snapshot format (no Spark) ----------------------------------------


def key_text(i: int) -> str:
    return f"K{i:06d}"


def write_store(root: Path, keys: int, partitions: int) -> tuple[str, list[int]]:
    """A snapshot of `keys` small JSON values; returns its location and each key's partition."""
    snapshot = version_dir(str(root), STORE, 1)
    owners = [partition_for(Partitioner.MURMUR2, key_text(i).encode(), partitions) for i in range(keys)]
    counts = [0] * partitions
    with ExitStack() as stack:
        files = []
        for p in range(partitions):
            folder = partition_dir(snapshot, p)
            folder.mkdir(parents=True)
            files.append(stack.enter_context(open(folder / "part-00000.json", "w")))
        for i, p in enumerate(owners):  # keys in ascending order, so each partition's file is sorted
            value = {"customer": i, "route": f"R{i % 7}", "fare": round(10 + (i % 1000) * 1.5, 2)}
            files[p].write(json.dumps({"key": key_text(i), "value": value}) + "\n")
            counts[p] += 1
    manifest = Manifest(STORE, 1, partitions, Partitioner.MURMUR2, KeyFormat.STRING, ("v",), tuple(counts))
    write_manifest(snapshot, manifest)
    return str(snapshot), owners


def published_store(stack: ExitStack, work: Path, keys: int, partitions: int) -> tuple[ZkSettings, list[int]]:
    """STORE written under `work` (`write_store`: `keys` keys in `partitions` partitions) and published on a
    ZooKeeper of its own, running for `stack`'s life (its data in `work` too), under CHROOT: the settings to
    reach it with and each key's partition."""
    snapshot, partitions_of = write_store(work / "snapshots", keys, partitions)
    zk_server = stack.enter_context(harness.zookeeper(work))
    zk_settings = ZkSettings(hosts=zk_server.connect_string, chroot=CHROOT)
    client = zk.connect(zk_settings)
    stack.callback(zk.close, client)
    record = StoreRecord(STORE, partitions, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot, ("v",), 1, time.time())
    client.create(zk_layout.store_path(STORE), record.to_json(), makepath=True)
    return zk_settings, partitions_of


# -- processes --------------------------------------------------------------------------------------------


@dataclass
class Service:
    name: str
    popen: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self, sig: int = signal.SIGTERM) -> None:
        harness.stop(self.popen, 15, sig)


def start_service(
    name: str, args: Sequence[str], work: Path, url: str, *, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> Service:
    log = work / f"{name}.log"
    with open(log, "ab") as out:
        popen = subprocess.Popen(
            list(args),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            # Per-request logging would be measured as router/node CPU.
            env={**os.environ, **(env or {}), "KEYROUTE_LOG_LEVEL": "WARNING"},
        )
    return Service(name, popen, url, log)


# -- where a keyroute process's code comes from: this work tree, or a git worktree of another revision ------


@dataclass(frozen=True)
class Build:
    """`python -m keyroute` from this work tree (the venv's editable install), from a worktree of `rev`
    with its own packages first on PYTHONPATH, or from another interpreter's installed keyroute (`python`)."""

    label: str
    cwd: Path = ROOT
    env: dict[str, str] = field(default_factory=dict)
    rev: str = ""
    subject: str = ""
    python: str = sys.executable
    # how the tables name (b2): the "previous" router, or the "compiled" one
    role: str = "previous"
    # how it was built, for the written section
    how: str = "pure Python, the venv's editable install"
    compiled: bool = False

    def start(self, name: str, args: Sequence[str], work: Path, url: str) -> Service:
        command = [self.python, "-m", "keyroute", *args]
        return start_service(name, command, work, url, cwd=self.cwd, env=self.env)


THIS_TREE = Build("this work tree")

# sitecustomize.py for a revision whose pyproject maps import names onto folders (package-dir, as
# `keyroute.core` = keyroute/core/): without it, a name its own keyroute/ folder lacks would fall through to
# the venv's editable finder and so to this work tree's code.
REVISION_FINDER = '''"""Written by benchmarks/router.py: keyroute's import names onto a worktree's folders."""
import importlib.util
import sys

FOLDERS = {folders!r}


class RevisionFinder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        folder = FOLDERS.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder + "/__init__.py", submodule_search_locations=[folder]
        )


sys.meta_path.insert(0, RevisionFinder)
'''

# Prints where each import name given as an argument comes from.
WHERE_FROM = """
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = importlib.import_module(name).__file__
    except Exception as exc:
        found[name] = f"not importable: {exc!r}"
print(json.dumps(found))
"""


def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"git {shlex.join(args)} failed:\n{done.stderr}")
    return done.stdout.strip()


# The modules of a proxied read that a compiled build must import from its C extensions.
COMPILED_PROBES = ("keyroute.router.proxy", "keyroute.http.protocol")


def where_from(python: str, names: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """Which file each import name comes from for `python` run in `cwd` with `env` (WHERE_FROM)."""
    check = subprocess.run(
        [python, "-c", WHERE_FROM, *names], cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True
    )
    if check.returncode != 0:
        raise SystemExit(f"{python} cannot import keyroute:\n{check.stderr}")
    found: dict[str, str] = json.loads(check.stdout)
    return found


def compiled_build(python: str, work: Path) -> Build:
    """keyroute as installed for the interpreter `python` with `KEYROUTE_COMPILE=1 pip install .` (setup.py
    compiles its read path with mypyc), run from `work` so that this tree's folders do not shadow it."""
    where = where_from(python, COMPILED_PROBES, work)
    if not all(str(f).endswith(".so") for f in where.values()):
        raise SystemExit(f"{python}'s keyroute is not compiled (KEYROUTE_COMPILE=1 pip install .): {where}")
    print("compiled: " + ", ".join(f"{n} <- {f}" for n, f in where.items()), file=sys.stderr, flush=True)
    how = (
        f"compiled with mypyc (`KEYROUTE_COMPILE=1 pip install .` into the venv of `{python}`; setup.py lists the"
        " compiled modules)"
    )
    return Build(
        "mypyc",
        work,
        python=python,
        subject="this work tree compiled with mypyc",
        role="compiled",
        how=how,
        compiled=True,
    )


def copy_work_tree(target: Path) -> Path:
    """This work tree's files as they are now, uncommitted edits included (tracked and untracked files that
    git does not ignore), copied to `target`: the source of a build that leaves the work tree untouched."""
    for name in git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0"):
        source = ROOT / name
        if name and source.is_file():  # a tracked file deleted in the work tree is left out
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def export_revision(sha: str, target: Path) -> Path:
    """The files of commit `sha` (`git archive`), written to `target`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", sha], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"git archive {sha} failed:\n{archive.stderr.decode(errors='replace')}")
    target.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(target, filter="data")
    return target


def compiles(sha: str) -> bool:
    """Whether commit `sha` has a setup.py that compiles a COMPILED list of modules with KEYROUTE_COMPILE=1."""
    shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{sha}:setup.py"], capture_output=True, text=True)
    return shown.returncode == 0 and re.search(r"^COMPILED\b", shown.stdout, re.MULTILINE) is not None


def installed_build(source: Path, site: Path, label: str, what: str, rev: str = "", subject: str = "") -> Build:
    """keyroute built from `source` and compiled with mypyc, `KEYROUTE_COMPILE=1 <python> -m pip install
    --no-deps --target SITE SOURCE` (build isolation fetches setuptools and mypy), and how to run it: from `site`
    with `site` first on PYTHONPATH. Stops unless the read path's modules are `site`'s C extensions."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(source)]
    log = site.parent / f"{site.name}-pip.log"
    print(f"building {what} with mypyc into {site} (about 1.5 min)", file=sys.stderr, flush=True)
    started = time.monotonic()
    with open(log, "wb") as out:
        built = subprocess.run(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "KEYROUTE_COMPILE": "1"}, cwd=site.parent
        )
    if built.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} failed; see {log}:\n{log.read_text(errors='replace')[-3000:]}")
    print(f"built {what} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    env = {"PYTHONPATH": str(site)}
    where = where_from(sys.executable, ["keyroute", *COMPILED_PROBES], site, env)
    inside = os.path.realpath(site) + os.sep
    astray = {
        name: found
        for name, found in where.items()
        if not os.path.realpath(found).startswith(inside) or (name in COMPILED_PROBES and not found.endswith(".so"))
    }
    if astray:
        raise SystemExit(f"{what}: not imported from the compiled build in {site}: {astray}")
    print(f"{what}: " + ", ".join(f"{n} <- {f}" for n, f in where.items()), file=sys.stderr, flush=True)
    how = (
        "compiled with mypyc as the image builds it: `KEYROUTE_COMPILE=1 python -m pip install --no-deps --target"
        " DIR` (setup.py compiles the modules of its COMPILED list), each build into its own directory, run from"
        f" it with it first on PYTHONPATH ({' and '.join(COMPILED_PROBES)} checked to be its C extensions)"
    )
    return Build(label, site, env, rev, subject, how=how, compiled=True)


def shipped_builds(rev: str, work: Path, pure: Callable[[str], Build]) -> tuple[Build, Build]:
    """(b) and (b2) for --build compiled: this work tree compiled as the image compiles it, and revision `rev`
    compiled the same way, or pure (`pure(rev)`, a git worktree) when its setup.py has no COMPILED list."""
    new = installed_build(
        copy_work_tree(work / "build-new" / "source"), work / "build-new" / "site", "mypyc", "this work tree"
    )
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    if not compiles(sha):
        print(f"{rev} ({sha[:12]}) has no setup.py with a COMPILED list: its router runs pure", file=sys.stderr)
        return new, pure(rev)
    folder = work / f"build-{sha[:12]}"
    subject = git("log", "-1", "--format=%s", sha)
    previous = installed_build(
        export_revision(sha, folder / "source"), folder / "site", sha[:7], f"{rev} ({sha[:12]})", rev, subject
    )
    return new, previous


@contextmanager
def revision_build(rev: str, work: Path) -> Iterator[Build]:
    """A detached `git worktree` of `rev` under `work`, removed on the way out, and how to run keyroute
    from it: cwd and PYTHONPATH the worktree, so that its own top-level packages are imported."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    tree = work / f"rev-{sha[:12]}"
    print(f"git worktree of {rev} ({sha[:12]}) at {tree}", file=sys.stderr, flush=True)
    git("worktree", "add", "--detach", str(tree), sha)
    try:
        setuptools = tomllib.loads((tree / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
        package_dir: dict[str, str] = setuptools.get("package-dir", {})
        pythonpath = [str(tree)]
        mapped = {name: str(tree / folder) for name, folder in package_dir.items() if name.replace(".", "/") != folder}
        if mapped:
            shim = work / f"rev-{sha[:12]}-finder"
            shim.mkdir()
            (shim / "sitecustomize.py").write_text(REVISION_FINDER.format(folders=mapped))
            pythonpath.append(str(shim))
        env = {"PYTHONPATH": os.pathsep.join(pythonpath)}
        # The packages a router and a node import: mapped names, or the old top-level folders.
        names = [n for n in package_dir if "pipeline" not in n] or ["keyroute", "router", "state_node"]
        check = subprocess.run(
            [sys.executable, "-c", WHERE_FROM, *names],
            cwd=tree,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
        )
        if check.returncode != 0:
            raise SystemExit(f"checking the imports of {rev} failed:\n{check.stderr}")
        where = json.loads(check.stdout)
        print(
            f"{rev} imports: " + ", ".join(f"{n} <- {f}" for n, f in where.items()),
            file=sys.stderr,
            flush=True,
        )
        inside = os.path.realpath(tree) + os.sep
        outside = {n: f for n, f in where.items() if not os.path.realpath(str(f)).startswith(inside)}
        if outside:
            raise SystemExit(f"{rev}'s packages do not all come from its worktree {tree}: {outside}")
        subject = git("log", "-1", "--format=%s", sha)
        how = (
            "pure Python, run from a `git worktree` of that revision with its own packages first on PYTHONPATH"
            " (same venv)"
        )
        yield Build(sha[:7], tree, env, rev, subject, how=how)
    finally:
        removed = subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True, text=True
        )
        if removed.returncode != 0:
            print(f"git worktree remove {tree}: {removed.stderr.strip()}", file=sys.stderr)
            shutil.rmtree(tree, ignore_errors=True)
            subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], capture_output=True)


def _listening(url: str) -> bool:
    host, _, port = url.removeprefix("http://").partition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def http_json(url: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, services: list[Service]) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for service in services:
            if service.popen.poll() is not None:
                raise SystemExit(f"{service.name} exited; see {service.log}:\n{service.log.read_text()[-3000:]}")
        try:
            if predicate():
                return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            raise SystemExit(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.2)


# -- CPU time of a process tree, from /proc ---------------------------------------------------------------

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()  # fields from the 3rd on: state, ppid, ...


def _tree(root: int) -> tuple[set[int], dict[int, list[str]]]:
    """`root` and every live descendant, and the stat fields of every process."""
    parents: dict[int, int] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            parents[int(entry)] = int(fields[1])
            stats[int(entry)] = fields
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    return tree, stats


def tree_size(root: int) -> int:
    """How many live processes `root`'s tree has."""
    tree, stats = _tree(root)
    return sum(1 for pid in tree if pid in stats)


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system, also of reaped children) of `root` and every live descendant."""
    tree, stats = _tree(root)
    ticks = 0
    for pid in tree:
        fields = stats.get(pid)
        if fields is not None:  # utime, stime, cutime, cstime are the 14th-17th fields
            ticks += sum(int(v) for v in fields[11:15])
    return ticks / CLOCK_TICKS


# -- one wrk run ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    requests: int = 0
    duration_s: float = 0.0
    errors: int = 0
    p50_us: float = 0.0
    p99_us: float = 0.0
    proxy_cpu_s: float = 0.0
    node_cpu_s: float = 0.0


def wrk_start(
    wrk: str,
    script: Path,
    url: str,
    paths: Path,
    concurrency: int,
    duration_s: float,
    seed: int,
    rate_per_s: float | None = None,
) -> subprocess.Popen[str]:
    """wrk as fast as it can, or paced to `rate_per_s` (then `script` must hold WRK_PACING)."""
    command = [wrk, "-t1", f"-c{concurrency}", f"-d{duration_s:g}s", "--timeout", "5s", "--latency"]
    command += ["-s", str(script), url, "--", str(paths), str(seed)]
    if rate_per_s is not None:
        command.append(f"{rate_per_s:g}")
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wrk_result(popen: subprocess.Popen[str]) -> Run:
    out, err = popen.communicate()
    if popen.returncode != 0:
        raise SystemExit(f"wrk failed ({popen.returncode}):\n{out}{err}")
    line = next((ln for ln in out.splitlines() if ln.startswith("KEYROUTE-WRK ")), None)
    if line is None:
        raise SystemExit(f"wrk printed no summary:\n{out}")
    requests, duration_us, *errors, p50, p99 = (int(v) for v in line.split()[1:])
    return Run(requests, duration_us / 1e6, sum(errors), float(p50), float(p99))


def wrk_run(
    wrk: str,
    script: Path,
    url: str,
    paths: Path,
    concurrency: int,
    duration_s: float,
    seed: int,
    rate_per_s: float | None = None,
) -> Run:
    return wrk_result(wrk_start(wrk, script, url, paths, concurrency, duration_s, seed, rate_per_s))


@dataclass
class Cluster:
    wrk: str
    script: Path
    nodes: dict[str, Service]
    router: Service
    nginx: Service
    rr_url: str
    owner_url: str
    files: dict[str, Path]
    paced_script: Path
    bare: Service
    framework: Service
    # The router of a previous revision, and one of this tree's with --workers 2 (None in router_variants.py).
    previous: Service | None = None
    workers: Service | None = None
    previous_build: Build | None = None
    # The nodes' build, and the build of the routers (b) and (b3): the same, or with --build compiled this work
    # tree compiled, the nodes' pure build then being measured as (b4) `pure`.
    new_build: Build = THIS_TREE
    router_build: Build = THIS_TREE
    pure: Service | None = None

    def measure(
        self, scenario: str, concurrency: int, duration_s: float, seed: int, rate_per_s: float | None = None
    ) -> Run:
        """One measurement. Unpaced, (a) runs one wrk per node in turn and adds the figures up; paced to a
        total `rate_per_s` over `concurrency` connections, it runs them at once, each with its share of
        both, so that every node sees the rate it sees behind a proxy."""
        if scenario == DIRECT:
            legs = [(node.url, self.files[name]) for name, node in self.nodes.items()]
        elif scenario == ROUTER:
            legs = [(self.router.url, self.files["all"])]
        elif scenario == PREVIOUS:
            assert self.previous is not None
            legs = [(self.previous.url, self.files["all"])]
        elif scenario == WORKERS:
            assert self.workers is not None
            legs = [(self.workers.url, self.files["all"])]
        elif scenario == PURE:
            assert self.pure is not None
            legs = [(self.pure.url, self.files["all"])]
        elif scenario == NGINX_RR:
            legs = [(self.rr_url, self.files["all"])]
        elif scenario == BARE:
            legs = [(self.bare.url, self.files["all"])]
        elif scenario == FRAMEWORK:
            legs = [(self.framework.url, self.files["all"])]
        else:
            legs = [(self.owner_url, self.files["prefixed"])]
        proxies = {ROUTER: self.router, NGINX_RR: self.nginx, NGINX_OWNER: self.nginx, BARE: self.bare}
        proxies |= {PREVIOUS: self.previous, WORKERS: self.workers, PURE: self.pure}
        proxy = proxies.get(scenario)
        # (f) answers by itself: its CPU is the "node" CPU of its row.
        nodes = [self.framework] if scenario == FRAMEWORK else list(self.nodes.values())
        total = Run()
        weighted_p50 = weighted_p99 = 0.0
        batches: list[list[tuple[str, Path, int, float | None]]]
        if rate_per_s is None:
            batches = [[(url, paths, concurrency, None)] for url, paths in legs]
        else:
            share = len(legs)
            batches = [[(url, paths, max(1, concurrency // share), rate_per_s / share) for url, paths in legs]]
        for batch in batches:
            before_nodes = sum(tree_cpu_s(n.popen.pid) for n in nodes)
            before_proxy = tree_cpu_s(proxy.popen.pid) if proxy else 0.0
            script = self.script if rate_per_s is None else self.paced_script
            started = [
                wrk_start(self.wrk, script, url, paths, connections, duration_s, seed + i, rate)
                for i, (url, paths, connections, rate) in enumerate(batch)
            ]
            runs = [wrk_result(popen) for popen in started]
            total.node_cpu_s += sum(tree_cpu_s(n.popen.pid) for n in nodes) - before_nodes
            total.proxy_cpu_s += (tree_cpu_s(proxy.popen.pid) - before_proxy) if proxy else 0.0
            total.duration_s += max(run.duration_s for run in runs)  # the legs of a batch run at the same time
            for run in runs:
                total.requests += run.requests
                total.errors += run.errors
                weighted_p50 += run.p50_us * run.requests
                weighted_p99 += run.p99_us * run.requests
        total.p50_us = weighted_p50 / max(1, total.requests)
        total.p99_us = weighted_p99 / max(1, total.requests)
        return total


@contextmanager
def running_cluster(args: argparse.Namespace, wrk: str, nginx: str, work: Path) -> Iterator[Cluster]:
    with ExitStack() as stack:
        print(f"writing {args.keys:,} keys in {args.partitions} partitions to {work}", file=sys.stderr)
        zk_settings, partitions_of = published_store(stack, work, args.keys, args.partitions)

        # Worktrees first, so that they are removed only after every process that runs from them has stopped.
        builds: dict[str, Build] = {}

        def build_of(rev: str | None) -> Build:
            if not rev:
                return THIS_TREE
            if rev not in builds:
                builds[rev] = stack.enter_context(revision_build(rev, work))
            return builds[rev]

        # The hidden --new-from REV stands a revision in for this work tree (nodes and routers alike), to test
        # this script while the work tree cannot serve.
        new = build_of(getattr(args, "new_from", None))
        previous_rev = getattr(args, "previous", None)
        # The routers (b) and (b3): the nodes' build, or with --build compiled this work tree compiled.
        router_build = new
        if getattr(args, "compiled", None):
            previous_build: Build | None = compiled_build(args.compiled, work)
        elif getattr(args, "build", "pure") == "compiled":
            router_build, previous_build = shipped_builds(previous_rev or DEFAULT_PREVIOUS, work, build_of)
        else:
            previous_build = build_of(previous_rev) if previous_rev else None

        connect = zk_settings.connect_string
        nodes: dict[str, Service] = {}
        for n in range(1, args.nodes + 1):
            name, port = f"n{n}", harness.free_port()
            node = new.start(
                name,
                ["node", "--zk", connect, "--node-id", name, "--port", str(port)]
                + ["--data-dir", str(work / f"data-{name}")],
                work,
                f"http://127.0.0.1:{port}",
            )
            stack.callback(node.stop)
            nodes[name] = node
        port = harness.free_port()
        router = router_build.start(
            "router", ["router", "--zk", connect, "--port", str(port)], work, f"http://127.0.0.1:{port}"
        )
        stack.callback(router.stop)
        routers = [router]
        previous = workers = pure = None
        if router_build is not new:  # (b4): the nodes' build, pure Python, on record beside the compiled one
            port = harness.free_port()
            pure = new.start(
                "router-pure", ["router", "--zk", connect, "--port", str(port)], work, f"http://127.0.0.1:{port}"
            )
            stack.callback(pure.stop)
            routers.append(pure)
        if previous_build is not None:
            port = harness.free_port()
            previous = previous_build.start(
                "router-previous", ["router", "--zk", connect, "--port", str(port)], work, f"http://127.0.0.1:{port}"
            )
            stack.callback(previous.stop)
            port = harness.free_port()
            workers = router_build.start(
                "router-workers-2",
                ["router", "--zk", connect, "--port", str(port), "--workers", "2"],
                work,
                f"http://127.0.0.1:{port}",
            )
            stack.callback(workers.stop)
            routers += [previous, workers]
        services = [*nodes.values(), *routers]

        def router_map_complete() -> bool:
            # Several times each: the workers of a --workers router share the port, each with its own map.
            for r in routers:
                for _ in range(8 if r is workers else 1):
                    status, body = http_json(r.url + "/admin/partition-map")
                    if status != 200 or not isinstance(body, dict) or not body.get("complete"):
                        return False
            return True

        wait_until(
            lambda: all(http_json(n.url + "/readyz")[0] == 200 for n in nodes.values()),
            180,
            "the nodes to load their partitions",
            services,
        )
        wait_until(router_map_complete, 60, "every router's partition map to be complete", services)
        if workers is not None:
            print(f"the --workers 2 router runs as {tree_size(workers.popen.pid)} processes", file=sys.stderr)

        # Owners as the router sees them; with rf=1 each partition has exactly one.
        _, described = http_json(router.url + "/admin/partition-map?detail=all")
        assert isinstance(described, dict)
        owner_of = [entry["serving"][0]["node"] for entry in described["stores"][STORE]["partition_map"]]
        print(
            "partitions per node: "
            + ", ".join(f"{n}: {owner_of.count(n)}" for n in nodes)
            + f"; load average {os.getloadavg()[0]:.1f}",
            file=sys.stderr,
        )

        files = write_key_files(work, args.keys, partitions_of, owner_of, list(nodes))
        rr_port, owner_port = harness.free_port(), harness.free_port()
        nginx_service = start_nginx(nginx, work, nodes, rr_port, owner_port)
        stack.callback(nginx_service.stop, signal.SIGQUIT)
        rr_url, owner_url = f"http://127.0.0.1:{rr_port}", f"http://127.0.0.1:{owner_port}"
        wait_until(lambda: http_json(rr_url + "/healthz")[0] == 200, 30, "nginx", [nginx_service])
        script, paced_script = work / "random-paths.lua", work / "paced-random-paths.lua"
        script.write_text(WRK_SCRIPT)
        paced_script.write_text(WRK_SCRIPT + WRK_PACING)
        routes = work / "bare-proxy-routes.json"
        routes.write_text(json.dumps({"partitions": args.partitions, "owners": [nodes[n].url for n in owner_of]}))
        bare_port, framework_port = harness.free_port(), harness.free_port()
        bare = start_service(
            "bare-proxy",
            [sys.executable, str(BASELINES / "bare_proxy.py"), str(routes), str(bare_port)],
            work,
            f"http://127.0.0.1:{bare_port}",
        )
        stack.callback(bare.stop)
        framework = start_service(
            "starlette-answer",
            [sys.executable, str(BASELINES / "starlette_answer.py"), str(framework_port)],
            work,
            f"http://127.0.0.1:{framework_port}",
        )
        stack.callback(framework.stop)
        wait_until(lambda: all(_listening(s.url) for s in (bare, framework)), 30, "the baselines", [bare, framework])
        cluster = Cluster(
            wrk,
            script,
            nodes,
            router,
            nginx_service,
            rr_url,
            owner_url,
            files,
            paced_script,
            bare,
            framework,
            previous,
            workers,
            previous_build,
            new,
            router_build,
            pure,
        )
        check_answers(cluster)
        yield cluster


def write_key_files(
    work: Path, keys: int, partitions_of: list[int], owner_of: list[str], nodes: list[str]
) -> dict[str, Path]:
    """Request paths, one a line: all keys, each node's own keys, and all keys with the owner as prefix."""
    lines: dict[str, list[str]] = {"all": [], "prefixed": [], **{n: [] for n in nodes}}
    for i in range(keys):
        path = f"/stores/{STORE}/keys/{key_text(i)}"
        owner = owner_of[partitions_of[i]]
        lines["all"].append(path)
        lines[owner].append(path)
        lines["prefixed"].append(f"/{owner}{path}")
    files = {}
    for name, found in lines.items():
        files[name] = work / f"paths-{name}.txt"
        files[name].write_text("\n".join(found) + "\n")
    return files


def start_nginx(nginx: str, work: Path, nodes: dict[str, Service], rr_port: int, owner_port: int) -> Service:
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (work / "nginx-tmp" / sub).mkdir(parents=True, exist_ok=True)
    address = {name: node.url.removeprefix("http://") for name, node in nodes.items()}
    conf = NGINX_CONF.format(
        # As root, nginx would run its worker as `nobody`, who cannot read our temporary directory.
        user="user root;" if os.geteuid() == 0 else "",
        work=work,
        every_node="\n".join(f"    server {a};" for a in address.values()),
        per_node_upstreams="\n".join(
            f"  upstream owner_{name} {{ server {a}; keepalive 64; }}" for name, a in address.items()
        ),
        rr_port=rr_port,
        owner_port=owner_port,
        per_node_locations="\n".join(
            f"    location /{name}/ {{ proxy_pass http://owner_{name}/; }}" for name in address
        ),
    )
    path = work / "nginx.conf"
    path.write_text(conf)
    command = [nginx, "-p", str(work), "-e", str(work / "nginx-error.log"), "-c", str(path)]
    command += ["-g", "daemon off; master_process on;"]
    return start_service("nginx", command, work, f"http://127.0.0.1:{rr_port}")


def check_answers(cluster: Cluster) -> None:
    """Every way in gives the same answer for a few keys, so the timings compare like with like."""
    for path in cluster.files["prefixed"].read_text().splitlines()[::9973]:
        owner, plain = path.split("/", 2)[1], "/" + path.split("/", 2)[2]
        bodies = set()
        routers = [r.url for r in (cluster.router, cluster.previous, cluster.workers, cluster.pure) if r is not None]
        for url in (cluster.nodes[owner].url, *routers, cluster.rr_url, cluster.owner_url, cluster.bare.url):
            target = url + (path if url == cluster.owner_url else plain)
            status, body = http_json(target)
            if status != 200:
                raise SystemExit(f"GET {target} answered {status}")
            assert isinstance(body, dict)
            bodies.add(json.dumps(body["value"], sort_keys=True))
        if len(bodies) != 1:
            raise SystemExit(f"different answers for {plain}: {bodies}")


# -- measuring and reporting -------------------------------------------------------------------------------


@dataclass
class Figures:
    runs: list[Run] = field(default_factory=list)

    def median(self, what: Callable[[Run], float]) -> float:
        return statistics.median(what(r) for r in self.runs)

    @property
    def per_s(self) -> float:
        return self.median(lambda r: r.requests / r.duration_s)

    @property
    def p50_us(self) -> float:
        return self.median(lambda r: r.p50_us)

    @property
    def p99_us(self) -> float:
        return self.median(lambda r: r.p99_us)

    @property
    def proxy_us(self) -> float:
        return self.median(lambda r: r.proxy_cpu_s / r.requests * 1e6)

    @property
    def node_us(self) -> float:
        return self.median(lambda r: r.node_cpu_s / r.requests * 1e6)

    @property
    def errors(self) -> int:
        return sum(r.errors for r in self.runs)


def paced_rates(args: argparse.Namespace) -> dict[str, float]:
    """The total rate each scenario is paced to in the equal-rate table; (c) serves far fewer reads."""
    rates = {scenario: args.rate for scenario in SCENARIOS if scenario != NGINX_RR}
    if not getattr(args, "previous", None):
        del rates[PREVIOUS]
    if args.rr_rate > 0:
        rates[NGINX_RR] = args.rr_rate
    return {scenario: rates[scenario] for scenario in SCENARIOS if scenario in rates}


def measure(cluster: Cluster, args: argparse.Namespace) -> tuple[dict[tuple[str, int], Figures], dict[str, Figures]]:
    """Figures at saturation, per (scenario, concurrency), and at an equal rate, per scenario. The
    --workers 2 router (b3) is measured at the highest concurrency only: it is there for its throughput; so is
    (b4), the pure build beside the compiled one, there for the record."""
    figures: dict[tuple[str, int], Figures] = {}
    paced: dict[str, Figures] = {}
    services = ((PREVIOUS, cluster.previous), (WORKERS, cluster.workers), (PURE, cluster.pure))
    absent = {s for s, service in services if service is None}
    scenarios = [s for s in SATURATED_SCENARIOS if s not in absent]
    high = max(args.concurrency)
    rates = paced_rates(args)
    for scenario in scenarios:  # warm up every path: connections, caches, the nodes' LMDB pages
        cluster.measure(scenario, high, 1.0, seed=1)
    rng = random.Random(20240229)
    for round_index in range(args.rounds):
        started = time.monotonic()
        for concurrency in args.concurrency:
            order = [s for s in scenarios if s not in (WORKERS, PURE) or concurrency == high]
            rng.shuffle(order)  # so slow drifts of the machine's load do not always hit the same scenario
            for scenario in order:
                run = cluster.measure(scenario, concurrency, args.duration, seed=rng.randrange(1, 1 << 30))
                figures.setdefault((scenario, concurrency), Figures()).runs.append(run)
        order = list(rates)
        rng.shuffle(order)
        for scenario in order:
            seed = rng.randrange(1, 1 << 30)
            run = cluster.measure(scenario, args.paced_connections, args.duration, seed, rates[scenario])
            paced.setdefault(scenario, Figures()).runs.append(run)
        print(
            f"round {round_index + 1}/{args.rounds} done in {time.monotonic() - started:.0f} s;"
            f" load average {os.getloadavg()[0]:.1f}",
            file=sys.stderr,
            flush=True,
        )
    return figures, paced


def previous_label(previous: Build, router_build: Build = THIS_TREE) -> str:
    """(b2)'s name: its revision, and beside a compiled (b) its build (mypyc, or pure when it has none)."""
    if not router_build.compiled:
        return previous.label
    return f"{previous.label}, {'mypyc' if previous.compiled else 'pure Python'}"


def scenario_names(previous: Build | None, router_build: Build = THIS_TREE) -> dict[str, str]:
    """How the tables name each scenario: (b2) with its revision, (b) and (b3) with their build."""
    if previous is None:
        return {}
    names = {PREVIOUS: f"b2. {previous.role} keyroute router ({previous_label(previous, router_build)}) -> owner"}
    if router_build.compiled:
        names[ROUTER] = "b. keyroute router, compiled (mypyc) -> owner"
        names[WORKERS] = "b3. keyroute router, compiled (mypyc), --workers 2 -> owner"
    return names


def table(figures: dict[tuple[str, int], Figures], names: dict[str, str] | None = None) -> str:
    names = names or {}
    lines = [
        "| setup | concurrency | requests/s | p50 ms | p99 ms | proxy CPU µs/request | node CPU µs/request | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    order = SATURATED_SCENARIOS.index
    for (scenario, concurrency), f in sorted(figures.items(), key=lambda i: (i[0][1], order(i[0][0]))):
        proxy = "—" if scenario in (DIRECT, FRAMEWORK) else f"{f.proxy_us:,.0f}"
        lines.append(
            f"| {names.get(scenario, scenario)} | {concurrency} | {f.per_s:,.0f} | {f.p50_us / 1000:.2f}"
            f" | {f.p99_us / 1000:.2f} | {proxy} | {f.node_us:,.0f} | {f.errors} |"
        )
    return "\n".join(lines)


def paced_table(paced: dict[str, Figures], rates: dict[str, float], names: dict[str, str] | None = None) -> str:
    names = names or {}
    lines = [
        "| setup | target requests/s | requests/s | p50 ms | p99 ms | proxy CPU µs/request | node CPU µs/request"
        " | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for scenario, f in sorted(paced.items(), key=lambda i: SCENARIOS.index(i[0])):
        proxy = "—" if scenario == DIRECT else f"{f.proxy_us:,.0f}"
        lines.append(
            f"| {names.get(scenario, scenario)} | {rates[scenario]:,.0f} | {f.per_s:,.0f} | {f.p50_us / 1000:.2f}"
            f" | {f.p99_us / 1000:.2f} | {proxy} | {f.node_us:,.0f} | {f.errors} |"
        )
    return "\n".join(lines)


def rates_check(paced: dict[str, Figures], rates: dict[str, float], tolerance: float = 0.1) -> str:
    """One sentence: did every paced scenario reach its target rate, so that the CPU figures compare?"""
    deviation = {scenario: f.per_s / rates[scenario] - 1 for scenario, f in paced.items()}
    off = [scenario for scenario, d in deviation.items() if abs(d) > tolerance]
    if not off:
        largest = max(deviation.values(), key=abs)
        return f"Every setup reached its target rate within {tolerance:.0%} (largest deviation {largest:+.1%})."
    listed = "; ".join(f"{s}: {paced[s].per_s:,.0f} of {rates[s]:,.0f} requests/s" for s in off)
    return (
        f"**Off the target rate by more than {tolerance:.0%}**: {listed}. These do not compare with the"
        " others at an equal rate (a setup that cannot keep up is saturated, or the machine was busy)."
    )


def verdicts(
    figures: dict[tuple[str, int], Figures],
    concurrencies: list[int],
    paced: dict[str, Figures],
    rate: float,
    previous_label: str,
    role: str = "previous",
    router_label: str = "",
) -> list[str]:
    """The verdict lines; they judge (b), the router `router_label` names (this work tree's build) when given."""

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    low, high = min(concurrencies), max(concurrencies)
    direct, rr, nginx = figures[(DIRECT, high)], figures[(NGINX_RR, high)], figures[(NGINX_OWNER, high)]
    router, previous, workers = figures[(ROUTER, high)], figures[(PREVIOUS, high)], figures[(WORKERS, high)]
    ratio = paced[ROUTER].node_us / paced[DIRECT].node_us
    previous_ratio = paced[PREVIOUS].node_us / paced[DIRECT].node_us
    nginx_ratio = paced[NGINX_OWNER].node_us / paced[DIRECT].node_us
    saturated_ratio = router.node_us / direct.node_us

    def added(scenario: str) -> float:
        return figures[(scenario, low)].p50_us - figures[(DIRECT, low)].p50_us

    added_limit = added(NGINX_OWNER) + TARGET_ADDED_P50_OVER_NGINX_US
    beats = router.p99_us < rr.p99_us and router.node_us < rr.node_us
    bare, framework = figures[(BARE, high)], figures[(FRAMEWORK, high)]
    # How much dearer this machine is than the one the targets were set on, by two measures taken in
    # this run: nginx's plain hop, and a Starlette app's answer.
    nginx_factor = nginx.proxy_us / NGINX_REFERENCE_US
    framework_factor = framework.node_us / STARLETTE_REFERENCE_US
    factor = min(nginx_factor, framework_factor)
    # nginx's plain hop (d) measured in this run is the yardstick that does not depend on how busy the machine is.
    relative = router.proxy_us / nginx.proxy_us
    compiled = []
    if role == "compiled":
        compiled_relative = previous.proxy_us / nginx.proxy_us
        compiled = [
            f"- The compiled router (b2, concurrency {high}): {previous.proxy_us:,.0f} µs CPU per proxied read"
            f" against the pure build's {router.proxy_us:,.0f} µs ({previous.proxy_us / router.proxy_us - 1:+.0%}),"
            f" {compiled_relative:.1f}x nginx's plain hop, target <= {TARGET_VS_NGINX:g}x:"
            f" {verdict(compiled_relative <= TARGET_VS_NGINX)}. (The line below compares the pure build with it.)"
        ]
    if (PURE, high) in figures:  # --build compiled: (b) is compiled, (b4) the same tree pure
        pure = figures[(PURE, high)]
        compiled = [
            f"- This work tree pure Python (b4, concurrency {high}): {pure.proxy_us:,.0f} µs CPU per proxied read"
            f" ({pure.proxy_us / nginx.proxy_us:.1f}x nginx's plain hop), {pure.per_s:,.0f} requests/s; compiled as"
            f" it ships (b): {router.proxy_us:,.0f} µs ({router.proxy_us / pure.proxy_us - 1:+.0%}),"
            f" {router.per_s:,.0f} requests/s."
        ]
    built = f", {router_label}" if router_label else ""
    return [
        *compiled,
        f"- Router CPU per proxied read (concurrency {high}{built}): {router.proxy_us:,.0f} µs, the {role} router"
        f" ({previous_label}) {previous.proxy_us:,.0f} µs ({router.proxy_us / previous.proxy_us - 1:+.0%}),"
        f" target no more than the {role}: {verdict(router.proxy_us <= previous.proxy_us)}. Relative to"
        f" nginx's plain proxy hop in the same run (d, {nginx.proxy_us:,.0f} µs): {relative:.1f}x (the {role}"
        f" router {previous.proxy_us / nginx.proxy_us:.1f}x), target <= {TARGET_VS_NGINX:g}x:"
        f" {verdict(relative <= TARGET_VS_NGINX)}. At concurrency {low}: {figures[(ROUTER, low)].proxy_us:,.0f}"
        f" µs, the {role} router {figures[(PREVIOUS, low)].proxy_us:,.0f} µs, nginx"
        f" {figures[(NGINX_OWNER, low)].proxy_us:,.0f} µs.",
        f"- Node CPU per read via the router / direct at an equal {rate:,.0f} requests/s:"
        f" {ratio:.2f}x ({paced[ROUTER].node_us:,.0f} vs {paced[DIRECT].node_us:,.0f} µs), target"
        f" <= {TARGET_NODE_RATIO}x: {verdict(ratio <= TARGET_NODE_RATIO)}. Via the {role} router the same ratio"
        f" is {previous_ratio:.2f}x, via nginx's plain hop (d) {nginx_ratio:.2f}x."
        f" At saturation (concurrency {high}) the router's and nginx's are {saturated_ratio:.2f}x and"
        f" {nginx.node_us / direct.node_us:.2f}x, because"
        " there (a) floods one node at a time, which then serves many reads per event-loop wakeup, while"
        " behind a proxy each node gets reads at the proxy's pace, fewer per wakeup and so dearer each:"
        " that ratio measures the shape of the load, not the work a node does per read.",
        f"- Added p50 latency at concurrency {low} over a direct read ({figures[(DIRECT, low)].p50_us:,.0f} µs):"
        f" through the router {added(ROUTER):,.0f} µs, target <= nginx's plain hop's {added(NGINX_OWNER):,.0f} µs"
        f" + {TARGET_ADDED_P50_OVER_NGINX_US:.0f} = {added_limit:,.0f} µs: {verdict(added(ROUTER) <= added_limit)}"
        f" (the {role} router: {added(PREVIOUS):,.0f} µs).",
        f"- Throughput at saturation (concurrency {high}): one router process {router.per_s:,.0f} requests/s"
        f" ({router.proxy_us:,.0f} µs CPU/read); `--workers 2` {workers.per_s:,.0f} requests/s"
        f" ({workers.per_s / router.per_s:.2f}x) at {workers.proxy_us:,.0f} µs CPU/read over its whole process tree"
        f" (parent and workers); the {role} router {previous.per_s:,.0f} requests/s. For scale: nginx's plain"
        f" hop (d) {nginx.per_s:,.0f}, the nodes read directly (a, one at a time) {direct.per_s:,.0f} requests/s;"
        f" every process shares this machine's {os.cpu_count()} CPUs with wrk and the nodes.",
        f"- keyroute (router) vs nginx round-robin with forwarding nodes (concurrency {high}): p99"
        f" {router.p99_us / 1000:.2f} vs {rr.p99_us / 1000:.2f} ms, node CPU {router.node_us:,.0f} vs"
        f" {rr.node_us:,.0f} µs/read: {verdict(beats)}.",
        f"- This machine against the one the issue's targets were set on (concurrency {high}): nginx's plain hop"
        f" costs {nginx.proxy_us:,.0f} µs here against {NGINX_REFERENCE_US:.0f} there ({nginx_factor:.1f}x), a"
        f" Starlette app's answer (f) {framework.node_us:,.0f} µs against {STARLETTE_REFERENCE_US:.0f}"
        f" ({framework_factor:.1f}x). Divided by the smaller factor, the router's {router.proxy_us:,.0f} µs"
        f" would be ~{router.proxy_us / factor:,.0f} µs there (target {TARGET_ROUTER_US:.0f}).",
        f"- The floor for a proxy hop in Python on this machine (e: uvloop, httptools, callbacks only, no"
        f" metrics, request ids, admission, failover or timeouts): {bare.proxy_us:,.0f} µs/read; the router"
        f" costs {router.proxy_us / bare.proxy_us:.1f}x that, the {role} router"
        f" {previous.proxy_us / bare.proxy_us:.1f}x.",
    ]


def router_client(tree: Path = ROOT) -> str:
    """Which HTTP client a router uses for its data path, read from its source (the app that builds it)."""
    app = tree / "router" / "app.py"
    source = app.read_text(encoding="utf-8") if app.exists() else ""
    if "FastUpstream" in source:
        return "`FastUpstream`"
    return "`HttpxUpstream` (httpx)" if "HttpxUpstream" in source else "see router/"


def section(
    figures: dict[tuple[str, int], Figures],
    paced: dict[str, Figures],
    args: argparse.Namespace,
    command: str,
    versions: str,
    load: str,
    previous: Build,
    new: Build = THIS_TREE,
    data_path: str | None = None,
    router_build: Build | None = None,
) -> str:
    router_build = router_build or new
    rates = paced_rates(args)
    names = scenario_names(previous, router_build)
    own_rate = (
        f" ((c) at its own {args.rr_rate:,.0f} requests/s, as it serves far fewer)"
        if NGINX_RR in rates
        else " ((c), which serves far fewer, is left out)"
    )
    high = max(args.concurrency)
    # --new-from (testing this script): nodes and routers (b), (b3) are another revision's, not this tree's.
    tree = "this work tree" if new is THIS_TREE else f"commit {new.label} (--new-from)"
    if router_build.compiled:
        # --build compiled: the routers as they ship, the nodes pure.
        if previous.compiled:
            built_previous = "built and run the same way"
        else:
            built_previous = (
                "pure Python, as that revision has no setup.py with a COMPILED list: run from a `git worktree` of"
                " that revision with its own packages first on PYTHONPATH (same venv)"
            )
        routers = (
            f" (b) {tree}'s as it ships (data path: {data_path or router_client()}), {router_build.how};"
            f' (b2) the previous one, of commit {previous.label} ("{previous.subject}"), {built_previous};'
            f" (b3) (b) again with `--workers 2` (its CPU: the parent and the workers; at concurrency {high} only);"
            f" (b4) {tree}'s pure Python, the venv's editable install (at concurrency {high} only, for the record)."
            f" The nodes: {tree}'s pure Python build (the venv's editable install)."
        )
    else:
        routers = (
            f" (b) {tree}'s (data path: {data_path or router_client()});"
            + (
                f' (b2) the previous one, of commit {previous.label} ("{previous.subject}"), run from a `git'
                " worktree` of that revision with its own packages first on PYTHONPATH (same venv);"
                if previous.role == "previous"
                else f" (b2) {tree}'s compiled with mypyc (`KEYROUTE_COMPILE=1 pip install .` into the venv of"
                f" `{previous.python}`; setup.py lists the compiled modules);"
            )
            + " (b3)"
            f" {tree}'s again with `--workers 2` (its CPU: the parent and the workers; at concurrency {high} only)."
        )
    return "\n".join(
        [
            SUBSECTION if previous.role == "previous" else COMPILED_SUBSECTION,
            "",
            f"`{command}` on {datetime.date.today().isoformat()}: store of {args.keys:,} keys (~90-byte JSON"
            f" values) in {args.partitions} partitions, replication 1, on {args.nodes} nodes of {tree}."
            " Routers, all on the same ZooKeeper and nodes:"
            + routers
            + f" One nginx worker. wrk, one thread, random keys over all partitions, {args.duration:g} s per"
            f" measurement, median of {args.rounds} round{'s' if args.rounds > 1 else ''} (scenario order"
            " shuffled per round). Every process, wrk included, shares the machine's cores.",
            f"Machine: {os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()},"
            f" {versions}; load average {load} (other work on the machine makes figures noisy).",
            "CPU µs/request = the process tree's user+system CPU time (/proc) during the run / requests;"
            " node CPU adds up every node. (a) and (d) need the owner of each key: (a) runs one wrk per node"
            " with that node's keys (figures summed, latencies request-weighted); in (d) the wrk"
            " script puts the owner in the path prefix (`/n1/stores/...`) and nginx strips it, so nginx"
            " does a plain proxy hop: the C-language reference for what a proxy hop costs. In (c) nginx"
            " spreads reads over every node and a node forwards what it does not own (one hop). A node"
            " that a slow proxy leaves half idle pays the event loop's per-wakeup costs for each read, so"
            " its CPU per read also rises with the proxy's slowness, not only with forwarding. Two references,"
            " at saturation only: (e) a bare Python proxy hop to the owner with nothing else"
            " (benchmarks/baselines/bare_proxy.py), the floor a Python hop does not go below; (f) a Starlette"
            " app answering every read with one fixed body (benchmarks/baselines/starlette_answer.py), which"
            " with (d) says how much dearer this machine is than the one the issue's targets were set on.",
            "",
            "At saturation (wrk as fast as it can; (a) loads one node at a time):",
            "",
            table(figures, names),
            "",
            f"At an equal rate: wrk paced by its Lua `delay()` to {args.rate:,.0f} requests/s in all over"
            f" {args.paced_connections} connections{own_rate}, well below what each setup serves, so that"
            " nothing saturates; (a) loads both nodes at once, each with half the rate and half the"
            " connections, so every node sees the rate it sees behind a proxy. " + rates_check(paced, rates),
            "",
            paced_table(paced, rates, names),
            "",
            *verdicts(
                figures,
                args.concurrency,
                paced,
                args.rate,
                previous_label(previous, router_build),
                previous.role,
                "compiled (mypyc), as it ships" if router_build.compiled else "",
            ),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--keys", type=int, help="keys in the store (default: 100,000; --quick: 20,000)")
    parser.add_argument("--partitions", type=int, default=12, help="partitions (default: 12)")
    parser.add_argument("--nodes", type=int, default=2, help="state nodes (default: 2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32], help="wrk connections (1 32)")
    parser.add_argument("--duration", type=float, help="seconds per measurement (default: 5; --quick: 1)")
    parser.add_argument("--rounds", type=int, help="rounds; medians are reported (default: 5; --quick: 1)")
    parser.add_argument(
        "--previous",
        metavar="REV",
        default=DEFAULT_PREVIOUS,
        help="the revision whose router (b2) is measured beside this work tree's, built as --build says and"
        f" removed at the end (default: {DEFAULT_PREVIOUS}, the last commit before the data-plane work)",
    )
    parser.add_argument(
        "--build",
        choices=("compiled", "pure"),
        help="compiled (the default): the routers as they ship, this work tree and --previous each built with"
        " `KEYROUTE_COMPILE=1 pip install --target` into a directory of their own (--previous pure when it has no"
        " setup.py with a COMPILED list), this work tree pure beside them at the highest concurrency; pure: this"
        " work tree's editable install against --previous from a git worktree, both pure Python",
    )
    parser.add_argument(
        "--compiled",
        metavar="PYTHON",
        help="(implies --build pure) measure as (b2), instead of a previous revision, this work tree compiled with"
        " mypyc: the interpreter of a venv holding `KEYROUTE_COMPILE=1 pip install .` (written under its own"
        " heading)",
    )
    parser.add_argument(
        "--rate", type=float, default=1000.0, help="requests/s in all for the equal-rate table (default: 1,000)"
    )
    parser.add_argument(
        "--rr-rate",
        type=float,
        default=200.0,
        help="requests/s for (c) in the equal-rate table, 0 to leave it out (default: 200)",
    )
    parser.add_argument(
        "--paced-connections", type=int, default=32, help="wrk connections in the equal-rate table (default: 32)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run of the plumbing, not figures: 20,000 keys, 1 s per measurement, 1 round (no --write)",
    )
    parser.add_argument("--write", action="store_true", help=f"record the figures in {RESULTS.name}")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs, configs)")
    parser.add_argument(
        "--tls",
        action="store_true",
        help="then the TLS rows in the same run: benchmarks/router_tls.py (this work tree's router serving HTTPS and"
        " reaching the nodes over mutual TLS, beside nginx as a TLS proxy hop, on a cluster of HTTPS nodes of its"
        " own) with this run's --keys, --partitions, --nodes, --concurrency, --duration, --rounds, --build, --quick"
        " and --write",
    )
    # Runs nodes and routers of a revision (a git worktree) in place of this work tree's: tests this script
    # while the work tree cannot serve. Its figures are not this tree's, hence no --write.
    parser.add_argument("--new-from", metavar="REV", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.write and (args.quick or args.new_from):
        parser.error("--write records this work tree's figures: not with --quick or --new-from")
    if args.build == "compiled" and (args.compiled or args.new_from):
        parser.error("--build compiled builds this work tree itself: not with --compiled or --new-from")
    if args.tls and (args.compiled or args.new_from):
        parser.error("--tls measures this work tree as --build says: not with --compiled or --new-from")
    args.build = args.build or ("pure" if args.compiled or args.new_from else "compiled")
    args.keys = args.keys if args.keys is not None else 20_000 if args.quick else 100_000
    args.duration = args.duration if args.duration is not None else 1.0 if args.quick else 5.0
    args.rounds = args.rounds if args.rounds is not None else 1 if args.quick else 5
    # So that a `kill` still stops every process and removes the worktree (ExitStack, finally).
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))

    wrk, nginx = ensure_tools()
    versions = tool_versions(wrk, nginx)
    work = Path(tempfile.mkdtemp(prefix="keyroute-router-bench-"))
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    try:
        with running_cluster(args, wrk, nginx, work) as cluster:
            figures, paced = measure(cluster, args)
            previous, new, router_build = cluster.previous_build, cluster.new_build, cluster.router_build
            assert previous is not None
            data_path = router_client(new.cwd)  # while a worktree is still there
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    text = section(figures, paced, args, harness.command(argv), versions, load, previous, new, data_path, router_build)
    print(text)
    print(f"took {time.monotonic() - started:.0f} s", file=sys.stderr)
    if args.write:
        harness.write_subsection(SECTION, text.split("\n", 1)[0], text)
        print(f"wrote {text.split(chr(10), 1)[0]!r} under {SECTION!r} in {RESULTS}", file=sys.stderr)
    if args.tls:
        return tls_rows(args)
    return 0


def tls_rows(args: argparse.Namespace) -> int:
    """--tls: benchmarks/router_tls.py with this run's settings (its rows go under its own heading)."""
    import router_tls  # benchmarks/router_tls.py, beside this script (it imports this module's helpers)

    tls_argv = [f"--keys={args.keys}", f"--partitions={args.partitions}", f"--nodes={args.nodes}"]
    tls_argv += ["--concurrency", *map(str, args.concurrency)]
    tls_argv += [f"--duration={args.duration:g}", f"--rounds={args.rounds}", f"--build={args.build}"]
    tls_argv += [flag for flag, given in (("--quick", args.quick), ("--write", args.write)) if given]
    # Recorded as the command that measures exactly these rows on its own.
    sys.argv = [str(Path(sys.argv[0]).with_name("router_tls.py")), *tls_argv]
    print(f"\nthe TLS rows: {harness.command(tls_argv)}", file=sys.stderr, flush=True)
    return int(router_tls.main(tls_argv))


if __name__ == "__main__":
    raise SystemExit(main())
