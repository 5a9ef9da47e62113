"""A run's figures from its request records, samples, counters and log."""

import pytest

from sgl_vtoken_tools.bench.agent_summary import (
    concurrency,
    retractions,
    run_summary,
    summarize,
    vtoken_figures,
)


def rec(turn, ttft=0.1, e2e=1.0, prompt=100, completion=32, cached=0, error=None, t_end=1.0):
    return {
        "turn": turn,
        "ttft": ttft,
        "e2e": e2e,
        "tpot": (e2e - ttft) / (completion - 1) if completion > 1 else None,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "error": error,
        "t_end": t_end,
    }


def test_failed_requests_count_only_as_failed():
    s = summarize(
        [rec(1, cached=10), rec(1, ttft=0.3, cached=20), rec(2, error="HTTP 400", completion=1)]
    )
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["prompt_tokens"] == 200 and s["completion_tokens"] == 64 and s["cached_tokens"] == 30
    assert s["ttft_ms"]["p50"] == 200.0
    assert summarize([rec(1, cached=None)])["cached_tokens"] is None  # server without cache report


def test_concurrency_from_samples_counts_busy_samples_only():
    samples = [
        {"t": 0, "running": 0, "kv_used_tokens": 0},
        {"t": 1, "running": 2, "kv_used_tokens": 640},  # 640 / 16 / 2 = 20 pages
        {"t": 2, "running": 4, "kv_used_tokens": 640},  # 10 pages
        {"t": 3},
    ]  # /v1/loads did not answer
    c = concurrency(samples, page=16)
    assert c["peak_running_sampled"] == 4 and c["mean_running_sampled"] == 3.0
    assert c["kv_pages_per_running_req"] == 15.0 and c["peak_kv_used_tokens"] == 640
    assert concurrency(samples, page=None)["kv_pages_per_running_req"] is None


def test_retractions_prefer_metrics_then_log():
    assert retractions(
        {"retractions_exported": True}, {"num_retracted_requests_total": 2.0}, None
    ) == (2, "metrics")
    assert retractions({"retractions_exported": False}, {}, {"retracted_requests": 3}) == (3, "log")
    assert retractions(None, None, None) == (None, "unknown")


def test_retained_pages_per_request_divides_by_the_step_request_count():
    # budget 128: 3 requests holding 130..143 live tokens each -> live // 128 == 3.
    samples = [
        {"running": 3, "retained_pages": 27, "live_tokens": 400},
        {"running": 3, "retained_pages": 30, "live_tokens": 420},
        {"running": 3, "retained_pages": 0, "live_tokens": 0},
    ]  # before any eviction: skipped
    st0 = {
        "evictions": 1,
        "evicted_tokens": 10,
        "pages_freed": 0,
        "tokens_moved": 0,
        "bytes_moved": 0,
    }
    st1 = {**st0, "evictions": 4, "evicted_tokens": 500, "peak_running_requests": 3, "config": {}}
    v = vtoken_figures(st0, st1, samples, budget=128)
    assert v["retained_pages_per_req"] == pytest.approx(9.5)
    assert v["delta"]["evictions"] == 3 and v["delta"]["evicted_tokens"] == 490
    assert "config" not in v["after"] and v["peak_retained_pages_sampled"] == 30


def test_run_summary_without_metrics_or_plugin():
    s = run_summary(
        [rec(1, t_end=2.0), rec(1, t_end=4.0)],
        4.5,
        [],
        16,
        None,
        (None, None),
        (None, None),
        None,
        evicting=False,
    )
    assert s["output_tokens_per_s"] == 16.0  # 64 tokens over the last successful end (4 s)
    assert (
        s["vtoken"] is None and s["retractions_source"] == "unknown" and s["peak_running"] is None
    )
