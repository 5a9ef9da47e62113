"""The host tier: evicted tokens' K/V kept in host memory, recalled when a new turn needs them.

With `offload` an eviction copies its victims' K/V, every layer, to host memory
before their slots are freed: one `Chunk` per row and step, gathered for all rows of the step
at once and copied to the host in one transfer per K and V. Chunks are immutable and counted by
reference; their owners are

    a running request      `st.host`: its history's chunks (taken at its first forward), then
                           its own evictions'
    a stored history       `node.vt_host` of the radix node holding its view: the finished
                           request's chunks move there (`store`); released with the view (the
                           node evicted by the tree's LRU, the view punched or dropped, a flush)

so a chunk lives while some view or request can still recall it. The server-wide capacity is
`host_tokens` (`HostTier`): when an offload does not fit, the stores of the least recently used
stored histories are released first, then the victims that still do not fit are dropped
(counted as `offload_dropped_tokens`).

Recall (`recall > 0`): a turn continuing a view with a host store is prefilled in two chunks
(`sgl_vtoken.recall.split`, forced at admission: `prefill.chunk_limit`). The first chunk's last
`obs_window` queries score the store's candidates (`sgl_vtoken.recall`, in `scores.py`). Between
the chunks (`recall_prompt`, after SGLang stashed the first) the best `recall` come back: slots
(page-dense at page size > 1), K/V written from the host, joined to the row at their original
positions, and kept for the rest of the turn (`st.pinned`, must-keep like sinks); the first
chunk's tail from `back` on is dropped, and the second chunk recomputes it with them visible::

    row before   | view | new [start, back) | new [back, end) |          (chunk 1, then stashed)
    row after    | view | new [start, back) | recalled | new [back, total) ...  (chunk 2)

When the turn ends they leave the row before it is stored (`drop_recalled`).
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass

import torch

from sgl_vtoken.kernels import repack_kv_
from sgl_vtoken.planner import plan_eviction
from sgl_vtoken.recall import dedupe, pick, split

from .state import state_of


@dataclass(eq=False)
class Chunk:
    """Victims of one eviction of one row: ``positions [m] int64``, ``k, v [m, layers, H, D]``
    (host tensors), and how many owners hold it."""

    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    refs: int = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class HostTier:
    """Host-memory store of one scheduler process, capped at `cap` tokens."""

    def __init__(self, cap: int) -> None:
        self.cap, self.tokens, self.bytes, self.peak_bytes = cap, 0, 0, 0
        self.offloaded = self.dropped = self.recalled = self.recalls = 0
        self.recall_seconds = 0.0
        self.nodes: dict[int, object] = {}   # id -> radix node holding a store

    def hold(self, chunks) -> None:
        for c in chunks:
            if c.refs == 0:
                self.tokens += c.positions.numel()
                self.bytes += c.nbytes
            c.refs += 1
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def drop(self, chunks) -> None:
        for c in chunks:
            c.refs -= 1
            assert c.refs >= 0, "a host chunk was released twice"
            if c.refs == 0:
                self.tokens -= c.positions.numel()
                self.bytes -= c.nbytes

    def store(self, node, st) -> None:
        """A finished request's chunks become the store of the view at radix `node`."""
        self.detach(node)
        st.report["host_bytes"] = sum(c.nbytes for c in st.host)
        if st.host:
            node.vt_host, st.host = st.host, []
            self.nodes[id(node)] = node

    def detach(self, node) -> None:
        """Release the store of `node`'s view (the view is gone or replaced)."""
        chunks = getattr(node, "vt_host", None)
        if chunks:
            self.drop(chunks)
        node.vt_host = None
        self.nodes.pop(id(node), None)

    def reset(self) -> None:
        """The tree was flushed: every stored history's store goes."""
        for node in list(self.nodes.values()):
            self.detach(node)

    def make_room(self, m: int) -> int:
        """Room for up to `m` more tokens, releasing stored histories' stores, least recently
        used first, while it does not fit. Returns the tokens that fit (<= m)."""
        if self.tokens + m > self.cap:
            for node in sorted(self.nodes.values(), key=lambda n: n.last_access_time):
                self.detach(node)
                if self.tokens + m <= self.cap:
                    break
        return max(0, min(m, self.cap - self.tokens))

    def as_dict(self) -> dict:
        return {"host_tokens_cap": self.cap, "host_tokens_held": self.tokens, "host_bytes_held": self.bytes,
                "peak_host_bytes": self.peak_bytes, "offloaded_tokens": self.offloaded,
                "offload_dropped_tokens": self.dropped, "recalled_tokens": self.recalled,
                "recalls": self.recalls, "recall_seconds": round(self.recall_seconds, 6)}


# The host store of this scheduler process (`install`, at scheduler start when the server's
# `host_tokens` > 0); None: no request offloads.
_tier: HostTier | None = None


def install(cap: int) -> HostTier | None:
    global _tier
    _tier = HostTier(cap) if cap > 0 else None
    return _tier


def tier_of() -> HostTier | None:
    return _tier


# --- offload (eviction.py) ------------------------------------------------------------------
def offload(tier: HostTier, rows: list, k_buffers, v_buffers) -> None:
    """Copy the victims of `rows` (``(state, slots [m] device, positions [m] host)``) to the
    host, before their slots are freed: one gather per layer and one host copy for K and V."""
    slots = torch.cat([s for _, s, _ in rows])
    if not slots.numel():
        return
    k = torch.stack([buf[slots] for buf in k_buffers], dim=1).cpu()
    v = torch.stack([buf[slots] for buf in v_buffers], dim=1).cpu()
    start = 0
    for st, s, positions in rows:
        m = s.numel()
        keep = tier.make_room(m)
        tier.dropped += m - keep
        tier.offloaded += keep
        st.report["offloaded_tokens"] = st.report.get("offloaded_tokens", 0) + keep
        if keep:
            chunk = Chunk(positions[:keep].clone(), k[start:start + keep], v[start:start + keep])
            tier.hold([chunk])
            st.host.append(chunk)
        start += m


# --- recall -----------------------------------------------------------------------------------
@dataclass
class RecallPlan:
    """A turn's recall candidates: ``positions [c]``, ``k, v [c, layers, H, D]`` (host), their
    scores ``[c]`` float32 as the first chunk's window queries accumulate them (pool device), and
    the row lengths where its prefill is cut (`sgl_vtoken.recall.split`)."""

    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scores: torch.Tensor
    end: int
    back: int
    seconds: float = 0.0


def begin_turn(req, st) -> None:
    """Before a request's first prefill chunk (admission, then its first forward; once): it takes
    its view's store, and with `recall` its candidates are set up for scoring (`scores.py`) and
    its prefill is cut (`RecallPlan.end`)."""
    tier = _tier
    if st.host_taken or tier is None or not st.cfg.offload:
        return
    st.host_taken = True
    if st.hit is None:
        return
    chunks = getattr(st.hit[0], "vt_host", None) or []
    tier.hold(chunks)
    st.host = list(chunks) + st.host
    if not st.cfg.recall or not chunks:
        return
    t0 = time.perf_counter()
    depth = st.offset + st.kept_pos.numel()
    positions = torch.cat([c.positions for c in chunks])
    idx = dedupe(positions, depth, st.kept_pos)
    st.report["recall_candidates"] = int(idx.numel())
    cut = split(req.prefix_len, len(req.full_untruncated_fill_ids), st.cfg.obs_window, st.cfg.page_size)
    if not idx.numel() or cut is None:
        return
    st.recall = RecallPlan(positions[idx], torch.cat([c.k for c in chunks])[idx],
                           torch.cat([c.v for c in chunks])[idx], torch.zeros(idx.numel()), *cut)
    st.recall.seconds += time.perf_counter() - t0


def recall_prompt(scheduler, req, st, alloc) -> None:
    """Between a recalling turn's two prefill chunks (`prefill.py`): the best candidates join the
    row at `back`, the first chunk's entries from `back` on leave it (their slots are freed; the
    rest of `back`'s page is refilled), and the ids become row coordinates, so SGLang prefills
    the second chunk after the recalled entries at its logical positions. `alloc(n)`: n slots
    (whole pages) or None."""
    plan, st.recall = st.recall, None
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # overlap scheduler: the first chunk's forward has run
    t0 = time.perf_counter()
    sel = pick(plan.scores, st.cfg.recall, st.cfg.recall_pool, st.cfg.recall_gap)
    kv, end, back = req.kv, plan.end, plan.back
    req_to_token = scheduler.req_to_token_pool.req_to_token
    allocator = scheduler.token_to_kv_pool_allocator
    row = req_to_token[kv.req_pool_idx, :end].to(torch.int64)
    positions = st.positions(end)
    slots = _row_slots(scheduler, row[:back], int(sel.numel()), alloc) \
        if sel.numel() else row[:0]
    if slots is None:  # no free page: the turn goes on without them
        st.report["recall_skipped_tokens"] = int(sel.numel())
        sel, slots = sel[:0], row[:0]
    n, ps = int(sel.numel()), allocator.page_size
    tail = row[-(-back // ps) * ps:]  # whole pages past `back`'s page
    if tail.numel():
        allocator.free_page_ids(tail[::ps] // ps)
    if n:
        kvcache = allocator.get_kvcache()
        k, v = plan.k[sel], plan.v[sel]
        for layer, (kb, vb) in enumerate(zip(kvcache.k_buffer, kvcache.v_buffer)):
            kb[slots] = k[:, layer].to(kb.device, kb.dtype, non_blocking=True)
            vb[slots] = v[:, layer].to(vb.device, vb.dtype, non_blocking=True)
        req_to_token[kv.req_pool_idx, back:back + n] = slots.to(req_to_token.dtype)
    kv.kv_committed_len = kv.kv_allocated_len = back + n
    recalled = plan.positions[sel]
    logical = st.logical_ids(req)
    resume = int(positions[back])  # the first recomputed token
    ids = array("q", (logical[p] for p in torch.cat([positions[:back], recalled]).tolist())) + logical[resume:]
    st.recalled_into_row(req, recalled, back, resume, ids)
    req.prefix_len = req.already_computed = back + n
    seconds = plan.seconds + time.perf_counter() - t0
    st.report.update(recalled_tokens=n, recall_ms=round(seconds * 1e3, 3), recalled_positions=recalled.tolist(),
                     recomputed_tokens=end - back)
    tier = _tier
    tier.recalled += n
    tier.recalls += 1
    tier.recall_seconds += seconds


def _row_slots(scheduler, row: torch.Tensor, n: int, alloc) -> torch.Tensor | None:
    """Slots for `n` entries after `row`, page-dense (splice rule 6): the rest of the row's last
    page (its own), then fresh pages from `alloc` (whole pages). None: no free page."""
    ps = scheduler.token_to_kv_pool_allocator.page_size
    if ps == 1:
        return alloc(n)
    room = min(n, (ps - row.numel() % ps) % ps)
    head = int(row[-1]) + 1 + torch.arange(room, device=row.device) if room else row[:0].to(torch.int64)
    rest = n - room
    if not rest:
        return head.to(torch.int64)
    fresh = alloc(-(-rest // ps) * ps)
    if fresh is None:
        return None
    return torch.cat([head.to(torch.int64), fresh[:rest].to(head.device, torch.int64)])


def drop_recalled(req, tree) -> None:
    """A finished request's recalled tokens leave its row before it is stored (the view keeps
    what the policy kept, and the host store still has them): one plan as an eviction makes
    (`plan_eviction`: compaction at page size > 1), applied and freed here, before SGLang
    reads the row's lengths."""
    st = state_of(req)
    if st is None or st.pinned is None or not req.kv.holds_kv:
        return
    kv, ps = req.kv, tree.page_size
    committed, allocated = kv.kv_committed_len, kv.kv_allocated_len
    req_to_token = tree.req_to_token_pool.req_to_token
    row = req_to_token[kv.req_pool_idx, :allocated].to(torch.int64)
    positions = st.positions(committed)
    keep = (~torch.isin(positions, st.pinned)).nonzero().flatten()
    st.pinned = None
    if keep.numel() == committed and allocated == committed:
        return
    plan = plan_eviction(row.cpu(), keep, cpl=kv.cache_protected_len, page_size=ps)
    allocator = tree.token_to_kv_pool_allocator
    if plan.num_moved:
        kvcache = allocator.get_kvcache()
        repack_kv_(kvcache.k_buffer, kvcache.v_buffer, plan.src.to(row.device), plan.dst.to(row.device))
    if plan.row_slots.numel():
        req_to_token[kv.req_pool_idx, plan.row_start:plan.new_len] = plan.row_slots.to(req_to_token)
    if plan.num_freed_pages:
        freed = plan.freed_pages.to(row.device)
        (allocator.free if ps == 1 else allocator.free_page_ids)(freed)
    st.kept_pos, st.offset = positions[keep], st.offset + committed - keep.numel()
    kv.kv_committed_len = kv.kv_allocated_len = plan.new_len


def release_finished(req) -> None:
    """After a request's KV is released: a finished (or aborted) request's chunks that no stored
    view took are released; a retracted one keeps them."""
    st = state_of(req)
    tier = _tier
    if st is None or tier is None or not req.finished():
        return
    if st.host:  # no stored view took them
        tier.drop(st.host)
        st.host = []
        st.report["host_bytes"] = 0
    st.recall = None
