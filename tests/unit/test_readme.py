"""The README stays true: its set-up commands are what CI runs, and its example output is real."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_ci_runs_the_readme_test_command() -> None:
    assert "make test" in README and "make demo" in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.MULTILINE)


def test_partition_example_output_is_what_the_command_prints() -> None:
    block = re.search(r"```sh\n\$ (keyroute partition [^\n]+)\n(.*?)```", README, re.DOTALL)
    assert block, "README lost its `keyroute partition` example"
    args = shlex.split(block.group(1))[1:]
    out = subprocess.run([sys.executable, "-m", "keyroute", *args], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == block.group(2).strip()
