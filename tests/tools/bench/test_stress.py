"""The stress run's traffic and verdict, without a server."""

import random

import pytest

from sgl_vtoken_tools.bench.stress import StressConfig, expected, longest_gap, tally, verdict
from sgl_vtoken_tools.bench.stress_outcome import outcome, refusal
from sgl_vtoken_tools.bench.stress_spec import KINDS, TrafficSpec, evict_choice, kinds, prompt_ids
from sgl_vtoken_tools.bench.stress_traffic import play

SPEC = TrafficSpec()


def test_eviction_settings_cover_server_none_and_policies_deterministically():
    draws = [evict_choice(random.Random(f"s{i}"), SPEC) for i in range(300)]
    assert draws == [evict_choice(random.Random(f"s{i}"), SPEC) for i in range(300)]
    assert None in draws and {"policy": "none"} in draws
    chosen = [d for d in draws if d and d["policy"] != "none"]
    assert {d["policy"] for d in chosen} == set(SPEC.policies)
    assert all(d["budget"] in SPEC.budgets for d in chosen)
    # Every other field a request may carry is overridden by some requests, left to the server by others.
    for name, values in (
        ("sink", SPEC.sinks),
        ("window", SPEC.windows),
        ("interval", SPEC.intervals),
    ):
        assert {d[name] for d in chosen if name in d} == set(values)
        assert any(name not in d for d in chosen)
    assert not any(
        "offload" in d or "recall" in d for d in chosen
    )  # no host store: never asked for


def test_a_server_with_a_host_store_gets_offload_and_recall_overrides():
    spec = TrafficSpec(recalls=(0, 16, 32))
    chosen = [
        d
        for i in range(300)
        if (d := evict_choice(random.Random(f"h{i}"), spec)) and d["policy"] != "none"
    ]
    assert {d["offload"] for d in chosen if "offload" in d} == {True, False}
    assert {d["recall"] for d in chosen if "recall" in d} == set(spec.recalls)
    assert all(
        d["recall"] == 0 for d in chosen if d.get("offload") is False
    )  # recall needs offload


def test_a_503_naming_a_shortage_is_its_own_outcome_and_expected():
    rec = {"kind": "generate", "rid": "r"}
    reason = {
        "type": "abort",
        "status_code": 503,
        "message": "kv_evict prefill_chunk: no free KV page ...",
    }
    out = outcome(dict(rec), reason, 0, 8)
    assert out["status"] == "unavailable" and expected(out)
    # Any other abort of a request nobody aborted, or another 503, is not.
    assert (
        outcome(dict(rec), {"type": "abort", "status_code": 500, "message": "x"}, 0, 8)["status"]
        == "aborted"
    )
    assert (
        refusal(503, "Service overloaded") == "error"
        and refusal(400, "kv_evict.budget") == "rejected"
    )
    assert outcome(dict(rec), {"type": "length"}, 8, 8)["status"] == "ok"
    assert outcome(dict(rec), "length", 7, 8)["status"] == "error"
    # SGLang fits an opted-out request's reply to the pool; an evicting one gets every token.
    clipped = outcome({**rec, "evict": "none"}, "length", 7, 8)
    assert clipped["status"] == "clipped" and expected(clipped)
    assert outcome({**rec, "evict": "h2o"}, "length", 7, 8)["status"] == "error"


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
    assert expected({"kind": "abort", "status": "aborted"}) and expected(
        {"kind": "abort", "status": "ok"}
    )
    assert expected({"kind": "invalid", "status": "rejected"})
    assert not expected({"kind": "invalid", "status": "ok"})  # a bad kv_evict must be refused
    assert not expected({"kind": "session", "status": "error"})


def test_prompts_longer_than_the_pool_expect_an_answer_only_where_the_server_evicts_in_prefill():
    """`over_pool` requests are sent only when the spec has their lengths; each expects an answer
    on a server with prefill_chunk and HTTP 400 on one without, whatever else it says."""
    assert "over_pool" not in kinds(SPEC)
    for served, want in ((True, "ok"), (False, "rejected")):
        spec = TrafficSpec(over_pool=(3000, 6000), over_pool_served=served, timeout=5)
        assert "over_pool" in kinds(spec)
        (rec,) = play("over_pool", "http://127.0.0.1:9", random.Random(0), spec, "r")
        assert 3000 <= rec["prompt_tokens"] <= 6000 and rec["kv_evict"] is None
        assert expected({**rec, "status": want})
        assert not expected({**rec, "status": "rejected" if served else "ok"})
        assert not expected({**rec, "status": "error"})


def test_the_longest_gap_counts_the_load_before_the_first_and_after_the_last_completion():
    recs = [{"done_s": d} for d in (5.0, 20.0, 21.0, 90.0)] + [{"kind": "no time"}]
    assert longest_gap(recs, 100.0) == 69.0
    assert longest_gap(recs[:1], 100.0) == 95.0  # nothing completed after 5 s
    assert longest_gap([], 30.0) == 30.0


def test_tally_and_verdict():
    recs = [
        {"kind": "generate", "status": "ok", "evict": "random"},
        {"kind": "abort", "status": "aborted", "evict": "none"},
        {"kind": "invalid", "status": "ok", "evict": "server"},
    ]
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
