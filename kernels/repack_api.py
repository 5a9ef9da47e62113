"""`repack_kv_`: move K and V rows between slots in every layer, in place.

Validates through the cached buffer set (`buffer_set.py`), then runs the Triton launcher of
`repack.py` (imported on first use, so this module needs only torch) or the torch oracle
`reference.repack_kv_ref_`. `impl="triton"|"torch"` forces one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _checks as C
from . import reference as ref
from .buffer_set import KVBuffers, KVBufferSet, as_layer_list, buffer_set, require_disjoint


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
    k_buffers: KVBuffers,
    v_buffers: KVBuffers,
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
        check_moves(src, dst, bufs.num_slots)
    if impl == "torch":
        keys, values = (
            as_layer_list(k_buffers, "k_buffers"),
            as_layer_list(v_buffers, "v_buffers"),
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
            f"rope.cos_sin_cache has rot_dim {rot_dim}; "
            f"it must be even and in [2, head_dim={head_dim}]"
        )
    if check and num_moves and int(rope.delta.abs().max()) >= cs.shape[0]:
        raise ValueError(
            f"rope.delta reaches |{int(rope.delta.abs().max())}|, "
            f"beyond cos_sin_cache's {cs.shape[0]} rows"
        )


def check_moves(src: torch.Tensor, dst: torch.Tensor, num_slots: int) -> None:
    """Check the in-place repack precondition (syncs with the device; for debug mode and tests).

    Requires 0 <= src, dst < num_slots, no slot written twice, and no move reading a slot that an
    EARLIER move in the list writes:  src[i] not in {dst[j] : j < i}.  A move may read a slot that
    a later move writes (that is the compaction pattern) and may have src == dst.
    """
    n = src.numel()
    if n == 0:
        return
    s, d = src.long(), dst.long()
    for name, t in (("src", s), ("dst", d)):
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= num_slots:
            raise ValueError(f"{name} holds slot ids in [{lo}, {hi}], outside [0, {num_slots})")
    if torch.unique(d).numel() != n:
        raise ValueError(
            "dst repeats a slot: each destination slot may be written by one move only"
        )
    writer = torch.full((num_slots,), n, dtype=torch.long, device=d.device)
    writer[d] = torch.arange(n, device=d.device)
    bad = writer[s] < torch.arange(n, device=s.device)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        j = int(writer[s[i]])
        raise ValueError(
            f"move {i} reads slot {int(s[i])}, which the earlier move {j} overwrites: "
            "in-place repack needs every move that reads a destination slot to come before "
            "the move that writes it (e.g. compaction in row order)"
        )
