"""The public KV-management functions (repack, page indices): Triton on CUDA, torch on CPU.

Each function validates its arguments, then runs either the Triton launcher (imported on first
use, so this module needs only torch) or the pure-torch reference from `reference.py`.
`impl="triton"|"torch"` forces one; tests force Triton on CPU tensors under TRITON_INTERPRET=1.
The score function lives in `scores_api.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _checks as C
from . import reference as ref
from .buffer_set import KVBufferSet, buffer_set, require_disjoint


@dataclass(frozen=True)
class RopeShift:
    """Re-rotate moved keys by a per-move position delta (K only; V is always copied).

    Attributes:
        delta: [num_moves] int32/int64, new_position - old_position of each moved token (may be
            negative); |delta| must be < cos_sin_cache.shape[0].
        cos_sin_cache: [max_pos, rot_dim] float (fp32 for exact maths), row p = cos(p*f) | sin(p*f),
            the layout of SGLang's `RotaryEmbedding.cos_sin_cache`. rot_dim is even and <= head_dim;
            dims past rot_dim are copied unchanged (partial rotary).
        neox: True for rotate-half pairs (i, i + rot_dim/2), False for GPT-J interleaved pairs
            (2i, 2i+1).
    """

    delta: torch.Tensor
    cos_sin_cache: torch.Tensor
    neox: bool = True


def repack_kv_(
    k_buffers,
    v_buffers,
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    rope: RopeShift | None = None,
    impl: str | None = None,
    check: bool = False,
    block_moves: int | None = None,
    num_warps: int | None = None,
    col_block: int | None = None,
) -> None:
    """Move KV rows between slots in every layer, in place: buf[dst[i]] = buf[src[i]].

    Args:
        k_buffers: the K cache, one [num_slots, H, D] tensor per layer (as SGLang's
            `MHATokenToKVPool.k_buffer`), or one stacked [L, num_slots, H, D] tensor. All layers
            share shape, dtype and strides; the last dim must be contiguous. Any H and D.
        v_buffers: the V cache, same number of layers and slots (head count/dim may differ from K).
            dtypes: float16, bfloat16, float32, float8_e4m3fn, float8_e5m2, uint8, int8 (bytes
            are copied exactly).
        src, dst: [num_moves] int32/int64 slot ids on the buffers' device.
        rope: optional `RopeShift`: moved K rows are re-rotated in fp32 (K must be a float16,
            bfloat16 or float32 buffer).
        impl: "triton", "torch", or None (Triton on CUDA, torch otherwise).
        check: validate the buffers from scratch (refreshing the cache), slot ranges and the
            in-place precondition first (syncs; debug mode and tests).
        block_moves, num_warps, col_block: Triton tuning knobs (moves per chunk, warps per
            program, head_dim columns per program; a power of 2, ignored with rope); None takes
            the defaults of `repack.default_launch`.

    The buffers are validated once per buffer set and cached by identity (the same list or
    tensor objects with the same data pointers, see `buffer_set.py`), so a call costs a few
    microseconds of Python plus Triton's launch, and never synchronizes with the device unless
    `check=True`. The first Triton call on a buffer set builds its address tables (a
    host-to-device copy): make it, e.g. with empty move lists, before CUDA-graph capture.

    Precondition (in-place safety): every destination is written once, and no move reads a slot
    written by an EARLIER move: src[i] not in {dst[j] : j < i}. Then the result equals gathering
    all sources before scattering. The planner's compaction order (the k-th kept token of a row
    moves to the row's k-th slot, dst <= src, moves in row order; rows touch disjoint slots)
    satisfies it however the kept tokens overlap the destinations. Per-slot side buffers (e.g.
    attention scores) move with `score[dst] = score[src]` (torch gathers first; always safe).
    """
    bufs = buffer_set(k_buffers, v_buffers, revalidate=check)
    device = bufs.device
    if not C.index_pair_ok(src, dst, device):
        C.check_index_vector(src, "src", device, "k_buffers[0]")
        C.check_index_vector(dst, "dst", device, "k_buffers[0]", numel=src.numel())
    if rope is not None:
        _check_rope(rope, bufs, src.numel(), check)
    impl = C.resolve_impl(impl, device)
    if check:
        C.check_moves(src, dst, bufs.num_slots)
    if impl == "torch":
        keys, values = (
            C.as_layer_list(k_buffers, "k_buffers"),
            C.as_layer_list(v_buffers, "v_buffers"),
        )
        ref.repack_kv_ref_(keys, values, src, dst, rope)
        return
    require_disjoint(bufs, k_buffers, v_buffers)
    C.triton_module("repack").launch_repack(
        bufs, src, dst, rope, block_moves=block_moves, num_warps=num_warps, col_block=col_block
    )


def _check_rope(rope: RopeShift, bufs: KVBufferSet, num_moves: int, check: bool) -> None:
    if not isinstance(rope, RopeShift):
        raise TypeError(f"rope must be a RopeShift or None, got {type(rope).__name__}")
    if bufs.k_dtype not in C.FLOAT_DTYPES:
        raise ValueError(
            f"k_buffers[0] (with rope) has dtype {bufs.k_dtype}; allowed: {C.names(C.FLOAT_DTYPES)}"
        )
    C.check_index_vector(rope.delta, "rope.delta", bufs.device, "k_buffers[0]", numel=num_moves)
    cs = C.check_tensor(rope.cos_sin_cache, "rope.cos_sin_cache")
    C.check_ndim(cs, "rope.cos_sin_cache", 2, "[max_pos, rot_dim]")
    C.check_dtype(cs, "rope.cos_sin_cache", C.FLOAT_DTYPES)
    C.check_device(cs, "rope.cos_sin_cache", bufs.device, "k_buffers[0]")
    C.check_inner_contiguous(cs, "rope.cos_sin_cache")
    rot_dim, head_dim = cs.shape[1], bufs.k_shape[2]
    if rot_dim % 2 or not 2 <= rot_dim <= head_dim:
        raise ValueError(
            f"rope.cos_sin_cache has rot_dim {rot_dim}; it must be even and in [2, head_dim={head_dim}]"
        )
    if check and num_moves and int(rope.delta.abs().max()) >= cs.shape[0]:
        raise ValueError(
            f"rope.delta reaches |{int(rope.delta.abs().max())}|, beyond cos_sin_cache's {cs.shape[0]} rows"
        )


def page_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    *,
    num_pages: int | None = None,
    kv_indices_out: torch.Tensor | None = None,
    impl: str | None = None,
    check: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer paged-KV indices (`kv_indptr`, `kv_indices`, `kv_last_page_len`) for page-dense rows.

    Args:
        req_to_token: [max_reqs, max_ctx] int32/int64 slot table (SGLang's `ReqToTokenPool`).
        req_pool_indices: [bs] int32/int64 row of each request.
        seq_lens: [bs] int32/int64 row lengths (0 allowed).
        page_size: tokens per page P >= 1. Rows must be page-dense: position i of a row holds slot
            page_id * P + i % P, with the page id shared by positions of one page (`check=True`
            verifies it, with a host sync).
        num_pages: total pages (sum of ceil(seq_lens / P)) if the caller knows it, avoiding a
            host sync; else computed from seq_lens.
        kv_indices_out: optional preallocated [>= total pages] int32 buffer (e.g. the CUDA-graph
            index buffer); it is filled and returned whole (only kv_indptr[-1] entries are valid)
            unless num_pages is given.
        impl: "triton", "torch", or None (Triton on CUDA, torch otherwise).

    Returns:
        kv_indptr [bs+1] int32, kv_indices int32 (page id = first slot of the page // P) and
        kv_last_page_len [bs] int32 (1..P, 0 for an empty row), as FlashInfer's paged wrappers take
        them with page_size=P (`flashinfer.page.get_seq_lens` gives seq_lens back).
    """
    C.check_tensor(req_to_token, "req_to_token")
    C.check_ndim(req_to_token, "req_to_token", 2, "[max_reqs, max_ctx]")
    C.check_dtype(req_to_token, "req_to_token", C.INDEX_DTYPES)
    device = req_to_token.device
    C.check_index_vector(req_pool_indices, "req_pool_indices", device, "req_to_token")
    bs = req_pool_indices.numel()
    C.check_index_vector(seq_lens, "seq_lens", device, "req_to_token", numel=bs)
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if kv_indices_out is not None:
        C.check_tensor(kv_indices_out, "kv_indices_out")
        C.check_ndim(kv_indices_out, "kv_indices_out", 1, "[>= total pages]")
        C.check_dtype(kv_indices_out, "kv_indices_out", (torch.int32,))
        C.check_device(kv_indices_out, "kv_indices_out", device, "req_to_token")
        if kv_indices_out.numel() > 1 and kv_indices_out.stride(0) != 1:
            raise ValueError(
                f"kv_indices_out must be contiguous, got stride {kv_indices_out.stride(0)}"
            )
    impl = C.resolve_impl(impl, device)
    if check:
        _check_rows(req_to_token, req_pool_indices, seq_lens, page_size)
    if num_pages is None and (kv_indices_out is None or check):
        num_pages = int(((seq_lens.long() + page_size - 1) // page_size).sum())  # host sync
    if kv_indices_out is not None:
        if num_pages is not None and kv_indices_out.numel() < num_pages:
            raise ValueError(
                f"kv_indices_out holds {kv_indices_out.numel()} entries but the batch has {num_pages} pages"
            )
        kv_indices = kv_indices_out
    else:
        kv_indices = torch.empty(num_pages, dtype=torch.int32, device=device)
    if impl == "torch":
        indptr, ids, last = ref.page_indices_ref(
            req_to_token, req_pool_indices, seq_lens, page_size
        )
        if ids.numel() > kv_indices.numel():
            raise ValueError(
                f"kv_indices_out holds {kv_indices.numel()} entries but the batch has {ids.numel()} pages"
            )
        kv_indices[: ids.numel()] = ids
    else:
        indptr = torch.empty(bs + 1, dtype=torch.int32, device=device)
        last = torch.empty(bs, dtype=torch.int32, device=device)
        C.triton_module("page_index").launch_page_indices(
            req_to_token,
            req_pool_indices.contiguous(),
            seq_lens.contiguous(),
            page_size,
            indptr,
            kv_indices,
            last,
        )
    if kv_indices_out is not None and num_pages is not None:
        kv_indices = kv_indices[:num_pages]
    return indptr, kv_indices, last


def _check_rows(req_to_token, req_pool_indices, seq_lens, page_size) -> None:
    max_reqs, max_ctx = req_to_token.shape
    if req_pool_indices.numel():
        lo, hi = int(req_pool_indices.min()), int(req_pool_indices.max())
        if lo < 0 or hi >= max_reqs:
            raise ValueError(
                f"req_pool_indices holds rows in [{lo}, {hi}], outside [0, {max_reqs})"
            )
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 0 or hi > max_ctx:
            raise ValueError(f"seq_lens holds lengths in [{lo}, {hi}], outside [0, {max_ctx}]")
    ref.check_page_dense(req_to_token, req_pool_indices, seq_lens, page_size)
