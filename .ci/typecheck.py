"""mypy over every package, as `make lint` runs it.

mypy finds a module by its path, and three packages live in folders not named as they are imported (router/ is
keyroute.router: pyproject.toml's package-dir). So the packages are laid out at their import paths under
build/typecheck, one link per source file (as setup.py stages them for the compiled build), mypy checks that
tree with pyproject.toml's [tool.mypy] settings, and its report names the source files. Exits as mypy does.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGE = ROOT / "build" / "typecheck"


def source_folder(package: str, package_dir: dict[str, str]) -> Path:
    """The folder setuptools takes `package` from: the longest mapped prefix, else its import path."""
    for name in sorted(package_dir, key=len, reverse=True):
        if package == name or package.startswith(name + "."):
            return ROOT / package_dir[name] / package[len(name) :].lstrip(".").replace(".", "/")
    return ROOT / package.replace(".", "/")


def stage() -> dict[str, str]:
    """Links every package's modules at their import paths under STAGE; returns staged path -> source path,
    both relative (to STAGE and to the repository)."""
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    package_dir: dict[str, str] = settings.get("package-dir", {})
    sources: dict[str, str] = {}
    for package in settings["packages"]:
        target = STAGE / package.replace(".", "/")
        target.mkdir(parents=True, exist_ok=True)
        for module in sorted(source_folder(package, package_dir).glob("*.py")):
            (target / module.name).symlink_to(module)
            sources[str((target / module.name).relative_to(STAGE))] = str(module.relative_to(ROOT))
    return sources


def main() -> int:
    shutil.rmtree(STAGE, ignore_errors=True)  # links only: rmtree removes a link, never what it points to
    sources = stage()
    tops = sorted({path.split("/")[0] for path in sources})
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
        + ["--cache-dir", str(ROOT / "build" / "mypy-cache")]
        + [arg for top in tops for arg in ("-p", top)],
        cwd=STAGE,
        capture_output=True,
        text=True,
        check=False,
    )
    for line in (done.stdout + done.stderr).splitlines():
        path, colon, rest = line.partition(":")
        print(sources.get(path, path) + colon + rest)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
