"""The figures of one agent-benchmark run, from its request records, the server samples, the
Prometheus counters and vToken state before and after, and the server log written during it.

Definitions (the report's "How it is measured" repeats them):
- `mean_running_sampled`: mean of /v1/loads' running requests over the samples with requests
  running; `kv_pages_per_running_req`: mean over those samples of tokens in use (total -
  available - radix-evictable) / page size / running requests;
- `retained_pages_per_req` (evicting runs): mean over the samples of the plugin's gauge
  retained_pages / (live_tokens // budget). A request past its first eviction keeps between
  budget and budget + interval live tokens, so live_tokens // budget counts the requests of the
  same decode step (exact when prompts exceed budget + interval and interval < budget; the running
  count of /v1/loads is a separate snapshot and can be a step off);
- `retractions`: delta of `sglang:num_retracted_requests_total` when /metrics exports it, else
  the log's retraction lines, else unknown (None);
- `peak_running`: the larger of the log's largest decode batch and the samples' peak.
"""

from __future__ import annotations

from sgl_vtoken_tools.bench.probe import METRIC_COUNTERS
from sgl_vtoken_tools.bench.quantiles import percentiles

VTOKEN_CUMULATIVE = ("evictions", "evicted_tokens", "pages_freed", "tokens_moved", "bytes_moved")


def summarize(recs: list[dict]) -> dict:
    """Counts, latency percentiles (ms) and token sums of request records (failed ones count only
    in `failed`)."""
    ok = [r for r in recs if r["error"] is None]
    cached = [r["cached_tokens"] for r in ok]
    return {
        "requests": len(recs),
        "completed": len(ok),
        "failed": len(recs) - len(ok),
        "ttft_ms": percentiles([r["ttft"] for r in ok], 1000),
        "tpot_ms": percentiles([r["tpot"] for r in ok], 1000, 2),
        "e2e_ms": percentiles([r["e2e"] for r in ok], 1000),
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "completion_tokens": sum(r["completion_tokens"] for r in ok),
        "cached_tokens": None if any(c is None for c in cached) else sum(cached),
    }


def delta(after: dict | None, before: dict | None, keys) -> dict | None:
    if after is None or before is None:
        return None
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def concurrency(samples: list[dict], page: int | None) -> dict:
    running = [s["running"] for s in samples if s.get("running") is not None]
    busy = [s for s in samples if s.get("running")]
    out = {
        "samples": len(samples),
        "peak_running_sampled": max(running, default=None),
        "mean_running_sampled": round(sum(s["running"] for s in busy) / len(busy), 2)
        if busy
        else None,
        "kv_pages_per_running_req": None,
        "peak_kv_used_tokens": max((s.get("kv_used_tokens") or 0 for s in busy), default=None),
    }
    if busy and page and all(s.get("kv_used_tokens") is not None for s in busy):
        out["kv_pages_per_running_req"] = round(
            sum(s["kv_used_tokens"] / page / s["running"] for s in busy) / len(busy), 2
        )
    return out


def retractions(metrics_after: dict | None, metrics_delta: dict | None, log: dict | None) -> tuple:
    """(count, source): from /metrics when the counter is exported, else the log, else unknown."""
    if metrics_after is not None and metrics_after.get("retractions_exported"):
        return int(metrics_delta["num_retracted_requests_total"]), "metrics"
    if log is not None:
        return log["retracted_requests"], "log"
    return None, "unknown"


def vtoken_figures(st0: dict | None, st1: dict, samples: list[dict], budget: int | None) -> dict:
    busy = [s for s in samples if s.get("running")]
    retained = [
        s["retained_pages"] / (s["live_tokens"] // budget)
        for s in busy
        if budget and s.get("retained_pages") and (s.get("live_tokens") or 0) >= budget
    ]
    return {
        "delta": delta(st1, st0, VTOKEN_CUMULATIVE),
        "peak_running_requests": st1.get("peak_running_requests"),
        "peak_retained_pages": st1.get("peak_retained_pages"),
        "after": {k: v for k, v in st1.items() if k != "config"},
        "retained_pages_per_req": round(sum(retained) / len(retained), 2) if retained else None,
        "peak_retained_pages_sampled": max(
            (s.get("retained_pages") or 0 for s in samples), default=None
        ),
    }


def run_summary(
    recs: list[dict],
    duration: float,
    samples: list[dict],
    page: int | None,
    log: dict | None,
    metrics: tuple,
    states: tuple,
    budget: int | None,
    evicting: bool,
) -> dict:
    """The summary fields of a run. `metrics` and `states`: (before, after) of `scrape_metrics`
    and `vtoken_state`; `log`: `server_log.parse_log` of the run's log text, or None."""
    overall = summarize(recs)
    ok_end = max((r["t_end"] for r in recs if r["error"] is None), default=duration)
    s = {
        **overall,
        "duration_s": round(duration, 3),
        "output_tokens_per_s": round(overall["completion_tokens"] / ok_end, 2)
        if ok_end > 0
        else None,
        "requests_per_s": round(overall["completed"] / ok_end, 3) if ok_end > 0 else None,
        **concurrency(samples, page),
        "log": log,
        "peak_running_log": log["peak_running_requests"] if log is not None else None,
    }
    m0, m1 = metrics
    s["metrics_delta"] = delta(m1, m0, METRIC_COUNTERS)
    cpu = (s["metrics_delta"] or {}).get("scheduler_process_cpu_seconds_total")
    s["scheduler_cpu_s"] = round(cpu, 2) if cpu else None
    s["output_tokens_per_cpu_s"] = round(overall["completion_tokens"] / cpu, 1) if cpu else None
    s["retractions"], s["retractions_source"] = retractions(m1, s["metrics_delta"], log)
    st0, st1 = states
    s["vtoken"] = (
        vtoken_figures(st0, st1, samples, budget) if evicting and st1 is not None else None
    )
    peaks = [p for p in (s["peak_running_log"], s["peak_running_sampled"]) if p is not None]
    s["peak_running"] = max(peaks) if peaks else None
    return s
