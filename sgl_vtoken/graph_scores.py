"""Decode scoring a CUDA graph can capture: static buffers, loaded outside the graph.

A captured decode forward runs the same launches on the same addresses at every replay, so the
scoring it captures may not size, allocate or read anything by the batch's data. `GraphScoring`
holds, once per graph runner, buffers for its largest captured batch size `max_bs` and a row
bound `bound` (the evicting rows' peak: budget + interval + page_size):

    indptr      [max_bs + 1] int64   lane b's entries are indptr[b] .. indptr[b+1]
    kv_indices  [max_bs * bound]     their slots (entries past indptr[bs] are never read)
    buf         [max_bs * bound, layers, kv_heads] float32, scored by entry

A graph of batch size `bs` captures `score` on views of them (one `attn_scores_` launch per
layer, every lane's query). Before each replay `load` writes the real batch's CSR (lanes that
are not scored, and the graph's padding lanes, get no entries); after it, `unload` copies the
scored entries into the eager `DecodeScoring`'s buffer, whose blocks the requests staged:

    lanes     0 (scored, n=3)   1 (not scored)   2 (scored, n=2)   3 (padding)
    entries   [0 1 2]           []               [3 4]             []          ... unused
    eager     DecodeScoring.buf rows 0..2 = request 0, rows 3..4 = request 1: the same layout

A batch with a row longer than `bound`, or more lanes than `max_bs`, does not fit (`fits`): the
caller runs that forward eagerly. Every layer is captured; a request that scores fewer layers
gets zeros in the others after `unload`, as the eager path gives it. Layout: docs/design/step.md,
"Decode scoring under CUDA graphs".
"""

from __future__ import annotations

import torch

from sgl_vtoken.decode_scores import DecodeScoring
from sgl_vtoken.kernels import attn_scores_


class GraphScoring:
    """Static decode scoring buffers of one graph runner.

    Args:
        max_bs: the largest captured batch size.
        bound: the most row entries one lane may score (budget + interval + page_size).
        num_layers, kv_heads: the pool's layers and KV heads (this rank's).
        device: the pool's device.
    """

    def __init__(
        self, max_bs: int, bound: int, num_layers: int, kv_heads: int, device: torch.device | str
    ) -> None:
        if max_bs < 1 or bound < 1:
            raise ValueError(f"max_bs and bound must be >= 1, got {max_bs} and {bound}")
        self.max_bs, self.bound, self.num_layers = max_bs, bound, num_layers
        self.indptr = torch.zeros(max_bs + 1, dtype=torch.int64, device=device)
        self.kv_indices = torch.zeros(max_bs * bound, dtype=torch.int64, device=device)
        self.buf = torch.zeros(
            max_bs * bound, num_layers, kv_heads, dtype=torch.float32, device=device
        )
        self._lse: dict[int, tuple[torch.Tensor, str]] = {}
        self.bs = 0  # the batch size `score` captures / `load` fills

    def nbytes(self) -> int:
        """Device bytes the buffers hold."""
        return sum(t.numel() * t.element_size() for t in (self.indptr, self.kv_indices, self.buf))

    # --- inside the graph ----------------------------------------------------------------------
    def capture(self, bs: int) -> None:
        """The next `score` calls are captured for batch size `bs` (<= max_bs)."""
        if not 1 <= bs <= self.max_bs:
            raise ValueError(f"bs must be in [1, {self.max_bs}], got {bs}")
        self.bs = bs

    def offer_lse(self, layer: int, lse: torch.Tensor, base: str) -> None:
        """The attention's log-sum-exp of this layer's ``[bs, hq]`` queries (a captured tensor)."""
        self._lse[layer] = (lse, base)

    def score(self, layer: int, q: torch.Tensor, k_buffer: torch.Tensor, scale: float) -> None:
        """Score `layer` for every lane: `q` ``[bs, hq, d]``, `k_buffer` ``[num_slots, hkv, d]``.
        One launch on static views: no allocation, no host read, no shape that depends on data."""
        lse, base = self._lse.pop(layer, (None, "ln"))
        bs = self.bs
        attn_scores_(
            q,
            k_buffer,
            self.indptr[: bs + 1],
            self.kv_indices[: bs * self.bound],
            self.buf[: bs * self.bound, layer],
            scale,
            lse=lse,
            lse_base=base,
            decay=0.0,
            by_entry=True,
        )

    # --- outside the graph ---------------------------------------------------------------------
    def fits(self, decode: DecodeScoring, bs: int) -> bool:
        """Whether `decode`'s batch replays in the graph of batch size `bs`."""
        return bs <= self.max_bs and max(decode.lengths, default=0) <= self.bound

    def load(self, decode: DecodeScoring, bs: int, req_to_token: torch.Tensor) -> None:
        """Write `decode`'s batch (its forward padded to `bs` lanes) into the static CSR: one
        host-to-device copy of the offsets, one gather of the slots (before the replay)."""
        if not self.fits(decode, bs):
            raise ValueError(f"the batch does not fit the graph of batch size {bs} (see fits)")
        lane_len = [0] * bs
        for lane, n in zip(decode.q_rows, decode.lengths):
            lane_len[lane] = n
        indptr = [0]
        for n in lane_len:
            indptr.append(indptr[-1] + n)
        self.bs = bs
        self.indptr[: bs + 1].copy_(torch.tensor(indptr, dtype=torch.int64), non_blocking=True)
        nnz = decode.starts[-1]
        if nnz:
            self.kv_indices[:nnz].copy_(decode.slots(req_to_token))

    def unload(self, decode: DecodeScoring) -> None:
        """After the replay: the scored entries into `decode`'s buffer (one copy), zero in the
        layers a request does not score."""
        decode.buf.copy_(self.buf[: decode.starts[-1]])
        decode.zero_unscored()
