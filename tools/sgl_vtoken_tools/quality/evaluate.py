"""One quality run: every cell through the fast reference, then a subset through the server.

:func:`run` is what ``python -m sgl_vtoken_tools quality`` calls: it builds the tasks, runs them for every
(setting, budget) cell with :class:`~sgl_vtoken_tools.quality.runner.Runner`, then replays the first
trials of each task for every setting at the server budgets on a live server
(:class:`~sgl_vtoken_tools.quality.server_check.ServerCheck`), one server per group of settings that
need the same server-wide options, and ends with the summaries. Every record goes to `emit`.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sgl_vtoken_tools.quality import report, retrieval, splits, tasks
from sgl_vtoken_tools.quality.runner import Cell, Runner, make_cells
from sgl_vtoken_tools.quality.settings import Setting, Sweep

# passkey / recall / lm: the quality run's tasks; docqa / session: the split tasks (splits.py);
# kv / needle: the split's dense retrieval tasks (retrieval.py)
TASKS = ("passkey", "recall", "lm", "docqa", "session", "kv", "needle")
ONE_PROMPT = ("passkey", "docqa", "kv", "needle")  # one prompt, one answer


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (the CLI's flags); validated on construction."""

    model: str
    settings: tuple[Setting, ...]
    budgets: tuple[int, ...]
    sweep: Sweep = Sweep()
    passkey_lengths: tuple[int, ...] = (1000, 2000, 4000)
    passkey_depths: tuple[float, ...] = (0.1, 0.35, 0.6, 0.85)
    recall_trials: int = 3
    recall_fillers: int = 2
    lm_windows: int = 2
    lm_context: int = 1024
    lm_tokens: int = 256
    lm_greedy: int = 32
    server_trials: int = 1
    server_budgets: tuple[int, ...] = ()
    server_args: tuple[str, ...] = ()
    server_threads: int = 1
    seed: int = 0
    wheel_dir: str | None = None
    tasks: tuple[str, ...] = ("passkey", "recall", "lm")
    split: str = "heldout"
    docqa_lengths: tuple[int, ...] = (1000, 2000)
    session_trials: int = 12
    session_turns: int = 4
    retrieval_lengths: tuple[int, ...] = (1000,)
    retrieval_trials: int = 20
    max_new: dict = field(
        default_factory=lambda: {
            "passkey": 12,
            "recall": 24,
            "docqa": 12,
            "session": 24,
            "kv": 32,  # SmolLM2 restates the question before the value
            "needle": 32,
        }
    )

    def __post_init__(self) -> None:
        unknown = sorted(set(self.tasks) - set(TASKS))
        if unknown:
            raise ValueError(f"--tasks: unknown {unknown}; choose from {', '.join(TASKS)}")
        if self.split not in splits.SPLITS:
            raise ValueError(f"--split: {self.split!r}; choose from {', '.join(splits.SPLITS)}")
        if self.session_turns < 2:
            raise ValueError(
                f"--session-turns must be >= 2 (a fact and a question), got {self.session_turns}"
            )
        if not self.budgets:
            raise ValueError("--budgets: give at least one budget")
        if any(not 0.0 <= d <= 1.0 for d in self.passkey_depths):
            raise ValueError(
                f"--passkey-depths must lie in [0, 1] (got {list(self.passkey_depths)})"
            )
        for b in self.server_budgets:
            if b not in self.budgets:
                raise ValueError(
                    f"--server-budgets: {b} is not one of --budgets {list(self.budgets)}"
                )
        for s in self.settings:
            for b in self.budgets:
                s.config(self.sweep, b)  # ValueError naming the setting

    def cells(self) -> list[Cell]:
        return make_cells(list(self.settings), list(self.budgets), self.sweep)


def build_tasks(plan: Plan, tokenizer) -> dict[str, list]:
    out = {}
    if "passkey" in plan.tasks:
        out["passkey"] = tasks.passkey_trials(
            tokenizer,
            list(plan.passkey_lengths),
            list(plan.passkey_depths),
            plan.seed,
            plan.wheel_dir,
        )
    if "recall" in plan.tasks and plan.recall_trials:
        out["recall"] = tasks.recall_trials(
            tokenizer,
            plan.recall_trials,
            plan.recall_fillers,
            seed=plan.seed,
            wheel_dir=plan.wheel_dir,
        )
    if "docqa" in plan.tasks:
        out["docqa"] = splits.docqa_trials(
            tokenizer, plan.split, list(plan.docqa_lengths), plan.seed, plan.wheel_dir
        )
    if "session" in plan.tasks and plan.session_trials:
        out["session"] = splits.session_trials(
            tokenizer,
            plan.split,
            plan.session_trials,
            plan.session_turns,
            seed=plan.seed,
            wheel_dir=plan.wheel_dir,
        )
    for name, make in (("kv", retrieval.kv_trials), ("needle", retrieval.needle_trials)):
        if name in plan.tasks and plan.retrieval_trials:
            out[name] = make(
                tokenizer,
                plan.split,
                list(plan.retrieval_lengths),
                plan.retrieval_trials,
                plan.seed,
            )
    if "lm" in plan.tasks and plan.lm_windows:
        out["lm"] = tasks.lm_trials(
            tokenizer, plan.lm_windows, plan.lm_context, plan.lm_tokens, plan.seed, plan.wheel_dir
        )
    return out


def _bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, mininterval=2.0)


def run_reference(plan: Plan, model, tokenizer, trials: dict, emit) -> list[dict]:
    """Every trial of every task for every cell; returns the trial records."""
    cells = plan.cells()
    records: list[dict] = []

    def keep(r):
        records.append(r)
        emit(r)

    total = sum(len(v) for v in trials.values()) * len(cells)
    with _bar(total, "reference") as bar:
        runner = Runner(model, tokenizer, cells, keep, bar.update)
        for name, ts in trials.items():
            t0 = time.monotonic()
            if name in ONE_PROMPT:
                runner.passkey(ts, plan.max_new[name])
            elif name in ("recall", "session"):
                runner.recall(ts, plan.max_new[name])
            else:
                runner.lm(ts, plan.lm_greedy)
            emit(
                {
                    "kind": "timing",
                    "stage": f"reference/{name}",
                    "cells": len(cells),
                    "trials": len(ts),
                    "seconds": round(time.monotonic() - t0, 1),
                }
            )
    return records


def server_groups(plan: Plan) -> list[tuple[dict, list[Cell]]]:
    """Cells of the server subset grouped by the server-wide options they need: ``(options,
    cells)``; options ``{}`` is a ``--kv-evict none`` server taking everything per request."""
    budgets = plan.server_budgets or (sorted(plan.budgets)[len(plan.budgets) // 2],)
    groups: dict[str, list[Cell]] = {}
    opts: dict[str, dict] = {}
    for cell in plan.cells():
        if cell.budget is not None and cell.budget not in budgets:
            continue
        o = cell.setting.server_options()
        key = json.dumps([cell.setting.policy, o], sort_keys=True, default=list) if o else "{}"
        opts[key] = {"policy": cell.setting.policy, **o} if o else {}
        groups.setdefault(key, []).append(cell)
    return [(opts[k], v) for k, v in groups.items()]


def server_flags(plan: Plan, options: dict, pool: int) -> list[str]:
    """Flags of a CPU server for one group: per-request eviction on top of these defaults."""
    from sgl_vtoken_tools.launcher import cpu_server_args, evict_args

    sw = plan.sweep
    flags = cpu_server_args(plan.model, pool, sw.page_size) + [
        "--dtype",
        "float32",
        "--kv-sink",
        str(sw.sink),
        "--kv-evict-interval",
        str(sw.interval),
        # Prompts are prefilled in one chunk as the reference does (SGLang sizes its activation
        # reserve from the chunk size: fix the memory fraction, the pool is capped anyway).
        "--radix-cache-backend",
        "vtoken",
        "--chunked-prefill-size",
        "8192",
        "--mem-fraction-static",
        "0.8",
    ]
    if options:
        cfg = {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in options.items() if k != "policy"
        }
        flags += evict_args(options["policy"], max(plan.budgets), config=cfg)
    else:
        flags += ["--kv-evict", "none"]
    return flags + list(plan.server_args)


def run_server(
    plan: Plan,
    tokenizer,
    trials: dict,
    records: list[dict],
    emit,
    pool: int = 16384,
    base_url: str | None = None,
) -> list[dict]:
    """Replay the first `server_trials` trials of each task on servers; returns the records."""
    from sgl_vtoken_tools.launcher import ServerProcess
    from sgl_vtoken_tools.quality.server_check import Client, ServerCheck

    ref = {(r["task"], r["trial"], r["setting"], r["budget"]): r for r in records}
    subset = {k: v[: plan.server_trials] for k, v in trials.items()}
    out: list[dict] = []

    def keep(r):
        out.append(r)
        emit(r)

    groups = server_groups(plan)
    total = sum(len(v) for v in subset.values()) * sum(len(c) for _, c in groups)
    with _bar(total, "server") as bar:
        for options, cells in groups:
            if base_url is not None and options:
                continue  # a given server has its own options: only per-request settings fit
            t0 = time.monotonic()
            # One OpenMP thread: on a shared machine two spin-wait on each other (1 token/s).
            env = {"OMP_NUM_THREADS": str(plan.server_threads)} if plan.server_threads else None
            server = (
                None
                if base_url
                else ServerProcess(server_flags(plan, options, pool), env=env).start()
            )
            try:
                check = ServerCheck(
                    Client(base_url or server.base_url), tokenizer, ref, keep, bar.update
                )
                for name in ONE_PROMPT:
                    if name in subset:
                        check.passkey(subset[name], cells, plan.max_new[name])
                for name in ("recall", "session"):
                    if name in subset:
                        check.recall(subset[name], cells, plan.max_new[name])
                if "lm" in subset:
                    check.lm(subset["lm"], cells, plan.lm_greedy)
            finally:
                if server is not None:
                    server.stop()
            emit(
                {
                    "kind": "timing",
                    "stage": "server",
                    "options": options,
                    "cells": len(cells),
                    "startup_seconds": None if server is None else round(server.startup_seconds, 1),
                    "seconds": round(time.monotonic() - t0, 1),
                }
            )
    return out


def write_outputs(
    records: list[dict], plot_path: str | Path | None, title: str
) -> tuple[list[dict], str]:
    """Summaries and the markdown tables of `records`; the plot when a path is given."""
    summaries = report.summarize(records)
    if plot_path:
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        report.plot(summaries, plot_path, title)
    return summaries, report.markdown(summaries)
