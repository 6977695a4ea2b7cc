"""The README stays true: its set-up commands are what CI runs, its example output is real, its links and
those of the documents it leads to resolve, and measured figures stay in benchmarks/RESULTS.md."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
# Every document a newcomer is led to from the README.
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "k8s" / "README.md"]

_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.MULTILINE)
# A number with a unit of time or rate, or a ratio: what a measurement gives, never a configured value in
# the README (which has none of either).
_FIGURE = re.compile(
    r"\d[\d,.]*\s*(?:µs|μs|us|ms|req/s|requests/s|reads/s|rps|[x×](?![0-9A-Fa-f]))(?![A-Za-z])", re.IGNORECASE
)
# Units only a measurement uses: no document but benchmarks/RESULTS.md has them.
_MEASURED_ONLY = re.compile(r"µs|μs|\b(?:req|requests|reads)/s\b|\d(?:\.\d+)?\s*[x×](?![0-9A-Fa-f])(?![A-Za-z])")


def _prose(text: str) -> str:
    """The text outside code blocks and code spans, where links are links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file: lower case, punctuation dropped, spaces as '-',
    a repeated one suffixed with -1, -2, ..."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_ci_runs_the_readme_test_command() -> None:
    assert "make test" in README and "make demo" in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.MULTILINE)


def test_ci_runs_the_linters_before_the_suite() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    lint, suite = re.search(r"^make lint$", ci, re.MULTILINE), re.search(r"^make test$", ci, re.MULTILINE)
    assert lint and suite and lint.start() < suite.start()


def test_partition_example_output_is_what_the_command_prints() -> None:
    block = re.search(r"```sh\n\$ (keyroute partition [^\n]+)\n(.*?)```", README, re.DOTALL)
    assert block, "README lost its `keyroute partition` example"
    args = shlex.split(block.group(1))[1:]
    out = subprocess.run([sys.executable, "-m", "keyroute", *args], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == block.group(2).strip()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_to_an_existing_file(doc: Path) -> None:
    assert doc.is_file(), f"{doc.relative_to(ROOT)} is missing"
    broken = []
    for target in _LINK.findall(_prose(doc.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # http:, https:, mailto:
        path_part, _, anchor = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_links_every_document() -> None:
    linked = {target.partition("#")[0] for target in _LINK.findall(_prose(README))}
    for doc in DOCS[1:]:
        assert doc.relative_to(ROOT).as_posix() in linked, f"README does not link {doc.relative_to(ROOT)}"


def test_readme_holds_no_measured_figures() -> None:
    found = _FIGURE.findall(README) + re.findall(r"µs|μs|req/s", README)
    assert not found, f"measured figures belong in benchmarks/RESULTS.md, not the README: {found}"


@pytest.mark.parametrize("doc", DOCS[1:], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_documents_hold_no_measured_figures(doc: Path) -> None:
    found = _MEASURED_ONLY.findall(doc.read_text(encoding="utf-8"))
    assert not found, f"measured figures belong in benchmarks/RESULTS.md, not {doc.relative_to(ROOT)}: {found}"
