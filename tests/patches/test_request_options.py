"""Per-request `kv_evict`: the server's flags as its defaults, every field type-checked before any
arithmetic, and a server that cannot evict refusing it naming why (HTTP 400 at the tokenizer)."""

import pytest

from sgl_vtoken.config import EvictConfig


def test_a_server_that_cannot_evict_refuses_per_request_eviction_naming_why(monkeypatch):
    """The tokenizer manager asks `refusal` of its own server args: the SGLang setting eviction
    cannot run with, or hooks that failed to apply; `resolve` then refuses the request (HTTP 400)
    naming it. Decode CUDA graphs are not one of them."""
    from types import SimpleNamespace

    from sgl_vtoken.patches.core import contract
    from sgl_vtoken.patches.surface.request_options import resolve
    from sgl_vtoken.patches.surface.server_args import KV_EVICT_CHOICES, refusal

    monkeypatch.setattr(contract, "check_hooks_applied", lambda: [])
    assert refusal(SimpleNamespace(device="cpu")) == ""
    mixed = refusal(SimpleNamespace(device="cpu", enable_mixed_chunk=True))
    assert mixed == (
        "the server runs with --enable-mixed-chunk (mixed batches bypass the eviction hook)"
    )
    with pytest.raises(
        ValueError,
        match="kv_evict.policy: eviction is not available on this server: the server runs with --enable-mixed-chunk",
    ):
        resolve(EvictConfig(), {"policy": "streamingllm", "budget": 64}, KV_EVICT_CHOICES, mixed)
    assert not resolve(EvictConfig(), {"policy": "none"}, KV_EVICT_CHOICES, mixed).enabled
    # decode CUDA graphs on (a GPU server's default) refuse no policy: the scoring is captured
    graphs = refusal(SimpleNamespace(device="cuda"))
    assert graphs == ""
    assert resolve(EvictConfig(), {"policy": "h2o", "budget": 64}, KV_EVICT_CHOICES, graphs).enabled
    monkeypatch.setattr(contract, "check_hooks_applied", lambda: ["a.b.c"])
    assert refusal(SimpleNamespace(device="cpu")) == "hooks not in place: a.b.c"


def test_flags_are_per_request_defaults_without_a_policy(parse):
    """On a `--kv-evict none` server the other flags are what per-request `kv_evict` starts from."""
    from sgl_vtoken.patches.surface.request_options import resolve
    from sgl_vtoken.patches.surface.server_args import KV_EVICT_CHOICES

    parse(
        "--kv-budget",
        "96",
        "--kv-evict-interval",
        "16",
        "--kv-reclaim",
        "naive",
        "--page-size",
        "16",
    )
    server = EvictConfig.from_env()
    assert not server.enabled
    cfg = resolve(server, {"policy": "random"}, KV_EVICT_CHOICES)
    assert (cfg.budget, cfg.interval, cfg.reclaim, cfg.page_size) == (96, 16, "naive", 16)
    assert resolve(server, {"policy": "random", "budget": 64}, KV_EVICT_CHOICES).budget == 64


@pytest.mark.parametrize(
    "server",
    [
        dict(policy="streamingllm", budget=64, page_size=16, interval=16, prefill_chunk=64),
        dict(policy="streamingllm", budget=64, page_size=16, interval=16, host_tokens=4096),
        dict(policy="streamingllm", budget=64, page_size=1),
    ],
    ids=["prefill_chunk", "host_store", "plain"],
)
@pytest.mark.parametrize("field", ["budget", "sink", "window", "interval", "recall"])
@pytest.mark.parametrize("value", ["many", 1.5, True, [64]])
def test_every_request_field_is_type_checked_before_arithmetic(server, field, value):
    """A wrong type in any numeric `kv_evict` field is a ValueError naming the field (HTTP 400),
    never a TypeError from arithmetic on it (HTTP 500), on every kind of server."""
    from sgl_vtoken.patches.surface.request_options import resolve
    from sgl_vtoken.patches.surface.server_args import KV_EVICT_CHOICES

    obj = {"offload": True, field: value} if field == "recall" else {field: value}
    with pytest.raises(ValueError, match=rf"kv_evict\.(offload|{field}) "):
        resolve(EvictConfig.from_dict(server), obj, KV_EVICT_CHOICES)
