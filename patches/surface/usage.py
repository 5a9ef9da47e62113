"""What the API reports for an evicting request: counts of the prompt as sent, and the eviction
figures next to the usage (splice rule 12).

`prompt_tokens` counts the logical prompt and `cached_tokens` its tokens not prefilled (a turn
continuing a stored history holds its prompt in row coordinates); `meta_info["kv_evict"]`
travels with a stream's final chunk, not its first; OpenAI `usage` gains `kv_evict` when the
request evicted (summed over choices). Details: docs/design/splice.md, "Usage".
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from ..core.state import state_of
from .observe import META_KEY

if TYPE_CHECKING:
    from sglang.srt.entrypoints.openai.protocol import UsageInfo

    from ..core.sglang_types import Req, StreamAccumulator, TokenizerManager

SUMMED = (
    "evicted_tokens",
    "live_tokens",
    "pages_freed",
    "evictions",
    "history_tokens",
    "history_view_tokens",
    "history_restored_tokens",
    "prefill_evicted_tokens",
    "offloaded_tokens",
    "recall_candidates",
    "recalled_tokens",
    "recomputed_tokens",
    "pinned_tokens",
    "recall_ms",
    "host_bytes",
)
# The eviction figures a streamed request has seen so far, by request id (one dict per request:
# the streaming response runs in its own task, whose context starts without it).
_STREAMED: ContextVar[dict | None] = ContextVar("vtoken_streamed_kv_evict", default=None)


def around_accept(
    original: Callable[..., None],
    acc: StreamAccumulator,
    *args: object,
    req: Req,
    **kwargs: object,
) -> None:
    """AROUND `_GenerationStreamAccumulator.accept`: logical prompt counts; the eviction figures
    (the one place `Report.as_dict` serialises them), a stream's with its final chunk."""
    st = state_of(req)
    if st is None:
        return original(acc, *args, req=req, **kwargs)
    before = len(acc.rids)
    info, stream = req.customized_info, req.stream
    rust = getattr(acc, "rust_server_mode", False)
    figures = {}  # SGLang sends request-level values only when finished (or a rust stream's first)
    if req.finished() or (stream and rust):
        figures = {META_KEY: [st.report.as_dict(st.cfg.policy, st.cfg.budget)]}
        if stream and not rust:  # a stream's request-level values go with its first chunk only
            req.stream = False
    req.customized_info = {**(info or {}), **figures} or None
    try:
        original(acc, *args, req=req, **kwargs)
    finally:
        req.customized_info, req.stream = info, stream
    if len(acc.rids) > before and st.prompt.logical is not None:
        # evicted prompt tokens: a stored history's (not prefilled) and this prefill's (computed);
        # the tokens a recall brought back sit in the row ids again, though none was prefilled now
        hidden = len(st.prompt.logical) - len(req.origin_input_ids)
        cached = hidden + (st.report.pinned_tokens or 0) - st.prompt.prefill_evicted
        acc.prompt_tokens[-1] += hidden
        acc.cached_tokens[-1] += cached
        details = getattr(acc, "cached_tokens_details", None)  # Prometheus' cached_tokens_total
        if cached and details and isinstance(details[-1], dict):
            details[-1] = {**details[-1], "device": details[-1].get("device", 0) + cached}


def around_generate_request(
    original: Callable[..., AsyncGenerator[object, None]],
    manager: TokenizerManager,
    *args: object,
    **kwargs: object,
) -> AsyncGenerator[object, None]:
    """AROUND `TokenizerManager.generate_request` (an async generator): remember the eviction
    figures each output carries, for the streamed usage chunk."""
    outputs = original(manager, *args, **kwargs)

    async def relay() -> AsyncGenerator[object, None]:
        try:
            async for out in outputs:
                meta = out.get("meta_info") if isinstance(out, dict) else None
                if meta and meta.get(META_KEY):
                    seen = _STREAMED.get()
                    if seen is None:
                        seen = {}
                        _STREAMED.set(seen)
                    seen[meta.get("id")] = meta[META_KEY][0]
                yield out
        finally:
            await outputs.aclose()

    return relay()


def summarize(reports: list[dict]) -> dict:
    """One request's figures, or the sums over several choices (policy and budget of the first)."""
    out = dict(reports[0])
    for r in reports[1:]:
        for key in SUMMED:
            if key in r:
                out[key] = out.get(key, 0) + r[key]
    return out


def _with_figures(usage: UsageInfo, reports: list[dict]) -> UsageInfo:
    if reports and usage is not None:
        if usage.__pydantic_extra__ is None:  # built before extras were allowed
            object.__setattr__(usage, "__pydantic_extra__", {})
        usage.kv_evict = summarize(reports)
    return usage


def around_calculate_response_usage(
    original: Callable[..., UsageInfo], responses: list[Any], *args: object, **kwargs: object
) -> UsageInfo:
    """AROUND `UsageProcessor.calculate_response_usage` (non-streamed responses)."""
    reports = [
        r["meta_info"][META_KEY][0]
        for r in responses
        if isinstance(r, dict) and (r.get("meta_info") or {}).get(META_KEY)
    ]
    if reports:
        _allow_usage_extras()
    return _with_figures(original(responses, *args, **kwargs), reports)


def around_calculate_streaming_usage(
    original: Callable[..., UsageInfo], *args: object, **kwargs: object
) -> UsageInfo:
    """AROUND `UsageProcessor.calculate_streaming_usage` (the usage chunk of a stream)."""
    reports = list((_STREAMED.get() or {}).values())
    if reports:
        _allow_usage_extras()
    return _with_figures(original(*args, **kwargs), reports)


def _allow_usage_extras() -> None:
    """Let SGLang's `UsageInfo` carry `kv_evict` into the JSON of every response model that nests
    it (pydantic builds a nested model's serializer into its parent's schema). Done once, when
    the first evicting request is reported."""
    import sys

    import pydantic
    from sglang.srt.entrypoints.openai.protocol import UsageInfo as usage_cls

    if usage_cls.model_config.get("extra") == "allow":
        return
    usage_cls.model_config["extra"] = "allow"
    usage_cls.model_rebuild(force=True)
    module = sys.modules[usage_cls.__module__]
    for parent in vars(module).values():
        if (
            isinstance(parent, type)
            and issubclass(parent, pydantic.BaseModel)
            and parent is not usage_cls
            and any(usage_cls.__name__ in str(f.annotation) for f in parent.model_fields.values())
        ):
            parent.model_rebuild(force=True)
