"""Registers every SGLang hook of sgl-vtoken. Runs in the launcher and in every SGLang process."""

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from . import attention, cpu, graphs, runtime
from .cache import radix
from .step import admission, held, prefill, retraction, scores
from .surface import observe, request_options, server_args, usage

A, B, R = HookType.AFTER, HookType.BEFORE, HookType.AROUND
SCHED = "sglang.srt.managers.scheduler.Scheduler"
REQ = "sglang.srt.managers.schedule_batch.Req"
GRAPHS = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"

# (target, hook, type): the whole splice, in one table. `core/contract.py` checks each target
# exists.
HOOKS = (
    ("sglang.srt.server_args.ServerArgs.add_cli_args", server_args.add_cli_args, A),
    ("sglang.srt.server_args.ServerArgs.from_cli_args", server_args.from_cli_args, A),
    (f"{SCHED}.__init__", cpu.before_scheduler_init, B),
    (f"{SCHED}.__init__", runtime.after_scheduler_init, A),
    (f"{SCHED}.update_running_batch", runtime.around_update_running_batch, R),
    (f"{SCHED}.get_prefill_adder_class", admission.around_get_prefill_adder_class, R),
    (f"{SCHED}.stash_chunked_request", prefill.around_stash_chunked_request, R),
    (f"{SCHED}.init_req_max_new_tokens", admission.around_init_req_max_new_tokens, R),
    (
        "sglang.srt.managers.scheduler.validate_input_length",
        admission.around_validate_input_length,
        R,
    ),
    (f"{REQ}.__init__", runtime.after_req_init, A),
    (f"{REQ}.reset_for_retract", runtime.after_reset_for_retract, A),
    ("sglang.srt.managers.schedule_batch.release_req", retraction.before_release_req, B),
    (
        "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend",
        retraction.after_prepare_for_extend,
        A,
    ),
    (f"{REQ}._compute_max_prefix_len", admission.around_compute_max_prefix_len, R),
    (
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object",
        request_options.before_create_tokenized_object,
        B,
    ),
    ("sglang.srt.mem_cache.common.release_kv_cache", runtime.before_release_kv_cache, B),
    ("sglang.srt.mem_cache.common.release_kv_cache", runtime.after_release_kv_cache, A),
    (
        "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
        runtime.after_forward_batch_init,
        A,
    ),
    (
        "sglang.srt.layers.radix_attention.RadixAttention.forward",
        scores.around_radix_attention_forward,
        R,
    ),
    (f"{GRAPHS}.capture_one_shape", graphs.around_capture_one_shape, R),
    (f"{GRAPHS}.can_run_graph", graphs.around_can_run_graph, R),
    (f"{GRAPHS}.load_batch", graphs.around_load_batch, R),
    (f"{GRAPHS}.execute", graphs.around_execute, R),
    (
        "sglang.srt.managers.scheduler_components.pool_stats_observer.kv_private_tokens",
        held.around_kv_private_tokens,
        R,
    ),
    (f"{SCHED}.get_internal_state", observe.after_get_internal_state, A),
    (
        "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
        ".is_request_level_customized_info_key",
        observe.around_is_request_level_key,
        R,
    ),
    (
        "sglang.srt.managers.scheduler_components.output_streamer._GenerationStreamAccumulator.accept",
        usage.around_accept,
        R,
    ),
    (
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
        usage.around_generate_request,
        R,
    ),
    (
        "sglang.srt.entrypoints.openai.usage_processor.UsageProcessor.calculate_response_usage",
        usage.around_calculate_response_usage,
        R,
    ),
    (
        "sglang.srt.entrypoints.openai.usage_processor.UsageProcessor.calculate_streaming_usage",
        usage.around_calculate_streaming_usage,
        R,
    ),
)

_registered = False


def register() -> None:
    """Register the hooks once per process; SGLang applies them right after plugins load."""
    global _registered
    if _registered:
        return
    _registered = True
    for target, hook, hook_type in HOOKS:
        HookRegistry.register(target, hook, hook_type)
    attention.register_attention_backend()
    from sglang.srt.mem_cache.registry import register_radix_cache_backend

    register_radix_cache_backend(radix.NAME, radix.factory)
