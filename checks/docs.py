"""The project's documentation as the tests read it: README.md (the front page) and docs/*.md, one page per topic.
A marked block (`<!-- name -->`: a command the tests run, a table they regenerate) is found in whichever page holds
it, so a section can move between pages without its check going stale."""

from __future__ import annotations

import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pages() -> list[str]:
    """README.md, then every docs/ page."""
    return [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def page_with(marker: str) -> str:
    """The text of the one page holding `<!-- marker -->` (an error naming the pages when none or several do)."""
    holding = [path for path in pages() if f"<!-- {marker} -->" in open(path, encoding="utf-8").read()]
    assert len(holding) == 1, f"<!-- {marker} --> is in {len(holding)} pages ({holding}); expected exactly one"
    return open(holding[0], encoding="utf-8").read()
