"""SGLang's own multi-turn chat benchmark against stock and evicting servers, side by side.

Each cell starts one CPU server (fixed pool, page size, flags) and runs `python -m
sglang.bench_serving --backend sglang-oai-chat --dataset-name generated-shared-prefix
--gsp-num-turns N` against it: conversations that share a system prompt per group, each turn
re-sending the whole history as chat messages (the previous replies as text). Every cell runs the
same dataset (same seed and lengths, the same tokenizer), so a comparison changes only the
server. Around the run the cell reads the server's Prometheus counters (prompt, cached and
aborted totals) and its decode log (peak running requests, requests retracted).

One JSON line per cell: bench_serving's own result (throughput, TTFT, TPOT, completed) and the
server figures: `prefilled_tokens` (prompt tokens computed), `cached_tokens` (prompt tokens
reused from the radix cache, history views included), `retractions`, `peak_running`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sgl_vtoken_tools.bench.probe import scrape_metrics
from sgl_vtoken_tools.bench.server_log import peak_running_from_log, retracted_requests
from sgl_vtoken_tools.bench.workload import at_least_one
from sgl_vtoken_tools.launcher import ServerProcess, cpu_server_args, evict_args


@dataclass(frozen=True)
class Workload:
    """bench_serving's generated-shared-prefix dataset, multi-turn."""

    groups: int = 2
    prompts_per_group: int = 8
    system_len: int = 512
    question_len: int = 128
    output_len: int = 64
    turns: int = 3
    seed: int = 1

    def __post_init__(self) -> None:
        at_least_one(
            self, "groups", "prompts_per_group", "system_len", "question_len", "output_len", "turns"
        )

    def args(self) -> list[str]:
        return [
            "--dataset-name",
            "generated-shared-prefix",
            "--gsp-num-groups",
            str(self.groups),
            "--gsp-prompts-per-group",
            str(self.prompts_per_group),
            "--gsp-system-prompt-len",
            str(self.system_len),
            "--gsp-question-len",
            str(self.question_len),
            "--gsp-output-len",
            str(self.output_len),
            "--gsp-num-turns",
            str(self.turns),
            "--gsp-range-ratio",
            "1.0",
            "--num-prompts",
            str(self.groups * self.prompts_per_group),
            "--seed",
            str(self.seed),
        ]


NO_OVERLAP = ("--disable-overlap-schedule",)


@dataclass(frozen=True)
class Cell:
    """One server configuration: `flags` after the CPU defaults; `label` names it in tables."""

    label: str
    page_size: int
    flags: tuple[str, ...] = field(default_factory=tuple)


def cells(budget: int, page_sizes: tuple[int, ...], prefill_chunk: int | None = None) -> list[Cell]:
    """Stock vs `--kv-evict streamingllm --kv-budget budget` (interval 1 at page size 1, a page
    above) at each page size, and with `prefill_chunk` the same with eviction during prefill.
    Every cell runs without the overlap scheduler, which eviction during prefill needs, so a
    comparison changes the eviction settings only."""
    out = []
    for ps in page_sizes:
        out.append(Cell(f"stock, page {ps}", ps, NO_OVERLAP))
        evict = (*evict_args("streamingllm", budget, 1 if ps == 1 else ps), *NO_OVERLAP)
        out.append(Cell(f"streamingllm b{budget}, page {ps}", ps, evict))
        if prefill_chunk:
            out.append(
                Cell(
                    f"streamingllm b{budget} + prefill chunk {prefill_chunk}, page {ps}",
                    ps,
                    (*evict, "--kv-evict-config", json.dumps({"prefill_chunk": prefill_chunk})),
                )
            )
    return out


def bench_serving(
    base_url: str,
    model: str,
    tokenizer: str,
    work: Workload,
    routing_key: bool = False,
    timeout: float = 3600,
) -> dict:
    """bench_serving's multi-turn chat benchmark against `base_url`; its result line. With
    `routing_key`, bench_serving sends smg's routing-key header (`--gsp-send-routing-key`)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "sglang.bench_serving",
            "--backend",
            "sglang-oai-chat",
            "--base-url",
            base_url,
            "--model",
            model,
            "--tokenizer",
            tokenizer,
            "--request-rate",
            "inf",
            "--disable-tqdm",
            "--output-file",
            str(out),
            *work.args(),
            "--extra-request-body",
            json.dumps({"ignore_eos": True, "temperature": 0}),
            *(["--gsp-send-routing-key"] if routing_key else []),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"bench_serving failed: {proc.stderr[-2000:]}")
        return json.loads(out.read_text().strip().splitlines()[-1])


def run_bench(
    base_url: str, model: str, tokenizer: str, work: Workload, timeout: float = 3600
) -> dict:
    """Run bench_serving's multi-turn chat benchmark against the server at `base_url` (started with
    `--enable-metrics`); returns bench_serving's figures and the server's prompt totals."""
    before = scrape_metrics(base_url)
    if before is None:
        raise RuntimeError(f"{base_url} has no /metrics: start it with --enable-metrics")
    result = bench_serving(base_url, model, tokenizer, work, timeout=timeout)
    after = scrape_metrics(base_url)
    d = {
        k: after[k] - before[k]
        for k in ("prompt_tokens_total", "cached_tokens_total", "num_aborted_requests_total")
    }
    keep = (
        "completed",
        "duration",
        "output_throughput",
        "input_throughput",
        "request_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "total_input_tokens",
        "total_output_tokens",
    )
    return {
        "workload": work.__dict__,
        **{k: result.get(k) for k in keep},
        "prefilled_tokens": int(d["prompt_tokens_total"] - d["cached_tokens_total"]),
        "cached_tokens": int(d["cached_tokens_total"]),
        "aborted": int(d["num_aborted_requests_total"]),
    }


def run_cell(cell: Cell, model: str, tokenizer: str, work: Workload, pool: int) -> dict:
    """Start `cell`'s server, run bench_serving against it, return the cell's JSON line."""
    args = cpu_server_args(model, max_total_tokens=pool, page_size=cell.page_size) + [
        "--enable-metrics",
        "--enable-cache-report",
        "--decode-log-interval",
        "1",
        *cell.flags,
    ]
    with ServerProcess(args, env={"OMP_NUM_THREADS": "1"}) as server:
        figures = run_bench(server.base_url, model, tokenizer, work)
        log = server.log_text()
    return {
        "cell": cell.label,
        "page": cell.page_size,
        "flags": list(cell.flags),
        "pool": pool,
        **figures,
        "retractions": retracted_requests(log),
        "peak_running": peak_running_from_log(log),
    }
