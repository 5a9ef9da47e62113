"""Fast masked reference: incremental decoding under eviction, as the server computes it.

:func:`sgl_vtoken_tools.hf_reference.masked_greedy` reruns the whole sequence at every step (exact,
O(steps x length) forwards). This module keeps what the server keeps instead: a :class:`Row`
of logical positions and per-layer post-RoPE K/V, compacted at every eviction, and runs only the
new tokens against it at their original positions. The maths is the server's:

    prompt   one causal forward over all its tokens (the server prefills whole, never evicts in
             a prefill); the last `obs_window` queries' probabilities seed the statistics
    decode   before feeding the token at position t, a row of >= budget + interval tokens is
             cut to `budget` by the library policy (same TokenView: positions, K, V, statistics,
             rid, eviction step); the token then attends to the row plus itself
    history  a next turn continues from the row of the previous turn's last forward (page size
             1 with history reuse): its new tokens are prefilled against that row; at page
             size > 1 the runner prefills the whole conversation again, as the server does

Teacher-forced tokens (:meth:`Request.feed`) run in chunks that end where the next eviction is
due, so perplexity costs one forward per `interval` tokens; each query in a chunk sees the row
and the chunk's earlier tokens, exactly as one-by-one decoding would. Attention statistics come
from :mod:`sgl_vtoken_tools.quality.probe`, which the model must be loaded with (:func:`load_model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sgl_vtoken.config import EvictConfig, policy_from_config
from sgl_vtoken.rng import stable_id
from sgl_vtoken.types import TokenView
from sgl_vtoken.units import Words
from sgl_vtoken_tools.quality import probe

MAX_CHUNK = 1024  # teacher-forced tokens per forward without eviction (memory bound)


def load_model(path):
    """fp32 causal LM from `path` with the probing attention (SDPA otherwise)."""
    from transformers import AutoModelForCausalLM

    name = probe.register()
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=name
    ).eval()


@dataclass(frozen=True)
class Row:
    """The KV one request keeps: ``positions [n] int64`` ascending, K/V ``[1, hkv, n, d]`` per
    layer, and `length`, the logical tokens run so far (the next token's position; the newest
    token may have been evicted). Never modified in place, so rows are shared freely (one
    prompt, many settings)."""

    positions: torch.Tensor
    keys: tuple[torch.Tensor, ...] = ()
    values: tuple[torch.Tensor, ...] = ()
    length: int = 0

    @property
    def n(self) -> int:
        return self.positions.numel()

    def select(self, keep: torch.Tensor) -> Row:
        return Row(
            self.positions[keep],
            tuple(k[:, :, keep] for k in self.keys),
            tuple(v[:, :, keep] for v in self.values),
            self.length,
        )

    def stacked(self, which: str) -> torch.Tensor:
        """``[n, layers, hkv, d]``: the layout of ``TokenView.keys`` (`which`: keys or values)."""
        return torch.stack([t[0] for t in getattr(self, which)]).permute(2, 0, 1, 3)


EMPTY = Row(torch.zeros(0, dtype=torch.int64))


@torch.no_grad()
def extend(model, row: Row, ids: list[int], num_probe: int = 0, num_logits: int = 1):
    """Run `ids` at positions ``row.length`` onwards, attending to the whole row and causally to
    themselves.

    Returns ``(logits [num_logits, vocab], row', probs, lengths)``: the logits of the last
    `num_logits` tokens, the row with the new tokens appended, and (``num_probe > 0``) the
    ``[num_probe, row'.n, layers, hkv]`` probabilities of the last `num_probe` queries with the
    ``[num_probe]`` keys each attended.
    """
    from transformers import DynamicCache

    n, c = row.n, len(ids)
    start = row.length
    pos = torch.arange(start, start + c)
    cache = DynamicCache(ddp_cache_data=list(zip(row.keys, row.values))) if n else DynamicCache()
    mask = None
    if n:  # the row is compact: every cached key is live; the new tokens are causal
        mask = torch.zeros(1, 1, c, n + c)
        mask[0, 0, :, n:] = torch.full((c, c), torch.finfo(torch.float32).min).triu(1)
    p = probe.Probe(num_probe) if num_probe else None
    if p is not None:
        p.__enter__()
    try:
        res = model(
            input_ids=torch.tensor([ids]),
            position_ids=pos[None],
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=num_logits,
        )
    finally:
        if p is not None:
            p.__exit__()
    new = Row(
        torch.cat([row.positions, pos]),
        tuple(layer.keys for layer in cache.layers),
        tuple(layer.values for layer in cache.layers),
        start + c,
    )
    probs = lengths = None
    if p is not None:
        probs = p.block()
        q = probs.shape[0]
        lengths = torch.arange(n + c - q + 1, n + c + 1)
    return res.logits[0].float(), new, probs, lengths


@dataclass(frozen=True)
class Prompt:
    """A prompt prefilled once with full causal attention: the start of every setting's decode.

    Attributes: ``ids``; ``row``; ``logits [vocab]`` of the last token; ``probs [w, P, layers,
    hkv]`` and ``lengths [w]`` of its last `w` queries (the largest observation window needed).
    """

    ids: tuple[int, ...]
    row: Row
    logits: torch.Tensor
    probs: torch.Tensor
    lengths: torch.Tensor


def prefill(model, ids: list[int], obs_window: int = 16) -> Prompt:
    logits, row, probs, lengths = extend(
        model, EMPTY, list(ids), num_probe=min(obs_window, len(ids))
    )
    return Prompt(tuple(ids), row, logits[-1], probs, lengths)


class Request:
    """One request (one turn) under one :class:`EvictConfig`, as the server runs it.

    Start it with :meth:`start` (a fresh prompt, possibly prefilled once for many settings) or
    :meth:`prompt` (new tokens after ``history``: the previous turn's :attr:`row`), then
    :meth:`generate` greedily or :meth:`feed` given tokens. With a `span` (span-aware keeping)
    it needs `words` (the tokenizer's, `sgl_vtoken.units`) and, after a history, `ids`: every
    token id the history's positions index.
    """

    def __init__(
        self,
        model,
        cfg: EvictConfig,
        rid: str = "",
        history: Row = EMPTY,
        words: Words | None = None,
        ids: Sequence[int] = (),
    ) -> None:
        if cfg.prefill.chunk is not None:
            raise ValueError(
                f"EvictConfig.prefill_chunk {cfg.prefill.chunk}: the fast reference prefills "
                "whole prompts; eviction during prefill is defined by sgl_vtoken_tools.hf_reference"
            )
        self.model, self.cfg, self.rid = model, cfg, stable_id(rid)
        self.policy = policy_from_config(cfg) if cfg.enabled else None
        if self.policy is not None and self.policy.span and words is None:
            raise ValueError("EvictConfig.span: the fast reference needs the tokenizer's Words")
        self.words, self.ids = words, list(ids)
        self.acc = self.policy.new_accumulator() if self.policy is not None else None
        self.row, self.steps, self.logits = history, 0, None
        self.evicted = 0
        self.first_kept: torch.Tensor | None = None  # positions kept by the first eviction

    def start(self, prompt: Prompt) -> torch.Tensor:
        """Begin from a prefilled fresh prompt; returns the last prompt token's logits."""
        if self.row.n:
            raise ValueError("Request.start: the request already has a row; use prompt()")
        w = min(self.cfg.scoring.obs_window, prompt.probs.shape[0])
        self.row, self.logits, self.ids = prompt.row, prompt.logits, list(prompt.ids)
        self._observe(prompt.probs[-w:], prompt.lengths[-w:])
        return self.logits

    def prompt(self, ids: list[int]) -> torch.Tensor:
        """Prefill `ids` (all of them new: after the history) in one forward, no eviction."""
        w = min(self.cfg.scoring.obs_window, len(ids)) if self.acc is not None else 0
        logits, self.row, probs, lengths = extend(self.model, self.row, list(ids), num_probe=w)
        self.ids += ids
        self._observe(probs, lengths)
        self.logits = logits[-1]
        return self.logits

    def feed(self, ids: list[int]) -> torch.Tensor:
        """Teacher-force `ids` as decode steps; returns ``[len(ids), vocab]``: row i is the
        prediction made after feeding ``ids[i]`` (the first prediction is :attr:`logits`)."""
        out, i = [], 0
        while i < len(ids):
            self._evict_if_due()
            room = MAX_CHUNK
            if self.policy is not None:
                room = self.cfg.budget + self.cfg.interval - self.row.n
            chunk = ids[i : i + min(room, MAX_CHUNK)]
            probe_n = len(chunk) if self.acc is not None else 0
            logits, self.row, probs, lengths = extend(
                self.model, self.row, chunk, num_probe=probe_n, num_logits=len(chunk)
            )
            self.ids += chunk
            self._observe(probs, lengths)
            out.append(logits)
            i += len(chunk)
        self.logits = out[-1][-1]
        return torch.cat(out)

    def generate(self, max_new_tokens: int, stop: tuple[int, ...] = ()) -> list[int]:
        """Greedy tokens; stops after a token in `stop` (never fed, as the server finishes)."""
        out = []
        for k in range(max_new_tokens):
            nxt = int(self.logits.argmax())
            out.append(nxt)
            if k == max_new_tokens - 1 or nxt in stop:
                break
            self.feed([nxt])
        return out

    def _observe(self, probs, lengths) -> None:
        if self.acc is None or probs is None:
            return
        scored = self.cfg.scoring.layer_ids(probs.shape[2])
        if scored is not None:
            probs = probs.clone()
            off = [i for i in range(probs.shape[2]) if i not in scored]
            probs[:, :, off] = 0
        self.acc.update(probs, lengths)

    def _evict_if_due(self) -> None:
        if self.policy is None or not self.cfg.should_evict(self.row.n):
            return
        needs, span, positions = self.policy.needs, self.policy.span, self.row.positions
        units = None
        if span:
            assert self.words is not None
            units = self.words.unit_starts(self.ids[: int(positions[-1]) + 1], span)[positions]
        view = TokenView(
            positions=self.row.positions,
            keys=self.row.stacked("keys") if "keys" in needs else None,
            attn=self.acc.stats if self.acc is not None else None,
            rid=self.rid,
            step=self.steps,
            units=units,
        )
        keep = self.policy.keep(view, self.cfg.budget)
        if self.acc is not None:
            self.acc.select(keep)
        self.evicted += self.row.n - keep.numel()
        self.row = self.row.select(keep)
        if self.first_kept is None:
            self.first_kept = self.row.positions
        self.steps += 1
