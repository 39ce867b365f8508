"""The README is a front door (at most ~250 lines) and every relative link
in it and in docs/ leads to a file of the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_the_readme_is_short_and_every_link_resolves() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 250
    pages = [readme, *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 5
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or an anchor of the same page
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists() or ROOT not in path.parents:
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
    for page in pages:
        assert "DESIGN.md" not in page.read_text(), f"{page.name} cites a file outside the repository"
