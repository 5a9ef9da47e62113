"""Which models and pools eviction can serve, decided from the model config before weights load.

Eviction compacts rows of a plain per-layer K/V pool (`MHATokenToKVPool`) and keeps RoPE
positions per token: MLA, sliding-window or chunked layers, hybrid Mamba / linear attention,
M-RoPE and encoder-decoder models are refused, with the reason (docs/design/splice.md, "Model
support"). The launcher checks the served model when a server policy is set (exit 2); a
`--kv-evict none` server checks only when a request asks for eviction (HTTP 400). `peak_problem`:
when an evicting request's peak does not fit the pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs
    from transformers import PretrainedConfig

    from sgl_vtoken.config import EvictConfig

    from .sglang_types import KVPool


def unsupported_model_reason(model_config: ModelConfig) -> str:
    """Why eviction cannot serve the model of SGLang's `ModelConfig` ("" when it can)."""
    from sglang.srt.configs.model_config import AttentionArch, is_encoder_decoder_model
    from sglang.srt.mem_cache.kv_cache_builder import uses_ssm_state

    archs = list(getattr(model_config.hf_config, "architectures", None) or [])
    name = archs[0] if archs else getattr(model_config.hf_config, "model_type", "this model")
    if model_config.attention_arch == AttentionArch.MLA:
        return f"{name} uses multi-head latent attention (MLA), whose KV pool has no per-head K/V"
    if model_config.attention_arch == AttentionArch.SSM or uses_ssm_state(model_config):
        return (
            f"{name} is a hybrid Mamba / linear-attention model "
            "(its recurrent state cannot be evicted)"
        )
    if getattr(model_config, "is_hybrid_swa", False):
        return f"{name} is a hybrid sliding-window model"
    sliding = _non_full_layers(model_config.hf_text_config)
    if sliding:
        return (
            f"{name} has {sliding} layers (a window counted in row entries changes under eviction)"
        )
    if getattr(model_config, "model_is_mrope", False):
        return f"{name} uses multimodal rotary positions (M-RoPE)"
    if is_encoder_decoder_model(archs):
        return f"{name} is an encoder-decoder model"
    if not getattr(model_config, "is_generation", True):
        return f"{name} is not a generation model (nothing is decoded)"
    return ""


def _non_full_layers(text_config: PretrainedConfig) -> str:
    """Names of the attention types other than full attention ("" if every layer is full)."""
    types = getattr(text_config, "layer_types", None)
    if types:
        return "/".join(sorted(set(types) - {"full_attention"}))
    if getattr(text_config, "attention_chunk_size", None):
        return "chunked_attention"
    window = getattr(text_config, "sliding_window", None)
    if window is not None and getattr(text_config, "use_sliding_window", True) is not False:
        return f"sliding_attention (window {window})"
    return ""


def server_model_config(server_args: ServerArgs) -> ModelConfig:
    """SGLang's `ModelConfig` of the served model (reads its config only, no weights)."""
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig.from_server_args(server_args)


def unsupported_pool_reason(pool: object) -> str:
    """Why eviction cannot compact rows of this KV pool ("" when it can)."""
    k, v = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
    if (
        not isinstance(k, (list, tuple))
        or not isinstance(v, (list, tuple))
        or len(k) != len(v)
        or not k
    ):
        return (
            f"the KV pool {type(pool).__name__} has no per-layer k_buffer/v_buffer lists "
            "(eviction compacts MHATokenToKVPool rows)"
        )
    return ""


def kv_bytes_per_token(pool: KVPool) -> int:
    """Bytes of K and V of one token over every layer of a per-layer K/V pool."""
    return sum(b[0].numel() * b.element_size() for b in (*pool.k_buffer, *pool.v_buffer))


def peak_problem(
    cfg: EvictConfig, pool_tokens: int, budget_name: str = "argument --kv-budget"
) -> str:
    """Why one evicting request under `cfg` (an `EvictConfig`) cannot fit a pool of `pool_tokens`
    ("" when it can): while it decodes it holds up to `cfg.decode_peak` KV tokens. The launcher,
    the scheduler's start and each request with its own settings ask this one rule."""
    if cfg.decode_peak <= pool_tokens:
        return ""
    return (
        f"{budget_name} {cfg.budget}: an evicting request holds up to budget + interval + "
        f"page_size = {cfg.decode_peak} KV tokens, more than the pool's {pool_tokens}"
    )
