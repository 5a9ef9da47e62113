"""Attention statistics for H2O, TOVA and Scissorhands, which fused attention never exposes.

AROUND every `RadixAttention.forward`: after the layer's attention ran (and wrote this step's K
into the cache), the probabilities of each scored request's queries over its row are recomputed
from the same post-RoPE q and cached keys, summed over the query heads of each KV group, and
staged per request as ``[q, n, layers, kv_heads]``:

    decode   the one new query over the row it attended to (kept tokens + itself)
    prefill  the last `obs_window` prompt queries, causally (SnapKV-style observation window);
             with chunked prefill each chunk stages the window's queries that fall in it, over
             the row as far as the chunk reaches, and all blocks are folded in order
    recall   a turn with host-tier candidates (`host_recall.py`, any policy): the last
             `obs_window` queries of its first prefill chunk, their mass on the candidates,
             scored over the row and the candidates together
             (`sgl_vtoken.recall.candidate_mass`), summed into its `RecallPlan`; the policy
             stages nothing from that chunk (its window is recomputed by the second chunk, whose
             last `obs_window` queries are the prompt's observation window)

The eviction hook folds the staged block into the request's accumulator (`sgl_vtoken.stats`;
both are its `Stats`) before choosing victims, so a choice at step t uses every query up to t - 1,
as in H2O. The statistics are row-indexed: they follow the row through `select(keep)` (they move
with the KV) and vanish with the evicted tokens. With tensor parallelism each rank scores its own KV heads;
the eviction hook gathers all heads over the TP group first, so every rank sees the same scores
and evicts the same tokens. Blocks and statistics stay on the pool's device: nothing here or in
the eviction step copies them to the host.

CPU/torch path; on CUDA it runs eagerly, so decode CUDA graphs must be off (checked at start-up).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

from sgl_vtoken.kernels import attn_scores_
from sgl_vtoken.policies.base import EvictionPolicy
from sgl_vtoken.recall import candidate_mass, window_probs
from sgl_vtoken.stats import RowStats

from ..cache import host_tier
from ..state import state_of
from ..surface import shortage
from ..tp import tp_gather
from .prefill import evicts_in_prefill


@dataclass
class Stats:
    """A request's attention statistics (`st.stats`): the policy's row-indexed accumulator (None
    when its policy reads no attention) and the probabilities staged for it, one
    ``([q, n, layers, kv_heads], [q] lengths)`` per forward (`prepare` allocates, the attention
    layers fill them)."""

    accumulator: RowStats | None = None
    staged: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def fold(self, tp_group=None) -> None:
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
        statistic starts at zero)."""
        if self.accumulator is not None and self.accumulator.state is not None:
            self.accumulator.select(torch.arange(back, device=self.accumulator.state.device))
            self.accumulator.append_rows(n)

    def reset(self, policy: EvictionPolicy | None = None) -> None:
        """Retraction: the staged blocks go; with `policy` the statistics start over."""
        self.staged.clear()
        if policy is not None:
            self.accumulator = policy.new_accumulator()


def scored_requests(batch) -> list:
    """(batch index, request, state) of the requests of `batch` whose policy reads attention or
    whose turn scores recall candidates (`host_tier.py`)."""
    return [(i, r, st) for i, r in enumerate(batch.reqs)
            if (st := state_of(r)) is not None and ("attn" in st.policy.needs or st.recall.plan is not None)]


# The scored requests of the forward about to run, set when its ForwardBatch is built. The model
# may run on a copy of that ForwardBatch, so the plan is not kept on that object but on the model
# runner's KV pool, one per scheduler process, which runs one forward at a time: attention layers
# reach the same object through the forward context (`get_token_to_kv_pool`: every attention
# backend holds `model_runner.token_to_kv_pool`), as `pool._vtoken_scored`.


def prepare(forward_batch, scored: list, model_runner) -> None:
    """Allocate each scored request's staging block for this forward (row lengths known now).

    Prefill: the observation window is the last `obs_window` queries of the whole prompt (with
    `prefill_chunk`, of each chunk evicted after it: the row up to the prefill peak); a forward
    stages those of its queries that fall in it (always a suffix of the forward)."""
    pool = model_runner.token_to_kv_pool
    num_layers, device = pool.layer_num, pool.get_key_buffer(0).device
    decode = forward_batch.forward_mode.is_decode()
    seq_lens = forward_batch.seq_lens_cpu.tolist()
    plan = []
    for i, req, st in scored:
        n = seq_lens[i]
        if decode:
            q = 1
        else:  # n: the row as far as this chunk reaches; the prompt (or its chunk) ends at `total`
            total = n if st.retract.resume_prefill else n + len(req.full_untruncated_fill_ids) - req.extend_end
            if evicts_in_prefill(st, req):  # eviction during prefill: the window ends each chunk
                total = min(total, st.cfg.prefill_peak)
            pending = st.recall.plan
            if pending is not None and n > pending.end:  # not cut where its recall needs it
                st.report["recall_skipped_tokens"] = min(st.cfg.host.recall, int(pending.candidates.numel()))
                host_tier.tier_of().count_skip()
                shortage.note("recall_skipped", req.rid)
                st.recall.reset()
            if st.recall.plan is not None:  # a recalling turn: the window ends its first chunk
                total = min(total, st.recall.plan.end)
            q = max(0, n - max(total - st.cfg.scoring.obs_window, n - forward_batch.extend_seq_lens_cpu[i]))
        recall = None if decode else st.recall.plan
        if q == 0 or ("attn" not in st.policy.needs and recall is None):
            continue
        block = None
        if "attn" in st.policy.needs and recall is None:  # the first chunk's window only scores recall
            block = torch.zeros(q, n, num_layers, pool.head_num, device=device)  # where the KV lives
            st.stats.staged.append((block, torch.arange(n - q + 1, n + 1, device=device)))
        if recall is not None:
            recall.move_scores(device)
        plan.append((i, block, st.cfg.scoring.score_layers, req.kv.req_pool_idx, recall, q, n))
    pool._vtoken_scored = (plan, model_runner.req_to_token_pool.req_to_token)


def clear(model_runner) -> None:
    """No scored request in the forward about to run."""
    model_runner.token_to_kv_pool._vtoken_scored = None


def around_radix_attention_forward(original, layer, q, k, v, forward_batch, *args, **kwargs):
    """AROUND `RadixAttention.forward`: run attention, then stage the probabilities."""
    out = original(layer, q, k, v, forward_batch, *args, **kwargs)
    pool = get_token_to_kv_pool()
    current = getattr(pool, "_vtoken_scored", None)
    if current is not None:
        plan, req_to_token = current
        collect(layer, q, forward_batch, plan, pool, req_to_token)
    return out


@torch.no_grad()
def collect(layer, q: torch.Tensor, forward_batch, scored: list, pool, req_to_token) -> None:
    """Stage this layer's probabilities for every scored request."""
    hq, hkv = layer.tp_q_head_num, layer.tp_k_head_num
    q = q.view(-1, hq, layer.qk_head_dim)
    k_buffer = pool.get_key_buffer(layer.layer_id)
    if forward_batch.forward_mode.is_decode():
        starts = list(range(forward_batch.batch_size))
        ext = [1] * forward_batch.batch_size
    else:
        ext = forward_batch.extend_seq_lens_cpu
        starts = [sum(ext[:i]) for i in range(len(ext))]
    for i, block, score_layers, row, recall, nq, n in scored:
        if score_layers is not None and layer.layer_id not in score_layers:
            continue
        slots = req_to_token[row, :n].to(torch.int64)
        first = starts[i] + ext[i] - nq
        lengths = torch.arange(n - nq + 1, n + 1)
        if block is not None:
            probs = _probs(q[first:first + nq], k_buffer, slots, lengths, layer.scaling, hq, hkv)
            block[:, :, layer.layer_id, :] = probs.to(block.dtype)
        if recall is not None:  # the window's attention over the row and the host candidates
            t0 = time.perf_counter()
            recall.score(candidate_mass(q[first:first + nq].view(nq, hq, -1), k_buffer[slots], lengths,
                                        recall.k[:, layer.layer_id], layer.scaling), t0)


def _probs(q, k_buffer, slots, lengths, scale, hq, hkv) -> torch.Tensor:
    """``[nq, n, hkv]`` probabilities of `nq` queries over the keys at `slots`; query j sees the
    first ``lengths[j]`` keys (causal), group-summed over the query heads of each KV head."""
    nq, n = q.shape[0], slots.numel()
    if nq == 1:  # decode: the score kernel (Triton on CUDA, torch on CPU), per KV head
        score = torch.zeros(k_buffer.shape[0], hkv, dtype=torch.float32, device=k_buffer.device)
        indptr = torch.tensor([0, n], dtype=torch.int32, device=k_buffer.device)
        attn_scores_(q, k_buffer, indptr, slots.to(torch.int32), score, scale, decay=0.0)
        return score[slots].unsqueeze(0)
    p = window_probs(q.view(nq, hq, -1), k_buffer[slots], lengths, scale)    # [nq, hq, n]
    p = p.view(nq, hkv, hq // hkv, n).sum(dim=2)                             # [nq, hkv, n]
    return p.transpose(1, 2)
