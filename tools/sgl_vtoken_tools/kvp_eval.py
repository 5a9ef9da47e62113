"""Eviction policies replayed on a full-attention trace: retained future mass and perplexity.

    evaluate_sequence(model, ids, setup, policies, budgets, ppl_budgets)
        -> (full-attention NLL, tokens, one record per (policy, budget))
    replay(setup, policy, budget, keys, values, probs, future, group)
        -> (rows kept before each step, mean seconds per ``policy.keep``)
    future_masses(probs, start, horizon)   {t: [T, L, H]} mass of queries [t, t + horizon)
    retained(rows, future, prompt)         mean share of that mass on the kept rows
    masked_nll(model, ids, rows, prompt)   NLL with query t attending to the row kept at t + itself

A replay is the server at interval 1: a `setup.prompt` token prefill (attention policies see
its last `obs_window` queries), then before each token t the row (positions < t) is cut to
`budget` by the library policy, from the traced keys / values and, for h2o / tova, from the
full-attention probabilities of the past queries restricted to the kept row and renormalized
per KV head. ``oracle`` keeps the row's tokens with the most future mass (an upper bound for
greedy eviction). The model is the eager fp32 one of :func:`sgl_vtoken_tools.hf_reference.load_model`;
``scripts/eval_kvp.py`` is the command line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sgl_vtoken.config import EvictConfig, Scoring, policy_from_config
from sgl_vtoken.types import TokenView
from sgl_vtoken_tools.kvp_traces import hf_trace

POLICIES = ("kvp", "streamingllm", "h2o", "tova", "knorm", "random", "oracle")


@dataclass(frozen=True)
class Setup:
    """What every replay shares: the kvp checkpoint, prompt length, horizon of the future mass,
    sink tokens, h2o's recent window as a fraction of the budget, observed prompt queries."""

    checkpoint: str | None
    prompt: int = 16
    horizon: int = 128
    sink: int = 4
    h2o_window: float = 0.5
    obs_window: int = 16


def replay(setup: Setup, policy_name: str, budget: int, keys, values, probs, future, group: int):
    """Rows kept before each step t (positions < t) for t = prompt .. T-1, policy at interval 1,
    and the mean seconds per `policy.keep` call. `group`: query heads per KV head."""
    T = keys.shape[0]
    params = {"checkpoint": setup.checkpoint} if policy_name == "kvp" else {}
    name = "streamingllm" if policy_name == "oracle" else policy_name
    window = int(budget * setup.h2o_window) if policy_name == "h2o" else 0
    cfg = EvictConfig(
        policy=name,
        budget=budget,
        sink=setup.sink,
        window=window,
        params=params,
        scoring=Scoring(obs_window=setup.obs_window, span=0),  # the trace holds no token texts
    )
    policy = policy_from_config(cfg)
    acc = policy.new_accumulator()
    scale = probs.new_tensor(float(group))
    prompt, sink = setup.prompt, setup.sink

    def observe(queries, row):
        p = probs[:, :, queries][:, :, :, row]  # [L, H, q, n]
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12) * scale
        acc.update(p.permute(2, 3, 0, 1).contiguous(), torch.tensor([len(row)] * len(queries)))

    row = list(range(prompt))
    if acc is not None:
        observe(list(range(max(0, prompt - setup.obs_window), prompt)), row)
    rows, keep_s = [], []
    for t in range(prompt, T):
        if len(row) >= budget + 1:
            pos = torch.tensor(row)
            if policy_name == "oracle":
                score = future[t][pos].sum((1, 2)) if t in future else pos.double()
                keep = (
                    torch.cat(
                        [
                            torch.arange(min(sink, len(row))),
                            sink + score[sink:].topk(budget - sink).indices,
                        ]
                    )
                    .sort()
                    .values
                )
            else:
                view = TokenView(
                    positions=pos,
                    keys=keys[pos],
                    values=values[pos],
                    attn=acc.stats if acc is not None else None,
                    rid=0,
                    step=t,
                )
                t0 = time.perf_counter()
                keep = policy.keep(view, budget)
                keep_s.append(time.perf_counter() - t0)
            if acc is not None:
                acc.select(keep)
            row = [row[i] for i in keep.tolist()]
        rows.append(list(row))
        row.append(t)
        if acc is not None:
            observe([t], row)
    return rows, (sum(keep_s) / len(keep_s) if keep_s else 0.0)


def future_masses(probs: torch.Tensor, start: int, horizon: int) -> dict[int, torch.Tensor]:
    """``{t: [T, L, H]}`` for start <= t <= T - horizon: the attention queries [t, t + horizon)
    pay to each token, from the probabilities ``[L, H, T, T]``."""
    T = probs.shape[-1]
    csum = torch.cat([torch.zeros_like(probs[:, :, :1]), probs.cumsum(2)], dim=2)
    return {
        t: (csum[:, :, t + horizon] - csum[:, :, t]).permute(2, 0, 1)
        for t in range(start, T - horizon + 1)
    }


def retained(rows, future, prompt) -> float:
    """Mean share of future mass kept, over the steps that have a full horizon."""
    shares = []
    for t, m in future.items():
        if t < prompt:
            continue
        total = float(m[:t].sum())
        if total > 0:
            shares.append(float(m[rows[t - prompt]].sum()) / total)
    return sum(shares) / len(shares)


@torch.no_grad()
def masked_nll(model, ids, rows, prompt) -> tuple[float, int]:
    """Summed NLL of tokens 1..T-1 with query t attending to rows[t - prompt] + [t] (t >= prompt)."""
    T = ids.numel()
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)
    for t in range(prompt, T):
        mask[t, :t] = torch.finfo(torch.float32).min
        mask[t, rows[t - prompt]] = 0.0
    logits = model(ids[None], attention_mask=mask[None, None]).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum")
    return float(nll), T - 1


def evaluate_sequence(
    model, ids: torch.Tensor, setup: Setup, policies, budgets, ppl_budgets
) -> tuple[float, int, list[dict]]:
    """One held-out sequence ``ids [T]``: the full-attention NLL and token count, and a record
    ``{policy, budget, retained_mass, keep_ms[, nll, tokens]}`` per policy and budget of
    `budgets` or `ppl_budgets` (the NLL only at `ppl_budgets`)."""
    keys, values, probs = hf_trace(model, ids)  # probs [L, H, T, T]
    future = future_masses(probs, setup.prompt, setup.horizon)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    T = ids.numel()
    full_nll, count = masked_nll(
        model, ids, [list(range(t)) for t in range(setup.prompt, T)], setup.prompt
    )
    records = []
    for pol in policies:
        for b in sorted(set(budgets) | set(ppl_budgets)):
            rows, keep_s = replay(setup, pol, b, keys, values, probs, future, group)
            rec = {
                "policy": pol,
                "budget": b,
                "retained_mass": retained(rows, future, setup.prompt),
                "keep_ms": round(1e3 * keep_s, 3),
            }
            if b in ppl_budgets:
                rec["nll"], rec["tokens"] = masked_nll(model, ids, rows, setup.prompt)
            records.append(rec)
    return full_nll, count, records
