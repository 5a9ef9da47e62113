"""Rewriting one generated section of a markdown file, and only that section."""

import pytest

from sgl_vtoken_tools.bench.results_md import write_section


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
