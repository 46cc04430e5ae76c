"""Every relative link of README.md and docs/*.md points at a file that exists, and an anchor at a
heading of that file: the docs moved out of the README once, and a link that breaks silently sends a
newcomer nowhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) and ![alt](target); the target ends at whitespace or ")" (a title may follow)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _prose(page: Path) -> str:
    """The page without its fenced code blocks (indented ones too): links and headings are prose."""
    kept, fenced = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if re.match(r"\s*(```|~~~)", line):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return "\n".join(kept)


def _anchors(page: Path) -> set[str]:
    text = _prose(page)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def _links(page: Path) -> list[str]:
    return LINK.findall(_prose(page))


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file, or whose anchor in a Markdown file, does not exist."""
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ... not checked here
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_points_at_something_that_exists(page: Path) -> None:
    assert broken_links(page) == []


def test_the_check_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading, with `code`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-heading-with-code) [ok](https://example.com/x) [ok](#top)\n"
        "# Top\n"
        "[gone](missing.md) ![gone](img/none.png) [gone](there.md#nope) [gone](#nowhere)\n"
        "```\n[in code](not-checked.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md", "img/none.png", "there.md#nope", "#nowhere"]
