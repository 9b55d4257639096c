"""The README is an entry page: short, and every document it hands over to reachable from it, every
relative link resolving. Reads files only (well under a second)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _local_links(doc: Path) -> list[tuple[str, Path, str]]:
    out = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        out.append((target, (doc.parent / path).resolve(), anchor))
    return out


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", doc.read_text(), re.M)}


def test_the_readme_fits_on_a_screen_or_three():
    assert len(README.read_text().splitlines()) <= 200


def test_every_document_is_reachable_from_the_readme():
    linked = {p for _, p, _ in _local_links(README)}
    docs = set((ROOT / "docs").glob("*.md")) | {ROOT / "CHANGELOG.md"}
    missing = sorted(str(d.relative_to(ROOT)) for d in docs if d.resolve() not in linked)
    assert not missing, f"not linked from the README: {missing}"


def test_every_relative_link_resolves():
    broken = []
    for doc in [README, ROOT / "CHANGELOG.md", ROOT / "charts" / "cache-indexer" / "README.md",
                *sorted((ROOT / "docs").glob("*.md"))]:
        for target, path, anchor in _local_links(doc):
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_the_sections_the_readme_handed_over_are_where_it_says():
    """Moved, not dropped: the recovery guarantees (issue 36), the wire contract, sizing."""
    where = {
        "operations.md": ["## Recovery, replicas and HA", "## What is guaranteed, and what is lost when",
                          "## Install on Kubernetes", "## Sizing a fleet"],
        "architecture-and-wire.md": ["## Block hashing: must match the engines", "## The L1 stream (wire contract)",
                                     "## The L3 stream"],
        "api.md": ["## The hit-rate API", "## The ecosystem API"],
        "development.md": ["## Layout"],
    }
    for doc, headings in where.items():
        text = (ROOT / "docs" / doc).read_text()
        assert all(h in text for h in headings), (doc, [h for h in headings if h not in text])
