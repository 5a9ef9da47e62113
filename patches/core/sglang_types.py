"""What the plugin uses of SGLang's objects, as Protocols for mypy (SGLang ships no type
information, so its classes are `Any` to mypy). Each Protocol declares exactly the attributes and
methods of the named SGLang 0.5.23 class that `patches/` reads, writes or calls, with the types
SGLang gives them; where SGLang's type is wider than what the plugin relies on, the comment says
so (e.g. a row index that is None only while a request holds no KV, which the plugin never reads
then). Objects the plugin only passes along (tree locks, radix keys, match results, configs) keep
SGLang's own class, imported for type checking only (`Any` to mypy).

Nothing here runs: the module only declares types.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import Field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, TreeLock
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.server_args import ServerArgs


class KVPool(Protocol):
    """`mem_cache.memory_pool.MHATokenToKVPool`: a K and a V buffer per layer."""

    k_buffer: list[torch.Tensor]  # one [num_slots, H, D] per layer
    v_buffer: list[torch.Tensor]
    layer_num: int
    head_num: int

    def get_key_buffer(self, layer_id: int) -> torch.Tensor: ...

    def get_value_buffer(self, layer_id: int) -> torch.Tensor: ...


class Allocator(Protocol):
    """`mem_cache.allocator`'s token-to-KV-pool allocators (paged or not)."""

    page_size: int
    size: int
    device: torch.device

    def available_size(self) -> int: ...

    def alloc(self, need_size: int) -> torch.Tensor | None: ...

    def free(self, free_index: torch.Tensor) -> None: ...

    def free_page_ids(self, page_ids: torch.Tensor) -> None: ...

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None: ...

    def get_kvcache(self) -> KVPool: ...


class ReqToTokenPool(Protocol):
    """`mem_cache.memory_pool.ReqToTokenPool`: the slot table."""

    req_to_token: torch.Tensor  # [max_reqs, max_context] int32 slots


class TreeNode(Protocol):
    """`mem_cache.radix_cache.TreeNode`."""

    key: RadixKey
    value: torch.Tensor  # slots; SGLang: None once evicted (the plugin reads live nodes)
    parent: TreeNode  # the root's is None (SGLang declares it TreeNode too)
    children: dict[Any, TreeNode]
    lock_ref: int
    last_access_time: float
    # The plugin's record of a holed node (`cache/history.NodeRecord`, a layer above this one;
    # set and read through `history.record_of`).
    vt: Any


class RadixTree(Protocol):
    """`mem_cache.radix_cache.RadixCache`, as the holed radix cache (`cache/radix.py`) inherits it
    and the plugin's cache modules reach into it."""

    root_node: TreeNode
    page_size: int
    device: torch.device
    token_to_kv_pool_allocator: Allocator
    req_to_token_pool: ReqToTokenPool
    evictable_size_: int
    protected_size_: int
    _vt_serial: int  # the plugin's count of fresh namespaces (unset until the first)

    def lock(self, node: TreeNode) -> TreeLock | None: ...

    def unlock(self, lock: TreeLock | None) -> None: ...

    def evict(self, params: EvictParams) -> EvictResult: ...

    def evictable_size(self) -> int: ...

    def protected_size(self) -> int: ...

    def _insert_helper(
        self, node: TreeNode, key: RadixKey, value: torch.Tensor, priority: int = 0
    ) -> tuple[int, TreeNode]: ...

    def _match_prefix_helper(
        self, node: TreeNode, key: RadixKey
    ) -> tuple[list[torch.Tensor], TreeNode]: ...


class KvInfo(Protocol):
    """`managers.schedule_batch.ReqKvInfo` (`req.kv`): the KV a request holds (a dataclass)."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    # SGLang: None while the request holds no KV (`holds_kv`); the plugin reads it only then.
    req_pool_idx: int
    cache_protected_len: int
    kv_committed_len: int
    kv_allocated_len: int

    @property
    def holds_kv(self) -> bool: ...


class SamplingParams(Protocol):
    """`sampling.sampling_params.SamplingParams`."""

    max_new_tokens: int | None


class Req(Protocol):
    """`managers.schedule_batch.Req`."""

    rid: str
    origin_input_ids: array
    output_ids: array
    full_untruncated_fill_ids: array
    prefix_len: int
    already_computed: int
    extend_end: int  # SGLang: None outside a prefill round (the plugin reads it in one)
    kv: KvInfo
    lock: TreeLock | None
    last_node: TreeNode  # None before a match (SGLang: Any)
    extra_key: str | None
    cache_salt: str | None
    priority: int | None
    return_logprob: bool
    logprob_start_len: int
    sampling_params: SamplingParams
    customized_info: dict[str, list[Any]] | None
    stream: bool
    discard_output_reason: object  # a FINISH_ABORT, or None
    skip_radix_cache_insert: bool
    vtoken: object  # the plugin's `ReqEvictState`, read through `state.state_of`

    def finished(self) -> bool: ...

    def refresh_fill_ids(self) -> None: ...

    def _compute_max_prefix_len(self, input_len: int) -> int: ...

    def set_finish_with_abort(
        self, error_msg: str, status_code: int = ..., err_type: str = ...
    ) -> None: ...


class ScheduleBatch(Protocol):
    """`managers.schedule_batch.ScheduleBatch`."""

    reqs: list[Req]
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    orig_seq_lens: torch.Tensor
    seq_lens_sum: int | None
    batch_is_full: bool

    def is_empty(self) -> bool: ...

    def batch_size(self) -> int: ...


class Scheduler(Protocol):
    """`managers.scheduler.Scheduler`. Attributes read with `getattr` and a default (they vary by
    configuration) are not listed."""

    tree_cache: RadixTree  # its prefix cache (a `RadixCache` wherever requests evict)
    token_to_kv_pool_allocator: Allocator
    req_to_token_pool: ReqToTokenPool
    max_total_num_tokens: int
    model_config: ModelConfig
    waiting_queue: list[Req]
    chunked_prefill_size: int | None
    enable_overlap: bool
    max_new_tokens_limit: int | None
    _pending_chunked_abort_req: Req | None
    vtoken: object  # the plugin's `VTokenProcess`

    def _reqs_finishing_inflight(self, batch: ScheduleBatch) -> Iterable[Req]: ...

    def process_pending_chunked_abort(self) -> None: ...


class ForwardBatch(Protocol):
    """`model_executor.forward_batch_info.ForwardBatch`."""

    forward_mode: ForwardMode
    batch_size: int
    positions: torch.Tensor | None
    seq_lens_cpu: torch.Tensor  # SGLang: None until set; set on the batches the plugin reads
    extend_seq_lens_cpu: list[int]  # SGLang: None but in extend batches (where it is read)


class ModelRunner(Protocol):
    """`model_executor.model_runner.ModelRunner`."""

    token_to_kv_pool: KVPool
    req_to_token_pool: ReqToTokenPool
    use_mla_backend: bool
    init_new_workspace: bool


class DecodeGraphRunner(Protocol):
    """`model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner`."""

    model_runner: ModelRunner
    max_bs: int
    bs: int  # the padded batch size of the replay being loaded
    ragged_verify_mode: bool


class AttentionLayer(Protocol):
    """`layers.radix_attention.RadixAttention`."""

    layer_id: int
    tp_q_head_num: int
    qk_head_dim: int
    scaling: float


class TokenizerManager(Protocol):
    """`managers.tokenizer_manager.TokenizerManager`."""

    server_args: ServerArgs
    model_config: ModelConfig
    context_len: int


class StreamAccumulator(Protocol):
    """`managers.scheduler_components.output_streamer._GenerationStreamAccumulator`: per output
    in a batch, its request id and token counts."""

    rids: list[str]
    prompt_tokens: list[int]
    cached_tokens: list[int]


class TpGroup(Protocol):
    """`distributed.parallel_state.GroupCoordinator` (the scheduler's `tp_group`)."""

    world_size: int
    device: torch.device

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor: ...
