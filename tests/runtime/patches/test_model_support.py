"""Models and pools eviction cannot serve: refused at start-up (exit 2, before weights load) or per
request (HTTP 400) with the reason; a server without eviction reads nothing of them."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from sgl_vtoken.config import ENV_VAR, EvictConfig

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)


def _config(kind: str):
    import transformers as T

    if kind == "mla":
        return T.DeepseekV2Config(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=512,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
        ), "DeepseekV2ForCausalLM"
    if kind == "hybrid-swa":
        return T.GptOssConfig(**SMALL, head_dim=16, num_local_experts=4), "GptOssForCausalLM"
    if kind == "sliding":
        return T.Gemma3TextConfig(**SMALL, head_dim=16), "Gemma3ForCausalLM"
    if kind == "mamba":
        return T.Qwen3NextConfig(**SMALL, head_dim=16), "Qwen3NextForCausalLM"
    if kind == "mrope":
        text = dict(**SMALL, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
        return T.Qwen2VLConfig(text_config=text), "Qwen2VLForConditionalGeneration"
    if kind == "qwen2":  # carries sliding_window but does not use it: supported
        return T.Qwen2Config(**SMALL), "Qwen2ForCausalLM"
    raise ValueError(kind)


REASONS = {
    "mla": "uses multi-head latent attention (MLA)",
    "hybrid-swa": "is a hybrid sliding-window model",
    "sliding": "has sliding_attention layers",
    "mamba": "is a hybrid Mamba / linear-attention model",
    "mrope": "uses multimodal rotary positions (M-RoPE)",
}


@pytest.fixture(scope="module")
def fake_model(tmp_path_factory):
    """`fake_model(kind)` -> folder with only a config.json of that architecture."""

    def make(kind):
        path = tmp_path_factory.getbasetemp() / f"fake-{kind}"
        if not path.exists():
            cfg, arch = _config(kind)
            cfg.architectures = [arch]
            cfg.save_pretrained(path)
        return path

    return make


def _model_config(path):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    return ModelConfig.from_server_args(ServerArgs(model_path=str(path), device="cpu"))


@pytest.mark.parametrize("kind", [*REASONS, "qwen2"])
def test_unsupported_models_are_named(fake_model, kind):
    from sgl_vtoken.patches.core.model_support import unsupported_model_reason

    reason = unsupported_model_reason(_model_config(fake_model(kind)))
    assert (REASONS[kind] in reason) if kind in REASONS else reason == ""


def test_tiny_model_is_supported(tiny_model):
    from sgl_vtoken.patches.core.model_support import unsupported_model_reason

    assert unsupported_model_reason(_model_config(tiny_model)) == ""


def test_a_server_policy_on_an_unsupported_model_exits_2_before_weights_load(fake_model):
    """The real launcher: exit 2 naming the model and the reason; no weights are read. (One
    kind: every reason takes the same path, `test_unsupported_models_are_named` covers them.)"""
    kind = "mla"
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(fake_model(kind)),
            "--device",
            "cpu",
            "--kv-evict",
            "streamingllm",
            "--kv-budget",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        f"argument --kv-evict: streamingllm cannot serve --model-path '{fake_model(kind)}'"
        in proc.stderr
    )
    assert REASONS[kind] in proc.stderr
    assert "Load weight" not in proc.stdout + proc.stderr


class _Untouchable:
    """A KV pool that fails on any attribute read: proves a code path never looks inside."""

    def __getattr__(self, name):
        raise AssertionError(f"the plugin read pool.{name} on a server that does not evict")


class _MLAPool:
    """The shape of SGLang's MLA pool: one latent buffer per layer, no k_buffer/v_buffer."""

    def __init__(self):
        self.kv_buffer = [torch.zeros(8, 1, 24) for _ in range(2)]


def _fake_scheduler(pool, total=4096):
    allocator = SimpleNamespace(get_kvcache=lambda: pool)
    return SimpleNamespace(
        token_to_kv_pool_allocator=allocator,
        tree_cache=object(),
        max_total_num_tokens=total,
        model_config=SimpleNamespace(context_len=8192),
        metrics_reporter=None,
    )


@pytest.fixture
def server_policy(monkeypatch):
    """Set this process's server settings (as the launcher publishes them) for one test."""
    from sgl_vtoken.patches.core import contract
    from sgl_vtoken.patches.surface.server_args import server_config

    def use(cfg: EvictConfig):
        monkeypatch.setenv(ENV_VAR, cfg.to_json())
        server_config.cache_clear()
        monkeypatch.setattr(contract, "check_hooks_applied", lambda: [])  # as in a served process

    yield use
    server_config.cache_clear()


@pytest.mark.parametrize("pool", [_Untouchable(), _MLAPool()], ids=["untouchable", "mla"])
def test_scheduler_start_reads_no_pool_without_a_policy(server_policy, pool):
    from sgl_vtoken.patches import runtime

    server_policy(EvictConfig())
    scheduler = _fake_scheduler(pool)
    runtime.after_scheduler_init(None, scheduler)
    assert scheduler.vtoken.counters.bytes_per_token == 0  # sized at the first eviction, if any


def test_scheduler_start_refuses_an_mla_pool_with_a_policy(server_policy):
    from sgl_vtoken.patches import runtime

    server_policy(EvictConfig(policy="streamingllm", budget=64))
    with pytest.raises(
        ValueError, match="--kv-evict streamingllm: the KV pool _MLAPool has no per-layer"
    ):
        runtime.after_scheduler_init(None, _fake_scheduler(_MLAPool()))


def test_scheduler_start_refuses_a_pool_smaller_than_one_request(server_policy):
    from sgl_vtoken.patches import runtime

    pool = SimpleNamespace(k_buffer=[torch.zeros(8, 2, 4)], v_buffer=[torch.zeros(8, 2, 4)])
    server_policy(EvictConfig(policy="streamingllm", budget=64, interval=16))
    with pytest.raises(
        ValueError,
        match="budget \\+ interval \\+ page_size = 81 KV tokens, more than the pool's 80",
    ):
        runtime.after_scheduler_init(None, _fake_scheduler(pool, total=80))


def _manager(model_config, context_len=None):
    """A tokenizer manager of a CPU server whose hooks are in place (`refusals` says nothing)."""
    return SimpleNamespace(
        model_config=model_config,
        context_len=context_len or model_config.context_len,
        server_args=SimpleNamespace(device="cpu"),
    )


def _request(kv_evict):
    return SimpleNamespace(sampling_params={"custom_params": {"kv_evict": kv_evict}})


def test_per_request_eviction_on_an_unsupported_model_is_refused(server_policy, fake_model):
    """The tokenizer's check (HTTP 400): eviction is not available for this model, named."""
    from sgl_vtoken.patches.surface.request_options import before_create_tokenized_object

    server_policy(EvictConfig())
    manager = _manager(_model_config(fake_model("mla")))
    with pytest.raises(
        ValueError,
        match="kv_evict.policy: eviction is not available for this model: "
        "DeepseekV2ForCausalLM uses multi-head latent attention",
    ):
        before_create_tokenized_object(manager, _request({"policy": "streamingllm", "budget": 64}))
    before_create_tokenized_object(manager, _request({"policy": "none"}))  # opting out is fine


def test_per_request_budget_over_the_context_is_refused(server_policy, tiny_model):
    from sgl_vtoken.patches.surface.request_options import before_create_tokenized_object

    server_policy(EvictConfig())
    manager = _manager(_model_config(tiny_model), context_len=512)
    with pytest.raises(
        ValueError, match="kv_evict.budget: must be <= the model's context length 512 \\(got 600\\)"
    ):
        before_create_tokenized_object(manager, _request({"policy": "random", "budget": 600}))
    before_create_tokenized_object(manager, _request({"policy": "random", "budget": 512}))


def test_per_request_span_without_the_tokenizer_is_refused(server_policy, tiny_model):
    """A server started with --skip-tokenizer-init has no words: a request whose policy keeps
    spans (h2o's default) gets HTTP 400 naming kv_evict.span; `"span": 0` is served."""
    from sgl_vtoken.patches.surface.request_options import before_create_tokenized_object

    server_policy(EvictConfig())
    manager = _manager(_model_config(tiny_model))
    manager.server_args.skip_tokenizer_init = True
    with pytest.raises(ValueError, match="kv_evict.span: span 8 .*--skip-tokenizer-init"):
        before_create_tokenized_object(manager, _request({"policy": "h2o", "budget": 64}))
    before_create_tokenized_object(manager, _request({"policy": "h2o", "budget": 64, "span": 0}))
    before_create_tokenized_object(manager, _request({"policy": "streamingllm", "budget": 64}))
