"""The README is a front door (at most ~250 lines) and every relative link
in it and in docs/ leads to a file of the repository, and to a heading of
it when the link names one; a cross-reference by name alone ("see *The
slab*") says which page holds it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
BY_NAME = re.compile(r"\bsee \*([^*]+)\*(?!\s+in \[)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings."""
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_the_readme_is_short_and_every_link_resolves() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 250
    assert len(pages()) > 5
    broken = []
    for page in pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue  # a URL
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists() or ROOT not in path.parents:
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
        broken.extend(
            f"{page.relative_to(ROOT)}: see *{name}* (which page?)" for name in BY_NAME.findall(page.read_text())
        )
    assert not broken, broken
    for page in pages():
        assert "DESIGN.md" not in page.read_text(), f"{page.name} cites a file outside the repository"
