"""Per-request eviction settings: a `kv_evict` object overriding the server's policy, budget,
sinks, window, interval, offload or recall for one request (`{"policy": "none"}` opts out;
offload needs a server started with a host store, `host_tokens`).

It travels in SGLang's own per-request `custom_params` (SGLang rejects unknown sampling keys):
    /generate            "sampling_params": {"custom_params": {"kv_evict": {...}}}
    /v1/chat/completions, /v1/completions
                         extra body {"custom_params": {"kv_evict": {...}}}
The tokenizer process validates it once (invalid values: HTTP 400 naming the field), policy
parameters included; the scheduler only builds its config in `Req.__init__`.

A field the request does not send is the server's, fitted to what the request did send: the
server's `recall` becomes the most that fits the request's budget, sinks and window
(``budget - sink_tokens - window - 1``; 0 without offload). A value the request sent that does
not fit is refused naming it and what would fit.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from sgl_vtoken.config import EvictConfig, policy_from_config, setting_keys

from ..core.model_support import unsupported_model_reason
from .server_args import (
    KV_EVICT_CHOICES,
    SPAN_NEEDS_TOKENIZER,
    refusal,
    server_config,
    settings_problem,
)

if TYPE_CHECKING:
    from ..core.sglang_types import SamplingParams, TokenizerManager

KEY = "kv_evict"
# The flat keys a request may override (field metadata `request`).
FIELDS = setting_keys(request=True)


def resolve(
    server: EvictConfig, obj: object, choices: tuple[str, ...], refused: str = ""
) -> EvictConfig:
    """The settings of one request: the server's, overridden by `obj`. Raises ValueError naming
    the field (`kv_evict.<field>`) and the allowed values. `refused`: why this server refuses
    eviction ("" where it does not; `server_args.refusal`)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{KEY} must be a JSON object with fields {list(FIELDS)} (got {obj!r})")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise ValueError(f"{KEY}.{unknown[0]}: unknown field; allowed fields: {list(FIELDS)}")
    policy = obj.get("policy", server.policy)
    if policy not in choices:
        raise ValueError(f"{KEY}.policy must be one of {list(choices)} (got {policy!r})")
    if policy != "none":
        if refused:
            raise ValueError(f"{KEY}.policy: eviction is not available on this server: {refused}")
        if obj.get("budget", server.budget) is None:
            raise ValueError(f"{KEY}.budget is required: the server runs without --kv-budget")
    try:
        cfg = merged(server, obj)
        if cfg.enabled:
            policy_from_config(cfg)  # the policy's parameters: validated once, here
    except ValueError as e:
        raise ValueError(
            re.sub(r"EvictConfig\.(\w+)", rf"{KEY}.\1", _what_fits(server, obj, e))
        ) from None
    return cfg


def merged(server: EvictConfig, obj: dict) -> EvictConfig:
    """The server's settings overridden by a request's `kv_evict` object (ValueError if the
    result is invalid; `resolve` is the validation of a request). A server `recall` the request
    does not send is cut to the most that fits the request's settings (`_room`)."""
    policy = obj.get("policy", server.policy)
    if policy == "none":
        return EvictConfig(page_size=server.page_size)
    data = {**server.to_dict(), **obj, "policy": policy}
    if policy != server.policy:
        data["params"] = {}
    if "recall" not in obj:
        if data.get("offload") is not True:  # the request turned offload off: nothing to recall
            data["recall"] = 0
        elif (room := _room(data)) is not None and data["recall"] > room:
            data["recall"] = room
    return EvictConfig.from_dict(data)


def _room(data: dict) -> int | None:
    """The largest recall that fits the budget, sinks and window of `data` (flat keys):
    ``budget - sink_tokens - window - 1``, at least 0; None while any of them is not an integer
    (the config's own checks name it)."""
    values = [data.get(k) for k in ("budget", "sink", "window", "page_size")]
    ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    if len(ints) != len(values):
        return None
    budget, sink, window, page_size = ints
    sink_tokens = math.ceil(sink / page_size) * page_size
    return max(budget - sink_tokens - window - 1, 0)


def _what_fits(server: EvictConfig, obj: dict, e: ValueError) -> str:
    """The message of `e`, saying what would fit where a value the request sent does not fit the
    rest: its `recall` (the largest that fits), or its `interval` against the server's
    `prefill_chunk` (a server setting, named by the request field that broke it)."""
    msg = str(e)
    if msg.startswith("EvictConfig.recall must leave room"):
        room = _room({**server.to_dict(), **obj})
        if room is not None:
            return f"{msg}: the largest recall that fits this budget, sinks and window is {room}"
    chunk = server.prefill.chunk
    if (
        msg.startswith("EvictConfig.prefill_chunk")
        and "interval" in obj
        and chunk is not None
        and chunk % server.page_size == 0
    ):
        return (
            f"{KEY}.interval must be < this server's prefill_chunk {chunk}, at most "
            f"{chunk - 1} (got {obj['interval']})"
        )
    return msg


def before_create_tokenized_object(
    manager: TokenizerManager, obj: object, *args: object, **kwargs: object
) -> None:
    """BEFORE `TokenizerManager._create_tokenized_object`: reject an invalid `kv_evict` (HTTP
    400)."""
    sp = getattr(obj, "sampling_params", None)
    custom = sp.get("custom_params") if isinstance(sp, dict) else None
    if isinstance(custom, dict) and KEY in custom:
        cfg = resolve(server_config(), custom[KEY], KV_EVICT_CHOICES, refusal(manager.server_args))
        if cfg.enabled:
            check_fits_model(manager, cfg)
        if cfg.span and getattr(manager.server_args, "skip_tokenizer_init", False):
            raise ValueError(f"{KEY}.span: {SPAN_NEEDS_TOKENIZER.format(span=cfg.span)}")
    return None


def check_fits_model(manager: TokenizerManager, cfg: EvictConfig) -> None:
    """Raise ValueError (HTTP 400) if the served model cannot be evicted or `cfg` does not fit it.
    Read from the tokenizer's `ModelConfig` by each request that asks for eviction."""
    model_config = manager.model_config
    reason = unsupported_model_reason(model_config)
    if reason:
        raise ValueError(f"{KEY}.policy: eviction is not available for this model: {reason}")
    problem = settings_problem(
        cfg, manager.context_len, model_config.num_hidden_layers, None, budget_name=f"{KEY}.budget"
    )
    if problem:
        raise ValueError(problem)


def request_config(server: EvictConfig, sampling_params: SamplingParams) -> EvictConfig:
    """The settings of a scheduler-side request: built, not validated again (the tokenizer
    process has validated its `kv_evict`)."""
    custom = getattr(sampling_params, "custom_params", None) or {}
    value = custom.get(KEY) if isinstance(custom, dict) else None
    return server if value is None else merged(server, value)
