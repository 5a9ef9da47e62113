"""A short stress run (sgl_vtoken_tools.bench.stress: mixed /generate and chat traffic, streaming or
not, multi-turn sessions, aborts and disconnects, random per-request policies, budgets and
windows, invalid eviction objects) against the agent benchmark's test server, SGLang's memory
checkers on: every request ends as expected, the server survives, and no KV slot leaks."""

import pytest
from servers import BENCH_FLAGS

from sgl_vtoken_tools.bench.stress import StressConfig, run_stress
from sgl_vtoken_tools.bench.stress_spec import TrafficSpec

pytestmark = [pytest.mark.server, pytest.mark.server_group("bench16")]


def test_mixed_traffic_ends_healthy_and_leak_free(server_factory):
    client = server_factory(page_size=16, extra=BENCH_FLAGS)
    traffic = TrafficSpec(long_prompt=(200, 700), long_new=(48, 128), timeout=180)
    cfg = StressConfig(
        base_url=client.base_url,
        duration_s=25,
        workers=4,
        seed=1,
        progress_every_s=1e9,
        server_log=str(client.server.log_path),
        traffic=traffic,
    )
    lines = []
    summary = run_stress(cfg, lines.append)
    unexpected = [x for x in lines if x["kind"] == "unexpected"]
    assert summary["unexpected"] == 0, unexpected[:3]
    assert summary["checks"] == {k: True for k in summary["checks"]}, (
        summary["checks"],
        summary["tracebacks"],
    )
    # After the drain and a flush, the pool is whole, slot for slot.
    after = summary["pool_after_flush"]
    assert (
        after["pool_available_tokens"] == after["pool_total_tokens"]
        and after["pool_evictable_tokens"] == 0
    )
    # The run really mixed: several kinds, evicting and opted-out requests, aborts, evictions.
    assert len(summary["by_kind"]) >= 4 and summary["requests"] >= 8
    assert "none" in summary["by_evict"] and len(summary["by_evict"]) >= 3
    assert summary["aborted"] >= 1 and summary["counters"]["evicted_tokens"] > 0
