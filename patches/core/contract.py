"""The contract between sgl-vtoken and the pinned SGLang: version, hooked signatures, and the
SGLang symbols the hooks call or subclass.

A version bump that renames, moves or re-signs one of them must fail loudly here (and in
`tests/runtime/patches/test_contract.py`), not silently run stock SGLang.
"""

import inspect
import pkgutil
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

SGLANG_VERSION = "0.5.23"

_GRAPHS = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
# Leading parameter names (self/cls included) of every target `plugin.HOOKS` hooks: exactly these
# (tests/runtime/patches/test_contract.py), so that `check_hooks_applied` needs no hook table.
HOOKED_PARAMS = {
    "sglang.srt.server_args.ServerArgs.add_cli_args": ("parser",),
    "sglang.srt.server_args.ServerArgs.from_cli_args": ("cls", "args"),
    "sglang.srt.managers.scheduler.Scheduler.__init__": ("self", "server_args", "port_args"),
    "sglang.srt.managers.scheduler.Scheduler.update_running_batch": ("self", "batch"),
    "sglang.srt.managers.scheduler.Scheduler.get_prefill_adder_class": ("self",),
    "sglang.srt.managers.scheduler.Scheduler.stash_chunked_request": ("self", "req"),
    "sglang.srt.managers.scheduler.Scheduler.init_req_max_new_tokens": ("self", "req"),
    "sglang.srt.managers.scheduler.validate_input_length": (
        "req",
        "max_req_input_len",
        "allow_auto_truncate",
    ),
    "sglang.srt.managers.schedule_batch.Req.__init__": ("self", "rid"),
    "sglang.srt.managers.schedule_batch.Req.reset_for_retract": ("self",),
    "sglang.srt.managers.schedule_batch.release_req": (
        "req",
        "remaing_req_count",
        "req_to_token_pool",
        "token_to_kv_pool_allocator",
        "tree_cache",
    ),
    "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend": ("self",),
    "sglang.srt.mem_cache.common.release_kv_cache": ("req", "tree_cache", "checkpoint"),
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new": (
        "cls",
        "batch",
        "model_runner",
    ),
    "sglang.srt.managers.scheduler_components.pool_stats_observer.kv_private_tokens": (
        "kv",
        "page_size",
    ),
    "sglang.srt.managers.scheduler.Scheduler.get_internal_state": ("self", "recv_req"),
    "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
    ".is_request_level_customized_info_key": ("self", "key"),
    "sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len": ("self", "input_len"),
    "sglang.srt.managers.scheduler_components.output_streamer._GenerationStreamAccumulator"
    ".accept": ("self", "req"),
    "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request": (
        "self",
        "obj",
        "request",
    ),
    "sglang.srt.entrypoints.openai.usage_processor.UsageProcessor.calculate_response_usage": (
        "responses",
        "n_choices",
    ),
    "sglang.srt.entrypoints.openai.usage_processor.UsageProcessor.calculate_streaming_usage": (
        "prompt_tokens",
        "reasoning_tokens",
        "completion_tokens",
        "cached_tokens",
        "n_choices",
    ),
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object": (
        "self",
        "obj",
    ),
    "sglang.srt.layers.radix_attention.RadixAttention.forward": (
        "self",
        "q",
        "k",
        "v",
        "forward_batch",
    ),
    f"{_GRAPHS}.capture_one_shape": ("self", "size", "forward"),
    f"{_GRAPHS}.can_run_graph": ("self", "forward_batch"),
    f"{_GRAPHS}.load_batch": ("self", "forward_batch"),
    f"{_GRAPHS}.execute": ("self", "forward_batch"),
}
# ... and of every SGLang function our hooks call or override.
CALLED_PARAMS = {
    "sglang.srt.managers.scheduler.Scheduler._reqs_finishing_inflight": ("self", "batch"),
    "sglang.srt.managers.scheduler.Scheduler.process_pending_chunked_abort": (
        "self",
    ),  # prefill.py
    "sglang.srt.managers.schedule_policy.AddReqResult": (),
    "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req": (
        "self",
        "req",
        "has_chunked_req",
    ),
    "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req": ("self", "req"),
    "sglang.srt.managers.schedule_policy.PrefillAdder._get_running_request_total_token_offset": (
        "self",
        "req",
    ),
    "sglang.srt.managers.schedule_policy.PrefillAdder._check_prefill_budget": ("self", "req"),
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.free_page_ids": (
        "self",
        "page_ids",
    ),
    # radix.py: the RadixCache methods HoledRadixCache overrides or calls, and the registry
    "sglang.srt.mem_cache.registry.register_radix_cache_backend": ("name", "factory"),
    "sglang.srt.mem_cache.radix_cache.RadixCache.match_prefix": ("self", "params"),
    "sglang.srt.mem_cache.radix_cache.RadixCache.checkpoint": ("self", "req"),
    "sglang.srt.mem_cache.radix_cache.RadixCache.evict": ("self", "params"),
    "sglang.srt.mem_cache.radix_cache.RadixCache.inc_lock_ref": ("self", "node"),
    "sglang.srt.mem_cache.radix_cache.RadixCache.dec_lock_ref": ("self", "node", "params"),
    "sglang.srt.mem_cache.radix_cache.RadixCache._insert_helper": (
        "self",
        "node",
        "key",
        "value",
        "priority",
        "inserted_len",
    ),
    "sglang.srt.mem_cache.radix_cache.RadixCache._split_node": (
        "self",
        "key",
        "child",
        "split_len",
    ),
    "sglang.srt.mem_cache.radix_cache.RadixCache._delete_leaf": ("self", "node"),
    "sglang.srt.mem_cache.radix_cache.RadixCache._match_prefix_helper": ("self", "node", "key"),
    "sglang.srt.mem_cache.radix_cache.RadixCache.all_values_flatten": ("self",),
    "sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache.prefix_device_indices": ("self", "req"),
    "sglang.srt.managers.schedule_batch.Req.refresh_fill_ids": ("self",),
    "sglang.srt.model_executor.forward_context.get_token_to_kv_pool": (),  # scores.py
    "sglang.srt.managers.schedule_batch.ReqKvInfo": (),  # held.py subclasses it (one more slot)
}
EXPECTED_PARAMS = {**HOOKED_PARAMS, **CALLED_PARAMS}
# Module globals and attributes we read or set (module path, attribute).
EXPECTED_GLOBALS = (("sglang.srt.layers.rotary_embedding.base", "_is_cpu"),)


def _raw(target: str) -> Callable[..., Any]:
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    raw = (
        owner.__dict__[attr]
        if isinstance(owner, type) and attr in owner.__dict__
        else getattr(owner, attr)
    )
    return raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw


def check_contract() -> list[str]:
    """Every mismatch between the installed SGLang and what the plugin relies on, as messages."""
    problems = []
    installed = version("sglang")
    if installed != SGLANG_VERSION:
        problems.append(f"sgl-vtoken needs sglang=={SGLANG_VERSION}, found {installed}")
    for target, expected in EXPECTED_PARAMS.items():
        try:
            fn = inspect.unwrap(_raw(target))
        except (ImportError, AttributeError, KeyError) as e:
            problems.append(f"{target}: not found ({e!r})")
            continue
        params = tuple(inspect.signature(fn).parameters)
        if params[: len(expected)] != expected:
            problems.append(f"{target}: expected parameters {expected}, found {params}")
    for module, name in EXPECTED_GLOBALS:
        if not hasattr(pkgutil.resolve_name(module), name):
            problems.append(f"{module}.{name}: module global not found")
    return problems


def check_hooks_applied() -> list[str]:
    """Targets whose hook is not in place in this process (SGLang logs and swallows failures)."""
    return [t for t in HOOKED_PARAMS if not hasattr(_raw(t), "__wrapped__")]
