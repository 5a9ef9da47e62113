"""Replay one request through a policy and the page allocator under No-Evict, Naive-Evict, vToken.

The victims are chosen once per eviction (by the real policy, on the vToken row) and applied to
three rows in three pools: vToken (compaction plan at every eviction), Naive-Evict (same
keep-set, naive plan) and lazy vToken (naive plan unless the request's fragmentation
``F = 1 - live / (pages * page_size)`` would exceed `frag_threshold`, the paper's trigger under
memory pressure). The No-Evict footprint is arithmetic. Tokens arrive in blocks::

    prefill: | shared prefix (tree) | chunk | chunk | ... |   evict after a chunk if len >= budget + interval
    decode:  | block of tokens until len reaches budget + interval | evict | interval tokens | evict | ...

Attention statistics come from :class:`SyntheticAttention`: every decode query counts; in prefill
only the last `obs_window` queries of each chunk (a SnapKV-style observation window, what a
server can afford), so prefill statistics are cheap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sgl_vtoken.config import EvictConfig, Scoring, policy_from_config
from sgl_vtoken.pages import PageAllocator, num_pages
from sgl_vtoken.types import TokenView
from sgl_vtoken_tools.row import RequestRow
from sgl_vtoken_tools.sim.attention_model import AttentionParams, SyntheticAttention
from sgl_vtoken_tools.sim.workload import Request

MODES = ("noevict", "naive", "vtoken", "lazy")


@dataclass(frozen=True)
class SimSettings:
    """Eviction settings of a simulator run, turned into one EvictConfig per request.

    The budget follows the eviction ratio (the paper's knob): a request keeps its tree-owned
    prefix plus ``(1 - ratio)`` of its private tokens, raised to the configuration's floor
    (``max(cpl, sink_tokens) + window + page_size``). `window` is `window_frac` of the kept
    private tokens; `interval` defaults to ``max(page_size, 32)``.
    """

    ratio: float = 0.5
    page_size: int = 16
    sink: int = 4
    window_frac: float = 0.5
    interval: int = 0
    prefill_chunk: int = 256
    obs_window: int = 32
    max_block: int = 128
    seed: int = 0
    aggregation: str = "sum"
    frag_threshold: float = 0.25

    def config(self, req: Request, policy: str) -> EvictConfig:
        ps = self.page_size
        cpl = req.shared_len // ps * ps
        keep_private = round((1.0 - self.ratio) * (req.total_len - cpl))
        window = int(self.window_frac * keep_private)
        sink_tokens = math.ceil(self.sink / ps) * ps
        budget = max(cpl + keep_private, max(cpl, sink_tokens) + window + ps)
        return EvictConfig(
            policy=policy,
            budget=budget,
            sink=self.sink,
            window=window,
            interval=self.interval or max(ps, 32),
            page_size=ps,
            seed=self.seed,
            scoring=Scoring(aggregation=self.aggregation, span=0),  # synthetic ids: no words
        )


def _blocks(req: Request, cfg: EvictConfig, s: SimSettings, cpl: int):
    """Yield (size, is_prefill) for the request's token stream, given the live length so far."""
    left = req.prompt_len - cpl
    while left > 0:
        size = min(left, s.prefill_chunk)
        left -= size
        yield size, True
    left = req.output_len
    while left > 0:
        live = yield None
        size = min(left, s.max_block, max(1, cfg.budget + cfg.interval - live))
        left -= size
        yield size, False


def replay_request(
    req: Request, policy_name: str, s: SimSettings, attn: AttentionParams = AttentionParams()
) -> list[dict]:
    """One dict per mode: retained/ideal/peak pages, pages freed, tokens moved, evictions."""
    cfg = s.config(req, policy_name)
    ps = cfg.page_size
    cpl = req.shared_len // ps * ps
    policy = policy_from_config(cfg)
    acc = policy.new_accumulator()
    model = SyntheticAttention(req.total_len, req.rid, s.seed, attn) if policy.needs else None
    rows = {}
    for mode in ("vtoken", "naive", "lazy"):
        alloc = PageAllocator(num_pages(req.total_len, ps) + 2, ps)
        rows[mode] = RequestRow(
            alloc, torch.tensor(alloc.append_slots(None, cpl), dtype=torch.int64)
        )
    vt = rows["vtoken"]
    stats = {m: dict(peak_pages=0, pages_freed=0, tokens_moved=0) for m in rows}
    evictions = steps = 0
    gen = _blocks(req, cfg, s, cpl)
    for item in gen:
        if item is None:
            item = gen.send(len(vt))
        size, prefill = item
        steps += 1 if prefill else size
        new_pos = torch.arange(vt.next_pos, vt.next_pos + size)
        if acc is not None:
            probs, lengths = model.block_probs(
                vt.positions, new_pos, s.obs_window if prefill else None
            )
            acc.update(probs, lengths)
        for mode, row in rows.items():
            row.append(size)
            stats[mode]["peak_pages"] = max(stats[mode]["peak_pages"], row.held_pages().numel())
        if not cfg.should_evict(len(vt)):
            continue
        view = TokenView(
            positions=vt.positions,
            shared=vt.positions < cpl,
            keys=model.keys[vt.positions] if "keys" in policy.needs else None,
            attn=acc.stats if acc is not None else None,
            rid=req.rid,
            step=evictions,
        )
        keep = policy.keep(view, cfg.budget)
        for mode, row in rows.items():
            plan = row.plan(keep, reclaim="vtoken" if mode == "vtoken" else "naive")
            if mode == "lazy":  # compact only if the naive result is fragmented
                held = row.held_pages().numel() - plan.num_freed_pages
                if held and 1 - (plan.new_len - cpl) / (held * ps) > s.frag_threshold:
                    plan = row.plan(keep, reclaim="vtoken")
            stats[mode]["pages_freed"] += plan.num_freed_pages
            stats[mode]["tokens_moved"] += plan.num_moved
            row.apply(plan, keep)
        if acc is not None:
            acc.select(keep)
        evictions += 1
    private_total = req.total_len - cpl
    out = [
        dict(
            mode="noevict",
            retained_pages=num_pages(private_total, ps),
            ideal_pages=num_pages(private_total, ps),
            peak_pages=num_pages(private_total, ps),
            pages_freed=0,
            tokens_moved=0,
            live_tokens=req.total_len,
        )
    ]
    for mode, row in rows.items():
        row.check_integrity()
        out.append(
            dict(
                mode=mode,
                retained_pages=row.held_pages().numel(),
                ideal_pages=num_pages(row.num_private, ps),
                live_tokens=len(row),
                **stats[mode],
            )
        )
    common = dict(
        rid=req.rid,
        session=req.session,
        turn=req.turn,
        policy=policy_name,
        ratio=s.ratio,
        page_size=ps,
        budget=cfg.budget,
        window=cfg.window,
        interval=cfg.interval,
        shared_pages=cpl // ps,
        total_len=req.total_len,
        steps=steps,
        evictions=evictions,
    )
    return [{**common, **o} for o in out]
