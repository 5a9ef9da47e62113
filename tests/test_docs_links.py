"""Every relative link in the README and the docs leads somewhere: the file exists, and an
`#anchor` into a markdown file names one of its headings (GitHub's slugs: lowercase, markup and
punctuation other than `-` and `_` dropped, spaces to `-`, a repeated heading numbered `-1`,
`-2`...). Links inside code blocks and code spans are not links and are not checked."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        REPO / "README.md",
        *(REPO / "docs").glob("*.md"),
        *(REPO / "docs" / "design").glob("*.md"),
        *(REPO / "docs" / "results").glob("*.md"),
    ]
)
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fence = None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            yield n, line


def slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text()):
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return frozenset(found)


def links(path: Path):
    for n, line in prose_lines(path.read_text()):
        for m in LINK.finditer(CODE_SPAN.sub("", line)):
            yield n, m.group(1).strip("<>")


def broken(path: Path) -> list[str]:
    bad = []
    for n, target in links(path):
        if EXTERNAL.match(target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        where = f"{path.relative_to(REPO)}:{n}: {target}"
        if not dest.exists():
            bad.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where} (no heading '#{anchor}' in {dest.relative_to(REPO)})")
    return bad


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    assert broken(path) == []


def test_slugs_follow_github():
    assert slug("Agent sessions on SmolLM2 (server, CPU)") == "agent-sessions-on-smollm2-server-cpu"
    assert slug("SGLang's multi-turn chat benchmark") == "sglangs-multi-turn-chat-benchmark"
    assert slug("Span 8: `span` and [kvpress](x.md)") == "span-8-span-and-kvpress"
    assert slug("prefill_chunk 64") == "prefill_chunk-64"
