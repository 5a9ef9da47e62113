"""The figures of the scored agent benchmark: one `summary` per (cell, repeat), one `cell` line
per cell (each figure's spread over repeats), and their markdown table.

    summarize(reqs, answers, wall, log, reference)   output tokens/s (over the wall time), prompt
        tokens computed (prompt - cached), mean TTFT, accuracy (all, fact in the task, fact in
        the first tool output), agreement with the full cache's answers of the same repeat (the
        same first number), later turns by how their history came back (`joint.history_turns`:
        device, host, radix prefix, prefilled again), host bytes moved per turn (`host`:
        `joint.host_moved` over the run), device KV per session, retractions, peak running and
        mean running (rows per decode step) from the log
    cell_lines(summaries)   the spreads and the throughput ratio to stock of the same repeat
"""

from __future__ import annotations

from functools import partial

from sgl_vtoken_tools.bench import joint
from sgl_vtoken_tools.bench.joint_table import RATIOS, spread_lines
from sgl_vtoken_tools.bench.quantiles import spread_text as _fmt

CELL_KEYS = (
    "output_tokens_per_s",
    "prefill_tokens",
    "mean_ttft_ms",
    "accuracy",
    "accuracy_task",
    "accuracy_tool",
    "agreement",
    "turns_from_device",
    "turns_from_host",
    "turns_from_prefix",
    "turns_prefilled_again",
    "host_bytes_per_turn",
    "kv_tokens_mean",
    "retractions",
    "peak_running",
    "mean_running",
    "wall_s",
    "failed",
)


ACCURACY_BY_FACT = {
    "accuracy_task": lambda a: a["fact_turn"] == 1,
    "accuracy_tool": lambda a: a["fact_turn"] != 1,
}


# One run's figures: `joint.summarize`'s, counted in sessions, accuracy by where the fact was.
summarize = partial(joint.summarize, count_key="sessions", accuracy_by=ACCURACY_BY_FACT)


def cell_lines(summaries: list[dict]) -> list[dict]:
    """One `cell` line per cell (first-seen order): every CELL_KEYS figure's spread over the
    repeats and `throughput_ratio`, output tokens/s over stock's of the same repeat (None
    without a `stock` cell)."""
    return spread_lines(summaries, CELL_KEYS, RATIOS[:1])


def table(cells: list[dict]) -> str:
    """Markdown: medians over repeats with (min-max)."""
    lines = [
        "| cell | output tok/s | x stock | prompt tokens computed | mean TTFT ms | accuracy % "
        "| fact in task % | fact in tool output % | agree w/ full % | KV tokens / session "
        "| retractions | peak running | mean running | later turns from host | prefilled again |",
        "|---|" + "---:|" * 14,
    ]
    for c in cells:
        lines.append(
            f"| {c['cell']} | {_fmt(c['output_tokens_per_s'])} | {_fmt(c['throughput_ratio'], 2)} "
            f"| {_fmt(c['prefill_tokens'], 0)} | {_fmt(c['mean_ttft_ms'], 0)} "
            f"| {_fmt(c['accuracy'], pct=True)} | {_fmt(c['accuracy_task'], pct=True)} "
            f"| {_fmt(c['accuracy_tool'], pct=True)} | {_fmt(c['agreement'], pct=True)} "
            f"| {_fmt(c['kv_tokens_mean'], 0)} | {_fmt(c['retractions'], 0)} "
            f"| {_fmt(c['peak_running'], 0)} | {_fmt(c.get('mean_running'), 1)} "
            f"| {_fmt(c.get('turns_from_host'), 0)} "
            f"| {_fmt(c.get('turns_prefilled_again'), 0)} |"
        )
    return "\n".join(lines) + "\n"
