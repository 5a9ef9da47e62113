"""The cells of the agent-benchmark matrix and the figures of their runs.

A cell is one mode (No-Evict `none`, Naive-Evict `naive`, vToken `vtoken`) x policy x budget x
page size. Each repeat of a cell holds its runs by name: `burst` (all sessions at once),
`unloaded` (sessions one at a time) and `rate{r}` (Poisson arrivals at r sessions/s), each run
the `agent.run_benchmark` result {"summary", "turns", "requests", "samples"}.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sgl_vtoken_tools.bench.quantiles import spread

MODES = ("none", "naive", "vtoken")
MODE_NAMES = {"none": "No-Evict", "naive": "Naive-Evict", "vtoken": "vToken"}


@dataclass
class Cell:
    mode: str
    policy: str | None
    budget: int | None
    page: int
    pool: int
    repeats: list[dict] = field(default_factory=list)  # per repeat: run name -> run
    skipped: list[list] = field(default_factory=list)  # per repeat: ladder rates not run
    ladder_done: list[bool] = field(default_factory=list)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} (got {self.mode!r})")

    @property
    def key(self) -> str:
        return "none" if self.mode == "none" else f"{self.mode}-{self.policy}-b{self.budget}"

    @property
    def name(self) -> str:
        """Unique over a matrix: the key and the page size."""
        return f"ps{self.page}-{self.key}"

    def repeat(self, r: int) -> dict:
        while len(self.repeats) <= r:
            self.repeats.append({})
            self.skipped.append([])
            self.ladder_done.append(False)
        return self.repeats[r]

    def runs_named(self, name: str) -> list[dict]:
        """The run `name` of every repeat that has it."""
        return [rep[name] for rep in self.repeats if name in rep]


def run_figures(run: dict, pool: int, page: int) -> dict:
    """The report's figures of one run (one burst run: the tables' columns)."""
    s = run["summary"]
    vt = s.get("vtoken") or {}
    d = vt.get("delta") or {}
    pages = s["kv_pages_per_running_req"]
    return {
        "peak_running": s["peak_running_log"]
        if s["peak_running_log"] is not None
        else s["peak_running"],
        "mean_running": s["mean_running_sampled"],
        "retained_pages_per_req": vt.get("retained_pages_per_req"),
        "kv_pages_per_running_req": pages,
        "peak_kv_used_tokens": s["peak_kv_used_tokens"],
        "pool_capacity": pool / page / pages if pages else None,
        "out_tok_s": s["output_tokens_per_s"],
        "scheduler_cpu_s": s.get("scheduler_cpu_s"),
        "out_tok_per_cpu_s": s.get("output_tokens_per_cpu_s"),
        "ttft_p50": s["ttft_ms"]["p50"],
        "ttft_p95": s["ttft_ms"]["p95"],
        "tpot_p50": s["tpot_ms"]["p50"],
        "e2e_p95": s["e2e_ms"]["p95"],
        "duration_s": s["duration_s"],
        "retractions": s["retractions"],
        "prompt_tokens": s["prompt_tokens"],
        "cached_tokens": s["cached_tokens"],
        "evicted_tokens": d.get("evicted_tokens"),
        "pages_freed": d.get("pages_freed"),
        "tokens_moved": d.get("tokens_moved"),
        "failed": s["failed"],
    }


def figure_spread(cell: Cell, key: str, run: str = "burst") -> dict | None:
    """`quantiles.spread` of one figure of run `run` over the cell's repeats."""
    return spread([run_figures(r, cell.pool, cell.page)[key] for r in cell.runs_named(run)])


def turn_spread(cell: Cell, turn: int, key: str = "p50", run: str = "burst") -> dict | None:
    """Spread over repeats of one turn's TTFT percentile `key` (ms)."""
    return spread([r["turns"][turn]["ttft_ms"][key] for r in cell.runs_named(run)])


def meets(cell: Cell, r: int, run: dict, factor: float) -> bool:
    """Whether `run` of repeat `r` meets the SLA: no failure, p95 TTFT <= factor x the unloaded p95."""
    base = cell.repeats[r]["unloaded"]["summary"]["ttft_ms"]["p95"]
    return run["summary"]["failed"] == 0 and run["summary"]["ttft_ms"]["p95"] <= factor * base


def sla_rate(cell: Cell, r: int, factor: float) -> float | None:
    """Highest ladder rate of repeat `r` meeting the SLA, every lower rate meeting it too; 0.0 if
    the lowest misses it; None without a ladder."""
    runs = cell.repeats[r] if r < len(cell.repeats) else {}
    ladder = sorted((v for v in runs.values() if "rate" in v), key=lambda v: v["rate"])
    if not ladder:
        return None
    best = 0.0
    for v in ladder:
        if not meets(cell, r, v, factor):
            break
        best = v["rate"]
    return best


def sla_spread(cell: Cell, factor: float) -> dict | None:
    return spread([sla_rate(cell, r, factor) for r in range(len(cell.repeats))])


def groups(cells: list[Cell]) -> list[tuple]:
    """(page, policy, budget, {mode: cell}) with the page size's No-Evict cell in every group."""
    out = []
    for page in sorted({c.page for c in cells}):
        none = next(c for c in cells if c.page == page and c.mode == "none")
        keys = sorted({(c.policy, c.budget) for c in cells if c.page == page and c.mode != "none"})
        for policy, budget in keys:
            by_mode = {"none": none}
            by_mode.update(
                {
                    c.mode: c
                    for c in cells
                    if c.page == page and c.policy == policy and c.budget == budget
                }
            )
            out.append((page, policy, budget, by_mode))
    return out
