"""The architecture's import rules: services never import each other, the core imports no service and no
HTTP plumbing, the CLI is imported by nothing, the node and router never import pyspark, and every import
name lives under `keyroute.`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# import name -> the repository folder that holds it (pyproject.toml's package-dir)
FOLDERS = {
    "keyroute.core": "keyroute_core",
    "keyroute.router": "router",
    "keyroute.node": "state_node",
    "keyroute.pipeline": "pipeline",
}
SERVICES = ("keyroute.router", "keyroute.node", "keyroute.pipeline")
CLI = ("keyroute.cli", "keyroute.demo", "keyroute.sample_data", "keyroute.__main__")


def imported_modules(package: str) -> set[str]:
    found: set[str] = set()
    for path in (ROOT / FOLDERS[package]).rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
    return found


def under(modules: set[str], packages: tuple[str, ...] | set[str]) -> set[str]:
    return {m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)}


@pytest.mark.parametrize("service", SERVICES)
def test_no_service_imports_another_or_the_cli(service: str) -> None:
    forbidden = (set(SERVICES) - {service}) | set(CLI)
    assert not under(imported_modules(service), forbidden)


def test_the_core_imports_no_service_no_cli_and_no_spark() -> None:
    modules = imported_modules("keyroute.core")
    assert not under(modules, set(SERVICES) | set(CLI) | {"pyspark"})


@pytest.mark.parametrize("package", sorted(FOLDERS))
def test_imports_use_names_under_keyroute(package: str) -> None:
    """The old top-level names (router, state_node, pipeline, keyroute_core) are not importable names."""
    tops = {m.split(".")[0] for m in imported_modules(package)}
    assert not tops & {"router", "state_node", "pipeline", "keyroute_core"}


def test_no_generic_top_level_names_are_installed() -> None:
    code = (
        "import importlib.util as u, sys; "
        "found = [n for n in ('router', 'state_node', 'pipeline', 'keyroute_core') if u.find_spec(n)]; "
        "assert not found, found"
    )
    # Outside the repository, where only the installed distribution is importable.
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent)


def test_node_and_router_run_without_pyspark() -> None:
    code = (
        "import sys, keyroute.router.app, keyroute.node.app, keyroute.core.snapshot; "
        "assert not [m for m in sys.modules if m.startswith('pyspark')], 'pyspark imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# Makes pyspark and pandas unimportable, as in the serving image (installed without the `pipeline` extra).
_WITHOUT_PIPELINE_EXTRA = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pyspark", "pandas", "py4j"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, Absent())
"""


def test_the_serving_install_needs_neither_pyspark_nor_pandas_and_the_pipeline_says_what_to_install() -> None:
    code = _WITHOUT_PIPELINE_EXTRA + (
        "import contextlib, io\n"
        "import keyroute.router.service, keyroute.node.service, keyroute.client, keyroute.cli as cli\n"
        "err = io.StringIO()\n"
        "with contextlib.redirect_stderr(err):\n"
        "    assert cli.main(['pipeline', 'build', '--spec', 's.toml', '--output', 'o', '--zk', 'z:1']) == 1\n"
        "    assert cli.main(['demo']) == 1\n"
        "print(err.getvalue(), end='')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "keyroute pipeline build needs pyspark, which is not installed: pip install 'keyroute[pipeline]'",
        "keyroute demo needs pyspark, which is not installed: pip install 'keyroute[pipeline]'",
    ]
