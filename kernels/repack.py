"""Triton KV repacker: move K and V rows of every layer between slots in one launch.

Work is split by *columns*, not by moves: program (h, part, layer) owns columns
[part * BLOCK_D, (part + 1) * BLOCK_D) of head h of layer `layer` (K and V) and walks the whole
move list in order, `BLOCK_M` moves at a time, loading every source row of a chunk before storing
any destination row, with a CTA barrier between the phases:

    chunk c:   load K/V[src[cM : cM+M], h, cols]  ->  barrier  ->  store K/V[dst[cM : cM+M], h, cols]  ->  barrier

No other program touches those bytes, so the result equals "gather all sources, then scatter"
whenever no move reads a slot that an earlier move writes (src[i] not in dst[:i]): reads inside a
chunk precede its writes, and chunks run in list order. In-place compaction (the k-th kept token
moves to the k-th slot of the row, dst <= src in row order) satisfies that for any overlap.

Buffers are reached through int64 tables of per-layer base addresses (SGLang keeps one tensor per
layer), offsets are int64, and copies move raw integers of the element width, so fp8 and NaN
payloads are preserved. Needs compiled Triton on CUDA tensors, or TRITON_INTERPRET=1 (set before
this module is imported) on CPU tensors.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_COPY_TL = {1: tl.uint8, 2: tl.int16, 4: tl.int32}
_FLOAT_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_CHUNK_BYTES = 16384  # bytes of K (and again of V) a program loads per chunk on a GPU


@triton.jit
def _repack_kernel(
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
            xp = tl.load(k_src + (partner - offs_d)[None, :], mask=mask & rotated[None, :], other=0.0)
            prod = xp.to(tl.float32) * sin
            y = tl.where(first[None, :], x * cos - prod, x * cos + prod)
            k = tl.where(rotated[None, :], y, x).to(K_DTYPE)
        tl.debug_barrier()  # every source of this chunk is read before any destination is written

        tl.store(k_col[None, :] + (dst * stride_ks)[:, None], k, mask=mask)
        if HAS_V:
            tl.store(v_col[None, :] + (dst * stride_vs)[:, None], v, mask=mask)
        tl.debug_barrier()  # and written before the next chunk reads


@functools.lru_cache(maxsize=64)
def _address_table(device: torch.device, ptrs: tuple[int, ...]) -> torch.Tensor:
    # Keyed by the addresses themselves, so a stale entry can only ever hold the same content.
    # Built once per buffer set (a host-to-device copy: warm it up before CUDA-graph capture).
    return torch.tensor(ptrs, dtype=torch.int64, device=device)


def _is_interpreted(kernel) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def launch_repack(
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
    rope=None,
    *,
    block_moves: int | None = None,
    num_warps: int | None = None,
    col_block: int | None = None,
) -> None:
    """Launch the repack kernel on validated arguments (see `sgl_vtoken.kernels.repack_kv_`).

    K and V go in one launch when their layer layouts match, else in one launch each.
    """
    device = src.device
    interpreted = _is_interpreted(_repack_kernel)
    if device.type == "cpu" and not interpreted:
        raise ValueError(
            "impl='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before "
            "sgl_vtoken.kernels.repack is first imported, or use impl='torch'"
        )
    if device.type != "cpu" and interpreted:
        raise ValueError(
            "the repack kernel reads per-layer addresses from a table, which the Triton interpreter cannot "
            "map to device memory: run it compiled (TRITON_INTERPRET unset) or pass CPU tensors"
        )
    if col_block is not None and (col_block < 1 or col_block & (col_block - 1)):
        raise ValueError(f"col_block must be a power of 2, got {col_block}")
    n = src.numel()
    if n == 0:
        return
    src, dst = src.contiguous(), dst.contiguous()
    k0, v0 = k_buffers[0], v_buffers[0]
    same_layout = k0.shape[1:] == v0.shape[1:] and k0.dtype == v0.dtype
    groups = [(k_buffers, v_buffers if same_layout else None, rope)]
    if not same_layout:
        groups.append((v_buffers, None, None))
    for keys, values, rp in groups:
        _launch_group(keys, values, src, dst, rp, n, block_moves, num_warps, col_block, interpreted)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _default_col_block(block_d: int, elem: int, programs_per_part: int, device, interpreted: bool) -> int:
    """Split heads into column parts until there are >= 4 programs per SM, keeping >= 128-byte rows."""
    if interpreted:
        return block_d
    col, target = block_d, 4 * _num_sms(device)
    while programs_per_part * (block_d // col) < target and (col // 2) * elem >= 128:
        col //= 2
    return col


def _launch_group(keys, values, src, dst, rope, n, block_moves, num_warps, col_block, interpreted):
    k0 = keys[0]
    device = k0.device
    num_layers = len(keys)
    _, heads, head_dim = k0.shape
    elem = k0.element_size()
    block_d = triton.next_power_of_2(head_dim)
    if rope is not None:
        col_block = block_d  # a rotation pairs columns across the whole rotary span of a head
    elif col_block is None:
        col_block = _default_col_block(block_d, elem, heads * num_layers, device, interpreted)
    col_block = min(col_block, block_d)
    parts = triton.cdiv(head_dim, col_block)
    if block_moves is None:
        if interpreted:
            block_moves = 16  # interpreter cost grows with ops, not with bytes: few fat chunks
        else:
            rows = _CHUNK_BYTES // (col_block * elem)
            if rope is not None:
                rows //= 4  # fp32 temporaries: keep the chunk in registers
            block_moves = max(8, min(256, triton.next_power_of_2(max(rows, 1))))
    if num_warps is None:
        num_warps = 4
    k_table = _address_table(device, tuple(t.data_ptr() for t in keys))
    v_table = k_table if values is None else _address_table(device, tuple(t.data_ptr() for t in values))
    v0 = k0 if values is None else values[0]
    if rope is not None:
        delta, cos_sin = rope.delta.contiguous(), rope.cos_sin_cache
        stride_cs, rot_dim = cos_sin.stride(0), cos_sin.shape[1]
        k_dtype = _FLOAT_TL[k0.dtype]
    else:
        delta, cos_sin, stride_cs, rot_dim = src, k_table, 0, 2
        k_dtype = _COPY_TL[elem]
    _repack_kernel[(heads * parts, num_layers)](
        k_table,
        v_table,
        src,
        dst,
        n,
        k0.stride(0),
        k0.stride(1),
        v0.stride(0),
        v0.stride(1),
        delta,
        cos_sin,
        stride_cs,
        K_DTYPE=k_dtype,
        V_DTYPE=_COPY_TL[v0.element_size()],
        HAS_V=values is not None,
        D=head_dim,
        BLOCK_D=col_block,
        PARTS=parts,
        BLOCK_M=block_moves,
        ROPE=rope is not None,
        ROT_DIM=rot_dim,
        NEOX=True if rope is None else rope.neox,
        num_warps=num_warps,
        num_stages=1,  # no software pipelining: loads of chunk c+1 must not start before stores of c
        # no mul+add -> fma contraction: the RoPE maths then rounds exactly like the torch reference
        enable_fp_fusion=False,
    )
