"""Pure-torch oracles, one per kernel: the CPU implementation and the tests' ground truth.

They take already-validated arguments (the public functions in `sgl_vtoken.kernels` validate) and
favour plain indexing over speed. Copies go through integer views, so fp8 and NaN payloads survive
bit for bit; RoPE and softmax maths run in fp32.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class Rope(Protocol):
    """What the repack reference reads of a `RopeShift` (`repack_api.py` imports this module)."""

    @property
    def delta(self) -> torch.Tensor: ...

    @property
    def cos_sin_cache(self) -> torch.Tensor: ...

    @property
    def neox(self) -> bool: ...


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw(t: torch.Tensor) -> torch.Tensor:
    """The same memory viewed as integers of the element's width (bytes preserved exactly)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


# --------------------------------------------------------------------------------------------
# repack
# --------------------------------------------------------------------------------------------
def rope_cos_sin_ref(
    delta: torch.Tensor,  # [n] int, rotation in positions (new_pos - old_pos)
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] cos | sin halves, as SGLang's RotaryEmbedding
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of `delta` (each [n, rot_dim // 2] fp32), using sin(-x) = -sin(x)."""
    half = cos_sin_cache.shape[1] // 2
    rows = cos_sin_cache[delta.abs().long()].float()
    cos, sin = rows[:, :half], rows[:, half:]
    return cos, torch.where((delta < 0)[:, None], -sin, sin)


def rope_rotate_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool
) -> torch.Tensor:
    """Rotate the first 2*cos.shape[-1] dims of x [n, H, D] (fp32); the rest pass through."""
    rot = 2 * cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    if neox:  # rotate-half: pairs (i, i + rot/2)
        x1, x2 = x[..., : rot // 2], x[..., rot // 2 : rot]
        y = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:  # GPT-J interleaved: pairs (2i, 2i + 1)
        x1, x2 = x[..., 0:rot:2], x[..., 1:rot:2]
        y = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    return torch.cat((y, x[..., rot:]), dim=-1)


def repack_kv_ref_(
    k_buffers: list[torch.Tensor],  # L x [num_slots, H, D]
    v_buffers: list[torch.Tensor],  # L x [num_slots, Hv, Dv]
    src: torch.Tensor,  # [n] int32/int64
    dst: torch.Tensor,  # [n] int32/int64
    rope: Rope | None = None,  # a RopeShift
) -> None:
    """buf[dst] = buf[src] for every K and V layer, gathering all sources before scattering.

    With `rope`, moved K rows are re-rotated by `rope.delta` in fp32 and cast back; V is copied.
    """
    if src.numel() == 0:
        return
    s, d = src.long(), dst.long()
    if rope is not None:
        cos, sin = rope_cos_sin_ref(rope.delta, rope.cos_sin_cache)
    for k in k_buffers:
        if rope is None:
            raw(k)[d] = raw(k)[s]
        else:
            k[d] = rope_rotate_ref(k[s].float(), cos, sin, rope.neox).to(k.dtype)
    for v in v_buffers:
        raw(v)[d] = raw(v)[s]


# --------------------------------------------------------------------------------------------
# page indices
# --------------------------------------------------------------------------------------------
def page_indices_ref(
    req_to_token: torch.Tensor,  # [max_reqs, max_ctx] int32 slot ids
    req_pool_indices: torch.Tensor,  # [bs] int
    seq_lens: torch.Tensor,  # [bs] int
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's paged-KV CSR triple for page-dense rows.

    Returns kv_indptr [bs+1] int32, kv_indices [total_pages] int32 (page id = first slot of the page
    // page_size) and kv_last_page_len [bs] int32 (0 for an empty row, else 1..page_size).
    """
    dev = req_to_token.device
    lens = seq_lens.long()
    num_pages = (lens + page_size - 1) // page_size
    kv_indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = torch.cumsum(num_pages, 0).to(torch.int32)
    pages = [
        req_to_token[int(r), 0 : int(n) : page_size] // page_size
        for r, n in zip(req_pool_indices.tolist(), lens.tolist())
    ]
    kv_indices = (
        torch.cat(pages).to(torch.int32) if pages else torch.empty(0, dtype=torch.int32, device=dev)
    )
    last = torch.where(lens > 0, lens - (num_pages - 1) * page_size, torch.zeros_like(lens)).to(
        torch.int32
    )
    return kv_indptr, kv_indices, last


# --------------------------------------------------------------------------------------------
# attention scores
# --------------------------------------------------------------------------------------------
LN2 = math.log(2.0)


def attn_lse_ref(
    q: torch.Tensor,  # [bs, Hq, D]
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    kv_indptr: torch.Tensor,  # [bs+1]
    kv_indices: torch.Tensor,  # [>= kv_indptr[-1]] token slots
    sm_scale: float,
) -> torch.Tensor:
    """Natural-log log-sum-exp of the decode logits, [bs, Hq] fp32 (-inf for an empty row)."""
    bs, hq, _ = q.shape
    group = hq // k_buffer.shape[1]
    out = torch.full((bs, hq), -math.inf, dtype=torch.float32, device=q.device)
    for b in range(bs):
        lo, hi = int(kv_indptr[b]), int(kv_indptr[b + 1])
        if hi > lo:
            out[b] = torch.logsumexp(
                _logits(q[b], k_buffer, kv_indices[lo:hi], group, sm_scale), dim=-1
            )
    return out


def _logits(
    qb: torch.Tensor, k_buffer: torch.Tensor, slots: torch.Tensor, group: int, sm_scale: float
) -> torch.Tensor:  # [Hq, n] fp32
    k = k_buffer[slots.long()].float()  # [n, Hkv, D]; query head h reads KV head h // group
    q = qb.float().view(k.shape[1], group, -1)  # [Hkv, group, D]
    return torch.einsum("kgd,nkd->kgn", q, k).reshape(qb.shape[0], -1) * sm_scale


def attn_scores_ref_(
    q: torch.Tensor,  # [bs, Hq, D]
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    kv_indptr: torch.Tensor,  # [bs+1]
    kv_indices: torch.Tensor,  # [>= kv_indptr[-1]]
    score: torch.Tensor,  # [num_slots] or [num_slots, Hkv] fp32, updated in place
    sm_scale: float,
    lse: torch.Tensor | None = None,  # [bs, Hq]
    lse_base: str = "ln",
    decay: float = 1.0,
    by_entry: bool = False,  # score is [nnz] / [nnz, Hkv], indexed like kv_indices
) -> None:
    """score[s] = decay * score[s] + sum of softmax probabilities that the batch gives slot s
    (decay 0 overwrites; decay != 1 assumes each slot is read by one row only); `by_entry`:
    score[e] the same for entry e of kv_indices (each entry belongs to one row).

    Probabilities are summed over the query heads of each KV head's group (score [num_slots, Hkv])
    or over all heads (score [num_slots]); a slot read by several rows gets every row's share.
    """
    bs, hq, _ = q.shape
    hkv = k_buffer.shape[1]
    group = hq // hkv
    lse_ln = None if lse is None else lse.float() * (LN2 if lse_base == "log2" else 1.0)
    for b in range(bs):
        lo, hi = int(kv_indptr[b]), int(kv_indptr[b + 1])
        if hi <= lo:
            continue
        slots = kv_indices[lo:hi].long()
        logits = _logits(q[b], k_buffer, slots, group, sm_scale)  # [Hq, n]
        row_lse = torch.logsumexp(logits, dim=-1) if lse_ln is None else lse_ln[b]
        p = torch.exp(logits - row_lse[:, None])
        p = p.view(hkv, group, -1).sum(1).t()  # [n, Hkv]
        if score.ndim == 1:
            p = p.sum(1)
        at = torch.arange(lo, hi, device=score.device) if by_entry else slots
        if decay == 1.0:
            score.index_add_(0, at, p)
        elif decay == 0.0:  # overwrite: stale inf/nan scores must not leak through 0 * x
            score[at] = p
        else:
            score[at] = decay * score[at] + p
