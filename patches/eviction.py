"""Token eviction in the scheduler: evict, reclaim, fix lengths, before the decode memory check.

Runs AROUND `Scheduler.update_running_batch`, so `check_decode_mem` already sees the reclaimed
memory, and before `prepare_for_decode` appends the slot of the incoming token. Every SGLang
length stays in row coordinates (splice rule 1, docs/design.md): after an eviction of `d` tokens the row holds
`budget` live slots and the request's position offset grows by `d`::

    row before (L = budget + interval)            row after (budget), offset += d
    | tree-owned [0, cpl) | private ........ |    | tree-owned | kept private |
    0                     cpl                L    0            cpl           budget
    logical position of row index j: kept_pos[j] for j < m (at the last eviction), j + offset after

Tree-owned slots are never freed or moved (splice rule 2). With compacted-history reuse (`radix.py`,
page size 1) the policy may drop them from the row, which then stops using them; otherwise it
sees them as shared and keeps them. Page size 1: the row is compacted and dead slots freed. Page size > 1: kept private tokens
move down onto the request's own pages (`dst <= src`, one all-layer KV move) and whole pages
are freed (splice rule 6); with `--kv-reclaim naive` the pages a Naive-Evict cache could not free stay
held by the request (see `held.py`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.policies import policy_from_config
from sgl_vtoken.policies.base import EvictionPolicy
from sgl_vtoken.rng import stable_id
from sgl_vtoken.step import EvictRow, KVPoolView, apply, decide

from . import held, radix
from .counters import counters_of
from .model_support import kv_bytes_per_token
from .observe import sample_held
from .scores import fold_staged


@dataclass
class ReqEvictState:
    """Per-request eviction state, stored on the SGLang `Req` as `req.vtoken`."""

    cfg: EvictConfig
    policy: EvictionPolicy
    rid: int                                   # stable 32-bit identity (seeded policies)
    kept_pos: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    offset: int = 0                            # tokens evicted so far: logical - row position
    steps: int = 0                             # evictions so far (seeded policies hash it)
    pages_freed: int = 0
    naive_pages: list[int] = field(default_factory=list)  # pages held back in naive mode
    report: dict = field(default_factory=dict)  # meta_info["kv_evict"][0], updated in place
    accumulator: object = None                 # attention statistics (H2O, TOVA, Scissorhands)
    staged: list = field(default_factory=list)  # ([q, n, layers, kv_heads], [q] lengths) per forward
    holed: bool = False                        # served by the holed radix cache (radix.tree_mode)
    logical_prompt: array | None = None        # the prompt's ids while the request holds a view's
    hit: tuple | None = None                   # (node, slots) of the stored view it continues
    attach: int = 0                            # logical prefix whose KV is hole-free, full attention
    tree_len: int = 0                          # positions below were tree-owned at the first eviction
    tree_lock: int = 0                         # Naive-Evict: tree tokens its lock still covers
    naive_excess: int = 0                      # Naive-Evict: pages held beyond its true footprint
    stash: object = None                       # retraction.RetractStash while retracted (page size 1)
    resume_node: object = None                 # the radix node its stash was written back to
    real_outputs: object = None                # a resumed request's outputs while its prefill is set up
    undo: tuple | None = None                  # this step's state before its fold and eviction
    resume_prefill: bool = False               # its prefill is a resume's (the row ends there)
    retractions: int = 0
    blocked: bool = False                      # retracted, and its view does not fit the pool yet

    def logical_ids(self, req) -> array:
        """The request's logical token ids (prompt + output), whatever its row holds."""
        prompt = req.origin_input_ids if self.logical_prompt is None else self.logical_prompt
        return array("q", prompt) + array("q", req.output_ids)

    def positions(self, row_len: int) -> torch.Tensor:
        """``[row_len] int64`` logical position of every live row entry."""
        m = self.kept_pos.numel()
        return torch.cat([self.kept_pos[:row_len], torch.arange(m, row_len) + self.offset])

    def reset(self) -> None:
        """Retraction: the row is gone. With a stash the request resumes from it (the policy state
        stays); without one it is re-prefilled from its ids and every eviction is forgotten."""
        self.kept_pos = self.kept_pos[:0]
        self.offset = 0
        self.tree_len = self.tree_lock = self.naive_excess = 0
        self.staged.clear()
        if self.stash is None:
            self.steps = 0
            self.accumulator = self.policy.new_accumulator()


def new_state(cfg: EvictConfig, rid: str) -> ReqEvictState:
    policy = policy_from_config(cfg)
    st = ReqEvictState(cfg=cfg, policy=policy, rid=stable_id(rid), accumulator=policy.new_accumulator(),
                       holed=radix.tree_mode(cfg))
    st.report.update(policy=cfg.policy, budget=cfg.budget, evicted_tokens=0, live_tokens=None,
                     pages_freed=0, evictions=0)
    return st


def evict_batch(scheduler, batch, skip: set) -> bool:
    """Evict every request of `batch` whose row reached its trigger, in one pass
    (`sgl_vtoken.step`); update the batch lengths. Returns whether the batch holds any evicting
    request."""
    evicting = [(i, req, st) for i, req in enumerate(batch.reqs)
                if (st := getattr(req, "vtoken", None)) is not None]
    if not evicting:
        return False
    c = counters_of(scheduler)
    if not c.bytes_per_token:  # first eviction on a server without a policy: read the pool now
        c.bytes_per_token = kv_bytes_per_token(scheduler.token_to_kv_pool_allocator.get_kvcache())
    sample_held(scheduler)  # rows as prefilled, before this step's eviction
    seq_lens_cpu = batch.seq_lens_cpu
    due = []
    for i, req, st in evicting:
        st.stash, st.resume_prefill = None, False  # decoding again: a resumed view is its row now
        # A retraction later in this step resumes from the state before this step (retraction.py):
        # references only, the statistics are replaced, never written in place.
        st.undo = (st.accumulator.state if st.accumulator is not None else None, None)
        if st.accumulator is not None:
            fold_staged(st, getattr(scheduler, "tp_group", None))
        row_len = int(seq_lens_cpu[i])
        if req not in skip and st.cfg.should_evict(row_len):
            due.append((req, st, row_len))
    freed_before = c.pages_freed
    evicted = evict_rows(scheduler, due) if due else []
    new_lens = seq_lens_cpu.clone()
    index = {id(req): i for i, req, _ in evicting}
    for (req, _, row_len), n in zip(due, evicted):
        new_lens[index[id(req)]] = row_len - n
    if c.pages_freed > freed_before:
        # SGLang stops admitting after a failed admission until the batch shrinks; memory
        # freed by eviction must reopen admission the same way.
        batch.batch_is_full = False
    if not any(evicted):
        return True
    delta = seq_lens_cpu - new_lens
    # New tensors: the in-flight forward (overlap scheduler) keeps reading the old ones.
    batch.seq_lens_cpu = new_lens
    batch.seq_lens = batch.seq_lens - delta.to(batch.seq_lens.device, batch.seq_lens.dtype)
    batch.orig_seq_lens = batch.orig_seq_lens - delta.to(batch.orig_seq_lens.device, batch.orig_seq_lens.dtype)
    batch.seq_lens_sum = None
    return True


def evict_rows(scheduler, due: list) -> list[int]:
    """Evict the rows of `due` (``(req, state, row_len)``) down to their budgets in one pass:
    view -> keep -> plan on the device (`step.decide`), the tree's part row by row on the host
    (relock, release, pages for copies), then one repack, one row write (`step.apply`) and one
    allocator free. Returns the tokens each row evicted (0: not this step)."""
    tree, allocator = scheduler.tree_cache, scheduler.token_to_kv_pool_allocator
    ps = allocator.page_size
    for req, st, row_len in due:
        if st.holed and st.steps == 0 and st.hit is None:
            # The prompt's KV is full attention: share it before the first eviction (under the
            # overlap scheduler the prefill checkpoint may not have landed yet; then a no-op).
            tree.checkpoint(req, up_to=req.extend_end)
            st.tree_len = req.kv.cache_protected_len
        kv = req.kv
        assert kv.kv_committed_len == row_len == kv.kv_allocated_len, (
            f"row {row_len} != committed {kv.kv_committed_len} / allocated {kv.kv_allocated_len}")
    rows = [_row(req, st, row_len) for req, st, row_len in due]
    kvcache = allocator.get_kvcache()
    tp_group = getattr(scheduler, "tp_group", None)
    view = KVPoolView(scheduler.req_to_token_pool.req_to_token, kvcache.k_buffer, kvcache.v_buffer, ps,
                      tp_gather=None if tp_group is None or tp_group.world_size == 1
                      else lambda t, dim: tp_group.all_gather(t, dim=dim))
    d = decide(rows, view)
    copies, active = [], []
    for b, (req, st, row_len) in enumerate(due):
        w, n_copy, cpl = d.counts["whole"][b], d.counts["copies"][b], rows[b].cpl
        slots = _alloc(scheduler, -(-n_copy // ps) * ps) if n_copy else d.raw[b, :0]
        copies.append(d.raw[b, :0] if slots is None else slots)
        active.append(slots is not None)  # no free page for the copies: retry at the next step
        if slots is None or not st.holed or w == cpl:
            continue
        if ps == 1 and st.hit is not None:  # its own stored history: free what nobody reaches
            gone = d.raw[b, :cpl][~d.keep[b, :cpl].to(d.raw.device)]
            freed = tree.release_dropped(req, gone.to(st.hit[1].device))
            counters_of(scheduler).pages_freed += freed
            st.pages_freed += freed
        elif ps == 1 or st.cfg.reclaim == "vtoken":
            # Whole pages need not be a prefix (sinks, then a later run): lock up to the last one.
            # (Naive-Evict keeps its lock at page size > 1: see held.hold_naive_pages.)
            tree.relock_shallower(req, d.counts["depth"][b])
    stream = getattr(scheduler, "forward_stream_ctx", None) if view.req_to_token.is_cuda else None
    out = apply(d, view, copies, active, move_stream=stream)
    freed_rows = iter(torch.split(out.freed, out.freed_counts))
    to_free, evicted = [], []
    c = counters_of(scheduler)
    for b, (req, st, row_len) in enumerate(due):
        if not active[b]:
            evicted.append(0)
            continue
        evicted.append(_record(st, req, rows[b], d, b, next(freed_rows), to_free, tree))
        c.evictions += 1
    if to_free:
        pages = torch.cat(to_free).to(allocator.device)
        if pages.numel():
            (allocator.free if ps == 1 else allocator.free_page_ids)(pages)
            c.pages_freed += int(pages.numel())
    c.evicted_tokens += sum(evicted)
    c.tokens_moved += out.moved
    c.bytes_moved += out.moved * c.bytes_per_token
    return evicted


def _row(req, st: ReqEvictState, row_len: int) -> EvictRow:
    attn = st.accumulator.stats if st.accumulator is not None else None
    if attn is not None and attn.shape[0] != row_len:
        raise RuntimeError(f"attention statistics cover {attn.shape[0]} tokens, the row {row_len}")
    return EvictRow(row=req.kv.req_pool_idx, length=row_len, positions=st.positions(row_len),
                    policy=st.policy, budget=st.cfg.budget, cpl=req.kv.cache_protected_len,
                    shared=not st.holed, rid=st.rid, step=st.steps, attn=attn)


def _record(st: ReqEvictState, req, row: EvictRow, d, b: int, freed: torch.Tensor, to_free: list,
            tree) -> int:
    """Row `b` of decision `d` was applied: follow it in the request's state; add the pages to
    free to `to_free` (Naive-Evict holds some back). Returns the tokens evicted."""
    keep, kv = d.keep_indices(b), req.kv
    if st.holed and st.cfg.page_size == 1:  # what a retraction in this step resumes from
        st.undo = (st.undo[0], (d.raw[b, :row.length], row.positions, st.steps, st.kept_pos, st.offset,
                                dict(st.report), st.pages_freed))
    if st.accumulator is not None:
        st.accumulator.select(keep.to(st.accumulator.state.device))
    w, n_copy = d.counts["whole"][b], d.counts["copies"][b]
    if st.holed and (w != row.cpl or n_copy):  # the view changed below cpl
        kv.cache_protected_len = w
    new_len = d.new_length(b)
    kept_pos = row.positions[keep]
    if st.cfg.reclaim == "naive" and st.cfg.page_size > 1:
        own = new_len - w if st.holed else new_len  # pinned tree tokens are its own
        freed = held.hold_naive_pages(st, kept_pos, int(row.positions[-1]) + 1, own, kv, freed.cpu())
        if st.holed:
            tree.relock_shallower(req, st.tree_lock)
    to_free.append(freed)
    evicted = row.length - new_len
    st.kept_pos = kept_pos
    st.offset += evicted
    st.steps += 1
    st.pages_freed += int(freed.numel())
    st.report.update(evicted_tokens=st.report["evicted_tokens"] + evicted, live_tokens=new_len,
                     pages_freed=st.pages_freed, evictions=st.steps)
    kv.kv_committed_len -= evicted
    kv.kv_allocated_len -= evicted
    return evicted


def _alloc(scheduler, n: int) -> torch.Tensor | None:
    """`n` slots (whole pages) from the pool, evicting unlocked radix-cache nodes if needed."""
    allocator = scheduler.token_to_kv_pool_allocator
    if allocator.available_size() < n:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        scheduler.tree_cache.evict(EvictParams(num_tokens=n))
    return allocator.alloc(n) if allocator.available_size() >= n else None
