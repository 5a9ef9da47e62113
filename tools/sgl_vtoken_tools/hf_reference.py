"""Hugging Face oracle for eviction: greedy decoding where each query attends to exactly the keys
the server keeps, with every token at its original position.

Every query runs with a per-query 4-D attention mask, so each token's hidden states (and
therefore its cached K/V) are computed with the keys that were live when that token was
decoded: prompt tokens causally (the prompt is prefilled whole, or chunk by chunk with
`prefill_chunk`, each chunk over the row kept after the previous one), decode token `t` with
the row kept at step `t` plus itself. Victims are chosen by the `policy` and `recall` objects
the caller passes (`hf_rules.RequestPolicy`, `hf_rules.RecallRule`) from the inputs the server has
(positions, post-RoPE keys, values, every layer's attention, rid, eviction step), without
reading them from the server: the exactness tests pass the independent oracles of
`tests/runtime/oracles`; the default, `sgl_vtoken_tools.runtime_choice`, is the runtime's own code.

The model is a `transformers` causal LM loaded in fp32 with `attn_implementation="eager"` (the
attention policies read its attention probabilities): :func:`load_model`. Prompt chunks are
computed whole; each decode step then runs its new token alone over the cached K/V of every
earlier token (evicted ones included, masked out), which is what a token's K/V is: computed
once, under the mask of its own step. Meant for tests and short cross-checks.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Collection
from contextlib import contextmanager

import torch

from sgl_vtoken.config import EvictConfig
from sgl_vtoken_tools.hf_rules import PolicyFactory, RecallRule


def _choice(policy: PolicyFactory | None, recall: RecallRule | None):
    """The caller's chooser and recall rule; None: the runtime's (`runtime_choice`)."""
    if policy is None or recall is None:
        import sgl_vtoken_tools.runtime_choice as runtime_choice

        policy = policy or runtime_choice.runtime_policy
        recall = recall or runtime_choice.RUNTIME_RECALL
    return policy, recall


@functools.lru_cache(maxsize=4)
def _vocab(path: str) -> tuple[str, ...]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tuple(tok.batch_decode([[i] for i in range(len(tok))]))


def token_texts(model, ids: list[int]) -> list[str]:
    """The decoded text of each token of `ids`, by the tokenizer saved with `model`."""
    vocab = _vocab(model.config._name_or_path)
    return [vocab[i] for i in ids]


def load_model(path):
    """fp32 causal LM from `path` with eager attention (attention probabilities returned)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _mask(allowed: list[list[int]], n: int, first: int = 0, dtype=torch.float32) -> torch.Tensor:
    """``[1, 1, len(allowed), n]`` additive mask: query ``first + i`` sees keys ``allowed[i]``."""
    m = torch.full((len(allowed), n), torch.finfo(dtype).min, dtype=dtype)
    for i, keys in enumerate(allowed):
        m[i, keys] = 0.0
    return m[None, None]


@torch.no_grad()
def masked_greedy(
    model, prompt: list[int], max_new_tokens: int, cfg: EvictConfig, **options
) -> tuple[list[int], list[int]]:
    """Greedy tokens under `cfg`'s eviction, and the final kept row (logical positions):
    :func:`masked_turn` of a prompt with no history, its keyword `options` passed on (`rid`,
    `tree_owned`, `cached`, `policy`, `recall`, `evicted_at`, `evicted_to`, `prefill_whole`).

    Mirrors the server's convention: before decoding the token at position t the row (positions
    < t) is evicted down to `cfg.budget` when it holds `budget + interval` or more, then the query
    at t attends to the row plus itself. The first `tree_owned` tokens came from the radix cache
    (another request's prompt): the policy must keep them. The first `cached` came from the
    prefix cache: their queries are not recomputed, so they seed no attention statistics.
    `policy(cfg, rid)` makes the request's chooser and `recall` is the recall rule (None: the
    runtime's, `sgl_vtoken_tools.runtime_choice`). Under the pressure trigger the server reports
    when the pool was short: `evicted_at` (its `usage` report's list), the logical lengths at
    which the decode row was evicted, replaces the budget + interval trigger, and `evicted_to`
    (the report's list beside it; None: the budget each time) the tokens each of them kept.
    """
    out, row, _ = masked_turn(model, prompt, max_new_tokens, cfg, **options)
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
    *,
    policy: PolicyFactory | None = None,
    recall: RecallRule | None = None,
    stop: int | None = None,
    evicted_at: Collection[int] | None = None,
    evicted_to: Collection[int] | None = None,
    prefill_whole: bool = False,
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
    Victims and recalled tokens are chosen by `policy` and `recall` (:func:`masked_greedy`).
    With `stop`, the turn ends after that token (included), as a server's stop token ends it.
    With `evicted_at` (the pressure trigger: :func:`masked_greedy`) a decode eviction runs
    exactly when the row holds that many logical tokens, not at ``budget + interval``, down to
    `evicted_to`'s tokens (the budget without it), and with
    `prefill_whole` (a prompt the server's pool held whole: no `prefill_evicted_tokens` in its
    report) the prompt is prefilled without eviction whatever `prefill_chunk` says.
    """
    if evicted_at is None and cfg.on_pressure:
        raise ValueError(
            "trigger 'pressure' evicts when the server's pool was short: pass the server's "
            "evicted_at"
        )
    pressed = (
        None
        if evicted_at is None
        else dict(zip(evicted_at, evicted_to or [cfg.budget] * len(evicted_at), strict=True))
    )
    make, rule = _choice(policy, recall)
    chooser = make(cfg, rid) if cfg.enabled else None
    attn = chooser is not None and "attn" in chooser.needs
    ids = list(prompt)
    start = 0 if history is None else len(history[0])
    row = [] if history is None else list(history[1])
    allowed = [] if history is None else [list(a) for a in history[0]]
    # Host tier: every token with KV that the row lacks was evicted and offloaded, so all of
    # them are recall candidates (a host store large enough never drops one).
    pinned: list[int] = []

    def evict(res, row: list[int], budget: int | None = None) -> list[int]:
        """`row` evicted to `budget` (None: the config's) by the chooser, given the forward `res`
        over its tokens."""
        keys = None
        cache = res.past_key_values
        if "keys" in chooser.needs:
            # [layers, Hkv, T, D] -> rows of the live tokens: [n, layers, Hkv, D]
            k = torch.stack([cache.layers[i].keys[0] for i in range(len(cache.layers))])
            keys = k[:, :, row].permute(2, 0, 1, 3)
        shared = [p < tree_owned or p in set(pinned) for p in row]
        texts = token_texts(model, ids) if cfg.span else []
        keep = chooser.keep(list(row), shared, keys, budget or cfg.budget, texts)
        return [row[i] for i in keep]

    def observe(res, first: int, end: int) -> None:
        """Fold the attention of the observation window of the prompt chunk `[first, end)`."""
        window = min(cfg.scoring.obs_window, end - max(first, cached))
        if attn and window > 0:
            queries = list(range(end - window, end))
            chooser.observe(row, *_group_probs(res.attentions, queries, row, model.config))

    # The prompt, chunk by chunk with `prefill_chunk`: the row is evicted to the budget whenever
    # it reaches budget + prefill_chunk and prompt tokens remain. With recall, the last chunk is
    # cut in two: its first part's window scores the candidates (every token with KV the row
    # lacks, this prefill's victims included), the best join the row, and the rest is computed
    # with them visible, without a further eviction.
    pos, recalling = start, cfg.enabled and cfg.host.recall > 0
    while True:
        end = (
            len(prompt)
            if chooser is None or cfg.prefill_peak is None or pinned or prefill_whole
            else min(len(prompt), pos + cfg.prefill_peak - len(row))
        )
        if end == len(prompt) and recalling:
            recalling = False
            candidates = [p for p in range(pos) if p not in set(row)]
            cut = rule.split(cfg, len(row), len(row) + len(prompt) - pos) if candidates else None
            if cut is not None:
                end, back = (pos + c - len(row) for c in cut)
                first = [row + list(range(pos, i + 1)) for i in range(pos, end)]
                window = min(cfg.scoring.obs_window, end - max(pos, cached))
                head, rounds = row + list(range(pos, back)), rule.rounds(cfg)
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
                    quota = rule.quota(cfg, len(pinned), r == rounds - 1)
                    taken = set(pinned)
                    got = _recall(
                        res,
                        queries,
                        [c for c in candidates if c not in taken],
                        head + pinned + list(range(back, end)),
                        list(range(end - window, end)),
                        cfg,
                        quota,
                        rule,
                        sorted(pinned),
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
            output_attentions=attn,
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
                output_attentions=attn,
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
                output_attentions=attn,
            )
            if attn:  # the new token's query
                chooser.observe(row, *_group_probs(res.attentions, [t], row, model.config, first=t))
        nxt = int(res.logits[0, -1].argmax())
        out.append(nxt)
        t = len(ids)
        ids.append(nxt)
        if nxt == stop:  # the turn ends: no forward (nor eviction) for the stop token
            allowed.append(row + [t])
            break
        due = cfg.should_evict(len(row)) if pressed is None else t in pressed
        if chooser is not None and due:
            row = evict(res, row, None if pressed is None else pressed[t])
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
    res,
    queries,
    candidates: list[int],
    row: list[int],
    window: list[int],
    cfg: EvictConfig,
    k: int,
    rule: RecallRule,
    recalled: list[int],
) -> list[int]:
    """The `k` candidates the window's queries recall under `rule`, ascending (`recalled`:
    the turn's earlier rounds')."""
    lengths = torch.tensor([row.index(t) + 1 for t in window])
    layers = []
    for layer, (q, scale) in enumerate(queries):
        keys = res.past_key_values.layers[layer].keys[0]  # [hkv, T, d]
        layers.append(
            (
                q[0][:, window].transpose(0, 1),
                scale,
                keys[:, row].transpose(0, 1),
                keys[:, candidates].transpose(0, 1),
            )
        )
    return [candidates[i] for i in rule.choose(cfg, layers, lengths, k, candidates, recalled)]


def _group_probs(attentions, queries: list[int], row: list[int], config, first: int = 0):
    """``[q, n, layers, kv_heads]`` probabilities of `queries` (positions; the attentions' query
    rows start at position `first`) over the `row` positions, every layer, summed over the query
    heads of each KV head (HF's GQA maps query head h to KV head h // group), and ``[q]`` keys
    attended per query (row entries up to the query)."""
    hkv = config.num_key_value_heads
    group = config.num_attention_heads // hkv
    rows = [q - first for q in queries]
    per_layer = []
    for a in attentions:  # a: [1, hq, T - first, T]
        p = a[0][:, rows][:, :, row].float()  # [hq, q, n]
        p = p.view(hkv, group, len(queries), len(row)).sum(1)  # [hkv, q, n]
        per_layer.append(p.permute(1, 2, 0))  # [q, n, hkv]
    lengths = torch.tensor([sum(1 for r in row if r <= q) for q in queries])
    return torch.stack(per_layer, dim=2), lengths
