"""How long `keyroute demo` takes from its start to "keyroute demo is up.", against a reference revision's demo.

The reference's keyroute/dev/demo.py and keyroute/dev/sample_data.py come from git (`--reference`, a revision) and
run side by side with this tree's, interleaved round by round, on the same machine; the processes they
start (ZooKeeper, pipeline, nodes, router) are this tree's for both, so only the demo itself differs.
Each round stops its demo with SIGTERM and waits for it.

    .venv/bin/python benchmarks/demo_start.py --reference HEAD~3 --rounds 3 [--events 120000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py: ports, ZooKeeper, waiting, RESULTS.md

ROOT = Path(__file__).resolve().parents[1]


def _reference(revision: str, folder: Path) -> None:
    """The reference's demo as two modules, ref_demo and ref_sample_data, in `folder`."""
    for name in ("demo", "sample_data"):
        text = subprocess.run(
            ["git", "show", f"{revision}:keyroute/{name}.py"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        text = text.replace("from keyroute.dev import sample_data\n", "import ref_sample_data as sample_data\n")
        (folder / f"ref_{name}.py").write_text(text)


_STEP = re.compile(r"^(\S+ \S+) INFO keyroute\.pipeline\.build: store '(\w+)': (computing|wrote|writing empty)")


def _store_seconds(workdir: Path) -> dict[str, float]:
    """Each store's build time in the demo's pipeline log: from "computing" to "wrote"."""
    started: dict[str, dt.datetime] = {}
    took: dict[str, float] = {}
    for line in (workdir / "logs" / "pipeline.log").read_text(errors="replace").splitlines():
        found = _STEP.match(line)
        if found:
            at = dt.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f")
            if found.group(3) == "computing":
                started[found.group(2)] = at
            elif found.group(2) in started:
                took[found.group(2)] = (at - started[found.group(2)]).total_seconds()
    return took


def _time_up(command: list[str], workdir: Path) -> float:
    started = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    up = None
    for line in proc.stdout:
        if b"keyroute demo is up." in line and up is None:
            up = time.monotonic() - started
            proc.send_signal(signal.SIGTERM)
    proc.wait()
    if up is None:
        raise SystemExit(f"the demo did not come up (exit {proc.returncode}); see {workdir / 'logs'}")
    return up


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", required=True, help="git revision whose demo is the reference")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--events", type=int, default=120_000, help="the demo's --events (its default)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="keyroute-demo-bench-") as tmp:
        folder = Path(tmp)
        _reference(args.reference, folder)
        times: dict[str, list[float]] = {"reference": [], "this tree": []}
        for round_ in range(args.rounds):
            for name in times:
                port, workdir = harness.free_port(), folder / f"work-{name.replace(' ', '-')}"
                if name == "reference":
                    code = (
                        f"import sys; sys.path.insert(0, {str(folder)!r}); import ref_demo; from pathlib import Path; "
                        f"sys.exit(ref_demo.run(ref_demo.DemoSettings(router_port={port}, "
                        f"workdir=Path({str(workdir)!r}), events={args.events})))"
                    )
                    command = [sys.executable, "-c", code]
                else:
                    command = [sys.executable, "-m", "keyroute", "demo", "--port", str(port), "--workdir",
                               str(workdir), "--events", str(args.events)]
                times[name].append(_time_up(command, workdir))
                stores = ", ".join(f"{store} {s:.1f} s" for store, s in _store_seconds(workdir).items())
                print(f"round {round_ + 1}: {name}: up after {times[name][-1]:.1f} s (pipeline: {stores})", flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values):.1f} s over {len(values)} rounds ({values})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
