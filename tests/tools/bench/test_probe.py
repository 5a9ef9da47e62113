"""Reading a server's Prometheus page and vToken state (no server: the parsing and the checks)."""

from sgl_vtoken_tools.bench import probe

METRICS = """\
# HELP sglang:num_requests_total Number of requests.
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{model_name="m",priority="0"} 12.0
sglang:num_requests_total{model_name="m",priority="1"} 3.0
sglang:generation_tokens_total{model_name="m"} 384.0
sglang:num_retracted_reqs{model_name="m"} 0.0
sglang:scheduler_process_cpu_seconds_total{pid="7"} 1.5
sglang:other_counter_total{model_name="m"} 99.0
"""


def test_parse_metrics_sums_label_sets_and_knows_the_retraction_gauge():
    m = probe.parse_metrics(METRICS)
    assert m["num_requests_total"] == 15.0  # two label sets summed
    assert m["generation_tokens_total"] == 384.0
    assert m["scheduler_process_cpu_seconds_total"] == 1.5
    assert m["num_retracted_requests_total"] == 0.0  # not exported yet: counted as 0
    assert m["retractions_exported"] is True  # ... but its gauge is, so 0 is a real 0
    assert "other_counter_total" not in m
    assert probe.parse_metrics("# no sglang series\nfoo 1\n") is None
    assert (
        probe.parse_metrics(METRICS.replace("sglang:num_retracted_reqs", "x"))[
            "retractions_exported"
        ]
        is False
    )


def test_vtoken_state_and_pool_whole():
    state = {"pool_total_tokens": 4096, "pool_available_tokens": 4000, "pool_evictable_tokens": 96}
    info = {"internal_states": [{"vtoken": state}]}
    assert probe.vtoken_state("unused", info) is state
    assert probe.vtoken_state("unused", {"internal_states": [{}]}) is None
    assert probe.vtoken_state("unused", {}) is None
    assert probe.pool_whole(state)
    assert not probe.pool_whole(
        {**state, "pool_available_tokens": 3984}
    )  # 16 slots held: a leak once idle
