"""Recall (`recall > 0`): tokens of a stored history's host store (`host_tier.py`) come back into
the row of a turn that needs them (a request's `Recall`, `st.recall`).

A turn continuing a view with a host store is prefilled in two chunks (`begin_turn`; the cut is
forced at admission, `prefill.chunk_limit`). The first chunk's last `obs_window` queries score
the candidates (`scores.py`); between the chunks (`recall_prompt`) the best `recall` are written
back and join the row at their original positions, pinned for the turn, and the second chunk
recomputes the first one's tail with them visible (with `recall_rounds`, round after round). When
the turn ends they leave the row before it is stored (`drop_recalled`). Design:
docs/design/cache.md, "Host tier and recall".
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl_vtoken.recall import GAP, POOL, dedupe, pick, round_quota, split, turn_rounds
from sgl_vtoken.step import KVPoolView, plan_keep
from sgl_vtoken.step_apply import apply

from ..core.process import process
from ..core.state import state_of
from . import host_tier

if TYPE_CHECKING:
    from ..core.sglang_types import KVPool, RadixTree, Req, Scheduler
    from ..core.state import ReqEvictState


@dataclass
class RecallPlan:
    """A turn's recall candidates: their logical positions ``candidates [c] int64``, ``k, v [c,
    layers, H, D]`` (host), their scores ``[c]`` float32 as the first chunk's window queries
    accumulate them (pool device), the row lengths where its prefill is cut
    (`sgl_vtoken.recall.split`), and the seconds spent on it so far. A later round
    (`recall_rounds`) shares the first round's tensors: `unpicked` ``[m] int64`` indexes the
    candidates still left (None: all), and `scores` is ``[m]``. On the pool's device: `k_device`
    (the candidates' keys, copied once per turn) and, on CUDA, the events of that copy (`k_ready`)
    and of the last layer scored (`scored`)."""

    candidates: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scores: torch.Tensor
    end: int
    back: int
    rounds: int = 1  # this round and the ones after it (`recall_rounds`)
    seconds: float = 0.0
    unpicked: torch.Tensor | None = None
    k_device: torch.Tensor | None = None
    k_ready: torch.cuda.Event | None = None
    scored: torch.cuda.Event | None = None

    def stage(self, device: torch.device | str) -> None:
        """Before a forward that scores the candidates (`scores.prepare`): the scores accumulate
        on `device` (the pool's), and the candidates' keys go there once, asynchronously."""
        self.scores = self.scores.to(device)
        if self.k_device is None:
            self.k_device, self.k_ready = host_tier.to_device(self.k, device)
        if self.unpicked is not None:
            self.unpicked = self.unpicked.to(device)

    def layer_keys(self, layer: int) -> torch.Tensor:
        """``[m, H, D]`` the keys of `layer` of the candidates left, on the pool's device; the
        turn's first call waits (on the device, not the host) for their copy."""
        if self.k_ready is not None:
            torch.cuda.current_stream().wait_event(self.k_ready)
            self.k_ready = None
        assert self.k_device is not None, "the plan is staged before a layer scores it"
        keys = self.k_device[:, layer]
        return keys if self.unpicked is None else keys[self.unpicked]

    def left_positions(self) -> torch.Tensor:
        """``[m]`` ascending positions of the candidates left (host)."""
        return self.candidates if self.unpicked is None else self.candidates[self.unpicked.cpu()]

    def chosen(self, sel: torch.Tensor) -> torch.Tensor:
        """Indices into `candidates` of `sel` ``[n]`` (indices into the candidates left)."""
        return sel if self.unpicked is None else self.unpicked.cpu()[sel]

    def next_round(self, sel: torch.Tensor, n: int) -> RecallPlan | None:
        """The plan of the round after this one recalled `sel` (``n`` of them joined the row, so
        the cut moves ``n`` entries on), or None when no round is left, none joined, or no
        candidate is left. Tensors are shared, not copied."""
        rest = torch.ones(self.scores.numel(), dtype=torch.bool)
        rest[sel] = False
        if self.rounds == 1 or not n or not rest.any():
            return None
        live = (
            torch.arange(self.candidates.numel()) if self.unpicked is None else self.unpicked.cpu()
        )[rest]
        return RecallPlan(
            self.candidates,
            self.k,
            self.v,
            torch.zeros(live.numel()),
            self.end + n,
            self.back + n,
            self.rounds - 1,
            unpicked=live,
            k_device=self.k_device,
        )

    def score(self, mass: torch.Tensor, t0: float) -> None:
        """Add one layer's window mass on the candidates, ``[c]`` float32 (`scores.collect`, which
        started computing it at `time.perf_counter()` `t0`)."""
        self.scores += mass
        if mass.is_cuda:  # what `recall_prompt` waits for before reading the scores
            self.scored = torch.cuda.Event()
            self.scored.record()
        self.seconds += time.perf_counter() - t0


@dataclass
class Recall:
    """A request's recall state (`st.recall`)."""

    plan: RecallPlan | None = None  # until the first part of its prompt's last chunk ends
    pinned: torch.Tensor | None = (
        None  # [n] int64 positions recalled this turn (ascending): kept like sinks
    )
    planned: bool = False  # its turn's candidates were looked at (`begin_turn`)

    def reset(self, unpin: bool = False) -> None:
        """No recall is pending (the turn's prefill starts over, is not cut where the plan needs,
        or the request finished); `unpin`: the recalled positions are no longer kept either."""
        self.plan = None
        if unpin:
            self.pinned = None

    def rematch(self) -> None:
        """A waiting request's match is undone (SGLang matches it again each round until it is
        admitted): its plan goes, and its next admission plans again from the new match. Without
        this a turn not admitted at its first try never recalled."""
        self.plan, self.planned = None, False


def begin_turn(req: Req, st: ReqEvictState) -> None:
    """Before each prefill chunk of a turn (admission, then its forward): it takes its view's store
    once (`host_tier.take_store`); with `recall`, at the prompt's last chunk (its first, unless
    `prefill_chunk` evicts before it), the candidates (what the request's store holds below its
    depth that its row lacks: its view's store and, with `prefill_chunk`, this prefill's victims)
    are set up for scoring (`scores.py`) and the chunk is cut (`RecallPlan.end`). Once a turn."""
    host_tier.take_store(st)
    if not st.cfg.host.recall or st.recall.planned or req.output_ids:
        return
    total = len(req.full_untruncated_fill_ids)  # row coordinates
    if st.cfg.prefill_peak is not None and total > st.cfg.prefill_peak:
        return  # a chunk before the last: it is evicted at the peak, its victims become candidates
    st.recall.planned = True
    if not st.host.chunks:
        return
    t0 = time.perf_counter()
    chunks = [c.wait() for c in st.host.chunks]  # offloaded at an earlier step: copies landed
    depth = st.row.offset + st.row.kept_pos.numel()
    positions = torch.cat([c.positions for c in chunks])
    idx = dedupe(positions, depth, st.row.kept_pos)
    st.report.recall_from(int(idx.numel()))
    cut = split(req.prefix_len, total, st.cfg.scoring.obs_window, st.cfg.page_size)
    if not idx.numel() or cut is None:
        return
    st.recall.plan = RecallPlan(
        positions[idx],
        torch.cat([c.k for c in chunks])[idx],
        torch.cat([c.v for c in chunks])[idx],
        torch.zeros(idx.numel()),
        *cut,
        rounds=turn_rounds(st.cfg.host.recall, st.cfg.host.rounds),
    )
    st.recall.plan.seconds += time.perf_counter() - t0


def skipped(st: ReqEvictState, rid: str, tokens: int, why: str) -> None:
    """A recall of `tokens` went without (`why`: "page", no free page; "cut", the prefill was not
    cut where it needed): reported, counted by the host tier, noted as a shortage."""
    st.report.skip_recall(tokens)
    tier = process().tier
    assert tier is not None, "a recall needs the host tier"
    tier.count_skip()
    process().shortages.note("recall_skipped", rid, why)


def recall_prompt(
    scheduler: Scheduler,
    req: Req,
    st: ReqEvictState,
    alloc: Callable[[int], torch.Tensor | None],
) -> None:
    """Between a recalling turn's two prefill chunks (`prefill.py`): the best candidates join the
    row at `back`, the first chunk's entries from `back` on leave it (their slots are freed; the
    rest of `back`'s page is refilled), and the ids become row coordinates, so SGLang prefills
    the second chunk after the recalled entries at its logical positions. `alloc(n)`: n slots
    (whole pages) or None."""
    plan, st.recall.plan = st.recall.plan, None
    tier = process().tier
    assert plan is not None and tier is not None, "a recalling turn has a plan and a host tier"
    if plan.scored is not None:  # overlap scheduler: the first chunk's scoring has run
        plan.scored.synchronize()
    t0 = time.perf_counter()
    host, before = st.cfg.host, st.recall.pinned
    done = 0 if before is None else int(before.numel())  # recalled by this turn's earlier rounds
    sel = pick(  # the earlier rounds' tokens are taken neighbours: their holes are filled too
        plan.scores,
        round_quota(host.recall, host.rounds, done, plan.rounds == 1),
        POOL,
        GAP,
        plan.left_positions(),
        before,
    )
    kv, end, back = req.kv, plan.end, plan.back
    req_to_token = scheduler.req_to_token_pool.req_to_token
    allocator = scheduler.token_to_kv_pool_allocator
    row = req_to_token[kv.req_pool_idx, :end].to(torch.int64)
    positions = st.row.positions(end)
    n = int(sel.numel())
    slots = _row_slots(allocator.page_size, row[:back], n, alloc) if n else row[:0]
    if slots is None:  # no free page: the turn goes on without them
        skipped(st, req.rid, n, "page")
        sel, slots = sel[:0], row[:0]
    n, ps = int(sel.numel()), allocator.page_size
    tail = row[-(-back // ps) * ps :]  # whole pages past `back`'s page
    if tail.numel():
        allocator.free_page_ids(tail[::ps] // ps)
    chosen = plan.chosen(sel)
    if n:
        _write_kv(allocator.get_kvcache(), slots, plan.k[chosen], plan.v[chosen])
        req_to_token[kv.req_pool_idx, back : back + n] = slots.to(req_to_token.dtype)
    kv.kv_committed_len = kv.kv_allocated_len = back + n
    recalled = plan.candidates[chosen]
    logical = st.prompt.logical_ids(req)
    resume = int(positions[back])  # the first recomputed token
    ids = (
        array("q", (logical[p] for p in torch.cat([positions[:back], recalled]).tolist()))
        + logical[resume:]
    )
    # The row: its first `back` entries, then the recalled ones (kept for the rest of the turn);
    # the ids become row coordinates, and the next chunk continues at logical position `resume`.
    st.row.join(back, recalled, resume)
    pinned = recalled.cpu() if before is None else torch.cat([before, recalled.cpu()])
    st.recall.pinned = pinned.sort().values
    st.stats.recalled(back, n)
    st.prompt.row_ids(req, ids)
    req.prefix_len = req.already_computed = back + n
    seconds = plan.seconds + time.perf_counter() - t0
    st.report.recall_round(  # a later round adds to the turn's figures
        done + n, st.recall.pinned.tolist(), seconds * 1e3, end - back, first=before is None
    )
    tier.count_recall(n, seconds)
    # The next round: the scoring window, recomputed after what this one recalled, ends a chunk
    # again and scores the candidates left.
    st.recall.plan = plan.next_round(sel, n)


def _write_kv(kvcache: KVPool, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the recalled tokens' K/V (host ``[n, layers, H, D]``) at `slots` in every layer: one
    asynchronous copy to the device for K and one for V, then one write per layer."""
    device = kvcache.k_buffer[0].device
    k, k_ready = host_tier.to_device(k, device)
    v, v_ready = host_tier.to_device(v, device)
    for ready in (k_ready, v_ready):
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)
    for layer, (kb, vb) in enumerate(zip(kvcache.k_buffer, kvcache.v_buffer)):
        kb[slots] = k[:, layer].to(kb.dtype)
        vb[slots] = v[:, layer].to(vb.dtype)


def _row_slots(
    ps: int, row: torch.Tensor, n: int, alloc: Callable[[int], torch.Tensor | None]
) -> torch.Tensor | None:
    """``[n] int64`` slots for `n` entries after `row` (the row's slots), page-dense at page size
    `ps` (splice rule 6): the rest of the row's last page (its own), then fresh pages from `alloc`
    (whole pages). None: no free page::

        ps 4, row slots 40 41 42 43 | 56 57     -> 58 59, then fresh pages
    """
    room = min(n, (ps - row.numel() % ps) % ps)
    head = (int(row[-1]) + 1 if room else 0) + torch.arange(room, device=row.device)
    rest = n - room
    if not rest:
        return head
    fresh = alloc(-(-rest // ps) * ps)
    if fresh is None:
        return None
    return torch.cat([head, fresh[:rest].to(head.device, torch.int64)])


def drop_recalled(req: Req, tree: RadixTree) -> None:
    """A finished request's recalled tokens leave its row before it is stored (the view keeps
    what the policy kept, and the host store still has them): planned as an eviction is
    (`step.plan_keep`: compaction at page size > 1), applied and freed here, before SGLang
    reads the row's lengths."""
    st = state_of(req)
    if st is None or st.recall.pinned is None or not req.kv.holds_kv:
        return
    kv, ps = req.kv, tree.page_size
    committed, allocated = kv.kv_committed_len, kv.kv_allocated_len
    positions = st.row.positions(committed)
    kept = ~torch.isin(positions, st.recall.pinned)  # [committed] bool
    st.recall.pinned = None
    if bool(kept.all()) and allocated == committed:
        return
    mask = torch.zeros(allocated, dtype=torch.bool)  # entries past `committed` leave too
    mask[:committed] = kept
    allocator = tree.token_to_kv_pool_allocator
    kvcache = allocator.get_kvcache()
    view = KVPoolView(tree.req_to_token_pool.req_to_token, kvcache.k_buffer, kvcache.v_buffer, ps)
    d = plan_keep(view, [kv.req_pool_idx], [mask], [kv.cache_protected_len])
    out = apply(d, view)  # KV moves, then the row write
    if out.freed.numel():
        (allocator.free if ps == 1 else allocator.free_page_ids)(out.freed)
    keep = kept.nonzero().flatten()
    st.row.keep(positions[keep], committed - keep.numel())
    kv.kv_committed_len = kv.kv_allocated_len = d.new_length(0)
