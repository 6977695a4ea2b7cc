"""README.md's shell and Python blocks, then docs/usage.md's (the tour that moved there), run as written against
one running `keyroute demo` (the tests are in test_demo.py, which starts that demo once for its own tests and
these blocks), in that order: each command exits 0, each curl answers 200 with JSON (asked again until then,
within a deadline: a quote may not be produced yet, a version may still be loading; every top-level field an
example's `# {...}` comment shows is in the answer, with the value it shows when that is a string, a number,
true or false), a `$ command` prints the output below it, the client example prints values, the demo tour
kills a demo node and reads on, and the "Your first cluster" section brings up a second cluster from the
demo's files. A line that cannot run here is skipped only with its reason in _SKIPPED.
What the test changes in the text, and only that: the ports (the demo's 8080, the own cluster's 8090-8092)
become free ones, `127.0.0.1:2181` becomes the session's ZooKeeper, curl gets `--write-out` for its status
code, and commands run in a folder whose `.keyroute-demo/` is the demo's work directory.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# The documents whose blocks run, in order (tests/unit/test_readme.py's TOURED).
TOURED = [ROOT / "README.md", ROOT / "docs" / "usage.md"]

# Lines of README blocks the test does not run, by how they start, and why.
_SKIPPED = {
    "make demo": "starts the demo, which test_demo.py has already started once for every block (`keyroute demo`)",
    "make test": "runs the whole test suite, this test included",
    "keyroute zookeeper": "the test runs against the session's ZooKeeper (its address replaces 127.0.0.1:2181)",
}
_STATUS = "\n__status__=%{http_code}"
_CURL_DEADLINE_S = 120.0


@dataclass(frozen=True)
class Block:
    index: int
    language: str
    heading: str
    text: str
    doc: str = "README.md"

    @property
    def id(self) -> str:
        where = "" if self.doc == "README.md" else Path(self.doc).stem + "-"
        return f"{self.index}-{where}{self.language}-{re.sub(r'[^a-z0-9]+', '-', self.heading.lower()).strip('-')}"


def _blocks() -> list[Block]:
    found: list[Block] = []
    for doc in TOURED:
        heading = ""
        text = doc.read_text(encoding="utf-8")
        for match in re.finditer(r"^(#{1,6} [^\n]+)$|^```(\w*)\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
            if match.group(1):
                heading = match.group(1).lstrip("# ")
            elif match.group(2) in ("sh", "bash", "python"):
                name = doc.relative_to(ROOT).as_posix()
                found.append(Block(len(found), match.group(2), heading, match.group(3), name))
    return found


BLOCKS = _blocks()


def _skip_reason(line: str) -> str | None:
    return next((why for start, why in _SKIPPED.items() if line.startswith(start)), None)


@dataclass
class Readme:
    """The state the blocks share: the folder they run in, the replacements, the background processes."""

    folder: Path
    replace: dict[str, str]
    env: dict[str, str]
    background: list[subprocess.Popen[bytes]] = field(default_factory=list)
    done: dict[int, str] = field(default_factory=dict)

    def text(self, source: str) -> str:
        for old, new in self.replace.items():
            source = source.replace(old, new)
        return source

    def run(self, block: Block) -> str:
        """Run the blocks before `block` first (later ones build on them); what was skipped, and why."""
        for earlier in BLOCKS[: block.index + 1]:
            if earlier.index not in self.done:
                run = self._python if earlier.language == "python" else self._shell
                self.done[earlier.index] = run(earlier)
        return self.done[block.index]

    def _python(self, block: Block) -> str:
        out = subprocess.run(
            [sys.executable, "-c", self.text(block.text)], cwd=self.folder, env=self.env, capture_output=True,
            text=True, timeout=300,
        )
        assert out.returncode == 0, f"the README's Python block failed:\n{block.text}\n{out.stderr}"
        printed = out.stdout.splitlines()
        assert printed, f"the README's Python block printed nothing:\n{block.text}"
        for line in printed:
            assert isinstance(ast.literal_eval(line), dict), f"not a value: {line!r}"
        return ""

    def _shell(self, block: Block) -> str:
        ran, skipped, output_of = 0, [], None
        lines = block.text.splitlines()
        for n, line in enumerate(lines):
            if output_of is not None and line.strip() and not line.startswith("$ "):
                continue  # the output shown after a `$ command`
            output_of = None
            if not line.strip() or line.startswith("#"):
                continue
            reason = _skip_reason(line.removeprefix("$ "))
            if reason is not None:
                skipped.append(f"`{line.split('#')[0].strip()}`: {reason}")
                continue
            ran += 1
            if line.startswith("$ "):
                output_of = line
                shown = []
                for following in lines[n + 1 :]:
                    if following.startswith("$ ") or not following.strip():
                        break
                    shown.append(following)
                self._command(line[2:], shown_output="\n".join(shown))
            else:
                following = lines[n + 1] if n + 1 < len(lines) else ""
                self._command(line, shown_answer=following[2:] if following.startswith("# {") else None)
        if not ran:
            return "SKIPPED " + "; ".join(skipped)
        return "; ".join(skipped)

    def _command(self, line: str, shown_output: str | None = None, shown_answer: str | None = None) -> None:
        command = self.text(line)
        if command.rstrip().endswith("&"):
            log = open(self.folder / f"background-{len(self.background)}.log", "ab")
            self.background.append(
                subprocess.Popen(
                    ["bash", "-c", "exec " + command.rstrip().removesuffix("&")], cwd=self.folder, env=self.env,
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                )
            )
            log.close()
            return
        curl = command.startswith("curl ")
        if curl:
            command = command.split("  #")[0] + f" --write-out {shlex.quote(_STATUS)}"
        deadline = time.monotonic() + _CURL_DEADLINE_S
        while True:
            out = subprocess.run(
                ["bash", "-c", command], cwd=self.folder, env=self.env, capture_output=True, text=True, timeout=600
            )
            # A curl may come before what it reads is there (a quote not yet produced, a version still
            # loading): it is asked again until it answers 200 as shown or the deadline passes.
            if not curl or (out.returncode == 0 and out.stdout.endswith("__status__=200")
                            and _mismatch(out.stdout, shown_answer) is None):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert out.returncode == 0, f"`{line}` exited {out.returncode}:\n{out.stdout}\n{out.stderr}\n{self._logs()}"
        if shown_output is not None:
            assert out.stdout.strip() == shown_output.strip(), f"`{line}` printed:\n{out.stdout}"
        if curl:
            _check_answer(line, out.stdout, shown_answer)

    def _logs(self) -> str:
        return "\n".join(
            f"--- {log.name}:\n{log.read_text(errors='replace')[-3000:]}" for log in sorted(self.folder.glob("*.log"))
        )

    def stop(self) -> None:
        for proc in reversed(self.background):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.background:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _body(output: str) -> str:
    body = output.rpartition("\n__status__=")[0]
    if body.startswith("HTTP/"):
        body = re.split(r"\r?\n\r?\n", body, maxsplit=1)[1]
    return body


def _mismatch(output: str, shown: str | None) -> str | None:
    """What differs between a curl's answer and the example answer the document shows (None: nothing)."""
    try:
        answer = json.loads(_body(output))
    except ValueError:
        return "not JSON"
    for name, value in _shown_fields(shown or ""):
        if name not in answer:
            return f"{name} is not in the answer"
        if value is not _ANY and answer[name] != value:
            return f"{name} is {answer[name]!r}, the document shows {value!r}"
    return None


def _check_answer(line: str, output: str, shown: str | None) -> None:
    body, _, status = output.rpartition("\n__status__=")
    assert status == "200", f"`{line}` answered {status}: {body}"
    if "-si " in line or "-i " in line:
        assert body.startswith("HTTP/1.1 200"), body
    wrong = _mismatch(output, shown)
    assert wrong is None, f"`{line}`: {wrong}: {_body(output)[:2000]}"


_ANY = object()


def _shown_fields(shown: str) -> Iterator[tuple[str, Any]]:
    """The top-level fields of an example answer (`{"store": "x", "partition": 8, "value": {...}}`): each
    name, with the value it spells out (a string, an integer, true, false) or _ANY (`...`, a list, an object,
    a string cut short with `...`)."""
    depth = 0
    for n, char in enumerate(shown):
        depth += char in "{[" and 1 or char in "}]" and -1 or 0
        if depth == 1 and char in "{,":
            found = re.match(r'[{,]\s*"(\w+)":\s*(?:("[^".]*"|-?\d+|true|false)(?=\s*[,}]))?', shown[n:])
            if found:
                literal = found.group(2)
                yield found.group(1), _ANY if literal is None else json.loads(literal)
