"""Decode attention statistics of a whole batch: one score launch per scored layer.

Each scored request's decode query attends to its row; the probabilities per row entry, summed
over the query heads of each KV head, are what H2O, TOVA and Scissorhands accumulate. The rows
are concatenated and scored by entry (`attn_scores_(by_entry=True)`) into one
``[nnz, layers, kv_heads]`` float32 buffer (request k's block: its ``n_k`` entries), sized by the
batch's rows, never by the pool; requests scoring other layers are scattered in after their
layer's launch. No host synchronization. Layout: docs/design/step.md, "Decode scoring".
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_vtoken.kernels import attn_scores_


def layer_groups(layers: list, num_layers: int) -> dict[int, tuple]:
    """Per layer, the requests that score it (indices, ascending; layers none scores are left
    out): `layers[k]` is request k's scored layer ids, None for every layer."""
    groups = {}
    for layer in range(num_layers):
        members = tuple(k for k, ls in enumerate(layers) if ls is None or layer in ls)
        if members:
            groups[layer] = members
    return groups


def entry_columns(
    lengths: torch.Tensor, offsets: torch.Tensor, nnz: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each entry's row and column ``[nnz]`` int64 of CSR rows of `lengths` ``[b]`` starting at
    `offsets` ``[b + 1]`` (device tensors; `nnz` their total, known on the host: no sync)."""
    rows = torch.arange(lengths.numel(), device=lengths.device)
    owner = torch.repeat_interleave(rows, lengths, output_size=nnz)
    return owner, torch.arange(nnz, device=lengths.device) - offsets[owner]


class _Slots(NamedTuple):
    """A group's launch arguments on the device (built at its first layer): the members' query
    rows, CSR offsets and slots, and (a subset only) each entry's place in the buffer."""

    q_rows: torch.Tensor
    indptr: torch.Tensor
    kv_indices: torch.Tensor
    entries: torch.Tensor | None


class _Group:
    """The requests that score one layer (`members`: their indices in the scoring, ascending)."""

    def __init__(self, members: list[int], everyone: bool):
        self.members, self.everyone = members, everyone
        self.slots: _Slots | None = None


class DecodeScoring:
    """One decode forward's scored requests.

    Args:
        q_rows: each request's row in the forward's queries (its batch index).
        rows: each request's `req_to_token` row.
        lengths: its row length n (the keys its query sees).
        layers: each request's scored layer ids (None: every layer).
        num_layers, kv_heads: the pool's layers and KV heads (this rank's).
        device: the pool's device.
    """

    def __init__(
        self,
        q_rows: list[int],
        rows: list[int],
        lengths: list[int],
        layers: list[tuple[int, ...] | None],
        num_layers: int,
        kv_heads: int,
        device: torch.device | str,
    ) -> None:
        self.q_rows, self.rows, self.lengths, self.layers = q_rows, rows, lengths, layers
        self.starts = [0]
        for n in lengths:
            self.starts.append(self.starts[-1] + n)
        self.device = device
        self.buf = torch.zeros(
            self.starts[-1], num_layers, kv_heads, dtype=torch.float32, device=device
        )
        # [B] keys seen by each query, one host-to-device copy; request k's is a view
        self.key_counts = torch.tensor(lengths, dtype=torch.int64).to(device, non_blocking=True)
        by_members: dict[tuple, _Group] = {}
        self.groups: dict[int, _Group] = {
            layer: by_members.setdefault(m, _Group(list(m), len(m) == len(rows)))
            for layer, m in layer_groups(layers, num_layers).items()
        }
        self._lse: dict[int, tuple[torch.Tensor, str]] = {}

    def block(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request `k`'s staged block ``[1, n, layers, kv_heads]`` (a view of the buffer, filled as
        the layers run) and its query's key count ``[1]`` int64."""
        return self.buf[self.starts[k] : self.starts[k + 1]].unsqueeze(0), self.key_counts[
            k : k + 1
        ]

    def scores(self, layer: int) -> bool:
        """Whether some request scores `layer`."""
        return layer in self.groups

    def offer_lse(self, layer: int, lse: torch.Tensor, base: str) -> None:
        """The attention backend's log-sum-exp of this layer's decode queries, ``[bs, hq]`` float32
        (every query of the forward; `base` "ln" or "log2"): the score launch then reads K once."""
        self._lse[layer] = (lse, base)

    def score(
        self,
        layer: int,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        scale: float,
    ) -> None:
        """Score `layer`: `q` ``[bs, hq, d]`` the forward's decode queries, `k_buffer` the layer's
        ``[num_slots, hkv, d]`` keys. One `attn_scores_` launch (plus one scatter for a subset)."""
        group = self.groups.get(layer)
        lse, base = self._lse.pop(layer, (None, "ln"))
        if group is None:
            return
        if group.slots is None:
            group.slots = self._build(group, req_to_token)
        s = group.slots
        q = q.index_select(0, s.q_rows)
        if lse is not None:
            lse = lse.index_select(0, s.q_rows).float()
        out = (
            self.buf[:, layer]
            if s.entries is None
            else torch.empty(
                s.kv_indices.numel(), self.buf.shape[2], dtype=torch.float32, device=self.device
            )
        )
        attn_scores_(
            q,
            k_buffer,
            s.indptr,
            s.kv_indices,
            out,
            scale,
            lse=lse,
            lse_base=base,
            decay=0.0,
            by_entry=True,
        )
        if s.entries is not None:
            self.buf[:, layer].index_copy_(0, s.entries, out)

    def slots(self, req_to_token: torch.Tensor) -> torch.Tensor:
        """``[nnz]`` int64 every scored request's row slots, in buffer order (the CSR a captured
        graph scores: `graph_scores.GraphScoring.load`)."""
        return self._build(_Group(list(range(len(self.rows))), True), req_to_token).kv_indices

    def zero_unscored(self) -> None:
        """Zero each request's entries in the layers it does not score (a graph scores all)."""
        for k, ls in enumerate(self.layers):
            other = [] if ls is None else [x for x in range(self.buf.shape[1]) if x not in ls]
            if other:
                self.buf[self.starts[k] : self.starts[k + 1], other] = 0

    def _build(self, group: _Group, req_to_token: torch.Tensor) -> _Slots:
        """The group's query rows, CSR offsets and slots (gathered from `req_to_token`), and its
        entries' places in the buffer; host lists go over in one copy."""
        m = group.members
        lens = [self.lengths[k] for k in m]
        indptr = [0]
        for n in lens:
            indptr.append(indptr[-1] + n)
        nnz = indptr[-1]
        host = torch.tensor(
            [
                *(self.q_rows[k] for k in m),
                *(self.rows[k] for k in m),
                *lens,
                *indptr,
                *(self.starts[k] for k in m),
            ],
            dtype=torch.int64,
        )
        dev = host.to(self.device, non_blocking=True)
        b = len(m)
        q_rows, rows, lens_d = dev[:b], dev[b : 2 * b], dev[2 * b : 3 * b]
        offsets, first = dev[3 * b : 4 * b + 1], dev[4 * b + 1 :]
        owner, col = entry_columns(lens_d, offsets, nnz)
        entries = None if group.everyone else first[owner] + col
        return _Slots(q_rows, offsets, req_to_token[rows[owner], col], entries)
