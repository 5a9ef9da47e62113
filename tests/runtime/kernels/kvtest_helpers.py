"""Builders shared by the kernel tests: random KV pools, page-dense rows, compaction move lists,
and the repacker run both ways."""

from __future__ import annotations

import math

import torch

from sgl_vtoken.kernels import repack_kv_

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_SIZE[t.element_size()])


def random_bytes(shape, dtype, g: torch.Generator, device) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, infs, denormals included): copies must keep them."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    device = torch.device(device)
    if device.type == "cpu":
        b = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
    else:  # multi-GB GPU pools: draw on the device, seeded from g (still deterministic)
        gd = torch.Generator(device=device).manual_seed(
            int(torch.randint(0, 2**62, (1,), generator=g))
        )
        b = torch.randint(0, 256, (nbytes,), generator=gd, dtype=torch.uint8, device=device)
    return b.view(dtype).view(shape)


def random_layers(num_layers, num_slots, heads, dim, dtype, g, device) -> list[torch.Tensor]:
    """One separately allocated [num_slots, heads, dim] tensor per layer, as SGLang's pool."""
    return [random_bytes((num_slots, heads, dim), dtype, g, device) for _ in range(num_layers)]


def assert_same_bytes(got, expected, what="buffer"):
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(raw(a).cpu(), raw(b).cpu()), f"{what}[{i}] differs"


def disjoint_moves(num_slots, n, idx_dtype, g, device):
    perm = torch.randperm(num_slots, generator=g)
    return perm[:n].to(idx_dtype).to(device), perm[n : 2 * n].to(idx_dtype).to(device)


def page_dense_rows(page_size, lens, num_pages, g):
    """Rows of slot ids on randomly chosen whole pages (page 0 is left out as SGLang's pad page)."""
    need = sum((n + page_size - 1) // page_size for n in lens)
    assert need < num_pages, (need, num_pages)
    pages = (torch.randperm(num_pages - 1, generator=g) + 1)[:need].tolist()
    rows, used = [], 0
    for n in lens:
        k = (n + page_size - 1) // page_size
        slots = [p * page_size + j for p in pages[used : used + k] for j in range(page_size)][:n]
        rows.append(slots)
        used += k
    return rows


def compaction_moves(rows, keeps, starts):
    """The planner's in-place compaction: the k-th kept token of row[start:] moves to row[start + k].

    rows: lists of slots; keeps: bool lists over row[start:]; starts: first private position.
    Moves with src == dst are dropped; rows are concatenated in order.
    """
    src, dst = [], []
    for row, keep, start in zip(rows, keeps, starts):
        kept = [p for p, k in zip(range(start, len(row)), keep) if k]
        for k, p in enumerate(kept):
            if row[p] != row[start + k]:
                src.append(row[p])
                dst.append(row[start + k])
    return src, dst


def rope_cache(max_pos, rot_dim, base=10000.0, dtype=torch.float32):
    """cos | sin table in the layout of SGLang's RotaryEmbedding.cos_sin_cache."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two same-dtype float tensors."""
    ia, ib = raw(a).long(), raw(b).long()
    bits = a.element_size() * 8
    # map sign-magnitude to a monotonic integer line
    ia = torch.where(ia < 0, -(ia & ((1 << (bits - 1)) - 1)), ia)
    ib = torch.where(ib < 0, -(ib & ((1 << (bits - 1)) - 1)), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def run_both(keys, values, src, dst, **kw):
    """Reference on clones, Triton in place; returns (expected K, expected V)."""
    k_exp, v_exp = [t.clone() for t in keys], [t.clone() for t in values]
    repack_kv_(
        k_exp,
        v_exp,
        src,
        dst,
        impl="torch",
        **{k: v for k, v in kw.items() if k in ("rope", "check")},
    )
    repack_kv_(keys, values, src, dst, impl="triton", **kw)
    return k_exp, v_exp


def bufs(device, n=2, **kw):
    shape = kw.get("shape", (16, 2, 8))
    dtype = kw.get("dtype", torch.float16)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
