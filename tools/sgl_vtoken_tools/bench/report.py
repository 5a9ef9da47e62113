"""The agent benchmark's markdown section: a headline table per policy, budget and page size,
the full tables, TTFT per turn and the rate ladder, every figure as the median over repeats with
its range, "median (min-max)". `render(meta, cells, checks, plots)` returns the section's text
(`results_md.write_section` puts it into docs/results/agent-benchmark.md); the prose is in
`report_text.py`."""

from __future__ import annotations

import os
from pathlib import Path

from sgl_vtoken_tools.bench import report_text
from sgl_vtoken_tools.bench.cells import (
    MODE_NAMES,
    MODES,
    Cell,
    figure_spread,
    groups,
    sla_spread,
    turn_spread,
)
from sgl_vtoken_tools.bench.quantiles import spread

ROWS = [
    ("peak running requests", "peak_running", 0),
    ("mean running requests", "mean_running", 2),
    ("retained pages per request (plugin gauge)", "retained_pages_per_req", 2),
    ("KV pages in use per running request (pool)", "kv_pages_per_running_req", 2),
    (
        "requests the pool holds at that footprint (pool pages / KV pages per request)",
        "pool_capacity",
        1,
    ),
    ("peak KV tokens in use", "peak_kv_used_tokens", 0),
    ("output tokens/s", "out_tok_s", 1),
    ("scheduler CPU seconds", "scheduler_cpu_s", 2),
    ("output tokens per scheduler CPU second", "out_tok_per_cpu_s", 1),
    ("TTFT p50 (ms)", "ttft_p50", 0),
    ("TTFT p95 (ms)", "ttft_p95", 0),
    ("TPOT p50 (ms)", "tpot_p50", 1),
    ("E2E p95 (ms)", "e2e_p95", 0),
    ("run time (s)", "duration_s", 1),
    ("retractions", "retractions", 0),
    ("cached prompt tokens", "cached_tokens", 0),
    ("evicted tokens", "evicted_tokens", 0),
    ("pages freed by eviction", "pages_freed", 0),
    ("tokens moved (compaction)", "tokens_moved", 0),
]
HEADING = "## Agent benchmark (server, CPU)"
HEADLINE_ROWS = (
    "retained_pages_per_req",
    "kv_pages_per_running_req",
    "mean_running",
    "out_tok_s",
    "out_tok_per_cpu_s",
    "ttft_p95",
    "cached_tokens",
)


def fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def fmt_spread(sp: dict | None, digits: int = 1) -> str:
    """ "median (min-max)"; the median alone when every repeat agrees; "-" without values."""
    if sp is None:
        return "-"
    mid = fmt(sp["median"], digits)
    lo, hi = fmt(sp["min"], digits), fmt(sp["max"], digits)
    return mid if lo == hi else f"{mid} ({lo}-{hi})"


def change(new: dict | None, old: dict | None) -> str:
    """Median of `new` against the median of `old`, in percent."""
    if new is None or old is None or not old["median"]:
        return "-"
    return f"{(new['median'] / old['median'] - 1) * 100:+.0f}%"


def sla_text(sp: dict | None, rates) -> str:
    """A session rate's spread; 0 (the lowest rate already missed the SLA) reads "<lowest"."""
    if sp is None:
        return "-"
    mid, lo, hi = (f"{sp[k]:g}" if sp[k] else f"<{min(rates):g}" for k in ("median", "min", "max"))
    return mid if lo == hi else f"{mid} ({lo} to {hi})"


def headline_table(by_mode: dict, settings: dict) -> list[str]:
    present = [m for m in MODES if m in by_mode]
    titles = {k: t for t, k, _ in ROWS}
    digits = {k: d for _, k, d in ROWS}
    L = [
        "| burst run, median (min-max) | "
        + " | ".join(MODE_NAMES[m] for m in present)
        + " | vToken vs Naive-Evict |",
        "|---|" + "---|" * (len(present) + 1),
    ]
    for key in HEADLINE_ROWS:
        sp = {m: figure_spread(by_mode[m], key) for m in present}
        L.append(
            f"| {titles[key]} | "
            + " | ".join(fmt_spread(sp[m], digits[key]) for m in present)
            + f" | {change(sp.get('vtoken'), sp.get('naive'))} |"
        )
    if not settings["quick"]:
        f = max(settings["sla_factors"])
        sp = {m: sla_spread(by_mode[m], f) for m in present}
        L.append(
            f"| max session rate with p95 TTFT <= {f:g} x unloaded | "
            + " | ".join(sla_text(sp[m], settings["rates"]) for m in present)
            + " | |"
        )
    return L


def full_table(by_mode: dict, settings: dict) -> list[str]:
    present = [m for m in MODES if m in by_mode]
    L = [
        "| burst run, median (min-max) | " + " | ".join(MODE_NAMES[m] for m in present) + " |",
        "|---|" + "---|" * len(present),
    ]
    for title, key, digits in ROWS:
        L.append(
            f"| {title} | "
            + " | ".join(fmt_spread(figure_spread(by_mode[m], key), digits) for m in present)
            + " |"
        )
    if not settings["quick"]:
        for f in settings["sla_factors"]:
            L.append(
                f"| max rate with p95 TTFT <= {f:g} x unloaded (sessions/s) | "
                + " | ".join(
                    sla_text(sla_spread(by_mode[m], f), settings["rates"]) for m in present
                )
                + " |"
            )
    return L


def turn_table(by_mode: dict, settings: dict) -> list[str]:
    present = [m for m in MODES if m in by_mode]
    L = [
        "TTFT p50 per turn (ms), median (min-max) over repeats:",
        "",
        "| turn | prompt tokens (mean) | " + " | ".join(MODE_NAMES[m] for m in present) + " |",
        "|---|---|" + "---|" * len(present),
    ]
    for i in range(settings["turns"]):
        first = by_mode["none"].runs_named("burst")[0]["turns"][i]
        prompt = first["prompt_tokens"] / max(1, first["completed"])
        L.append(
            f"| {i + 1} | {prompt:.0f} | "
            + " | ".join(fmt_spread(turn_spread(by_mode[m], i), 0) for m in present)
            + " |"
        )
    return L


def ladder_table(by_mode: dict, settings: dict) -> list[str]:
    present = [m for m in MODES if m in by_mode]
    rates = sorted(settings["rates"])
    L = [
        "Rate ladder: p95 TTFT (ms) at each Poisson session rate, median (min-max) over the repeats "
        f"that ran it; a repeat's ladder stops after the first rate over {max(settings['sla_factors']):g} x "
        "its unloaded p95 (empty: no repeat ran it).",
        "",
        "| | unloaded p95 | " + " | ".join(f"{r:g}/s" for r in rates) + " |",
        "|---|---|" + "---|" * len(rates),
    ]
    for m in present:
        c = by_mode[m]
        cols = []
        for r in rates:
            runs = c.runs_named(f"rate{r:g}")
            cols.append(
                fmt_spread(spread([v["summary"]["ttft_ms"]["p95"] for v in runs]), 0)
                if runs
                else ""
            )
        base = spread([v["summary"]["ttft_ms"]["p95"] for v in c.runs_named("unloaded")])
        L.append(f"| {MODE_NAMES[m]} | {fmt_spread(base, 0)} | " + " | ".join(cols) + " |")
    return L


def render(meta: dict, cells: list[Cell], checks: list[dict], plots: list[str]) -> str:
    """The whole section: provenance, setup, what the columns isolate with the run's own checks,
    then per group the headline table, the full table, TTFT per turn and the ladder; plots; notes."""
    settings = meta["settings"]
    L = [
        report_text.provenance(meta),
        "",
        report_text.setup(meta),
        "",
        report_text.isolation(checks),
        "",
    ]
    for page, policy, budget, by_mode in groups(cells):
        n = max(len(c.runs_named("burst")) for c in by_mode.values())
        L += [f"**{policy}, budget {budget}, page size {page}: headline ({n} repeats).**", ""]
        L += headline_table(by_mode, settings) + [""]
        L += (
            ["All figures:", ""]
            + full_table(by_mode, settings)
            + [""]
            + turn_table(by_mode, settings)
            + [""]
        )
        if not settings["quick"]:
            L += ladder_table(by_mode, settings) + [""]
    img = meta.get("img_link", "img")  # the plots' folder, relative to the markdown file
    L += [f"![{p}]({img}/{p})" for p in plots]
    L += ["", report_text.measuring(meta)]
    return "\n".join(L)


def publish(jsonl: Path, results_md: Path, img_dir: Path, repo: Path) -> list[dict]:
    """Render the section and plots from the raw JSON lines alone (a fresh run and `--render-only`
    take this same path) into `results_md` and `img_dir`; returns the fairness checks, computed
    again from the runs' lines (`checks.fairness_checks`)."""
    from sgl_vtoken_tools.bench import raw
    from sgl_vtoken_tools.bench.checks import fairness_checks
    from sgl_vtoken_tools.bench.plots import plot
    from sgl_vtoken_tools.bench.results_md import write_section

    meta, cells, _ = raw.load(jsonl)
    checks = fairness_checks(cells)
    meta["jsonl"] = os.path.relpath(Path(jsonl).resolve(), Path(repo).resolve())
    meta["jsonl_link"] = os.path.relpath(Path(jsonl).resolve(), Path(results_md).resolve().parent)
    meta["img_link"] = os.path.relpath(Path(img_dir).resolve(), Path(results_md).resolve().parent)
    plots = plot(meta["settings"], cells, img_dir)
    write_section(results_md, "bench", render(meta, cells, checks, plots), heading=HEADING)
    return checks
