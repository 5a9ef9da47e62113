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


# The README's chat command: a server recall that fits its budget 256 but not a lower one.
CHAT_FLAGS = (
    "--kv-evict",
    "h2o",
    "--kv-budget",
    "256",
    "--kv-sink",
    "16",
    "--kv-window",
    "32",
    "--kv-evict-interval",
    "16",
    "--kv-evict-config",
    '{"host_tokens": 1048576, "offload": true, "recall": 192}',
)


def test_an_inherited_recall_is_cut_to_what_the_request_budget_leaves(parse):
    """A request that lowers only its budget keeps the server's offload, with the most recall its
    budget, sinks and window leave (128 - 16 - 32 - 1 = 79), not an HTTP 400 about a `recall` it
    never sent; the scheduler, which builds the same config unvalidated, gets the same one."""
    from types import SimpleNamespace

    from sgl_vtoken.patches.surface.request_options import request_config, resolve
    from sgl_vtoken.patches.surface.server_args import KV_EVICT_CHOICES

    parse(*CHAT_FLAGS)
    server = EvictConfig.from_env()
    assert (server.budget, server.host.offload, server.host.recall) == (256, True, 192)
    obj = {"policy": "random", "budget": 128}
    cfg = resolve(server, obj, KV_EVICT_CHOICES)
    assert (cfg.policy, cfg.budget, cfg.host.offload, cfg.host.recall) == ("random", 128, True, 79)
    assert request_config(server, SimpleNamespace(custom_params={"kv_evict": obj})) == cfg
    # a recall that still fits is the server's; without offload the request recalls nothing
    assert resolve(server, {"budget": 250}, KV_EVICT_CHOICES).host.recall == 192
    assert resolve(server, {"window": 64}, KV_EVICT_CHOICES).host.recall == 256 - 16 - 64 - 1
    off = resolve(server, {"offload": False}, KV_EVICT_CHOICES)
    assert (off.host.offload, off.host.recall) == (False, 0)
    # a budget that leaves nothing past the sinks and window still recalls nothing, not below 0
    assert resolve(server, {"budget": 49}, KV_EVICT_CHOICES).host.recall == 0


def test_a_recall_the_request_sends_that_does_not_fit_is_refused_naming_what_fits(parse):
    """The request's own recall is not cut: HTTP 400 naming `kv_evict.recall` and the largest
    recall its budget, sinks and window leave; a budget with no room for the sinks and window
    fails on the budget, as before."""
    from sgl_vtoken.patches.surface.request_options import resolve
    from sgl_vtoken.patches.surface.server_args import KV_EVICT_CHOICES

    parse(*CHAT_FLAGS)
    server = EvictConfig.from_env()
    with pytest.raises(ValueError, match=r"^kv_evict\.recall must leave room.*is 79$"):
        resolve(server, {"budget": 128, "recall": 100}, KV_EVICT_CHOICES)
    assert resolve(server, {"budget": 128, "recall": 79}, KV_EVICT_CHOICES).host.recall == 79
    with pytest.raises(ValueError, match=r"^kv_evict\.budget must be >= 49 .*\(got 40\)"):
        resolve(server, {"policy": "random", "budget": 40}, KV_EVICT_CHOICES)


def test_an_interval_that_breaks_the_server_prefill_chunk_is_refused_naming_interval():
    """`prefill_chunk` is the server's (no request field): a request interval at or above it is
    refused naming `kv_evict.interval` and the most that fits."""
    from sgl_vtoken.patches.surface.request_options import resolve
    from sgl_vtoken.patches.surface.server_args import KV_EVICT_CHOICES

    server = EvictConfig.from_dict(
        dict(policy="streamingllm", budget=64, page_size=16, interval=16, prefill_chunk=64)
    )
    assert resolve(server, {"interval": 63}, KV_EVICT_CHOICES).interval == 63
    with pytest.raises(
        ValueError,
        match=r"^kv_evict\.interval must be < this server's prefill_chunk 64, at most 63 "
        r"\(got 64\)$",
    ):
        resolve(server, {"interval": 64}, KV_EVICT_CHOICES)
