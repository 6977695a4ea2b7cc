"""The architecture's import rules: services never import each other, the core imports no service, no HTTP
plumbing and no HTTP framework, the HTTP layer imports no service, the local replica (keyroute.local) imports
rooms and the client but no service, the CLI is imported by nothing, the node and router never import
pyspark, and every import name lives under `keyroute.`.

The folder of every package comes from pyproject.toml (its `packages` and `package-dir`), so the layout rule
is written once: everything shared lives under keyroute/ at its own path, and only the three service folders
are mapped, each to its own name."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = _SETUPTOOLS.get("package-dir", {})
# The only mappings the layout rule allows: a service folder the product is known by, under its own name.
MAPPED_SERVICES = {"keyroute.router": "router", "keyroute.state_node": "state_node", "keyroute.pipeline": "pipeline"}
SERVICES = tuple(sorted(MAPPED_SERVICES))
CLI = ("keyroute.cli", "keyroute.__main__")
DEV = "keyroute.dev"
# The shared domain in rooms, lowest first: a room imports only rooms before it (and the standard library and
# its dependencies); `keyroute.api` is the HTTP data API's contract every part speaks.
ROOMS = (
    "keyroute.api",
    "keyroute.runtime",
    "keyroute.keys",
    "keyroute.storage",
    "keyroute.formats",
    "keyroute.cluster",
    "keyroute.auth",
    "keyroute.replica",
)
HTTP_FRAMEWORKS = {"starlette", "httptools", "uvicorn", "httpx", "httpcore", "h11", "uvloop"}


def folder_of(package: str) -> Path:
    """The repository folder that holds an import name, as setuptools finds it: the longest mapped prefix,
    else the import name's own path."""
    for name in sorted(PACKAGE_DIR, key=len, reverse=True):
        if package == name or package.startswith(name + "."):
            return ROOT / PACKAGE_DIR[name] / package[len(name) :].lstrip(".").replace(".", "/")
    return ROOT / package.replace(".", "/")


# The top-level parts: the rooms, keyroute.http, the client, the CLI and the three services (their subpackages are
# inside).
FOLDERS = {
    name: folder_of(name)
    for name in (*ROOMS, "keyroute.http", "keyroute.client", "keyroute.local", "keyroute.cli", *SERVICES)
}


def sources(package: str) -> list[Path]:
    folder = FOLDERS[package]
    module = folder.with_suffix(".py")
    return [module] if module.is_file() else sorted(folder.rglob("*.py"))


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The nodes under `if TYPE_CHECKING:`: names for the type checker, never imported at run time."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                hidden.update(id(n) for n in ast.walk(child))
    return hidden


def test_only_the_three_service_folders_are_mapped_each_to_its_own_name() -> None:
    assert PACKAGE_DIR == MAPPED_SERVICES
    for name, folder in PACKAGE_DIR.items():
        assert name == "keyroute." + folder


def test_every_package_folder_is_listed_for_the_installed_distribution() -> None:
    """A subpackage folder pyproject does not list would be missing from the wheel (and so from the image)."""
    listed = set(_SETUPTOOLS["packages"])
    for name in listed:
        assert (folder_of(name) / "__init__.py").is_file(), name
    for top in ("keyroute", *SERVICES):
        for init in folder_of(top).rglob("__init__.py"):
            relative = init.parent.relative_to(folder_of(top))
            name = ".".join((top, *relative.parts)) if relative.parts else top
            assert name in listed, f"{name} ({init.parent.relative_to(ROOT)}) is not in pyproject's packages"


def imported_modules(package: str, *, at_run_time: bool = False, top_level: bool = False) -> set[str]:
    """The modules a package's sources import: every one, or only those imported at run time (not under
    `if TYPE_CHECKING:`), or only those imported when a module loads (not inside a function)."""
    found: set[str] = set()
    for path in sources(package):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        hidden = _type_checking_only(tree) if at_run_time else set()
        if top_level:
            for fn in ast.walk(tree):
                if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    hidden.update(id(n) for n in ast.walk(fn))
        for node in ast.walk(tree):
            if id(node) in hidden:
                continue
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


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_imports_no_service_no_cli_no_spark_no_http_layer_and_no_dev_tool(room: str) -> None:
    modules = imported_modules(room)
    assert not under(modules, set(SERVICES) | set(CLI) | {"pyspark", "keyroute.http", "keyroute.client", DEV})
    assert not under(modules, HTTP_FRAMEWORKS)


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_imports_only_the_rooms_before_it(room: str) -> None:
    later = ROOMS[ROOMS.index(room) + 1 :]
    assert not under(imported_modules(room, at_run_time=True), later)


def test_the_shared_domain_is_in_rooms_not_a_drawer() -> None:
    """Every module under keyroute/ is in a room, the HTTP layer, the client, the CLI or the dev tools."""
    top = ROOT / "keyroute"
    loose = sorted(p.name for p in top.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "api.py", "zone.py"]
    assert not (top / "core").exists()


@pytest.mark.parametrize("package", sorted(set(FOLDERS) - {"keyroute.cli"}))
def test_no_product_module_imports_the_dev_tools(package: str) -> None:
    assert not under(imported_modules(package), {DEV})


def test_the_cli_loads_a_dev_tool_only_when_its_command_runs() -> None:
    """`keyroute demo` and `keyroute zookeeper` import keyroute.dev inside their command, never at load."""
    assert under(imported_modules("keyroute.cli"), {DEV})
    assert not under(imported_modules("keyroute.cli", top_level=True), {DEV})


def test_the_http_layer_imports_no_service_no_client_and_no_cli() -> None:
    modules = imported_modules("keyroute.http")
    assert not under(modules, set(SERVICES) | set(CLI) | {"pyspark", "keyroute.client", DEV})


def test_the_local_replica_imports_rooms_and_the_client_never_a_service_the_http_layer_or_the_cli() -> None:
    """keyroute.local is a library for applications, as the client is: it holds partitions with the rooms'
    code (keyroute.replica), never with a service's, and nothing but an application imports it."""
    modules = imported_modules("keyroute.local")
    assert under(modules, ("keyroute.replica",)) and under(modules, ("keyroute.client",))
    assert not under(modules, set(SERVICES) | set(CLI) | {"pyspark", "keyroute.http", DEV})
    for package in sorted(set(FOLDERS) - {"keyroute.local"}):
        assert not under(imported_modules(package), {"keyroute.local"}), package


def test_the_rules_catch_what_they_forbid() -> None:
    """The helpers see a forbidden import: a rule that reads nothing would pass every tree."""
    assert under({"starlette.requests", "keyroute.state_node.app"}, HTTP_FRAMEWORKS) == {"starlette.requests"}
    assert "keyroute.keys.key_location" in imported_modules("keyroute.http") | imported_modules("keyroute.router")
    assert under(imported_modules("keyroute.cluster"), ("keyroute.keys",))
    assert "keyroute.cluster.partition_map" in imported_modules("keyroute.keys")
    assert "keyroute.cluster.partition_map" not in imported_modules("keyroute.keys", at_run_time=True)


@pytest.mark.parametrize("package", sorted(FOLDERS))
def test_imports_use_names_under_keyroute(package: str) -> None:
    """The folders' own names (router, state_node, pipeline) are not importable names."""
    tops = {m.split(".")[0] for m in imported_modules(package)}
    assert not tops & {"router", "state_node", "pipeline"}


def test_no_generic_top_level_names_are_installed() -> None:
    code = (
        "import importlib.util as u, sys; "
        "found = [n for n in ('router', 'state_node', 'pipeline', 'core') if u.find_spec(n)]; "
        "assert not found, found"
    )
    # Outside the repository, where only the installed distribution is importable.
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent)


def test_node_and_router_run_without_pyspark() -> None:
    code = (
        "import sys, keyroute.router.app, keyroute.state_node.app, keyroute.storage.snapshot; "
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
        "import keyroute.router.service, keyroute.state_node.service, keyroute.client, keyroute.cli as cli\n"
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
