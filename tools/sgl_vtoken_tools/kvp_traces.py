"""K/V traces for KVP training: what a Hugging Face model keeps and attends to on text.

    hf_trace(model, ids)             keys and values ``[T, L, H, D]`` (post-RoPE, as a KV cache
                                     holds them) and attention probabilities ``[L, H, T, T]``
                                     (query, key), summed over the query heads of each KV head
    future_mass(probs, cut, horizon) ``[T, L, H]``: the mass token j < cut receives from queries
                                     [cut, cut + horizon); 0 for j >= cut
    cut_points(seq_len, horizon, min_cut, cut_every)
                                     cuts min_cut, min_cut + cut_every, ... <= seq_len - horizon
    trace_mb(identity, num_seqs, seq_len, num_cuts)
                                     the size of the traces in MB, known before any forward
    collect(model, seqs, cuts, horizon, meta)
                                     a :class:`sgl_vtoken_tools.kvp_train.Traces` of ``seqs [S, T]``

The model runs with full causal attention, in fp32, with eager attention so that it returns its
probabilities (:func:`sgl_vtoken_tools.hf_reference.load_model`). Keys and values are stored in
float16, targets in float32 (the file format is documented in :mod:`sgl_vtoken_tools.kvp_train`).
``scripts/collect_traces.py`` is the command line.
"""

from __future__ import annotations

import torch

from sgl_vtoken.kvp import ModelIdentity
from sgl_vtoken_tools.kvp_train import Traces


@torch.no_grad()
def hf_trace(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-attention trace of one sequence ``ids [T]``: keys, values, probabilities (fp32)."""
    res = model(ids[None], use_cache=True, output_attentions=True)
    cache = res.past_key_values
    keys = torch.stack([layer.keys[0] for layer in cache.layers]).permute(2, 0, 1, 3)
    values = torch.stack([layer.values[0] for layer in cache.layers]).permute(2, 0, 1, 3)
    hkv = model.config.num_key_value_heads
    probs = torch.stack([a[0].view(hkv, -1, *a.shape[-2:]).sum(1) for a in res.attentions])
    return keys.float(), values.float(), probs.float()


def future_mass(probs: torch.Tensor, cut: int, horizon: int) -> torch.Tensor:
    """``[T, L, H]`` attention mass each token j < cut receives from queries [cut, cut + horizon)."""
    m = probs[:, :, cut : cut + horizon].sum(2)  # [L, H, T]
    m[:, :, cut:] = 0.0
    return m.permute(2, 0, 1)


def cut_points(seq_len: int, horizon: int, min_cut: int, cut_every: int) -> torch.Tensor:
    """The cut points whose whole horizon lies inside the sequence (empty when none does)."""
    return torch.arange(min_cut, seq_len - horizon + 1, cut_every)


def trace_mb(identity: ModelIdentity, num_seqs: int, seq_len: int, num_cuts: int) -> float:
    """MB of the traces: fp16 keys and values, one fp32 target per cut, per token and head."""
    heads = identity.num_layers * identity.num_kv_heads
    return num_seqs * seq_len * heads * (2 * 2 * identity.head_dim + 4 * num_cuts) / 2**20


def collect(model, seqs: torch.Tensor, cuts: torch.Tensor, horizon: int, meta: dict) -> Traces:
    """Traces of the sequences ``seqs [S, T]``: one forward each, targets at every cut."""
    keys, values, targets = [], [], []
    for ids in seqs:
        k, v, probs = hf_trace(model, ids)
        keys.append(k.half())
        values.append(v.half())
        targets.append(torch.stack([future_mass(probs, int(c), horizon) for c in cuts]))
    return Traces(
        identity=ModelIdentity.from_hf_config(model.config.to_dict()),
        keys=torch.stack(keys),
        values=torch.stack(values),
        positions=torch.arange(seqs.shape[1]),
        cuts=cuts,
        targets=torch.stack(targets),
        horizon=horizon,
        meta=meta,
    )
