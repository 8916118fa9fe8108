"""The docs are a manual with its measurements apart: every manual page (docs/*.md) shows how to run its subject
in a code block before its first section (before the first `## ` heading, within its first 25 lines); every
measurement page lives in docs/results/, is named `YYYY-MM-DD-<topic>.md` by the date it was measured, and is
listed in docs/results/README.md; and every relative link of README.md and docs/ points at a file that exists
and, with a `#fragment`, at a heading of that file (GitHub's anchor of it). The manual names no issue numbers and has
no "Measured" or "Earlier" sections: those are results."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
MANUAL_PAGES = sorted(DOCS.glob("*.md"))
ALL_PAGES = [ROOT / "README.md", *MANUAL_PAGES, *sorted(RESULTS.glob("*.md"))]
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _outside_code(lines):
    """The lines that are not inside a fenced code block, with their numbers."""
    inside = False
    for number, line in enumerate(lines):
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            yield number, line


def _anchor(heading):
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped but hyphens, spaces to hyphens."""
    text = re.sub(r"^#+\s*", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page):
    seen, anchors = {}, set()
    for _, line in _outside_code(page.read_text().splitlines()):
        if line.startswith("#"):
            base = _anchor(line)
            count = seen.get(base, 0)
            seen[base] = count + 1
            anchors.add(base if count == 0 else f"{base}-{count}")
    return anchors


@pytest.mark.parametrize("page", MANUAL_PAGES, ids=[p.name for p in MANUAL_PAGES])
def test_a_manual_page_starts_with_a_command(page):
    lines = page.read_text().splitlines()
    first_code = next((i for i, line in enumerate(lines) if FENCE.match(line)), None)
    first_section = next((i for i, line in _outside_code(lines) if line.startswith("## ")), len(lines))
    assert first_code is not None and first_code < min(first_section, 25), (
        f"docs/{page.name}: its first code block (line {None if first_code is None else first_code + 1}) must come "
        f"before its first section (line {first_section + 1}) and within its first 25 lines")


@pytest.mark.parametrize("page", [ROOT / "README.md", *MANUAL_PAGES], ids=["README.md", *(p.name for p in MANUAL_PAGES)])
def test_the_manual_keeps_no_research_log(page):
    lines = page.read_text().splitlines()
    log = [f"{page.name}:{n + 1}: {line}" for n, line in enumerate(lines) if re.search(r"\bissues? \d+", line, re.I)]
    log += [f"{page.name}:{n + 1}: {line}" for n, line in _outside_code(lines)
            if re.match(r"#+\s*(Measured|Earlier|An earlier)", line)]
    assert log == []


def test_measurements_are_dated_and_indexed():
    pages = sorted(p.name for p in RESULTS.glob("*.md") if p.name != "README.md")
    assert pages, "docs/results/ holds no measurement page"
    undated = [name for name in pages if not re.fullmatch(r"20\d\d-[01]\d-[0-3]\d-[a-z0-9][a-z0-9-]*\.md", name)]
    assert not undated, f"not named YYYY-MM-DD-<topic>.md: {undated}"
    index = (RESULTS / "README.md").read_text()
    assert [name for name in pages if f"]({name})" not in index] == [], "pages docs/results/README.md does not list"


def test_every_measurement_page_is_linked_from_a_manual_page():
    manual = "\n".join(p.read_text() for p in [ROOT / "README.md", *MANUAL_PAGES])
    orphans = [p.name for p in RESULTS.glob("*.md") if p.name != "README.md" and f"results/{p.name}" not in manual]
    assert orphans == [], f"no manual page links to {orphans}"


@pytest.mark.parametrize("page", ALL_PAGES, ids=[str(p.relative_to(ROOT)) for p in ALL_PAGES])
def test_relative_links_resolve(page):
    broken = []
    for number, line in _outside_code(page.read_text().splitlines()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}:{number + 1}: {target} (no such file)")
            elif fragment and linked.suffix == ".md" and fragment not in _anchors(linked):
                broken.append(f"{page.name}:{number + 1}: {target} (no such heading)")
    assert broken == []
