"""One markdown row per stress run, from its JSON lines alone (docs/results/stress-run.md).

Columns: run, page size, requests (ok + clipped / aborted / rejected with HTTP 400 / HTTP 503 /
unexpected), over-pool prompts (ok / rejected / 503), evicted tokens, history hits, retracted
requests, shortages met for real and forced (`core/shortage.py` kinds), the longest time without
a completion, the pool after the drain (available + evictable = total) and after a flush, and
the checks' verdict.
"""

from __future__ import annotations

import json
from pathlib import Path

HEADER = (
    "| run | page | requests | over-pool | evicted tokens | history hits | retractions "
    "| shortages met: real | forced | longest gap (s) | pool after drain | after flush | checks |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _counts(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"


def row(path: str | Path) -> str:
    """The row of one run's JSON lines (`python -m sgl_vtoken_tools stress --out`): its `server` and `summary`
    records; the run is named by the file (``stress_<run>.jsonl``)."""
    lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    server = next(r for r in lines if r["kind"] == "server")
    sm = next(r for r in lines if r["kind"] == "summary")
    kinds = sm["by_kind"]

    def total(outcome: str) -> int:
        return sum(v.get(outcome, 0) for v in kinds.values())

    over = kinds.get("over_pool", {})
    shortages = sm["shortages"]
    real = {k: v for k, v in shortages.items() if not k.startswith("forced:")}
    forced = {k.removeprefix("forced:"): v for k, v in shortages.items() if k.startswith("forced:")}
    drained, flushed = sm["pool_after_drain"], sm["pool_after_flush"]
    failed = [k for k, ok in sm["checks"].items() if not ok]
    name = Path(path).stem.removeprefix("stress_")
    cells = [
        f"`stress-{name}`",
        str(server["page_size"]),
        f"{sm['requests']} ({total('ok')} + {total('clipped')} clipped / {total('aborted')} / "
        f"{total('rejected')} / {total('unavailable')} / {sm['unexpected']})",
        f"{over.get('ok', 0)} / {over.get('rejected', 0)} / {over.get('unavailable', 0)}",
        str(sm["counters"]["evicted_tokens"]),
        str(sm["counters"]["history_hits"]),
        str(sm["retracted_requests"]),
        _counts(real),
        _counts(forced),
        str(sm["longest_gap_s"]),
        f"{drained['pool_available_tokens']} + {drained['pool_evictable_tokens']} = "
        f"{drained['pool_total_tokens']}",
        f"{flushed['pool_available_tokens']} free",
        "all pass" if sm["ok"] and not failed else "FAIL: " + ", ".join(failed),
    ]
    return "| " + " | ".join(cells) + " |"
