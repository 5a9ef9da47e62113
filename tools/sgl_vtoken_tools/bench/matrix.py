"""The No-Evict / Naive-Evict / vToken matrix of the agent benchmark: its cells, the servers that
run them, and the runs of every cell and repeat (`run_matrix`).

Cells: mode (none | naive | vtoken) x policy x budget x page size (No-Evict once per page size).
Servers, by default two per page size (one page size at a time), up together, with the same
flags but `--kv-reclaim`:
`--kv-evict P0 --kv-budget B0 --kv-evict-interval I --kv-sink S` (the first policy and budget)
and `--kv-reclaim vtoken` (No-Evict and vToken cells) or `naive` (Naive-Evict cells). Requests
choose their cell's policy and budget through `custom_params.kv_evict`; No-Evict requests send
`{"policy": "none"}` (stock SGLang paths). `server_per_cell`: one server per cell, one after the
other, with server-wide flags only. Every run flushes its server's radix cache first and sends
fixed request ids (`{run}-s{session}-t{turn}`), the same in every mode and repeat.

Reusing a request id needs care: 2 s after a streamed chat completion ends, SGLang aborts its id
if a request with that id is then in flight (`TokenizerManager.create_abort_task`, meant for
clients that disconnected), so a run that reuses the ids of a run on the same server waits until
`RID_REUSE_GAP_S` seconds have passed since that run ended.

Per repeat, every cell runs a burst and an unloaded baseline, then the Poisson rate ladder rate
by rate over all cells (a cell's ladder stops after the first rate over max(sla_factors) x its
unloaded p95 TTFT; rates not started by the deadline are skipped). Cells run in the same order
within a repeat, reversed every other repeat, so the modes compared see similar load from other
jobs on the machine.
"""

from __future__ import annotations

import io
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sgl_vtoken_tools.bench.agent import AgentConfig, run_benchmark
from sgl_vtoken_tools.bench.cell_server import RID_REUSE_GAP_S
from sgl_vtoken_tools.bench.cells import MODE_NAMES, Cell, meets
from sgl_vtoken_tools.bench.probe import flush_cache
from sgl_vtoken_tools.bench.raw import RawLog
from sgl_vtoken_tools.bench.workload import WorkloadSpec
from sgl_vtoken_tools.cli.common import from_args
from sgl_vtoken_tools.launcher import ServerProcess, cpu_server_args


@dataclass
class MatrixConfig:
    model: str
    pool: int = 4096
    page_sizes: list = field(default_factory=lambda: [16])
    policies: list = field(default_factory=lambda: ["streamingllm", "random"])
    budgets: list = field(default_factory=lambda: [128])
    interval: int = 16
    sink: int = 4
    server_per_cell: bool = False
    sessions: int = 8
    turns: int = 4
    system_tokens: int = 256
    user_tokens: int = 40
    tool_tokens: int = 300
    tool_min: int = 32
    tool_max: int = 1024
    reply_tokens: int = 32
    seed: int = 0
    rates: list = field(default_factory=lambda: [0.5, 1.0, 2.0])
    sla_factors: list = field(default_factory=lambda: [1.05, 2.0])
    deadline_min: float = 40.0
    baseline_sessions: int = 2
    sample_interval: float = 0.15
    repeats: int = 3
    quick: bool = False  # burst runs only (no baseline, no ladder)
    progress: bool = True

    def __post_init__(self):
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1 (got {self.repeats})")
        if not self.policies or not self.budgets or not self.page_sizes:
            raise ValueError("policies, budgets and page_sizes need at least one value each")

    def settings(self) -> dict:
        """The settings the report needs, JSON-ready."""
        return {k: v for k, v in vars(self).items() if k not in ("model", "progress")}


def build_cells(cfg: MatrixConfig) -> list[Cell]:
    cells = []
    for page in cfg.page_sizes:
        cells.append(Cell("none", None, None, page, cfg.pool))
        for policy in cfg.policies:
            for budget in cfg.budgets:
                cells += [
                    Cell(mode, policy, budget, page, cfg.pool) for mode in ("naive", "vtoken")
                ]
    return cells


def server_key(cell: Cell, cfg: MatrixConfig) -> tuple:
    if cfg.server_per_cell:
        return (cell.page, cell.mode, cell.policy, cell.budget)
    return (cell.page, "naive" if cell.mode == "naive" else "vtoken")


def server_flags(cell: Cell, cfg: MatrixConfig) -> list[str]:
    common = ["--kv-evict-interval", str(cfg.interval), "--kv-sink", str(cfg.sink)]
    if cfg.server_per_cell:
        if cell.mode == "none":
            return ["--kv-evict", "none"]
        return [
            "--kv-evict",
            cell.policy,
            "--kv-budget",
            str(cell.budget),
            "--kv-reclaim",
            cell.mode,
            *common,
        ]
    reclaim = "naive" if cell.mode == "naive" else "vtoken"
    return [
        "--kv-evict",
        cfg.policies[0],
        "--kv-budget",
        str(cfg.budgets[0]),
        "--kv-reclaim",
        reclaim,
        *common,
    ]


def request_kv_evict(cell: Cell, cfg: MatrixConfig) -> dict | None:
    """The per-request `kv_evict` object of a cell (None: the server's own settings)."""
    if cfg.server_per_cell:
        return None
    return (
        {"policy": "none"}
        if cell.mode == "none"
        else {"policy": cell.policy, "budget": cell.budget}
    )


class MatrixRun:
    """One matrix run: servers, cells and their raw lines (`raw`), server logs in `raw_dir`."""

    def __init__(self, cfg: MatrixConfig, raw: RawLog, raw_dir: Path):
        self.cfg, self.raw, self.raw_dir = cfg, raw, Path(raw_dir)
        self.cells = build_cells(cfg)
        self.servers_described: list[str] = []
        self.deadline = time.monotonic() + 60 * cfg.deadline_min
        self.ids_used: dict[tuple, float] = {}  # (server url, rid prefix) -> when its run ended

    def agent_config(self, server: ServerProcess, cell: Cell, name: str, **workload) -> AgentConfig:
        c = self.cfg
        return AgentConfig(
            base_url=server.base_url,
            workload=from_args(WorkloadSpec, c, **workload),
            reply_tokens=c.reply_tokens,
            kv_evict=request_kv_evict(cell, c),
            rid_prefix=name,
            server_log=str(server.log_path),
            sample_interval=c.sample_interval,
            label=f"{cell.name}-{name}",
        )

    def run_one(
        self,
        server: ServerProcess,
        cell: Cell,
        r: int,
        name: str,
        max_concurrency: int = 0,
        **workload,
    ) -> dict:
        ended = self.ids_used.get((server.base_url, name))
        if ended is not None:
            time.sleep(max(0.0, ended + RID_REUSE_GAP_S - time.monotonic()))
        flush_cache(server.base_url)
        cfg = self.agent_config(server, cell, name, **workload)
        cfg.max_concurrency = max_concurrency
        buf = io.StringIO()
        result = run_benchmark(cfg, buf, progress=self.cfg.progress)
        self.ids_used[(server.base_url, name)] = time.monotonic()
        (self.raw_dir / f"{cell.name}-r{r}-{name}.jsonl").write_text(buf.getvalue())
        self.raw.run(cell, r, name, buf.getvalue())
        s = result["summary"]
        print(
            json.dumps(
                {
                    "run": cfg.label,
                    "repeat": r,
                    "completed": s["completed"],
                    "failed": s["failed"],
                    "ttft_p95_ms": s["ttft_ms"]["p95"],
                    "out_tok_s": s["output_tokens_per_s"],
                    "peak_running": s["peak_running"],
                    "retractions": s["retractions"],
                    "duration_s": s["duration_s"],
                }
            ),
            flush=True,
        )
        if s["failed"]:
            print(
                f"warning: {cfg.label} (repeat {r}): {s['failed']} requests failed", file=sys.stderr
            )
        run = {k: result[k] for k in ("summary", "turns", "requests", "samples")}
        cell.repeat(r)[name] = run
        return run

    def run_fixed(self, server: ServerProcess, cell: Cell, r: int) -> None:
        """The burst run and (unless quick) the unloaded baseline of one cell and repeat."""
        self.run_one(server, cell, r, "burst")
        if not self.cfg.quick:
            self.run_one(
                server, cell, r, "unloaded", max_concurrency=1, sessions=self.cfg.baseline_sessions
            )

    def run_ladder_step(self, server: ServerProcess, cell: Cell, r: int, rate: float) -> None:
        """One rate of the cell's ladder in repeat `r`, unless its ladder stopped or the deadline passed."""
        cell.repeat(r)
        if cell.ladder_done[r]:
            return
        if time.monotonic() > self.deadline:
            cell.skipped[r].append(rate)
            print(
                f"# {cell.name} repeat {r}: rate {rate:g} skipped (deadline)",
                file=sys.stderr,
                flush=True,
            )
            return
        run = self.run_one(server, cell, r, f"rate{rate:g}", rate=rate)
        run["rate"] = rate
        if not meets(cell, r, run, max(self.cfg.sla_factors)):
            cell.ladder_done[r] = True  # higher rates only add load

    def start(self, key: tuple, group: list[Cell]) -> ServerProcess:
        flags = server_flags(group[0], self.cfg)
        args = cpu_server_args(self.cfg.model, self.cfg.pool, group[0].page) + [
            "--dtype",
            "float32",
            "--enable-metrics",
            "--enable-cache-report",
            "--decode-log-interval",
            "1",
            *flags,
        ]
        log = self.raw_dir / ("server-" + "-".join(str(k) for k in key) + ".log")
        print(f"# server {key}: {' '.join(flags)}", file=sys.stderr, flush=True)
        server = ServerProcess(args, log_path=log).start()
        print(
            json.dumps({"server": list(key), "startup_s": round(server.startup_seconds, 1)}),
            flush=True,
        )
        self.servers_described.append(
            f"`{' '.join(flags)}` ({', '.join(MODE_NAMES[c.mode] for c in group)})"
        )
        return server

    def repeat_all(self, servers: dict, cells: list[Cell], r: int) -> None:
        order = cells if r % 2 == 0 else cells[::-1]
        for cell in order:
            self.run_fixed(servers[server_key(cell, self.cfg)], cell, r)
        for rate in sorted(self.cfg.rates if not self.cfg.quick else []):
            for cell in order:
                self.run_ladder_step(servers[server_key(cell, self.cfg)], cell, r, rate)

    def run(self) -> list[Cell]:
        by_server: dict[tuple, list[Cell]] = {}
        for c in self.cells:
            by_server.setdefault(server_key(c, self.cfg), []).append(c)
        if self.cfg.server_per_cell:
            # One server at a time (a CPU server holds ~2 GB): all repeats of its cells on it.
            for key, group in by_server.items():
                server = self.start(key, group)
                try:
                    for r in range(self.cfg.repeats):
                        self.repeat_all({key: server}, group, r)
                finally:
                    server.stop()
        else:
            # Both servers of a page size up together (two at most), all repeats of its cells.
            for page in self.cfg.page_sizes:
                cells = [c for c in self.cells if c.page == page]
                servers: dict[tuple, ServerProcess] = {}
                try:
                    for key, group in by_server.items():
                        if key[0] == page:
                            servers[key] = self.start(key, group)
                    for r in range(self.cfg.repeats):
                        self.repeat_all(servers, cells, r)
                finally:
                    for server in servers.values():
                        server.stop()
        return self.cells
