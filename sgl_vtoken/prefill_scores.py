"""Prefill observation windows of a whole batch: one score launch per scored layer.

An attention policy's statistics start from the last `obs_window` queries of the prompt
(SnapKV-style): window query j of request k sees the first ``n_k - q_k + 1 + j`` keys of its
row (causal). Every window query of every scored request is one row of an
`attn_scores_(by_entry=True)` launch over those keys; its entries are copied into the request's
block ``[q_k, n_k, layers, kv_heads]`` (zero past each query's keys, and in the layers the
request does not score):

    launch rows   | k=0 j=0: n0-q0+1 keys | k=0 j=1: n0-q0+2 | ... | k=1 j=0: ... |
    buf           [sum of q_k * n_k, layers, kv_heads] float32; block k = a view of it
                  entry (k, j, col) -> buf[base_k + j * n_k + col]

Index lists are built on the host from the plan's lengths and go over in one copy; no host
synchronization. That is the GPU path (`batched`, the default on CUDA). On a CPU the kernel's
torch reference walks the launch rows one by one, so there each request's window is one explicit
softmax instead (`recall.window_probs`, 3-4x faster than the reference), into the same blocks.
Layout: docs/design/step.md, "Attention statistics".
"""

from __future__ import annotations

import torch

from sgl_vtoken.decode_scores import entry_columns, layer_groups
from sgl_vtoken.kernels import attn_scores_
from sgl_vtoken.recall import window_probs


class PrefillScoring:
    """One prefill forward's scored windows.

    Args:
        first: each request's first window query in the forward's queries.
        queries: its window's queries q_k (the last of its forward's queries).
        rows: its `req_to_token` row.
        lengths: its row length n_k as far as the forward reaches.
        layers: its scored layer ids (None: every layer).
        num_layers, kv_heads: the pool's layers and KV heads (this rank's).
        device: the pool's device.
        batched: one launch per layer for every window (None: on CUDA), else one softmax per
            request and layer.
    """

    def __init__(
        self,
        first: list[int],
        queries: list[int],
        rows: list[int],
        lengths: list[int],
        layers: list[tuple[int, ...] | None],
        num_layers: int,
        kv_heads: int,
        device: torch.device | str,
        batched: bool | None = None,
    ) -> None:
        self.first, self.queries, self.rows, self.lengths = first, queries, rows, lengths
        self.device = device
        self.batched = torch.device(device).type == "cuda" if batched is None else batched
        self.bases = [0]
        for nq, n in zip(queries, lengths):
            self.bases.append(self.bases[-1] + nq * n)
        self.buf = torch.zeros(
            self.bases[-1], num_layers, kv_heads, dtype=torch.float32, device=device
        )
        self.groups = layer_groups(layers, num_layers)
        self._built: dict[tuple, tuple] = {}

    def block(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request `k`'s block ``[q_k, n_k, layers, kv_heads]`` (a view, filled as the layers
        run) and its queries' key counts ``[q_k]`` int64."""
        nq, n = self.queries[k], self.lengths[k]
        block = self.buf[self.bases[k] : self.bases[k + 1]].view(nq, n, *self.buf.shape[1:])
        return block, torch.arange(n - nq + 1, n + 1, device=self.device)

    def scores(self, layer: int) -> bool:
        """Whether some request scores `layer`."""
        return layer in self.groups

    def score(
        self,
        layer: int,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        scale: float,
    ) -> None:
        """Score `layer`: `q` ``[tokens, hq, d]`` the forward's queries, `k_buffer` the layer's
        ``[num_slots, hkv, d]`` keys. Batched: one `attn_scores_` launch and one copy into the
        blocks."""
        members = self.groups.get(layer)
        if members is None:
            return
        if not self.batched:
            for k in members:
                block, lengths = self.block(k)
                nq, n, hkv = block.shape[0], block.shape[1], block.shape[3]
                slots = req_to_token[self.rows[k], :n].to(torch.int64)
                window = q[self.first[k] : self.first[k] + nq]
                p = window_probs(window, k_buffer[slots], lengths, scale)  # [nq, hq, n]
                block[:, :, layer] = p.view(nq, hkv, -1, n).sum(dim=2).transpose(1, 2)
            return
        if members not in self._built:
            self._built[members] = self._build(members, req_to_token)
        q_rows, indptr, slots, dest = self._built[members]
        out = torch.empty(slots.numel(), self.buf.shape[2], dtype=torch.float32, device=self.device)
        attn_scores_(
            q.index_select(0, q_rows), k_buffer, indptr, slots, out, scale, decay=0.0, by_entry=True
        )
        self.buf[:, layer].index_copy_(0, dest, out)

    def _build(
        self, members: tuple, req_to_token: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The launch rows of `members`' window queries: query rows, CSR offsets, slots and each
        entry's place in the buffer (host lists, one copy)."""
        q_rows, rows, lens, places = [], [], [], []
        for k in members:
            nq, n = self.queries[k], self.lengths[k]
            for j in range(nq):
                q_rows.append(self.first[k] + j)
                rows.append(self.rows[k])
                lens.append(n - nq + 1 + j)
                places.append(self.bases[k] + j * n)
        indptr = [0]
        for m in lens:
            indptr.append(indptr[-1] + m)
        nnz, b = indptr[-1], len(lens)
        host = torch.tensor([*q_rows, *rows, *lens, *places, *indptr], dtype=torch.int64)
        dev = host.to(self.device, non_blocking=True)
        q_rows_d, rows_d, lens_d, places_d = (dev[i * b : (i + 1) * b] for i in range(4))
        offsets = dev[4 * b :]
        owner, col = entry_columns(lens_d, offsets, nnz)
        return q_rows_d, offsets, req_to_token[rows_d[owner], col], places_d[owner] + col
