"""Rendering of the agent benchmark matrix's results (`scripts/bench_matrix.py` runs it).

From the matrix's cells (`Cell`: mode, policy, budget, page size, and each run's `bench_agent`
summary, per-turn records and samples), the run's arguments and its metadata, renders the
markdown section of `docs/RESULTS.md` (setup, headline, one table set per policy x budget x page
size, notes on reading and measuring), writes it between `<!-- bench:begin -->` and
`<!-- bench:end -->`, and draws the `bench_*.png` plots (matplotlib). Also the per-cell metrics
both sides use: `cell_row` (burst-run figures) and `sla_rate` (throughput under SLA).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

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
