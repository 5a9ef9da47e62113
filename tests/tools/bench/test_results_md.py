"""Rewriting one generated section of a markdown file, and only that section."""

import re
from pathlib import Path

import pytest

from sgl_vtoken_tools.bench.results_md import markers, write_section

REPO = Path(__file__).resolve().parents[3]


def test_replaces_only_its_section(tmp_path):
    md = tmp_path / "RESULTS.md"
    md.write_text(
        "# Results\n\nintro\n\n<!-- bench:begin -->\nold\n<!-- bench:end -->\n\n## Next\ntail\n"
    )
    write_section(md, "bench", "new table")
    assert (
        md.read_text()
        == "# Results\n\nintro\n\n<!-- bench:begin -->\nnew table\n<!-- bench:end -->\n\n## Next\ntail\n"
    )


def test_appends_under_a_heading_or_refuses(tmp_path):
    md = tmp_path / "RESULTS.md"
    md.write_text("# Results\n\nintro\n")
    with pytest.raises(ValueError, match="history:begin"):
        write_section(md, "history", "x")
    write_section(md, "bench", "body", heading="## Agent benchmark")
    assert (
        md.read_text()
        == "# Results\n\nintro\n\n## Agent benchmark\n\n<!-- bench:begin -->\nbody\n<!-- bench:end -->\n"
    )
    write_section(tmp_path / "new.md", "bench", "b", heading="## H")
    assert (tmp_path / "new.md").read_text().startswith("# Results\n\n## H\n")


def test_the_writers_default_to_the_pages_that_hold_their_sections():
    """`make bench`'s matrix and multi-turn steps rewrite sections of the results pages; each
    names the page whose markers it rewrites (a missing one would be appended to the wrong file,
    or refused)."""
    from sgl_vtoken_tools.cli import matrix as bench_matrix

    makefile = (REPO / "Makefile").read_text()
    multiturn = re.search(r"sgl_vtoken_tools multiturn [^\n]*\\?\n?\s*--results-md (\S+)", makefile)
    for path, name in [
        (bench_matrix.build_parser().parse_args([]).results_md, "bench"),
        (REPO / multiturn.group(1), "multiturn"),
    ]:
        text = Path(path).read_text()
        assert all(m in text for m in markers(name)), (path, name)
