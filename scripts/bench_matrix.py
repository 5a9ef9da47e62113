#!/usr/bin/env python
"""No-Evict vs Naive-Evict vs vToken on the multi-turn agent benchmark, one run, same KV pool.

    make bench                                       # = python scripts/bench_matrix.py: the CPU page
    python scripts/bench_matrix.py --quick           # smoke: 2 sessions x 2 turns, burst runs only
    python scripts/bench_matrix.py --policies random knorm --budgets 64 256 --page-sizes 1 16

Launches SGLang itself (`ServerProcess`, CPU: `cpu_server_args(model, pool, page)` plus
`--dtype float32 --enable-metrics --enable-cache-report --decode-log-interval 1`), runs
`scripts/bench_agent.py` against it for every cell of the matrix

    mode (none | naive | vtoken) x policy x budget x page size        (none: once per page size)

and writes the tables between `<!-- bench:begin -->` and `<!-- bench:end -->` of
`--results-md` (appended with a heading at the end of the file when missing; nothing else in
the file changes), the plots `bench_*.png` in `--img-dir`, and every run's JSON lines, the server
logs and `matrix.jsonl` (one line per cell) in `--raw-dir`.

Servers. By default two per page size, up at the same time, both with the server-wide flags
`--kv-evict P0 --kv-budget B0 --kv-evict-interval I --kv-sink S` (the first policy and budget),
one with `--kv-reclaim vtoken` (No-Evict and vToken cells), one with `--kv-reclaim naive`
(Naive-Evict cells). Every request carries `custom_params.kv_evict`, sgl-vtoken's per-request
override: `{"policy": "none"}` for No-Evict (the request opts out: stock SGLang code paths),
`{"policy": P, "budget": B}` otherwise (the server's interval, sinks and reclaim mode apply).
Start-ups cost half a minute to two minutes each on two shared cores, hence two, not one per
cell. `--server-per-cell` runs one server per cell instead, one after the other, with only
server-wide flags (`--kv-evict none`, or `--kv-evict P --kv-budget B --kv-reclaim R ...`). The
radix cache is flushed before every run.

Runs per cell (same seed, so the same sessions and texts):
- burst: all `--sessions` arrive at t = 0: peak and mean concurrency, KV pages per request, TTFT
  per turn, output tokens/s, retractions, the plugin's counters;
- unloaded: `--baseline-sessions` sessions one at a time: the cell's unloaded p95 TTFT;
- rate ladder: Poisson session arrivals at each of `--rates`, rate by rate over all cells; a
  cell's ladder stops after the first rate whose p95 TTFT exceeds max(`--sla-factors`) x its
  unloaded p95; rates not started by `--deadline-min` are skipped (and reported as skipped).
  Throughput under SLA, per factor: the highest rate whose p95 TTFT, and every lower rate's, is
  within factor x the cell's unloaded p95 TTFT (1.05: the vToken paper's factor).

Metric definitions: `render()`'s "How it is measured" paragraph and `scripts/bench_agent.py`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_agent  # noqa: E402

from sgl_vtoken.launcher import ServerProcess, cpu_server_args  # noqa: E402

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
HEADING = "## Agent benchmark (server, CPU)"
MODES = ("none", "naive", "vtoken")
MODE_NAMES = {"none": "No-Evict", "naive": "Naive-Evict", "vtoken": "vToken"}
COLORS = {"none": "#7f7f7f", "naive": "#d62728", "vtoken": "#1f77b4"}


@dataclass
class Cell:
    mode: str
    policy: str | None
    budget: int | None
    page: int
    pool: int
    runs: dict = field(default_factory=dict)   # name -> bench_agent summary (+ turns)
    skipped: list = field(default_factory=list)  # ladder rates not run (deadline)
    ladder_done: bool = False

    @property
    def key(self) -> str:
        return "none" if self.mode == "none" else f"{self.mode}-{self.policy}-b{self.budget}"



def build_cells(args) -> list[Cell]:
    cells = []
    for page in args.page_sizes:
        cells.append(Cell("none", None, None, page, args.pool))
        for policy in args.policies:
            for budget in args.budgets:
                for mode in ("naive", "vtoken"):
                    cells.append(Cell(mode, policy, budget, page, args.pool))
    return cells


def server_key(cell: Cell, args) -> tuple:
    if args.server_per_cell:
        return (cell.page, cell.mode, cell.policy, cell.budget)
    return (cell.page, "naive" if cell.mode == "naive" else "vtoken")


def server_flags(cell: Cell, args) -> list[str]:
    common = ["--kv-evict-interval", str(args.interval), "--kv-sink", str(args.sink)]
    if args.server_per_cell:
        if cell.mode == "none":
            return ["--kv-evict", "none"]
        return ["--kv-evict", cell.policy, "--kv-budget", str(cell.budget), "--kv-reclaim", cell.mode, *common]
    # Shared server: the interval, sinks and reclaim mode apply only under a server-wide policy;
    # requests override policy and budget (No-Evict requests opt out).
    reclaim = "naive" if cell.mode == "naive" else "vtoken"
    return ["--kv-evict", args.policies[0], "--kv-budget", str(args.budgets[0]), "--kv-reclaim", reclaim, *common]


def request_kv_evict(cell: Cell, args) -> dict | None:
    """The per-request `kv_evict` object of a cell (None: the server's own settings)."""
    if args.server_per_cell:
        return None
    return {"policy": "none"} if cell.mode == "none" else {"policy": cell.policy, "budget": cell.budget}


def flush_cache(base_url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.post(base_url + "/flush_cache", timeout=10).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError("/flush_cache did not succeed (requests still running?)")


def agent_args(args, server: ServerProcess, cell: Cell, label: str, extra: list[str]) -> argparse.Namespace:
    argv = ["--base-url", server.base_url, "--sessions", str(args.sessions), "--turns", str(args.turns),
            "--seed", str(args.seed), "--system-tokens", str(args.system_tokens),
            "--user-tokens", str(args.user_tokens), "--tool-tokens", str(args.tool_tokens),
            "--tool-min", str(args.tool_min), "--tool-max", str(args.tool_max),
            "--reply-tokens", str(args.reply_tokens), "--sample-interval", str(args.sample_interval),
            "--server-log", str(server.log_path), "--label", label, *extra]
    kv_evict = request_kv_evict(cell, args)
    if kv_evict is not None:
        argv += ["--kv-evict-json", json.dumps(kv_evict)]
    return bench_agent.build_parser().parse_args(argv)


def run_one(args, server, cell: Cell, name: str, extra: list[str]) -> dict:
    label = f"ps{cell.page}-{cell.key}-{name}"
    flush_cache(server.base_url)
    a = agent_args(args, server, cell, label, extra)
    with open(args.raw_dir / f"{label}.jsonl", "w") as f:
        result = bench_agent.run_benchmark(a, f, progress=not args.no_progress)
    s = result["summary"]
    ttft = s["ttft_ms"]
    print(json.dumps({"run": label, "completed": s["completed"], "failed": s["failed"],
                      "ttft_p95_ms": ttft["p95"], "out_tok_s": s["output_tokens_per_s"],
                      "peak_running": s["peak_running"], "retractions": s["retractions"],
                      "duration_s": s["duration_s"]}), flush=True)
    if s["failed"]:
        print(f"warning: {label}: {s['failed']} requests failed", file=sys.stderr)
    return {"summary": s, "turns": result["turns"], "samples": result["samples"]}


def run_fixed(args, server, cell: Cell) -> None:
    """The burst run and the unloaded baseline of one cell."""
    cell.runs["burst"] = run_one(args, server, cell, "burst", ["--rate", "inf"])
    if not args.quick:
        cell.runs["unloaded"] = run_one(args, server, cell, "unloaded", [
            "--rate", "inf", "--max-concurrency", "1", "--sessions", str(args.baseline_sessions)])


def run_ladder_step(args, server, cell: Cell, rate: float) -> None:
    """One rate of the cell's ladder, unless the cell's ladder stopped or the deadline passed."""
    if cell.ladder_done:
        return
    if time.monotonic() > args.deadline:
        cell.skipped.append(rate)
        print(f"# {cell.key}: rate {rate:g} skipped (--deadline-min)", file=sys.stderr, flush=True)
        return
    r = run_one(args, server, cell, f"rate{rate:g}", ["--rate", str(rate)])
    r["rate"] = rate
    cell.runs[f"rate{rate:g}"] = r
    if not meets(cell, r, max(args.sla_factors)):
        cell.ladder_done = True  # higher rates only add load


def meets(cell: Cell, run: dict, factor: float) -> bool:
    base = cell.runs["unloaded"]["summary"]["ttft_ms"]["p95"]
    return run["summary"]["failed"] == 0 and run["summary"]["ttft_ms"]["p95"] <= factor * base


def sla_rate(cell: Cell, factor: float) -> float | None:
    """Highest ladder rate meeting the SLA, with every lower rate meeting it too; 0.0 if the
    lowest misses it; None without a ladder."""
    ladder = sorted((r for r in cell.runs.values() if "rate" in r), key=lambda r: r["rate"])
    if not ladder:
        return None
    best = 0.0
    for r in ladder:
        if not meets(cell, r, factor):
            break
        best = r["rate"]
    return best


# ----------------------------------------------------------------------------- report


def fmt(v, digits=1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def pct(a, b) -> str:
    if a is None or b in (None, 0):
        return "-"
    return f"{(a / b - 1) * 100:+.0f}%"


def cell_row(cell: Cell) -> dict:
    s = cell.runs["burst"]["summary"]
    vt = s.get("vtoken") or {}
    d = vt.get("delta") or {}
    return {
        "peak_running": s["peak_running_log"] if s["peak_running_log"] is not None else s["peak_running"],
        "mean_running": s["mean_running_sampled"],
        "retained_pages_per_req": vt.get("retained_pages_per_req"),
        "kv_pages_per_running_req": s["kv_pages_per_running_req"],
        "peak_kv_used_tokens": s["peak_kv_used_tokens"],
        "pool_capacity": (cell.pool / cell.page / s["kv_pages_per_running_req"]
                          if s["kv_pages_per_running_req"] else None),
        "out_tok_s": s["output_tokens_per_s"],
        "scheduler_cpu_s": s.get("scheduler_cpu_s"), "out_tok_per_cpu_s": s.get("output_tokens_per_cpu_s"),
        "ttft_p50": s["ttft_ms"]["p50"], "ttft_p95": s["ttft_ms"]["p95"],
        "tpot_p50": s["tpot_ms"]["p50"], "e2e_p95": s["e2e_ms"]["p95"],
        "duration_s": s["duration_s"], "retractions": s["retractions"],
        "cached_tokens": s["cached_tokens"],
        "evicted_tokens": d.get("evicted_tokens"), "pages_freed": d.get("pages_freed"),
        "tokens_moved": d.get("tokens_moved"), "failed": s["failed"],
    }


def groups(cells: list[Cell]):
    """(page, policy, budget, {mode: cell}) with the page size's No-Evict cell in every group."""
    out = []
    for page in sorted({c.page for c in cells}):
        none = next(c for c in cells if c.page == page and c.mode == "none")
        keys = sorted({(c.policy, c.budget) for c in cells if c.page == page and c.mode != "none"})
        for policy, budget in keys:
            by_mode = {"none": none}
            by_mode.update({c.mode: c for c in cells
                            if c.page == page and c.policy == policy and c.budget == budget})
            out.append((page, policy, budget, by_mode))
    return out


def sla_text(v, rates) -> str:
    if v is None:
        return "-"
    return f"< {min(rates):g}" if v == 0 else f"{v:g}"


ROWS = [
    ("peak running requests", "peak_running", 0),
    ("mean running requests", "mean_running", 2),
    ("retained pages per request (plugin gauge)", "retained_pages_per_req", 2),
    ("KV pages in use per running request (pool)", "kv_pages_per_running_req", 2),
    ("requests the pool holds at that footprint (pool pages / KV pages per request)", "pool_capacity", 1),
    ("peak KV tokens in use", "peak_kv_used_tokens", 0),
    ("output tokens/s", "out_tok_s", 1),
    ("scheduler CPU seconds", "scheduler_cpu_s", 1),
    ("output tokens per scheduler CPU second", "out_tok_per_cpu_s", 1),
    ("TTFT p50 / p95 (ms)", ("ttft_p50", "ttft_p95"), 0),
    ("TPOT p50 (ms)", "tpot_p50", 1),
    ("E2E p95 (ms)", "e2e_p95", 0),
    ("run time (s)", "duration_s", 1),
    ("retractions", "retractions", 0),
    ("cached prompt tokens", "cached_tokens", 0),
    ("evicted tokens", "evicted_tokens", 0),
    ("pages freed by eviction", "pages_freed", 0),
    ("tokens moved (compaction)", "tokens_moved", 0),
]


def headline(args, gs) -> str:
    parts = []
    for page, policy, budget, by_mode in gs:
        r = {m: cell_row(c) for m, c in by_mode.items()}
        if "vtoken" not in r or "naive" not in r:
            continue
        parts.append(
            f"{policy} (budget {budget}, page {page}): retained pages per request "
            f"{fmt(r['naive']['retained_pages_per_req'], 1)} -> {fmt(r['vtoken']['retained_pages_per_req'], 1)} "
            f"({pct(r['vtoken']['retained_pages_per_req'], r['naive']['retained_pages_per_req'])} vs Naive-Evict), "
            f"mean running requests {fmt(r['none']['mean_running'], 1)} / {fmt(r['naive']['mean_running'], 1)} / "
            f"{fmt(r['vtoken']['mean_running'], 1)} (No-Evict / Naive-Evict / vToken), "
            f"output tokens/s {fmt(r['none']['out_tok_s'], 0)} / {fmt(r['naive']['out_tok_s'], 0)} / "
            f"{fmt(r['vtoken']['out_tok_s'], 0)}, per scheduler CPU second {fmt(r['none']['out_tok_per_cpu_s'], 0)} / "
            f"{fmt(r['naive']['out_tok_per_cpu_s'], 0)} / {fmt(r['vtoken']['out_tok_per_cpu_s'], 0)}")
    return "**Headline (burst run).** " + "; ".join(parts) + "."


def render(args, cells: list[Cell], meta: dict, plots: list[str]) -> str:
    gs = groups(cells)
    modes_in = [m for m in MODES if any(c.mode == m for c in cells)]
    L = [f"Regenerate with `make bench` (`python scripts/bench_matrix.py`; this run: `{meta['command']}`, "
         f"{meta['date']}, {meta['elapsed_min']:.1f} min on {meta['machine']}; load average "
         f"{meta['load_start']} at the start and {meta['load_end']} at the end: other jobs share these "
         "cores, so absolute latencies are noisy; compare the columns of one run).", ""]
    if args.quick:
        L += [f"**Quick smoke run.** Model `{meta['model']}`, pool {args.pool}, {args.sessions} sessions x "
              f"{args.turns} turns, replies of {args.reply_tokens} tokens, burst run only.", ""]
    else:
        L += [f"**Setup.** Model `{meta['model']}`; KV pool `--max-total-tokens {args.pool}` on every "
              f"server; eviction interval {args.interval}, sinks {args.sink}. Workload "
              f"(`scripts/bench_agent.py`, seed {args.seed}): {args.sessions} agent sessions x {args.turns} "
              f"turns of streaming chat completions; a system prompt shared by all sessions (instructions, "
              f"a JSON tool schema and filler: {meta['system_prompt_tokens']} tokens, `--system-tokens "
              f"{args.system_tokens}` or the schema's length if longer); turn 1 a user task (median {args.user_tokens} tokens), "
              f"later turns a tool output (lognormal, median {args.tool_tokens}, {args.tool_min}..{args.tool_max} "
              f"tokens); every reply exactly {args.reply_tokens} tokens (greedy, `ignore_eos`); every request "
              f"re-sends the whole history. Servers: {meta['servers']}. Runs per cell: a burst (all sessions "
              f"at t = 0; the tables and plots below unless said otherwise), an unloaded baseline "
              f"({args.baseline_sessions} sessions one at a time) and a Poisson rate ladder "
              f"({', '.join(f'{r:g}' for r in sorted(args.rates))} sessions/s).", ""]
        L += [headline(args, gs), ""]
    for page, policy, budget, by_mode in gs:
        rows = {m: cell_row(c) for m, c in by_mode.items()}
        present = [m for m in MODES if m in rows]
        L += [f"**{policy}, budget {budget}, page size {page}.**", ""]
        L.append("| burst run | " + " | ".join(MODE_NAMES[m] for m in present) + " |")
        L.append("|---|" + "---|" * len(present))
        for title, key, digits in ROWS:
            if isinstance(key, tuple):
                vals = [" / ".join(fmt(rows[m][k], digits) for k in key) for m in present]
            else:
                vals = [fmt(rows[m][key], digits) for m in present]
            L.append(f"| {title} | " + " | ".join(vals) + " |")
        if not args.quick:
            for f in args.sla_factors:
                L.append(f"| max rate with p95 TTFT <= {f:g} x unloaded (sessions/s) | "
                         + " | ".join(sla_text(sla_rate(by_mode[m], f), args.rates) for m in present) + " |")
        L.append("")
        L.append("TTFT p50 / p95 per turn (ms):")
        L.append("")
        L.append("| turn | prompt tokens (mean) | " + " | ".join(MODE_NAMES[m] for m in present) + " |")
        L.append("|---|---|" + "---|" * len(present))
        for i in range(args.turns):
            t0 = by_mode["none"].runs["burst"]["turns"][i]
            prompt = t0["prompt_tokens"] / max(1, t0["completed"])
            vals = []
            for m in present:
                t = by_mode[m].runs["burst"]["turns"][i]
                vals.append(f"{fmt(t['ttft_ms']['p50'], 0)} / {fmt(t['ttft_ms']['p95'], 0)}")
            L.append(f"| {i + 1} | {prompt:.0f} | " + " | ".join(vals) + " |")
        L.append("")
        if not args.quick:
            rates = sorted(args.rates)
            L.append("Rate ladder: p95 TTFT (ms) at each Poisson session rate; the ladder stops after the first "
                     f"rate over {max(args.sla_factors):g} x the cell's unloaded p95 (empty: not run).")
            L.append("")
            L.append("| | unloaded p95 | " + " | ".join(f"{r:g}/s" for r in rates) + " |")
            L.append("|---|---|" + "---|" * len(rates))
            for m in present:
                c = by_mode[m]
                cols = []
                for r in rates:
                    run = c.runs.get(f"rate{r:g}")
                    cols.append("skipped" if r in c.skipped else "" if run is None
                                else f"{run['summary']['ttft_ms']['p95']:.0f}")
                L.append(f"| {MODE_NAMES[m]} | {c.runs['unloaded']['summary']['ttft_ms']['p95']:.0f} | "
                         + " | ".join(cols) + " |")
            L.append("")
    L += [f"![{p}](img/{p})" for p in plots]
    L.append("")
    L.append(
        "**Reading the numbers.** Memory is the robust part: retained pages and KV pages per request do "
        "not depend on CPU speed. With scattered victims (random) Naive-Evict frees a page only once all "
        "its tokens are dead, so its requests keep nearly every page they ever filled, while vToken "
        "compacts the survivors into about (budget + interval) / page size pages; StreamingLLM evicts a "
        "contiguous range, so Naive-Evict frees whole pages too and the two stay close (as in the "
        "simulator). Concurrency and latency depend on more than memory here: (1) a prompt is prefilled "
        "whole before its first eviction, so admitting a request still needs room for its whole prompt, "
        "and the pool's capacity at the evicted footprint is reached only as prompts shrink; (2) at page "
        "size > 1 compacted histories are not stored, so every turn of an evicting session prefills what "
        "its cached prompt lacks: vToken requests share full-attention prompts through the holed radix "
        "cache (the system prompt and the previous turn's prompt), Naive-Evict requests insert nothing "
        "and re-prefill the whole history, while No-Evict reuses the previous turn's KV (cached prompt "
        "tokens, TTFT per turn; multi-turn history reuse at page size 1 has its own section); (3) with this many sessions the burst's peak is capped by the "
        "session count in every mode, hence the capacity row. "
        "Wall-clock figures (TTFT, TPOT, tokens/s, the rate ladder) move with the load other jobs put on "
        "the two cores: compare modes within one run, and prefer output tokens per scheduler CPU second "
        "for the cost of a token.")
    L.append("")
    L.append(
        "**How it is measured.** Peak running requests: the largest `Decode batch, #running-req` the server "
        "logged during the run (`--decode-log-interval 1`: every decode step). Mean running requests, KV "
        f"pages and retained pages come from samples every {args.sample_interval:g} s while requests run: "
        "*KV pages in use per running request* = pool tokens in use (`/v1/loads`: total - available - "
        "radix-evictable, so a shared prefix counts once and a prompt being prefilled counts whole) / page "
        "size / running requests, every mode; *retained pages per request* = the plugin's `retained_pages` "
        "gauge (pages of the last decode step's evicting requests after its eviction, naive held-back "
        "pages included; `/server_info`) / that step's request count (its `live_tokens` // budget: each "
        "request past its first eviction keeps between budget and budget + interval tokens), the paper's "
        "metric, evicting modes only. "
        "Throughput under SLA: the highest ladder rate whose p95 TTFT (and every lower rate's) stays within "
        "the factor x the cell's own unloaded p95 TTFT; 1.05 is the vToken paper's factor, the looser one "
        "absorbs the noise of a shared CPU. Retractions: delta of `sglang:num_retracted_requests_total`. "
        "Evicted tokens, pages freed, tokens moved: deltas of the plugin's counters. The No-Evict cells "
        "send `kv_evict: {\"policy\": \"none\"}` (stock SGLang code paths, radix prefix reuse included; "
        "Naive-Evict requests never insert their compacted rows, hence their 0 cached tokens and longer "
        f"prefills). Raw JSON lines of every run: `{meta['raw_dir']}/`.")
    return "\n".join(L)


def write_results(path: Path, body: str) -> None:
    text = path.read_text() if path.exists() else "# Results\n"
    block = f"{BEGIN}\n{body}\n{END}"
    if BEGIN in text and END in text:
        pre, rest = text.split(BEGIN, 1)
        _, post = rest.split(END, 1)
        text = pre + block + post
    else:
        text = text.rstrip("\n") + f"\n\n{HEADING}\n\n{block}\n"
    path.write_text(text)


def plot(args, cells: list[Cell]) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.img_dir.mkdir(parents=True, exist_ok=True)
    gs = groups(cells)
    names = [f"{policy} b{budget} ps{page}" for page, policy, budget, _ in gs]
    out = []

    def bars(ax, title, ylabel, value, modes=MODES):
        w = 0.8 / len(modes)
        for j, m in enumerate(modes):
            ys = [value(by_mode[m]) if m in by_mode else None for *_, by_mode in gs]
            xs = [i + (j - (len(modes) - 1) / 2) * w for i in range(len(gs))]
            ax.bar(xs, [y or 0 for y in ys], w, label=MODE_NAMES[m], color=COLORS[m])
            for x, y in zip(xs, ys):
                if y is not None:
                    ax.annotate(f"{y:.3g}", (x, y), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(gs)), names, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)

    def save(fig, fname):
        fig.tight_layout()
        fig.savefig(args.img_dir / fname, dpi=110)
        plt.close(fig)
        out.append(fname)

    width = 2.0 + 2.4 * len(gs)
    fig, axes = plt.subplots(1, 2, figsize=(2 * width, 3.6))
    bars(axes[0], "Retained pages per request (plugin gauge)", "pages",
         lambda c: cell_row(c)["retained_pages_per_req"], modes=("naive", "vtoken"))
    bars(axes[1], "KV pages in use per running request (pool)", "pages",
         lambda c: cell_row(c)["kv_pages_per_running_req"])
    save(fig, "bench_retained_pages.png")

    fig, axes = plt.subplots(1, 2, figsize=(2 * width, 3.6))
    bars(axes[0], f"Peak running requests (pool {args.pool} tokens)", "requests", lambda c: cell_row(c)["peak_running"])
    bars(axes[1], "Mean running requests", "requests", lambda c: cell_row(c)["mean_running"])
    save(fig, "bench_concurrency.png")

    if args.quick:
        fig, ax = plt.subplots(figsize=(width, 3.6))
        bars(ax, "Output tokens/s (burst run; quick run: no rate ladder)", "tokens/s", lambda c: cell_row(c)["out_tok_s"])
    else:
        fig, axes = plt.subplots(1, len(args.sla_factors) + 1, figsize=((len(args.sla_factors) + 1) * width, 3.6))
        for ax, f in zip(axes, args.sla_factors):
            bars(ax, f"Max session rate with p95 TTFT <= {f:g} x unloaded (0: < {min(args.rates):g})",
                 "sessions/s", lambda c, f=f: sla_rate(c, f))
            ax.set_ylim(0, 1.15 * max(args.rates))
        bars(axes[-1], "Output tokens per scheduler CPU second (burst run)", "tokens / CPU s",
             lambda c: cell_row(c)["out_tok_per_cpu_s"])
    save(fig, "bench_sla_throughput.png")

    fig, axes = plt.subplots(1, len(gs), figsize=(1 + 3.6 * len(gs), 3.4), squeeze=False)
    for ax, (page, policy, budget, by_mode) in zip(axes[0], gs):
        for m in MODES:
            if m not in by_mode:
                continue
            samples = by_mode[m].runs["burst"]["samples"]
            pts = [(x["t"], x["running"]) for x in samples if x.get("running") is not None]
            if pts:
                ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", label=MODE_NAMES[m], color=COLORS[m])
        ax.set_title(f"{policy} b{budget} ps{page}", fontsize=9)
        ax.set_xlabel("seconds since the burst")
        ax.set_ylabel("running requests")
        ax.legend(fontsize=7)
    fig.suptitle(f"Running requests over time (burst run, pool {args.pool} tokens)", fontsize=10)
    save(fig, "bench_running.png")

    fig, axes = plt.subplots(1, len(gs), figsize=(1 + 3.6 * len(gs), 3.4), squeeze=False)
    for ax, (page, policy, budget, by_mode) in zip(axes[0], gs):
        for m in MODES:
            if m not in by_mode:
                continue
            turns = by_mode[m].runs["burst"]["turns"]
            ax.plot([t["turn"] for t in turns], [t["ttft_ms"]["p50"] for t in turns], marker="o",
                    label=MODE_NAMES[m], color=COLORS[m])
        ax.set_title(f"{policy} b{budget} ps{page}", fontsize=9)
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_xticks(range(1, args.turns + 1))
        ax.legend(fontsize=7)
    fig.suptitle("TTFT per turn (burst run)", fontsize=10)
    save(fig, "bench_ttft_per_turn.png")
    return out


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model-path", default=None, help="default: the tiny model in .cache/tiny-llama")
    p.add_argument("--pool", type=int, default=4096, help="--max-total-tokens of every server")
    p.add_argument("--page-sizes", type=int, nargs="+", default=[16])
    p.add_argument("--policies", nargs="+", default=["streamingllm", "random"])
    p.add_argument("--budgets", type=int, nargs="+", default=[128])
    p.add_argument("--interval", type=int, default=16, help="--kv-evict-interval")
    p.add_argument("--sink", type=int, default=4, help="--kv-sink")
    p.add_argument("--server-per-cell", action="store_true", help="one server per cell with server-wide flags")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=40)
    p.add_argument("--tool-tokens", type=int, default=300)
    p.add_argument("--tool-min", type=int, default=32)
    p.add_argument("--tool-max", type=int, default=1024)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="Poisson session rates of the SLA ladder")
    p.add_argument("--sla-factors", type=float, nargs="+", default=[1.05, 2.0],
                   help="SLA: p95 TTFT within factor x the unloaded p95 (1.05: the vToken paper's)")
    p.add_argument("--deadline-min", type=float, default=11.0,
                   help="skip the remaining ladder rates once this many minutes have passed")
    p.add_argument("--baseline-sessions", type=int, default=2)
    p.add_argument("--sample-interval", type=float, default=0.15)
    p.add_argument("--quick", action="store_true", help="2 sessions x 2 turns, burst run only (smoke)")
    p.add_argument("--results-md", type=Path, default=REPO / "docs" / "RESULTS.md")
    p.add_argument("--img-dir", type=Path, default=REPO / "docs" / "img")
    p.add_argument("--raw-dir", type=Path, default=REPO / ".cache" / "bench")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM (e.g. a job runner's timeout) unwinds like Ctrl-C, so every server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.sessions, args.turns = 2, 2
    t_start = time.monotonic()
    args.deadline = t_start + 60 * args.deadline_min
    load_start = " ".join(f"{x:.1f}" for x in os.getloadavg())
    if args.model_path is None:
        from sgl_vtoken.tiny_model import ensure_tiny_model
        model = ensure_tiny_model(REPO / ".cache" / "tiny-llama")
        model_name = "tiny-llama (sgl_vtoken.tiny_model, random weights)"
    else:
        model, model_name = args.model_path, args.model_path
    args.raw_dir.mkdir(parents=True, exist_ok=True)
    cells = build_cells(args)

    by_server: dict[tuple, list[Cell]] = {}
    for c in cells:
        by_server.setdefault(server_key(c, args), []).append(c)
    server_descr = []

    def start(key, group) -> ServerProcess:
        flags = server_flags(group[0], args)
        server_args = cpu_server_args(model, args.pool, group[0].page) + [
            "--dtype", "float32", "--enable-metrics", "--enable-cache-report", "--decode-log-interval", "1", *flags]
        log = args.raw_dir / ("server-" + "-".join(str(k) for k in key) + ".log")
        print(f"# server {key}: {' '.join(flags)}", file=sys.stderr, flush=True)
        server = ServerProcess(server_args, log_path=log).start()
        print(json.dumps({"server": list(key), "startup_s": round(server.startup_seconds, 1)}), flush=True)
        server_descr.append(f"`{' '.join(flags)}` ({', '.join(MODE_NAMES[c.mode] for c in group)})")
        return server

    if args.server_per_cell:
        # One server at a time (a CPU server holds ~2 GB): each cell runs whole on its own server.
        for key, group in by_server.items():
            server = start(key, group)
            try:
                for cell in group:
                    run_fixed(args, server, cell)
                    for rate in sorted(args.rates if not args.quick else []):
                        run_ladder_step(args, server, cell, rate)
            finally:
                server.stop()
    else:
        # Both servers of a page size up at once; every cell's burst and baseline first, then the
        # ladder rate by rate over all cells, so a deadline cuts every cell at the same rate.
        servers: dict[tuple, ServerProcess] = {}
        try:
            for key, group in by_server.items():
                servers[key] = start(key, group)
            # build_cells' order: No-Evict, then Naive-Evict and vToken of each policy back to
            # back, so that the modes compared see similar load from other jobs.
            order = cells
            for cell in order:
                run_fixed(args, servers[server_key(cell, args)], cell)
            for rate in sorted(args.rates if not args.quick else []):
                for cell in order:
                    run_ladder_step(args, servers[server_key(cell, args)], cell, rate)
        finally:
            for server in servers.values():
                server.stop()

    elapsed = (time.monotonic() - t_start) / 60
    meta = {
        "command": "make bench" if argv is None and len(sys.argv) == 1 else "python scripts/bench_matrix.py " + " ".join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(), "elapsed_min": elapsed,
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, no GPU",
        "load_start": load_start, "load_end": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "model": model_name, "servers": "; ".join(server_descr),
        "raw_dir": os.path.relpath(args.raw_dir, REPO),
        "system_prompt_tokens": cells[0].runs["burst"]["summary"]["system_prompt_tokens"],
    }
    plots = plot(args, cells)
    write_results(args.results_md, render(args, cells, meta, plots))
    with open(args.raw_dir / "matrix.jsonl", "w") as f:
        for c in cells:
            f.write(json.dumps({"page": c.page, "mode": c.mode, "policy": c.policy, "budget": c.budget,
                                **cell_row(c), "skipped_rates": c.skipped,
                                "sla_rates": {f"{f:g}": sla_rate(c, f) for f in args.sla_factors}}) + "\n")
    print(f"wrote {args.results_md} and {', '.join(plots)} in {elapsed:.1f} min", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
