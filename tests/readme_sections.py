"""Documentation tables that tests hold as data: a section between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``
in README.md or one page of docs/, checked against its rendering by a test and rewritten by running that test file
as a script."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def section_path(name: str, writer: str) -> Path:
    """The one page (README.md or docs/**/*.md) holding section `name`; raises, naming the script that writes it
    (`writer`), when no page or several hold it."""
    start, end = markers(name)
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    holders = [page for page in pages if start in (text := page.read_text()) and end in text]
    if len(holders) != 1:
        where = ", ".join(str(p.relative_to(ROOT)) for p in holders) or "no page"
        raise AssertionError(f"{start} ... {end} must be in exactly one of README.md and docs/ (found: {where}); "
                             f"put the markers on the page the table belongs to and run `python {writer}`")
    return holders[0]


def read_section(name: str, writer: str) -> str:
    """The section `name`; raises, naming the script that writes it (`writer`), when it is missing."""
    start, end = markers(name)
    return section_path(name, writer).read_text().split(start, 1)[1].split(end, 1)[0].strip("\n")


def write_section(name: str, body: str, writer: str) -> Path:
    path = section_path(name, writer)  # raises when the markers are missing
    start, end = markers(name)
    head, _, rest = path.read_text().partition(start)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{start}\n{body}\n{end}{tail}")
    return path
