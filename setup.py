"""keyroute's build hook: the package is pure Python unless KEYROUTE_COMPILE=1 is set at build time.

    KEYROUTE_COMPILE=1 pip install .      # the modules in COMPILED become C extensions (mypyc)
    pip install .                          # pure Python (no compiler, no mypy)

Everything else about the distribution is in pyproject.toml. With KEYROUTE_COMPILE=1, mypy (which carries mypyc)
becomes a build requirement of that build only, and a C compiler and Python's headers must be present. The
compiled modules behave as their sources do (the same tests pass against both builds); only the interpreter's
overhead per call goes.
"""

from __future__ import annotations

import os
import shutil
import tomllib
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent

# The modules a read runs through, from the socket to the answer: a router's proxied read (to the node and back)
# and a node's read of a key it holds. The one list of what is compiled (benchmarks/RESULTS.md, "Router:
# compiled" and "Node: a read against redis-server", measures them).
COMPILED = (
    "keyroute.keys.partitioner",
    "keyroute.http.admission",
    "keyroute.http.dataplane",
    "keyroute.http.exchange",
    "keyroute.http.fast_upstream",
    "keyroute.http.multi_store",
    "keyroute.http.protocol",
    "keyroute.http.routing",
    "keyroute.http.wire",
    "keyroute.router.balancer",
    "keyroute.router.batch_reads",
    "keyroute.router.dataplane",
    "keyroute.router.engine",
    "keyroute.router.hedge_timer",
    "keyroute.router.key_read",
    "keyroute.router.metrics",
    "keyroute.router.multi_read",
    "keyroute.router.node_outcomes",
    "keyroute.router.proxy",
    "keyroute.router.proxy_settings",
    "keyroute.router.read_engine",
    "keyroute.router.relay",
    "keyroute.router.replica_order",
    "keyroute.router.routing_table",
    "keyroute.runtime.answers",
    "keyroute.state_node.dataplane",
    "keyroute.state_node.multi_read",
    "keyroute.state_node.reads",
)

MYPY_REQUIREMENT = "mypy>=1.10"


def compiling() -> bool:
    return os.environ.get("KEYROUTE_COMPILE", "").strip().lower() in ("1", "true", "yes")


def staged_sources(stage: Path) -> Path:
    """A copy of every package's sources at its import path (router/ at keyroute/router/, ...), so that mypyc
    names each compiled module by its import name; returns `stage`."""
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    package_dir: dict[str, str] = settings.get("package-dir", {})
    shutil.rmtree(stage, ignore_errors=True)
    for package in settings["packages"]:
        mapped = next((name for name in package_dir if package == name or package.startswith(name + ".")), None)
        if mapped is None:
            source = ROOT / package.replace(".", "/")
        else:
            source = ROOT / package_dir[mapped] / package[len(mapped) :].lstrip(".").replace(".", "/")
        target = stage / package.replace(".", "/")
        target.mkdir(parents=True, exist_ok=True)
        for module in source.glob("*.py"):
            shutil.copy2(module, target / module.name)
    return stage


def extensions() -> list:
    if not compiling():
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        # the build-requirements pass of a PEP 517 build: setup_requires below asks for mypy
        return []
    # setuptools puts everything under build/lib.* into the wheel: a previous compiled build's extensions
    # would come along, also of a module since taken off COMPILED (and importable in place of its source).
    for lib in (ROOT / "build").glob("lib.*"):
        for extension in lib.rglob("*.so"):
            extension.unlink()
    stage = staged_sources(ROOT / "build" / "mypyc-src")
    paths = [os.path.relpath((stage / name.replace(".", "/")).with_suffix(".py")) for name in COMPILED]
    # Imports outside the product (httptools, prometheus_client, ...) are typed Any; only the listed modules
    # must type-check.
    return mypycify([*paths, "--ignore-missing-imports", "--follow-imports=silent"], opt_level="3")


setup(ext_modules=extensions(), setup_requires=[MYPY_REQUIREMENT] if compiling() else [])
