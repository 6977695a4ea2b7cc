"""The architecture's import rules: services never import each other, the core imports no service,
and the node and router never import pyspark."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("router", "state_node", "pipeline")


def imported_packages(package: str) -> set[str]:
    found: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("service", SERVICES)
def test_no_service_imports_another_or_the_cli(service: str) -> None:
    forbidden = (set(SERVICES) - {service}) | {"keyroute"}
    assert not imported_packages(service) & forbidden


def test_the_core_imports_no_service_and_not_the_cli() -> None:
    assert not imported_packages("keyroute_core") & (set(SERVICES) | {"keyroute", "pyspark"})


def test_node_and_router_run_without_pyspark() -> None:
    code = (
        "import sys, router.app, state_node.app, keyroute_core.snapshot; "
        "assert not [m for m in sys.modules if m.startswith('pyspark')], 'pyspark imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
