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

Metric definitions: `render()`'s "How it is measured" paragraph (`scripts/bench_report.py`, which
renders the tables and plots) and `scripts/bench_agent.py`.
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
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_agent  # noqa: E402
from bench_report import MODE_NAMES, Cell, cell_row, meets, plot, render, sla_rate, write_results  # noqa: E402

from sgl_vtoken.launcher import ServerProcess, cpu_server_args  # noqa: E402


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
