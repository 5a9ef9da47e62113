"""Attention statistics for H2O, TOVA and Scissorhands, which fused attention never exposes.

AROUND every `RadixAttention.forward`: after the layer's attention, the probabilities of each
scored request's queries over its row are recomputed from the same q and cached keys, summed per
KV group and staged per request (`Stats`): at decode the batch's new queries, one launch per
layer; at prefill the last `obs_window` prompt queries; for recall a first chunk's window's mass
on the host candidates (`RecallPlan`). The eviction step folds the staged blocks before it
chooses, so a choice at step t sees every query up to t - 1. Blocks and statistics stay on the
pool's device. Details: docs/design/step.md, "Attention statistics".
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

from sgl_vtoken.decode_scores import DecodeScoring
from sgl_vtoken.graph_scores import GraphScoring
from sgl_vtoken.policies.base import EvictionPolicy
from sgl_vtoken.prefill_scores import PrefillScoring
from sgl_vtoken.recall import candidate_mass
from sgl_vtoken.stats import RowStats

from ..cache import host_recall
from ..core.process import process
from ..core.state import state_of
from ..core.tp import tp_gather
from .prefill import evicts_in_prefill

if TYPE_CHECKING:
    from ..core.process import ScoringPart
    from ..core.sglang_types import (
        AttentionLayer,
        ForwardBatch,
        KVPool,
        ModelRunner,
        Req,
        ScheduleBatch,
        TpGroup,
    )
    from ..core.state import ReqEvictState


@dataclass
class Stats:
    """A request's attention statistics (`st.stats`): the policy's row-indexed accumulator (None
    when its policy reads no attention) and the probabilities staged for it, one
    ``([q, n, layers, kv_heads], [q] lengths)`` per forward (`prepare` allocates, the attention
    layers fill them)."""

    accumulator: RowStats | None = None
    staged: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def fold(self, tp_group: TpGroup | None = None) -> None:
        """Fold the staged probabilities into the accumulator, oldest block first (an eviction's
        start). With tensor parallelism every rank folds every rank's KV heads."""
        if self.accumulator is None:
            return
        for block, lengths in self.staged:
            self.accumulator.update(tp_gather(block, tp_group, dim=-1), lengths)
        self.staged.clear()

    def snapshot(self) -> torch.Tensor | None:
        """The statistics as they are now, for `restore` (a reference: statistics are replaced,
        never written in place)."""
        return None if self.accumulator is None else self.accumulator.state

    def restore(self, state: torch.Tensor | None) -> None:
        """Back to the statistics `state` (`snapshot`)."""
        if self.accumulator is not None:
            self.accumulator.state = state

    def select(self, keep: torch.Tensor) -> None:
        """The statistics follow the row: keep those of the row entries `keep` (any device)."""
        if self.accumulator is not None and self.accumulator.state is not None:
            self.accumulator.select(keep.to(self.accumulator.state.device))

    def recalled(self, back: int, n: int) -> None:
        """Recall: the row kept its first `back` entries, then `n` recalled ones joined it (their
        statistic starts at zero). The statistics may cover fewer than `back` entries (the chunk
        before `back` was not scored: a recalling chunk stages for recall only); the entries past
        them start at zero, as they would when first attended."""
        acc = self.accumulator
        if acc is not None and acc.state is not None:
            kept = min(back, acc.n)
            acc.select(torch.arange(kept, device=acc.state.device))
            acc.append_rows(back - kept + n)

    def reset(self, policy: EvictionPolicy | None = None) -> None:
        """Retraction: the staged blocks go; with `policy` the statistics start over."""
        self.staged.clear()
        if policy is not None:
            self.accumulator = policy.new_accumulator()


def scored_requests(batch: ScheduleBatch) -> list[tuple[int, Req, ReqEvictState]]:
    """(batch index, request, state) of the requests of `batch` whose policy reads attention or
    whose turn scores recall candidates (`host_tier.py`)."""
    return [
        (i, r, st)
        for i, r in enumerate(batch.reqs)
        if (st := state_of(r)) is not None
        and ("attn" in st.policy.needs or st.recall.plan is not None)
    ]


# The scored requests of the forward about to run, set when its ForwardBatch is built. The model
# may run on a copy of that ForwardBatch, so the plan is not kept on that object but on the
# process object (`process().scoring`): a scheduler process runs one forward at a time.


@dataclass
class Scored:
    """What the forward about to run scores (`process().scoring`), over the slot table
    `req_to_token`: a decode batch's requests (`decode`), a prefill's observation windows
    (`window`) and its recalling turns' windows (`recall`: ``(first query, queries, row, row
    length, score layers, recall plan)`` each, one at a time); or, while a decode CUDA graph is
    captured, every lane on static buffers (`graph`, `patches/graphs.py`)."""

    decode: DecodeScoring | None
    recall: list
    req_to_token: torch.Tensor
    graph: GraphScoring | None = None
    window: PrefillScoring | None = None


def prepare(
    forward_batch: ForwardBatch,
    scored: list[tuple[int, Req, ReqEvictState]],
    model_runner: ModelRunner,
) -> None:
    """Allocate each scored request's staging block for this forward (row lengths known now).

    Decode: one buffer for the batch, each request's block a view of it. Prefill: the observation
    window is the last `obs_window` queries of the whole prompt (with `prefill_chunk`, of each
    chunk evicted after it: the row up to the prefill peak); a forward stages those of its
    queries that fall in it (always a suffix of the forward): one buffer for the batch's windows,
    each block a view of it."""
    pool = model_runner.token_to_kv_pool
    num_layers, device = pool.layer_num, pool.get_key_buffer(0).device
    seq_lens = forward_batch.seq_lens_cpu.tolist()
    req_to_token = model_runner.req_to_token_pool.req_to_token
    if forward_batch.forward_mode.is_decode():  # recall plans score prefills only
        batch = [(i, req, st) for i, req, st in scored if "attn" in st.policy.needs]
        decode: DecodeScoring | None = None
        if batch:
            decode = DecodeScoring(
                [i for i, _, _ in batch],
                [req.kv.req_pool_idx for _, req, _ in batch],
                [seq_lens[i] for i, _, _ in batch],
                [st.cfg.scoring.layer_ids(num_layers) for _, _, st in batch],
                num_layers,
                pool.head_num,
                device,
            )
            for k, (_, _, st) in enumerate(batch):
                st.stats.staged.append(decode.block(k))
        process().scoring = Scored(decode, [], req_to_token)
        return
    ext = forward_batch.extend_seq_lens_cpu
    ends = list(itertools.accumulate(ext))  # each request's last query + 1
    windows, recalls = [], []
    for i, req, st in scored:
        # `n`: the row as far as this chunk reaches; the prompt (or its chunk) ends at `total`.
        n = seq_lens[i]
        total = (
            n
            if st.retract.resume_prefill
            else n + len(req.full_untruncated_fill_ids) - req.extend_end
        )
        if evicts_in_prefill(st, req):  # eviction during prefill: the window ends each chunk
            total = min(total, st.cfg.prefill_peak)
        pending = st.recall.plan
        if pending is not None and n > pending.end:  # not cut where its recall needs it
            quota = min(st.cfg.host.recall, int(pending.scores.numel()))
            host_recall.skipped(st, req.rid, quota, "cut")
            st.recall.reset()
        recall = st.recall.plan
        if recall is not None:  # a recalling turn: the window ends its first chunk
            total = min(total, recall.end)
        q = max(0, n - max(total - st.cfg.scoring.obs_window, n - ext[i]))
        if q == 0 or ("attn" not in st.policy.needs and recall is None):
            continue
        at = (ends[i] - q, q, req.kv.req_pool_idx, n, st.cfg.scoring.layer_ids(num_layers))
        if recall is not None:  # the first chunk's window only scores recall
            recall.stage(device)
            recalls.append((*at, recall))
        else:
            windows.append((at, st))
    window = None
    if windows:
        first, queries, rows, lengths, layers = (list(c) for c in zip(*(at for at, _ in windows)))
        window = PrefillScoring(
            first, queries, rows, lengths, layers, num_layers, pool.head_num, device
        )
        for k, (_, st) in enumerate(windows):
            st.stats.staged.append(window.block(k))
    process().scoring = Scored(None, recalls, req_to_token, window=window)


def clear() -> None:
    """No scored request in the forward about to run."""
    process().scoring = None


def around_radix_attention_forward(
    original: Callable[..., torch.Tensor],
    layer: AttentionLayer,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    forward_batch: ForwardBatch,
    *args: object,
    **kwargs: object,
) -> torch.Tensor:
    """AROUND `RadixAttention.forward`: run attention, then stage the probabilities."""
    out = original(layer, q, k, v, forward_batch, *args, **kwargs)
    scored = process().scoring
    if scored is not None:
        collect(layer, q, forward_batch, scored, get_token_to_kv_pool())
    return out


def offer_lse(layer_id: int, lse: torch.Tensor, base: str = "log2") -> None:
    """For an attention backend that computed this decode layer's log-sum-exp ``[bs, hq]``
    (FlashInfer's `return_lse`: base 2): the score launch uses it instead of recomputing it."""
    scored = process().scoring
    if scored is not None and scored.graph is not None:
        scored.graph.offer_lse(layer_id, lse, base)
    elif scored is not None and scored.decode is not None and scored.decode.scores(layer_id):
        scored.decode.offer_lse(layer_id, lse, base)


def wants_lse(layer_id: int) -> bool:
    """Whether this forward scores decode layer `layer_id` (`offer_lse` would be used)."""
    scored = process().scoring
    return scored is not None and (
        scored.graph is not None or (scored.decode is not None and scored.decode.scores(layer_id))
    )


@torch.no_grad()
def collect(
    layer: AttentionLayer,
    q: torch.Tensor,
    forward_batch: ForwardBatch,
    scored: ScoringPart,
    pool: KVPool,
) -> None:
    """Stage this layer's probabilities for every scored request."""
    q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
    k_buffer = pool.get_key_buffer(layer.layer_id)
    if scored.graph is not None:  # a decode CUDA graph being captured
        scored.graph.score(layer.layer_id, q, k_buffer, layer.scaling)
        return
    if scored.decode is not None:
        scored.decode.score(layer.layer_id, q, k_buffer, scored.req_to_token, layer.scaling)
    if scored.window is not None:
        scored.window.score(layer.layer_id, q, k_buffer, scored.req_to_token, layer.scaling)
    for first, nq, row, n, score_layers, recall in scored.recall:
        if score_layers is not None and layer.layer_id not in score_layers:
            continue
        # the window's attention over the row and the host candidates
        slots = scored.req_to_token[row, :n].to(torch.int64)
        t0 = time.perf_counter()
        recall.score(
            candidate_mass(
                q[first : first + nq],
                k_buffer[slots],
                torch.arange(n - nq + 1, n + 1),
                recall.layer_keys(layer.layer_id),
                layer.scaling,
            ),
            t0,
        )
