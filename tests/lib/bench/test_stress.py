"""The stress run's traffic and verdict, without a server."""

import random

import pytest

from sgl_vtoken_tools.bench.stress import StressConfig, expected, tally, verdict
from sgl_vtoken_tools.bench.stress_traffic import KINDS, TrafficSpec, evict_choice, play, prompt_ids

SPEC = TrafficSpec()


def test_eviction_settings_cover_server_none_and_policies_deterministically():
    draws = [evict_choice(random.Random(f"s{i}"), SPEC) for i in range(300)]
    assert draws == [evict_choice(random.Random(f"s{i}"), SPEC) for i in range(300)]
    assert None in draws and {"policy": "none"} in draws
    chosen = [d for d in draws if d and d["policy"] != "none"]
    assert {d["policy"] for d in chosen} == set(SPEC.policies)
    assert all(d["budget"] in SPEC.budgets and d["window"] in SPEC.windows for d in chosen)


def test_prompts_within_bounds_and_sharing_heads():
    rng = random.Random(0)
    prompts = [prompt_ids(rng, SPEC, long=i % 2 == 1) for i in range(200)]
    for i, p in enumerate(prompts):
        lo, hi = SPEC.long_prompt if i % 2 else SPEC.short_prompt
        assert lo <= len(p) <= hi and all(SPEC.vocab[0] <= t < SPEC.vocab[1] for t in p)
    long_heads = {tuple(p[:256]) for p in prompts[1::2]}
    assert len(long_heads) < len(prompts[1::2])  # some long prompts share a 256-token head


def test_expected_outcomes_per_kind():
    assert expected({"kind": "generate", "status": "ok"})
    assert not expected({"kind": "chat", "status": "aborted"})  # nobody aborted it
    assert expected({"kind": "abort", "status": "aborted"}) and expected({"kind": "abort", "status": "ok"})
    assert expected({"kind": "invalid", "status": "rejected"})
    assert not expected({"kind": "invalid", "status": "ok"})  # a bad kv_evict must be refused
    assert not expected({"kind": "session", "status": "error"})


def test_tally_and_verdict():
    recs = [{"kind": "generate", "status": "ok", "evict": "random"},
            {"kind": "abort", "status": "aborted", "evict": "none"},
            {"kind": "invalid", "status": "ok", "evict": "server"}]
    t = tally(recs)
    assert t["requests"] == 3 and t["unexpected"] == 1 and t["aborted"] == 1
    assert t["by_kind"] == {"abort": {"aborted": 1}, "generate": {"ok": 1}, "invalid": {"ok": 1}}
    assert t["by_evict"] == {"none": 1, "random": 1, "server": 1}
    assert verdict({"a": True, "log": None}) and not verdict({"a": True, "b": False})


def test_unreachable_server_is_an_error_record_not_an_exception():
    out = play("generate", "http://127.0.0.1:9", random.Random(0), TrafficSpec(timeout=5), "r0")
    assert len(out) == 1 and out[0]["status"] == "error" and "ConnectionError" in out[0]["error"]
    with pytest.raises(ValueError, match="unknown kind"):
        play("bogus", "http://127.0.0.1:9", random.Random(0), SPEC, "r1")
    assert set(KINDS) >= {"generate", "chat_stream", "session", "abort", "disconnect", "invalid"}


def test_config_validation():
    with pytest.raises(ValueError, match="workers"):
        StressConfig(base_url="u", workers=0)
