"""Per-request `kv_evict`: the server's flags as its defaults, every field type-checked before any
arithmetic, and a server that cannot evict refusing it naming why (HTTP 400 at the tokenizer)."""

import pytest

from sgl_vtoken.config import EvictConfig


def test_a_server_that_cannot_evict_refuses_per_request_eviction_naming_why(monkeypatch):
    """The tokenizer manager asks `refusals` of its own server args: the SGLang setting eviction
    cannot run with, hooks that failed to apply, or (GPU) decode CUDA graphs for attention
    policies; `resolve` then refuses the request (HTTP 400) naming it."""
    from types import SimpleNamespace

    from sgl_vtoken.patches.core import contract
    from sgl_vtoken.patches.surface import server_args
    from sgl_vtoken.patches.surface.request_options import resolve
    from sgl_vtoken.patches.surface.server_args import KV_EVICT_CHOICES, refusals

    monkeypatch.setattr(contract, "check_hooks_applied", lambda: [])
    assert refusals(SimpleNamespace(device="cpu")) == ("", "")
    mixed = refusals(SimpleNamespace(device="cpu", enable_mixed_chunk=True))
    assert mixed == (
        "the server runs with --enable-mixed-chunk (mixed batches bypass the eviction hook)",
        "",
    )
    with pytest.raises(
        ValueError,
        match="kv_evict.policy: eviction is not available on this server: the server runs with --enable-mixed-chunk",
    ):
        resolve(EvictConfig(), {"policy": "streamingllm", "budget": 64}, KV_EVICT_CHOICES, mixed)
    assert not resolve(EvictConfig(), {"policy": "none"}, KV_EVICT_CHOICES, mixed).enabled
    monkeypatch.setattr(server_args, "_has_cuda", lambda: True)
    graphs = refusals(SimpleNamespace(device="cuda"))
    assert graphs[0] == "" and "decode CUDA graphs off" in graphs[1]
    with pytest.raises(
        ValueError,
        match="kv_evict.policy: h2o is not available on this server: needs decode CUDA graphs off",
    ):
        resolve(EvictConfig(), {"policy": "h2o", "budget": 64}, KV_EVICT_CHOICES, graphs)
    assert resolve(
        EvictConfig(), {"policy": "streamingllm", "budget": 64}, KV_EVICT_CHOICES, graphs
    ).enabled
    monkeypatch.setattr(contract, "check_hooks_applied", lambda: ["a.b.c"])
    assert refusals(SimpleNamespace(device="cpu"))[0] == "hooks not in place: a.b.c"


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
