"""The public kernel functions: one per operation, Triton on CUDA tensors, torch on CPU tensors.

Each function validates its arguments once, then runs either the Triton launcher (imported on
first use, so this module needs only torch) or the pure-torch reference from `reference.py`.
`impl="triton"|"torch"` forces one; tests force Triton on CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _checks as C
from . import reference as ref


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
        check: validate slot ranges and the in-place precondition first (syncs; debug mode).
        block_moves, num_warps: Triton tuning knobs (moves per chunk, warps per program).

    Precondition (in-place safety): every destination is written once, and no move reads a slot
    written by an EARLIER move: src[i] not in {dst[j] : j < i}. Then the result equals gathering
    all sources before scattering. The planner's compaction order (the k-th kept token of a row
    moves to the row's k-th slot, dst <= src, moves in row order; rows touch disjoint slots)
    satisfies it however the kept tokens overlap the destinations. Per-slot side buffers (e.g.
    attention scores) move with `score[dst] = score[src]` (torch gathers first; always safe).
    """
    keys = C.as_layer_list(k_buffers, "k_buffers")
    values = C.as_layer_list(v_buffers, "v_buffers")
    if len(keys) != len(values):
        raise ValueError(f"k_buffers has {len(keys)} layers but v_buffers has {len(values)}")
    C.check_layer_group(keys, "k_buffers", C.COPY_DTYPES)
    C.check_layer_group(values, "v_buffers", C.COPY_DTYPES)
    device, num_slots = keys[0].device, keys[0].shape[0]
    C.check_device(values[0], "v_buffers[0]", device, "k_buffers[0]")
    if values[0].shape[0] != num_slots:
        raise ValueError(f"v_buffers hold {values[0].shape[0]} slots but k_buffers hold {num_slots}")
    C.check_index_vector(src, "src", device, "k_buffers[0]")
    C.check_index_vector(dst, "dst", device, "k_buffers[0]", numel=src.numel())
    if rope is not None:
        _check_rope(rope, keys[0], src.numel(), check)
    impl = C.resolve_impl(impl, device)
    if check:
        C.check_moves(src, dst, num_slots)
    if impl == "torch":
        ref.repack_kv_ref_(keys, values, src, dst, rope)
        return
    C.check_disjoint_buffers(
        [(f"k_buffers[{i}]", t) for i, t in enumerate(keys)] + [(f"v_buffers[{i}]", t) for i, t in enumerate(values)]
    )
    from .repack import launch_repack

    launch_repack(keys, values, src, dst, rope, block_moves=block_moves, num_warps=num_warps)


def _check_rope(rope: RopeShift, k0: torch.Tensor, num_moves: int, check: bool) -> None:
    if not isinstance(rope, RopeShift):
        raise TypeError(f"rope must be a RopeShift or None, got {type(rope).__name__}")
    C.check_dtype(k0, "k_buffers[0] (with rope)", C.FLOAT_DTYPES)
    C.check_index_vector(rope.delta, "rope.delta", k0.device, "k_buffers[0]", numel=num_moves)
    cs = C.check_tensor(rope.cos_sin_cache, "rope.cos_sin_cache")
    C.check_ndim(cs, "rope.cos_sin_cache", 2, "[max_pos, rot_dim]")
    C.check_dtype(cs, "rope.cos_sin_cache", C.FLOAT_DTYPES)
    C.check_device(cs, "rope.cos_sin_cache", k0.device, "k_buffers[0]")
    C.check_inner_contiguous(cs, "rope.cos_sin_cache")
    rot_dim = cs.shape[1]
    if rot_dim % 2 or not 2 <= rot_dim <= k0.shape[2]:
        raise ValueError(f"rope.cos_sin_cache has rot_dim {rot_dim}; it must be even and in [2, head_dim={k0.shape[2]}]")
    if check and num_moves and int(rope.delta.abs().max()) >= cs.shape[0]:
        raise ValueError(f"rope.delta reaches |{int(rope.delta.abs().max())}|, beyond cos_sin_cache's {cs.shape[0]} rows")
