"""EvictConfig: validation names the field and range; JSON round-trip is exact."""

import dataclasses
import json

import pytest

from sgl_vtoken.config import ENV_VAR, EvictConfig, HostTier, Prefill, Scoring, policy_from_config
from sgl_vtoken.policies import make_policy


def test_disabled_default_needs_no_budget():
    cfg = EvictConfig()
    assert not cfg.enabled and cfg.budget is None
    assert not cfg.should_evict(10**9)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(
            policy="h2o",
            budget=64,
            sink=4,
            window=16,
            interval=8,
            page_size=16,
            seed=7,
            aggregation="max",
            params={},
            reclaim="naive",
        ),
        dict(policy="scissorhands", budget=100, params={"history": 16, "threshold": 0.5}),
        dict(policy="none"),
    ],
)
def test_json_round_trip(kwargs):
    cfg = EvictConfig.from_dict(kwargs)
    text = cfg.to_json()
    assert json.loads(text)["policy"] == kwargs["policy"]
    back = EvictConfig.from_json(text)
    assert back == cfg and back.to_dict() == cfg.to_dict()


def test_from_env(monkeypatch):
    cfg = EvictConfig(policy="random", budget=32, seed=3)
    monkeypatch.setenv(ENV_VAR, cfg.to_json())
    assert EvictConfig.from_env() == cfg
    monkeypatch.delenv(ENV_VAR)
    assert EvictConfig.from_env() == EvictConfig()


def test_budget_floor_counts_sink_pages_window_and_one_page():
    # sink 4 rounds up to one page of 16; floor = 16 + 8 + 16 = 40
    assert EvictConfig(policy="streamingllm", budget=40, window=8, page_size=16).sink_tokens == 16
    with pytest.raises(ValueError, match=r"budget must be >= 40 .*16 \+ 8 \+ 16.*got 39"):
        EvictConfig(policy="streamingllm", budget=39, window=8, page_size=16)


def test_budget_required_when_enabled():
    with pytest.raises(ValueError, match="EvictConfig.budget is required"):
        EvictConfig(policy="h2o")


@pytest.mark.parametrize(
    "field,value,match",
    [
        (
            "policy",
            "lru",
            r"EvictConfig.policy must be one of \['none', 'h2o', 'knorm', 'random', "
            r"'scissorhands', 'streamingllm', 'tova'\]",
        ),
        ("reclaim", "eager", r"EvictConfig.reclaim must be one of \['vtoken', 'naive'\]"),
        ("aggregation", "mean", r"EvictConfig.aggregation must be one of \['sum', 'max'\] or null"),
        (
            "score_layers",
            "lower",
            r"EvictConfig.score_layers must be \"upper\", \"all\" \(or null\) or a non-empty",
        ),
        ("score_layers", [], r"EvictConfig.score_layers must be"),
        ("interval", 0, r"EvictConfig.interval must be >= 1"),
        ("page_size", 0, r"EvictConfig.page_size must be >= 1"),
        ("sink", -1, r"EvictConfig.sink must be >= 0"),
        ("window", 1.5, r"EvictConfig.window must be an integer"),
        ("seed", 2**32, r"EvictConfig.seed must be in \[0, 4294967295\]"),
        ("prefill_chunk", 0, r"EvictConfig.prefill_chunk must be >= 1"),
        (
            "prefill_chunk",
            1,
            r"EvictConfig.prefill_chunk must be a multiple of page_size 1 and > interval 1",
        ),
    ],
)
def test_errors_name_field_and_allowed_values(field, value, match):
    kwargs = dict(policy="scissorhands", budget=64)
    kwargs[field] = value
    with pytest.raises(ValueError, match=match):
        EvictConfig.from_dict(kwargs)


@pytest.mark.parametrize(
    "params,match",
    [
        ({"history": 99}, r"EvictConfig.params .* history must be an integer in \[1, 62\]"),
        ({"nope": 1}, r"EvictConfig.params .*unexpected keyword argument 'nope'"),
    ],
)
def test_params_are_checked_by_building_the_policy(params, match):
    cfg = EvictConfig(policy="scissorhands", budget=64, params=params)  # fields only
    with pytest.raises(ValueError, match=match):
        policy_from_config(cfg)


def test_groups_hold_the_flat_keys():
    flat = {
        "policy": "h2o",
        "budget": 64,
        "aggregation": "max",
        "obs_window": 8,
        "score_layers": [3, 1],
        "reuse_history": False,
        "prefill_chunk": 32,
        "recall_rounds": 3,
    }
    cfg = EvictConfig.from_dict(flat)
    assert cfg.scoring == Scoring(aggregation="max", obs_window=8, score_layers=(1, 3))
    assert (
        cfg.prefill == Prefill(chunk=32)
        and cfg.history.reuse is False
        and cfg.host == HostTier(rounds=3)
    )
    assert {k: cfg.to_dict()[k] for k in flat} == {**flat, "score_layers": [1, 3]}
    assert (
        EvictConfig.from_dict(
            {"policy": "h2o", "budget": 64, "prefill": {"chunk": 32}}
        ).prefill.chunk
        == 32
    )
    assert (
        EvictConfig.from_dict(
            {"policy": "h2o", "budget": 64, "host": HostTier(rounds=3)}
        ).host.rounds
        == 3
    )
    # the radix namespace of stored histories reads the groups as it read the flat fields
    assert cfg.history_namespace() == (
        "vtoken:h2o:b64:s4:w0:i1:p1:seed0:max:o8:l(1, 3):u8:c32:off0:r0:rr3:{}"
    )


def test_span_defaults_to_8_for_attention_policies_and_0_for_the_others():
    """`span` null: the attention policies keep words and digit runs of up to 8 tokens whole (the
    tuning split's choice); an explicit span, 0 included, wins for every policy."""
    for policy in ("h2o", "tova", "scissorhands"):
        cfg = EvictConfig(policy=policy, budget=64)
        assert cfg.span == 8 and make_policy(policy, **cfg.policy_kwargs()).span == 8
        assert EvictConfig(policy=policy, budget=64, scoring=Scoring(span=0)).span == 0
    for policy in ("streamingllm", "random", "knorm"):
        assert EvictConfig(policy=policy, budget=64).span == 0
        assert EvictConfig(policy=policy, budget=64, scoring=Scoring(span=4)).span == 4
    assert EvictConfig().span == 0  # eviction off
    assert EvictConfig.from_dict({"policy": "h2o", "budget": 64, "span": 0}).span == 0
    assert EvictConfig.from_dict({"policy": "h2o", "budget": 64, "span": None}).span == 8
    with pytest.raises(ValueError, match="EvictConfig.span must be an integer"):
        Scoring(span="8")


def test_scoring_defaults_resolve_against_the_model():
    """Default scoring: the upper half of the served model's layers, the policy's aggregation."""
    cfg = EvictConfig(policy="h2o", budget=64)
    assert cfg.scoring.score_layers == "upper" and cfg.scoring.aggregation is None
    assert cfg.scoring.layer_ids(30) == tuple(range(15, 30))
    assert cfg.scoring.layer_ids(3) == (1, 2) and cfg.scoring.layer_ids(1) == (0,)
    assert "aggregation" not in cfg.policy_kwargs() and policy_from_config(cfg).aggregation == "max"
    assert policy_from_config(EvictConfig(policy="tova", budget=64)).aggregation == "sum"
    assert (
        policy_from_config(
            EvictConfig.from_dict({"policy": "h2o", "budget": 64, "aggregation": "sum"})
        ).aggregation
        == "sum"
    )
    every = EvictConfig.from_dict({"policy": "h2o", "budget": 64, "score_layers": "all"})
    assert every.scoring.score_layers is None and every.scoring.layer_ids(30) is None
    assert Scoring(score_layers=[4, 2]).layer_ids(30) == (2, 4)
    # a rule survives the trip through the environment, and so does "all" (as null)
    for c in (cfg, every):
        assert EvictConfig.from_json(c.to_json()) == c
    assert cfg.to_dict()["score_layers"] == "upper" and every.to_dict()["score_layers"] is None


def test_from_dict_rejects_unknown_keys_listing_fields():
    with pytest.raises(ValueError, match=r"no field\(s\) \['kv_budget'\]; allowed: \['policy'"):
        EvictConfig.from_dict({"kv_budget": 3})
    # settings the server never honoured are unknown fields, not silently accepted ones
    for name, value in (
        ("frag_threshold", 0.25),
        ("free_watermark", 0.1),
        ("recall_pool", 5),  # a setting until the recall rule's pooling became fixed (recall.POOL)
    ):
        with pytest.raises(
            ValueError,
            match=rf"no field\(s\) \['{name}'\]; allowed: \[.*'reuse_history', 'prefill_chunk', 'offload', 'host_tokens', 'recall', 'recall_rounds'\]",
        ):
            EvictConfig.from_dict({"policy": "none", name: value})
    # `trigger` is a setting: a value it does not know is refused with the allowed ones
    with pytest.raises(ValueError, match=r"trigger must be one of \['budget', 'pressure'\]"):
        EvictConfig.from_dict({"policy": "none", "trigger": "fragmentation"})
    with pytest.raises(ValueError, match="malformed"):
        EvictConfig.from_json("{policy:")


def test_interval_hysteresis():
    cfg = EvictConfig(policy="streamingllm", budget=10, interval=3)
    assert [cfg.should_evict(n) for n in (10, 12, 13, 20)] == [False, False, True, True]
    every_step = EvictConfig(policy="streamingllm", budget=10, interval=1)
    assert [every_step.should_evict(n) for n in (10, 11)] == [False, True]
    assert cfg.decode_peak == 10 + 3 + 1
    assert (
        EvictConfig(policy="streamingllm", budget=64, interval=16, page_size=16).decode_peak == 96
    )


def test_policy_kwargs_pass_seed_only_to_seeded_policies():
    assert EvictConfig(policy="random", budget=9, seed=5).policy_kwargs()["seed"] == 5
    assert "seed" not in EvictConfig(policy="h2o", budget=9, seed=5).policy_kwargs()


def test_config_is_frozen_and_params_immutable():
    cfg = EvictConfig(policy="scissorhands", budget=64, params={"history": 8})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.budget = 3
    with pytest.raises(TypeError):
        cfg.params["history"] = 9


def test_history_namespace_names_every_setting_that_changes_the_kv():
    base = EvictConfig(policy="streamingllm", budget=64)
    others = [
        EvictConfig(policy="random", budget=64),
        EvictConfig(policy="streamingllm", budget=65),
        EvictConfig(policy="streamingllm", budget=64, sink=8),
        EvictConfig(policy="streamingllm", budget=64, window=4),
        EvictConfig(policy="streamingllm", budget=64, interval=2),
        EvictConfig(policy="streamingllm", budget=64, prefill=Prefill(chunk=32)),
    ]
    assert len({base.history_namespace(), *(c.history_namespace() for c in others)}) == 7
    assert (
        base.history_namespace()
        == EvictConfig(policy="streamingllm", budget=64).history_namespace()
    )
    with pytest.raises(ValueError, match="reuse_history must be true or false"):
        EvictConfig.from_dict(dict(policy="streamingllm", budget=64, reuse_history="yes"))


def test_prefill_chunk_ends_chunks_on_whole_pages():
    cfg = EvictConfig.from_dict(
        dict(policy="streamingllm", budget=64, page_size=16, interval=16, prefill_chunk=32)
    )
    assert (
        cfg.prefill_peak == 96
        and EvictConfig(policy="streamingllm", budget=64).prefill_peak is None
    )
    with pytest.raises(
        ValueError,
        match=r"prefill_chunk must be a multiple of page_size 16 and > interval 1 \(got 24\)",
    ):
        EvictConfig.from_dict(
            dict(policy="streamingllm", budget=64, page_size=16, prefill_chunk=24)
        )
    with pytest.raises(
        ValueError,
        match=r"prefill_chunk must be a multiple of page_size 16 and > interval 16 \(got 16\)",
    ):
        EvictConfig.from_dict(
            dict(policy="streamingllm", budget=64, page_size=16, interval=16, prefill_chunk=16)
        )
    with pytest.raises(
        ValueError, match=r"budget must be a multiple of page_size 16 with prefill_chunk \(got 72\)"
    ):
        EvictConfig.from_dict(
            dict(policy="streamingllm", budget=72, page_size=16, prefill_chunk=32)
        )


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(recall=8), "recall 8 needs offload"),
        (dict(offload=True), "offload needs host_tokens >= 1"),
        (
            dict(offload=True, host_tokens=100, page_size=16, budget=64, reclaim="naive"),
            "offload needs reclaim 'vtoken'",
        ),
        (dict(offload=True, host_tokens=100, recall=61), "recall must leave room in the budget"),
        (dict(offload="yes", host_tokens=100), "offload must be true or false"),
        (
            dict(offload=True, host_tokens=100, recall=8, recall_rounds=0),
            "recall_rounds must be >= 1",
        ),
        (
            dict(offload=True, host_tokens=100, recall=8, recall_rounds=1.5),
            "recall_rounds must be an integer",
        ),
    ],
)
def test_offload_settings_are_validated_naming_the_field(kwargs, needle):
    base = dict(policy="streamingllm", budget=64, sink=4)
    with pytest.raises(ValueError, match=needle):
        EvictConfig.from_dict({**base, **kwargs})
