"""Hugging Face oracle for eviction: greedy decoding where each query attends to exactly the keys
the server keeps, with every token at its original position.

Every query runs with a per-query 4-D attention mask, so each token's hidden states (and
therefore its cached K/V) are computed with the keys that were live when that token was decoded: prompt tokens causally (the prompt is prefilled whole, or chunk by chunk with
`prefill_chunk`, each chunk over the row kept after the previous one), decode token `t` with
the row kept at step `t` plus itself. Victims are chosen by the library policy from the same
inputs the server gives it (positions, post-RoPE keys, values, rid, eviction step), so the
oracle replays the server's decisions without reading them from the server.

The model is a `transformers` causal LM loaded in fp32 with `attn_implementation="eager"` (the
attention policies read its attention probabilities): :func:`load_model`. Prompt chunks are
computed whole; each decode step then runs its new token alone over the cached K/V of every
earlier token (evicted ones included, masked out), which is what a token's K/V is: computed
once, under the mask of its own step. Meant for tests and short cross-checks.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from sgl_vtoken.config import EvictConfig, policy_from_config
from sgl_vtoken.recall import candidate_mass, pick, round_quota, split, turn_rounds
from sgl_vtoken.rng import stable_id
from sgl_vtoken.types import TokenView


def load_model(path):
    """fp32 causal LM from `path` with eager attention (attention probabilities returned)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _mask(allowed: list[list[int]], n: int, first: int = 0, dtype=torch.float32) -> torch.Tensor:
    """``[1, 1, len(allowed), n]`` additive mask: query ``first + i`` sees the keys ``allowed[i]``."""
    m = torch.full((len(allowed), n), torch.finfo(dtype).min, dtype=dtype)
    for i, keys in enumerate(allowed):
        m[i, keys] = 0.0
    return m[None, None]


@torch.no_grad()
def masked_greedy(
    model,
    prompt: list[int],
    max_new_tokens: int,
    cfg: EvictConfig,
    rid: str = "",
    tree_owned: int = 0,
    cached: int = 0,
) -> tuple[list[int], list[int]]:
    """Greedy tokens under `cfg`'s eviction, and the final kept row (logical positions).

    Mirrors the server's convention: before decoding the token at position t the row (positions
    < t) is evicted down to `cfg.budget` when it holds `budget + interval` or more, then the query
    at t attends to the row plus itself. The first `tree_owned` tokens came from the radix cache
    (another request's prompt): the policy must keep them. The first `cached` came from the
    prefix cache: their queries are not recomputed, so they seed no attention statistics.
    """
    out, row, _ = masked_turn(model, prompt, max_new_tokens, cfg, rid, tree_owned, cached=cached)
    return out, row


@torch.no_grad()
def masked_turn(
    model,
    prompt: list[int],
    max_new_tokens: int,
    cfg: EvictConfig,
    rid: str = "",
    tree_owned: int = 0,
    history: tuple | None = None,
    cached: int = 0,
):
    """:func:`masked_greedy` for one turn of a conversation; returns (tokens, row, history).

    `history` is the previous turn's return value: the per-token masks of every token with KV,
    and the view the server stored when that turn finished (the kept row after its last forward).
    `prompt` extends that history; its tokens past the history attend to the view plus themselves
    (causally), as when the server continues from the stored view. With `cfg.prefill.chunk` the
    prompt is prefilled in chunks, the row evicted to the budget whenever it reaches
    ``budget + prefill_chunk`` with prompt tokens left; each chunk's last `obs_window` queries
    score that eviction. With `cfg.host.recall` (host tier) the tokens with KV that the view lacks
    are candidates, and the prompt is prefilled in two chunks (`sgl_vtoken.recall.split`): the
    first chunk's last `obs_window` queries score them, the best `recall` join the row and are
    kept for the rest of the turn, and the second chunk (the scoring window rounded to pages, and
    the prompt's end) is computed with them visible; with `recall_rounds` R the window is
    recomputed after each of R rounds of ``recall // R`` (the last: what is left) and scores the
    candidates left. The view stored for the next turn leaves them out (they stay candidates).
    """
    policy = policy_from_config(cfg) if cfg.enabled else None
    acc = policy.new_accumulator() if policy is not None else None
    ids = list(prompt)
    start = 0 if history is None else len(history[0])
    row = [] if history is None else list(history[1])
    allowed = [] if history is None else [list(a) for a in history[0]]
    steps = 0
    # Host tier: every token with KV that the row lacks was evicted and offloaded, so all of
    # them are recall candidates (a host store large enough never drops one).
    pinned: list[int] = []

    def evict(res, row: list[int]) -> list[int]:
        """`row` evicted to the budget by the policy, given the forward `res` over its tokens."""
        nonlocal steps
        keys = values = None
        cache = res.past_key_values
        if "keys" in policy.needs:
            # [layers, Hkv, T, D] -> rows of the live tokens: [n, layers, Hkv, D]
            k = torch.stack([cache.layers[i].keys[0] for i in range(len(cache.layers))])
            keys = k[:, :, row].permute(2, 0, 1, 3)
        if "values" in policy.needs:
            v = torch.stack([cache.layers[i].values[0] for i in range(len(cache.layers))])
            values = v[:, :, row].permute(2, 0, 1, 3)
        pos = torch.tensor(row)
        shared = (pos < tree_owned) | torch.isin(pos, torch.tensor(pinned, dtype=torch.int64))
        view = TokenView(
            positions=pos,
            keys=keys,
            attn=acc.stats if acc is not None else None,
            shared=shared,
            rid=stable_id(rid),
            step=steps,
            values=values,
        )
        keep = policy.keep(view, cfg.budget)
        if acc is not None:
            acc.select(keep)
        steps += 1
        return [row[i] for i in keep.tolist()]

    def observe(res, first: int, end: int) -> None:
        """Fold the attention of the observation window of the prompt chunk `[first, end)`."""
        window = min(cfg.scoring.obs_window, end - max(first, cached))
        if acc is not None and window > 0:
            acc.update(
                *_group_probs(
                    res.attentions, list(range(end - window, end)), row, model.config, cfg
                )
            )

    # The prompt, chunk by chunk with `prefill_chunk`: the row is evicted to the budget whenever
    # it reaches budget + prefill_chunk and prompt tokens remain. With recall, the last chunk is
    # cut in two: its first part's window scores the candidates (every token with KV the row
    # lacks, this prefill's victims included), the best join the row, and the rest is computed
    # with them visible, without a further eviction.
    pos, recalling = start, cfg.enabled and cfg.host.recall > 0
    while True:
        end = (
            len(prompt)
            if policy is None or cfg.prefill_peak is None or pinned
            else min(len(prompt), pos + cfg.prefill_peak - len(row))
        )
        if end == len(prompt) and recalling:
            recalling = False
            candidates = [p for p in range(pos) if p not in set(row)]
            cut = (
                split(len(row), len(row) + len(prompt) - pos, cfg.scoring.obs_window, cfg.page_size)
                if candidates
                else None
            )
            if cut is not None:
                end, back = (pos + c - len(row) for c in cut)
                first = [row + list(range(pos, i + 1)) for i in range(pos, end)]
                window = min(cfg.scoring.obs_window, end - max(pos, cached))
                head, rounds = (
                    row + list(range(pos, back)),
                    turn_rounds(cfg.host.recall, cfg.host.rounds),
                )
                for r in range(rounds):  # each round's window sees what the rounds before recalled
                    masks = (
                        allowed
                        + first[: back - pos]
                        + [head + pinned + list(range(back, i + 1)) for i in range(back, end)]
                    )
                    with _queries(model, True) as queries:
                        res = model(
                            torch.tensor([ids[:end]]),
                            attention_mask=_mask(masks, end),
                            use_cache=True,
                        )
                    quota = round_quota(
                        cfg.host.recall, cfg.host.rounds, len(pinned), r == rounds - 1
                    )
                    taken = set(pinned)
                    got = _recall(
                        res,
                        queries,
                        [c for c in candidates if c not in taken],
                        head + pinned + list(range(back, end)),
                        list(range(end - window, end)),
                        cfg,
                        quota,
                    )
                    pinned = pinned + got
                    if not got or len(pinned) == len(candidates):
                        break
                allowed += first[: back - pos]
                row, pos = head + pinned, back
                continue
        allowed += [row + list(range(pos, i + 1)) for i in range(pos, end)]
        row = row + list(range(pos, end))
        if end == len(prompt):
            break
        res = model(
            torch.tensor([ids[:end]]),
            attention_mask=_mask(allowed, end),
            use_cache=True,
            output_attentions=acc is not None,
        )
        observe(res, pos, end)
        row = evict(res, row)
        pos = end
    out = []
    for k in range(max_new_tokens):
        if k == 0:  # the whole prompt; its last chunk's observation window
            res = model(
                torch.tensor([ids]),
                attention_mask=_mask(allowed, len(ids)),
                use_cache=True,
                output_attentions=acc is not None,
            )
            observe(res, pos, len(prompt))
        else:  # the new token alone, over the cached K/V of every earlier token (each computed
            t = len(ids) - 1  # once, under its own step's mask, as the server computes it)
            res = model(
                torch.tensor([[ids[t]]]),
                attention_mask=_mask([allowed[t]], t + 1, first=t),
                past_key_values=res.past_key_values,
                position_ids=torch.tensor([[t]]),
                use_cache=True,
                output_attentions=acc is not None,
            )
            if acc is not None:  # the new token's query
                acc.update(*_group_probs(res.attentions, [t], row, model.config, cfg, first=t))
        nxt = int(res.logits[0, -1].argmax())
        out.append(nxt)
        t = len(ids)
        ids.append(nxt)
        if policy is not None and cfg.should_evict(len(row)):
            row = evict(res, row)
        row.append(t)
        allowed.append(list(row))
    view = [p for p in allowed[-2] if p not in set(pinned)]  # recalled tokens serve this turn only
    return out, row, (allowed[:-1], view)


@contextmanager
def _queries(model, on: bool):
    """While on: collect each layer's post-RoPE queries ``[1, hq, T, d]`` and attention scale,
    as ``(query, scale)`` per layer in order (Llama-style modules calling the module-level
    `eager_attention_forward`)."""
    got: list = []
    if not on:
        yield got
        return
    mod = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original = mod.eager_attention_forward

    def capture(module, query, *args, **kwargs):
        got.append((query, kwargs.get("scaling", module.scaling)))
        return original(module, query, *args, **kwargs)

    mod.eager_attention_forward = capture
    try:
        yield got
    finally:
        mod.eager_attention_forward = original


def _recall(
    res, queries, candidates: list[int], row: list[int], window: list[int], cfg: EvictConfig, k: int
) -> list[int]:
    """The `k` candidates the window's queries recall (`sgl_vtoken.recall`), ascending."""
    scores = torch.zeros(len(candidates))
    lengths = torch.tensor([row.index(t) + 1 for t in window])
    scored = cfg.scoring.layer_ids(len(queries))
    for layer, (q, scale) in enumerate(queries):
        if scored is not None and layer not in scored:
            continue
        keys = res.past_key_values.layers[layer].keys[0]  # [hkv, T, d]
        scores += candidate_mass(
            q[0][:, window].transpose(0, 1),
            keys[:, row].transpose(0, 1),
            lengths,
            keys[:, candidates].transpose(0, 1),
            scale,
        )
    return [candidates[i] for i in pick(scores, k, cfg.host.pool, cfg.host.gap).tolist()]


def _group_probs(
    attentions, queries: list[int], row: list[int], config, cfg: EvictConfig, first: int = 0
):
    """``[q, n, layers, kv_heads]`` probabilities of `queries` (positions; the attentions' query
    rows start at position `first`) over the `row` positions, summed over the query heads of each
    KV head (HF's GQA maps query head h to KV head h // group), and ``[q]`` keys attended per
    query (row entries up to the query)."""
    hkv = config.num_key_value_heads
    group = config.num_attention_heads // hkv
    rows = [q - first for q in queries]
    per_layer = []
    scored = cfg.scoring.layer_ids(len(attentions))
    for layer, a in enumerate(attentions):  # a: [1, hq, T - first, T]
        p = a[0][:, rows][:, :, row].float()  # [hq, q, n]
        p = p.view(hkv, group, len(queries), len(row)).sum(1)  # [hkv, q, n]
        if scored is not None and layer not in scored:
            p = torch.zeros_like(p)
        per_layer.append(p.permute(1, 2, 0))  # [q, n, hkv]
    lengths = torch.tensor([sum(1 for r in row if r <= q) for q in queries])
    return torch.stack(per_layer, dim=2), lengths
