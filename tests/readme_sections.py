"""README tables that tests hold as data: a section between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``,
checked against its rendering by a test and rewritten by running that test file as a script."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def read_section(name: str, writer: str) -> str:
    """The README's section `name`; raises, naming the script that writes it (`writer`), when it is missing."""
    start, end = markers(name)
    text = README.read_text()
    if start not in text or end not in text:
        raise AssertionError(f"README.md has no {start} ... {end} section; run `python {writer}`")
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n")


def write_section(name: str, body: str, writer: str) -> None:
    read_section(name, writer)  # raises when the markers are missing
    start, end = markers(name)
    head, _, rest = README.read_text().partition(start)
    _, _, tail = rest.partition(end)
    README.write_text(f"{head}{start}\n{body}\n{end}{tail}")
