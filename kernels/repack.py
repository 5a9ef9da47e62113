"""Triton KV repacker: the K and V rows of every layer move between slots in one launch.

Program (h, part, layer) owns columns [part * BLOCK_D, (part + 1) * BLOCK_D) of head h in one
layer (K and V) and walks the whole move list BLOCK_M moves at a time: load every source row of
the chunk, barrier, store every destination row, barrier. No other program touches those bytes,
so the result equals gather-then-scatter whenever no move reads a slot an earlier move wrote
(src[i] not in dst[:i]; the planner's compaction order guarantees it). Layers are reached
through int64 address tables built once per buffer set (`buffer_set.py`); copies move raw
integers of the element width (fp8 and NaN payloads exact). Needs compiled Triton on CUDA
tensors, or TRITON_INTERPRET=1 (set before this module is imported) on CPU tensors.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from . import _checks as C
from .buffer_set import KVBufferSet

if TYPE_CHECKING:
    from .repack_api import RopeShift

_COPY_TL = {1: tl.uint8, 2: tl.int16, 4: tl.int32}
_FLOAT_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_CHUNK_BYTES = 32768  # bytes of K (and again of V) a program loads per chunk on a GPU
_MAX_ROW_BYTES = 512  # widest head row one program copies whole


# Kernel parameters stay unannotated: Triton reads their annotations (tl.constexpr).
@triton.jit
def _repack_kernel(  # type: ignore[no-untyped-def]
    # In/out (through address tables)
    k_table,  # [num_layers] int64 data_ptr of each K layer [num_slots, H, D]
    v_table,  # [num_layers] int64 data_ptr of each V layer (same layout); unused without HAS_V
    # Inputs
    src_ptr,  # [num_moves] int32/int64 source slots
    dst_ptr,  # [num_moves] int32/int64 destination slots
    num_moves,
    stride_ks,  # K slot stride (elements); head stride follows
    stride_kh,
    stride_vs,
    stride_vh,
    # RoPE re-rotation of K (read only when ROPE)
    delta_ptr,  # [num_moves] int32/int64 position delta per move
    cos_sin_ptr,  # [max_pos, ROT_DIM] cos | sin
    stride_cs,
    # Constants
    K_DTYPE: tl.constexpr,  # float type when ROPE, else the integer type of the element width
    V_DTYPE: tl.constexpr,
    HAS_V: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,  # columns per program; a power of 2 covering D when ROPE
    PARTS: tl.constexpr,  # programs per head: cdiv(D, BLOCK_D)
    BLOCK_M: tl.constexpr,
    ROPE: tl.constexpr,
    ROT_DIM: tl.constexpr,
    NEOX: tl.constexpr,
):
    h = (tl.program_id(0) // PARTS).to(tl.int64)
    part = tl.program_id(0) % PARTS
    layer = tl.program_id(1)
    k_base = tl.multiple_of(tl.load(k_table + layer).to(tl.pointer_type(K_DTYPE)), 16)
    offs_d = part * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    k_col = k_base + h * stride_kh + offs_d  # [BLOCK_D] pointers of head h, slot 0
    if HAS_V:
        v_base = tl.multiple_of(tl.load(v_table + layer).to(tl.pointer_type(V_DTYPE)), 16)
        v_col = v_base + h * stride_vh + offs_d
    if ROPE:
        HALF: tl.constexpr = ROT_DIM // 2
        rotated = offs_d < ROT_DIM
        if NEOX:  # rotate-half: d pairs with d +- HALF
            first = offs_d < HALF
            partner = tl.where(first, offs_d + HALF, offs_d - HALF)
            freq = tl.where(first, offs_d, offs_d - HALF)
        else:  # GPT-J: d pairs with d ^ 1
            first = (offs_d % 2) == 0
            partner = tl.where(first, offs_d + 1, offs_d - 1)
            freq = offs_d // 2

    for m0 in range(0, num_moves, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < num_moves
        mask = mask_m[:, None] & mask_d[None, :]
        # int64 before multiplying by the slot stride: slot * stride overflows int32 on big pools
        src = tl.load(src_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        dst = tl.load(dst_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)

        k_src = k_col[None, :] + (src * stride_ks)[:, None]
        k = tl.load(k_src, mask=mask)
        if HAS_V:
            v = tl.load(v_col[None, :] + (src * stride_vs)[:, None], mask=mask)
        if ROPE:
            delta = tl.load(delta_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
            cs_row = cos_sin_ptr + (tl.abs(delta) * stride_cs)[:, None] + freq[None, :]
            cs_mask = mask_m[:, None] & rotated[None, :]
            cos = tl.load(cs_row, mask=cs_mask, other=1.0).to(tl.float32)
            sin = tl.load(cs_row + HALF, mask=cs_mask, other=0.0).to(tl.float32)
            sin = tl.where((delta < 0)[:, None], -sin, sin)  # sin(-x) = -sin(x)
            x = k.to(tl.float32)
            xp = tl.load(
                k_src + (partner - offs_d)[None, :], mask=mask & rotated[None, :], other=0.0
            )
            prod = xp.to(tl.float32) * sin
            y = tl.where(first[None, :], x * cos - prod, x * cos + prod)
            k = tl.where(rotated[None, :], y, x).to(K_DTYPE)
        tl.debug_barrier()  # every source of this chunk is read before any destination is written

        tl.store(k_col[None, :] + (dst * stride_ks)[:, None], k, mask=mask)
        if HAS_V:
            tl.store(v_col[None, :] + (dst * stride_vs)[:, None], v, mask=mask)
        tl.debug_barrier()  # and written before the next chunk reads


def launch_repack(
    bufs: KVBufferSet,
    src: torch.Tensor,
    dst: torch.Tensor,
    rope: RopeShift | None = None,
    *,
    block_moves: int | None = None,
    num_warps: int | None = None,
    col_block: int | None = None,
) -> None:
    """Launch the repack kernel on validated arguments (see `sgl_vtoken.kernels.repack_kv_`).

    K and V go in one launch when their layer layouts match, else in one launch each. Everything
    but the move lists is prepared once per (buffer set, launch parameters) and kept in
    `bufs.launch_cache`: the first call builds the address tables (a host-to-device copy: make it
    before CUDA-graph capture); later calls only launch.
    """
    interpreted = C.interpreted(_repack_kernel, bufs.device, "repack")
    if bufs.device.type != "cpu" and interpreted:
        raise ValueError(
            "the repack kernel reads per-layer addresses from a table, which the Triton "
            "interpreter cannot map to device memory: run it compiled (TRITON_INTERPRET unset) "
            "or pass CPU tensors"
        )
    rope_key = (
        None
        if rope is None
        else (rope.cos_sin_cache.shape[1], bool(rope.neox), rope.cos_sin_cache.dtype)
    )
    key = (rope_key, block_moves, num_warps, col_block)
    launches = bufs.launch_cache.get(key)
    if launches is None:
        if col_block is not None and (col_block < 1 or col_block & (col_block - 1)):
            raise ValueError(f"col_block must be a power of 2, got {col_block}")
        launches = bufs.launch_cache[key] = _prepare(
            bufs, rope_key, block_moves, num_warps, col_block, interpreted
        )
    n = src.numel()
    if n == 0:
        return
    src, dst = src.contiguous(), dst.contiguous()
    for grid, k_table, v_table, strides, meta in launches:
        if meta["ROPE"]:
            assert rope is not None, "a launch re-rotates K only when given a rope"
            delta, cos_sin, stride_cs = (
                rope.delta.contiguous(),
                rope.cos_sin_cache,
                rope.cos_sin_cache.stride(0),
            )
        else:
            delta, cos_sin, stride_cs = src, k_table, 0  # unused
        _repack_kernel[grid](
            k_table, v_table, src, dst, n, *strides, delta, cos_sin, stride_cs, **meta
        )


def default_launch(
    head_dim: int, elem: int, heads: int, num_layers: int, *, rope: bool, num_sms: int | None
) -> tuple[int, int, int]:
    """(block_moves, num_warps, col_block) for one group; num_sms None means the interpreter.

    Whole heads per program (one 256-byte row of a bf16 head_dim-128 head, 128 moves a chunk,
    4 warps) reached ~90% of copy bandwidth on an H200 where splitting heads to fill SMs reached
    ~78%. Heads wider than 512 bytes are split into 512-byte parts; heads are split further (rows
    of at least 128 bytes) only while the grid would not even fill every SM once.
    """
    block_d = triton.next_power_of_2(head_dim)
    if num_sms is None:  # interpreter: its cost grows with the number of ops, not bytes
        return 16, 4, block_d
    col = block_d
    if not rope:  # a rotation pairs columns across the whole rotary span: never split then
        while col * elem > _MAX_ROW_BYTES:
            col //= 2
        while (
            heads * num_layers * triton.cdiv(head_dim, col) < num_sms and (col // 2) * elem >= 128
        ):
            col //= 2
    rows = _CHUNK_BYTES // (col * elem)
    if rope:
        rows //= 4  # fp32 temporaries: keep the chunk in registers
    return max(8, min(256, triton.next_power_of_2(max(rows, 1)))), 4, col


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _prepare(
    bufs: KVBufferSet,
    rope_key: tuple[int, bool, torch.dtype] | None,
    block_moves: int | None,
    num_warps: int | None,
    col_block: int | None,
    interpreted: bool,
) -> list:
    """Per group (K with V, or K then V): grid, address tables, strides and launch constants."""
    same_layout = bufs.k_shape[1:] == bufs.v_shape[1:] and bufs.k_dtype == bufs.v_dtype
    groups = [("k", same_layout, rope_key)]
    if not same_layout:
        groups.append(("v", False, None))
    num_sms = None if interpreted else _num_sms(bufs.device)
    launches = []
    for which, with_v, rk in groups:
        ptrs, shape, strides, dtype = (
            (bufs.k_ptrs, bufs.k_shape, bufs.k_strides, bufs.k_dtype)
            if which == "k"
            else (bufs.v_ptrs, bufs.v_shape, bufs.v_strides, bufs.v_dtype)
        )
        _, heads, head_dim = shape
        elem = torch.empty(0, dtype=dtype).element_size()
        bm, nw, cb = default_launch(
            head_dim, elem, heads, len(ptrs), rope=rk is not None, num_sms=num_sms
        )
        bm, nw = block_moves or bm, num_warps or nw
        if rk is not None:
            cb = triton.next_power_of_2(head_dim)
        elif col_block is not None:
            cb = min(col_block, triton.next_power_of_2(head_dim))
        parts = triton.cdiv(head_dim, cb)
        table = torch.tensor(ptrs, dtype=torch.int64, device=bufs.device)
        v_table = (
            torch.tensor(bufs.v_ptrs, dtype=torch.int64, device=bufs.device) if with_v else table
        )
        v_strides = bufs.v_strides if with_v else strides
        v_elem = torch.empty(0, dtype=bufs.v_dtype).element_size() if with_v else elem
        meta = dict(
            K_DTYPE=_FLOAT_TL[dtype] if rk is not None else _COPY_TL[elem],
            V_DTYPE=_COPY_TL[v_elem],
            HAS_V=with_v,
            D=head_dim,
            BLOCK_D=cb,
            PARTS=parts,
            BLOCK_M=bm,
            ROPE=rk is not None,
            ROT_DIM=2 if rk is None else rk[0],
            NEOX=True if rk is None else rk[1],
            num_warps=nw,
            # no software pipelining: loads of chunk c+1 must not start before stores of c
            num_stages=1,
            # no mul+add -> fma contraction: the RoPE maths then rounds exactly like the reference
            enable_fp_fusion=False,
        )
        grid = (heads * parts, len(ptrs))
        launches.append(
            (grid, table, v_table, (strides[0], strides[1], v_strides[0], v_strides[1]), meta)
        )
    return launches
