"""Rewriting one generated section of a markdown file (a page of docs/results/) in place: the
text between `<!-- NAME:begin -->` and `<!-- NAME:end -->`; nothing else in the file changes."""

from __future__ import annotations

from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_section(path: Path, name: str, body: str, heading: str | None = None) -> None:
    """Replace section `name` of `path` with `body`. Without its markers, the section is appended
    under `heading` (a new file starts with "# Results"); with no heading given that is an error."""
    begin, end = markers(name)
    path = Path(path)
    text = path.read_text() if path.exists() else "# Results\n"
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    elif heading is not None:
        text = text.rstrip("\n") + f"\n\n{heading}\n\n{block}\n"
    else:
        raise ValueError(f"{path}: no '{begin}' ... '{end}' markers")
    path.write_text(text)
