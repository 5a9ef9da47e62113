"""Properties of plans on random traces (the paper's I1-I4 and the page claims).

A trace is a random sequence of appends and evictions on one request with a tree-owned
prefix, run in a fake pool whose K/V rows carry each token's identity. After every applied plan:
  I1 token conservation: every kept token's K/V bytes are unchanged and reachable from its row;
  I2 unique mapping: no slot is mapped twice, no row slot lies in a free page;
  freed pages are disjoint from the pages still held; the allocator balances;
  I4 the plan never increases the pages held; vtoken holds exactly ceil(live / page_size);
  attention over the compacted row == attention over all tokens with the evicted ones masked.
"""

import torch
from helpers.reference import attention_ref, row_attention_ref
from helpers.row import RequestRow, is_dense_row
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_vtoken.kernels.reference import repack_kv_ref_
from sgl_vtoken.pages import PageAllocator, num_pages

H, D = 2, 4


def _trace(draw, page_size):
    cpl_pages = draw(st.integers(0, 2))
    steps = draw(
        st.lists(
            st.tuples(st.integers(1, 3 * page_size + 3), st.floats(0.0, 1.0)),
            min_size=1,
            max_size=6,
        )
    )
    seed = draw(st.integers(0, 2**16))
    return cpl_pages * page_size, steps, seed


@st.composite
def traces(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    reclaim = draw(st.sampled_from(["vtoken", "naive", "mixed"]))
    shift = draw(st.booleans())
    return (page_size, reclaim, shift, *_trace(draw, page_size))


class World:
    """A pool, one request, and the ground truth of every token ever written."""

    def __init__(self, page_size, cpl, seed):
        self.alloc = PageAllocator(num_pages=256, page_size=page_size)
        self.g = torch.Generator().manual_seed(seed)
        self.k = torch.zeros(self.alloc.num_slots, H, D)
        self.v = torch.zeros(self.alloc.num_slots, H, D)
        self.truth_k, self.truth_v = {}, {}  # position -> K/V written at alloc
        tree = self.alloc.append_slots(None, cpl)  # a tree-owned prefix
        self.row = RequestRow(self.alloc, torch.tensor(tree, dtype=torch.int64))
        self._write(self.row.slots, self.row.positions)

    def _write(self, slots, positions):
        kk, vv = (
            torch.randn(len(slots), H, D, generator=self.g),
            torch.randn(len(slots), H, D, generator=self.g),
        )
        self.k[slots], self.v[slots] = kk, vv
        for i, p in enumerate(positions.tolist()):
            self.truth_k[p], self.truth_v[p] = kk[i].clone(), vv[i].clone()

    def append(self, count):
        slots = self.row.append(count)
        self._write(slots, self.row.positions[-count:])


@settings(max_examples=150, deadline=None)
@given(traces())
def test_plans_conserve_tokens_and_pages(trace):
    page_size, reclaim, shift, cpl, steps, seed = trace
    w = World(page_size, cpl, seed)
    q = torch.randn(4, D, generator=w.g)
    for count, frac in steps:
        mode = reclaim if reclaim != "mixed" else ("vtoken" if frac > 0.5 else "naive")
        w.append(count)
        held_before = w.row.held_pages().numel()
        used_before = w.alloc.num_used
        n = len(w.row)
        private = torch.arange(cpl, n)
        mask = torch.rand(private.numel(), generator=w.g) < frac
        keep = torch.cat([torch.arange(cpl), private[mask]])
        plan = w.row.plan(keep, reclaim=mode, shift_dead_pages=shift)
        pages_before = w.row.held_pages()
        held_after_expected = set(pages_before.tolist()) - set(plan.freed_pages.tolist())
        w.row.apply(plan, keep, buffers=(w.k, w.v))
        w.alloc.check_integrity()
        w.row.check_integrity()
        # I1: every kept token's bytes, read through its row slot
        for slot, pos in zip(w.row.slots.tolist(), w.row.positions.tolist()):
            assert torch.equal(w.k[slot].view(torch.int32), w.truth_k[pos].view(torch.int32))
            assert torch.equal(w.v[slot].view(torch.int32), w.truth_v[pos].view(torch.int32))
        # I2 + disjointness: row slots unique, none in a free page, freed pages no longer held
        pages_of_row = set((w.row.slots[cpl:] // page_size).tolist())
        assert pages_of_row <= w.alloc.used_pages
        assert not pages_of_row & set(plan.freed_pages.tolist())
        assert set(w.row.held_pages().tolist()) == held_after_expected
        assert held_after_expected == pages_of_row  # every fully dead page was freed
        assert w.alloc.num_used == used_before - plan.num_freed_pages
        # I4: never more pages; vtoken is ideal and dense
        held_after = w.row.held_pages().numel()
        assert held_after <= held_before
        if mode == "vtoken":
            assert held_after == num_pages(w.row.num_private, page_size)
            assert is_dense_row(w.row)
            dst_off, src_off = (
                _offsets(plan.dst, pages_before, page_size),
                _offsets(plan.src, pages_before, page_size),
            )
            assert bool((dst_off < src_off).all())  # moves go towards the front
            assert bool((dst_off[1:] > dst_off[:-1]).all())  # in row order
        else:
            assert held_after >= num_pages(w.row.num_private, page_size)
            assert plan.num_moved == 0
        # attention over the compacted row == attention over every token, evicted ones masked
        all_pos = sorted(w.truth_k)
        k_all = torch.stack([w.truth_k[p] for p in all_pos])
        v_all = torch.stack([w.truth_v[p] for p in all_pos])
        alive = torch.zeros(len(all_pos), dtype=torch.bool)
        alive[w.row.positions] = True
        if len(w.row):
            torch.testing.assert_close(
                row_attention_ref(q, w.k, w.v, w.row.slots),
                attention_ref(q, k_all, v_all, alive),
                rtol=0,
                atol=1e-6,
            )


def _offsets(slots, pages, page_size):
    """``[m]`` offset of each slot in the request's page list (row order for a dense row)."""
    index = {p: i for i, p in enumerate(pages.tolist())}
    return torch.tensor(
        [index[s // page_size] * page_size + s % page_size for s in slots.tolist()],
        dtype=torch.int64,
    )


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 200), st.integers(1, 40), st.integers(0, 2**16))
def test_moves_in_order_in_chunks_equal_gather_then_scatter(n, chunk, seed):
    """In-place compaction moves may overlap; any in-order chunking gives the same result."""
    g = torch.Generator().manual_seed(seed)
    alloc = PageAllocator(num_pages=64, page_size=4)
    row = RequestRow(alloc)
    row.append(n)
    keep = (torch.rand(n, generator=g) < 0.5).nonzero().flatten()
    plan = row.plan(keep)
    kv = torch.randn(alloc.num_slots, 3, generator=g)
    whole = kv.clone()
    repack_kv_ref_([whole], [], plan.src, plan.dst)
    chunked = kv.clone()
    for i in range(0, plan.num_moved, chunk):
        repack_kv_ref_([chunked], [], plan.src[i : i + chunk], plan.dst[i : i + chunk])
    sequential = kv.clone()
    for s, d in zip(plan.src.tolist(), plan.dst.tolist()):
        sequential[d] = sequential[s]
    assert torch.equal(whole, chunked) and torch.equal(whole, sequential)
