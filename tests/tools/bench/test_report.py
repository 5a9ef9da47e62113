"""The agent benchmark's report, rendered from committed raw lines (data/matrix_sample.jsonl: a
small real run, `python -m sgl_vtoken_tools matrix --repeats 2 --policies random --sessions 2
--turns 2 --reply-tokens 8 --tool-tokens 64 --tool-max 128 --rates 4 --baseline-sessions 1
--sample-interval 0.5`): the figures in the tables are the raw lines' figures, with their spread."""

import json
import statistics
from pathlib import Path

import pytest

from sgl_vtoken_tools.bench import raw
from sgl_vtoken_tools.bench.checks import fairness_checks
from sgl_vtoken_tools.bench.report import publish, render

SAMPLE = Path(__file__).parent / "data" / "matrix_sample.jsonl"


@pytest.fixture(scope="module")
def lines():
    return [json.loads(line) for line in SAMPLE.read_text().splitlines()]


@pytest.fixture(scope="module")
def loaded():
    meta, cells, checks = raw.load(SAMPLE)
    meta.update(jsonl="docs/results/bench_agent.jsonl", jsonl_link="results/bench_agent.jsonl")
    return meta, cells, checks


def burst_figure(lines, mode, path):
    """One summary figure of the mode's burst runs, one value per repeat, from the raw lines."""
    out = []
    for rec in lines:
        if rec.get("kind") == "summary" and rec["mode"] == mode and rec["run"] == "burst":
            v = rec
            for key in path:
                v = v[key]
            out.append(v)
    return out


def row(text: str, title: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith(f"| {title} |"))
    return [c.strip() for c in line.strip("|").split("|")][1:]


def test_load_rebuilds_every_cell_and_repeat(lines, loaded):
    meta, cells, checks = loaded
    assert [c.mode for c in cells] == ["none", "naive", "vtoken"]
    repeats = meta["settings"]["repeats"]
    assert all(len(c.repeats) == repeats for c in cells)
    runs = {(r["cell"], r["repeat"], r["run"]) for r in lines if r.get("kind") == "summary"}
    assert sum(len(rep) for c in cells for rep in c.repeats) == len(runs)
    requests = sum(r.get("kind") == "request" for r in lines)
    assert (
        sum(len(run["requests"]) for c in cells for rep in c.repeats for run in rep.values())
        == requests
    )
    assert len(checks) == 1


def test_headline_shows_the_median_and_range_of_the_raw_figures(lines, loaded):
    text = render(*loaded[:3], plots=[])
    for mode, col in (("naive", 1), ("vtoken", 2)):
        vals = [
            v
            for v in burst_figure(lines, mode, ("vtoken", "retained_pages_per_req"))
            if v is not None
        ]
        cell = row(text, "retained pages per request (plugin gauge)")[col]
        assert vals, "the sample has no retained-pages figure to check"
        mid = f"{statistics.median(vals):.2f}"
        assert (
            cell == mid
            if min(vals) == max(vals)
            else cell == f"{mid} ({min(vals):.2f}-{max(vals):.2f})"
        )
    ttft = burst_figure(lines, "none", ("ttft_ms", "p95"))
    assert row(text, "TTFT p95 (ms)")[0].startswith(f"{statistics.median(ttft):.0f}")
    assert row(text, "retained pages per request (plugin gauge)")[0] == "-"  # No-Evict has none


def test_fairness_line_counts_the_raw_request_pairs(lines, loaded):
    meta, cells, _ = loaded
    text = render(meta, cells, fairness_checks(cells), plots=[])
    pairs = {}
    for r in lines:
        if r.get("kind") == "request" and r["mode"] in ("naive", "vtoken") and r["error"] is None:
            pairs.setdefault((r["repeat"], r["run"], r["session"], r["turn"]), {})[r["mode"]] = r[
                "output_hash"
            ]
    both = [p for p in pairs.values() if len(p) == 2]
    same = sum(p["naive"] == p["vtoken"] for p in both)
    assert f"outputs identical in {same} of {len(both)} request pairs" in text
    assert "What each column isolates" in text and "No-Evict -> Naive-Evict" in text
    cached = [sum(burst_figure(lines, m, ("cached_tokens",))) for m in ("naive", "vtoken")]
    assert ("prompt caching differs" in text) == (cached[0] != cached[1])


def test_publish_rewrites_only_its_section_and_draws_the_plots(tmp_path, loaded):
    md = tmp_path / "RESULTS.md"
    md.write_text("# Results\n\nbefore\n\n<!-- bench:begin -->\nold\n<!-- bench:end -->\n\nafter\n")
    checks = publish(SAMPLE, md, tmp_path / "img", tmp_path)
    text = md.read_text()
    assert text.startswith(
        "# Results\n\nbefore\n\n<!-- bench:begin -->\nRegenerate with `make bench`"
    )
    assert text.endswith("<!-- bench:end -->\n\nafter\n") and "\nold\n" not in text
    assert [c["identical"] for c in checks] == [
        c["identical"] for c in loaded[2]
    ]  # the run's own check lines
    pngs = sorted(p.name for p in (tmp_path / "img").iterdir())
    assert pngs == sorted(
        f"bench_{n}.png"
        for n in ("retained_pages", "concurrency", "sla_throughput", "running", "ttft_per_turn")
    )
    assert all(f"![{p}](img/{p})" in text for p in pngs)
    publish(SAMPLE, md, tmp_path / "img", tmp_path)
    assert md.read_text() == text  # the same lines render the same section


def test_publish_links_the_raw_lines_and_plots_from_the_page(tmp_path):
    """A page under docs/results/ links docs/img/ and its raw lines relative to itself."""
    md = tmp_path / "docs" / "results" / "agent-benchmark.md"
    md.parent.mkdir(parents=True)
    md.write_text("# Agent benchmark\n\n<!-- bench:begin -->\nold\n<!-- bench:end -->\n")
    publish(SAMPLE, md, tmp_path / "docs" / "img", tmp_path)
    text = md.read_text()
    assert "![bench_running.png](../img/bench_running.png)" in text
    assert "](../../../matrix_sample.jsonl)" not in text and "(img/" not in text
