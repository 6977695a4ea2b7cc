"""The README stays true and short: its set-up commands are what CI runs, its example output is real (what it
says of /readyz included), its links and those of the documents it leads to resolve, the docs index links
every page of docs/, and measured figures stay in benchmarks/RESULTS.md."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from keyroute.cluster.partition_map import PartitionMap
from tests.unit.router.fakes import FakeNode, build_map
from tests.unit.router.test_app import STORES, router, run

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
INDEX = ROOT / "docs" / "README.md"
# Every document a newcomer is led to from the README.
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "deploy" / "k8s" / "README.md",
    ROOT / "CHANGELOG.md",
]
# The documents whose shell blocks run against the demo (tests/integration/test_readme_blocks.py).
TOURED = [ROOT / "README.md", ROOT / "docs" / "usage.md"]
# "About 8 KB": the first screen sells and orients; the rest is in docs/.
README_MAX_BYTES = 9 * 1024

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


def test_the_readme_is_short_and_the_first_screen_says_who_it_is_for() -> None:
    size = len(README.encode("utf-8"))
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes: move reference material to docs/"
    first_screen = README[: README.index("## Try it")]
    assert "is for" in first_screen and "docs/keyroute.svg" in first_screen
    assert "## How it compares" in first_screen
    for other in ("Kafka Streams", "ksqlDB", "Feast", "Venice"):
        assert other in first_screen, f"the comparison lost {other}"


def test_ci_runs_the_linters_before_the_suite() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    lint, suite = re.search(r"^make lint$", ci, re.MULTILINE), re.search(r"^make test$", ci, re.MULTILINE)
    assert lint and suite and lint.start() < suite.start()


def test_partition_example_output_is_what_the_command_prints() -> None:
    text = "\n".join(doc.read_text(encoding="utf-8") for doc in TOURED)
    block = re.search(r"```sh\n\$ (keyroute partition [^\n]+)\n(.*?)```", text, re.DOTALL)
    assert block, "the usage tour lost its `keyroute partition` example"
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


def _linked_from(doc: Path) -> set[Path]:
    """The files a Markdown document links to (relative links), resolved."""
    targets = (target.partition("#")[0] for target in _LINK.findall(_prose(doc.read_text(encoding="utf-8"))))
    return {(doc.parent / t).resolve() for t in targets if t and not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I)}


def test_readme_links_the_docs_index_and_the_changelog() -> None:
    linked = _linked_from(ROOT / "README.md")
    for doc in (INDEX, ROOT / "CHANGELOG.md", ROOT / "CONTRIBUTING.md"):
        assert doc.resolve() in linked, f"README does not link {doc.relative_to(ROOT)}"


def test_the_docs_index_links_every_page_of_docs_in_its_reading_order() -> None:
    linked = _linked_from(INDEX)
    pages = [p for p in (ROOT / "docs").iterdir() if p.is_file() and p != INDEX and p.suffix in (".md", ".svg")]
    missing = sorted(p.name for p in pages if p.resolve() not in linked)
    assert not missing, f"docs/README.md does not link {missing}"
    assert (ROOT / "deploy" / "k8s" / "README.md").resolve() in linked
    text = INDEX.read_text(encoding="utf-8")
    order = ["concepts.md", "your-first-cluster", "operations.md", "security.md", "k8s/README.md", "http-api.md"]
    positions = [text.index(name) for name in order]
    assert positions == sorted(positions), f"the reading order is {order}"


def _readyz(m: PartitionMap) -> bytes:
    """A router's /readyz body for map `m` (a router on 127.0.0.1, its nodes fakes)."""
    got: list[bytes] = []

    async def scenario() -> None:
        async with router(m, FakeNode("a", {}), FakeNode("b", {})) as r:
            answer = await r.client.get("/readyz")
            assert answer.status_code == 200
            got.append(answer.content)

    run(scenario)
    return got[0]


def test_what_the_readme_says_of_readyz_is_what_a_router_answers() -> None:
    """200 means the router has a map, not that every partition is served: its `complete` field says that,
    and the README's wait loop and example answer read the body a router really sends."""
    section = README[README.index("## Your first cluster") :]
    wait = re.search(r"^until curl -s (\S+/readyz) \| grep -q '([^']+)'; do sleep 1; done$", section, re.M)
    assert wait, "the first cluster's section lost its wait for a complete map"
    shown = re.search(r"^curl -s \S+/readyz\n# (\{.*\})$", section, re.M)
    assert shown, "the first cluster's section lost its /readyz example answer"
    loading = _readyz(build_map(STORES, {"a": {"s": [0, 1, 2, 3]}}, generation=10))
    complete = _readyz(build_map(STORES, {"a": {"s": [0, 1, 2, 3]}, "b": {"n": [0, 1]}}, generation=11))
    # Ready (200) while a store is still loading, as the README says; only a complete map matches its wait.
    assert b'"ready":true' in loading and b'"complete":false' in loading and b'"stores_loading":["n"]' in loading
    assert wait.group(2) not in loading.decode() and wait.group(2) in complete.decode()
    fields = dict(re.findall(r'"(\w+)": (true|false|\[\])', shown.group(1)))
    body = json.loads(complete)
    assert fields and all(json.dumps(body[name]) == value for name, value in fields.items()), (fields, body)
    prose = re.sub(r"\s+", " ", section[: wait.start()])
    assert "as soon as it has a partition map" in prose and "`complete`" in prose and "`stores_loading`" in prose


def test_readme_holds_no_measured_figures() -> None:
    found = _FIGURE.findall(README) + re.findall(r"µs|μs|req/s", README)
    assert not found, f"measured figures belong in benchmarks/RESULTS.md, not the README: {found}"


@pytest.mark.parametrize("doc", DOCS[1:], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_documents_hold_no_measured_figures(doc: Path) -> None:
    found = _MEASURED_ONLY.findall(doc.read_text(encoding="utf-8"))
    assert not found, f"measured figures belong in benchmarks/RESULTS.md, not {doc.relative_to(ROOT)}: {found}"
