"""The batched eviction step equals the per-row path on random batches: same victims, rows,
KV bytes, freed pages and moves (sgl_vtoken/step.py and step_apply.py against its oracle
tests/helpers/step_ref.py), for the policies' choices (`decide`) and for explicit keep masks (`plan_keep`)."""

import copy

import pytest
import torch
from helpers.step_ref import evict_row_ref, plan_eviction
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_vtoken.kernels.reference import repack_kv_ref_
from sgl_vtoken.pages import PageAllocator
from sgl_vtoken.policies import make_policy
from sgl_vtoken.policies.sharing_aware import SharingAware
from sgl_vtoken.step import EvictRow, KVPoolView, decide, plan_keep
from sgl_vtoken.step_apply import apply, pack_onto_own

LAYERS, H, D = 2, 2, 4
POLICIES = ["streamingllm", "random", "knorm", "h2o", "tova", "scissorhands"]


class FakePool:
    """An SGLang-shaped pool: a slot table, per-layer K/V buffers, a page allocator."""

    def __init__(self, num_pages: int, ps: int, rows: int, gen: torch.Generator):
        self.alloc_pages = PageAllocator(num_pages, ps)
        slots = (num_pages + 1) * ps
        self.view = KVPoolView(
            req_to_token=torch.zeros(rows, 256, dtype=torch.int32),
            k_buffers=[torch.randn(slots, H, D, generator=gen) for _ in range(LAYERS)],
            v_buffers=[torch.randn(slots, H, D, generator=gen) for _ in range(LAYERS)],
            page_size=ps,
        )

    def slots(self, pages: int) -> torch.Tensor:
        ps = self.view.page_size
        return (
            torch.tensor(self.alloc_pages.alloc(pages))[:, None] * ps + torch.arange(ps)
        ).flatten()

    def alloc(self, n: int) -> torch.Tensor:
        return self.slots(n // self.view.page_size)


@st.composite
def batches(draw):
    ps = draw(st.sampled_from([1, 2, 4, 16]))
    seed = draw(st.integers(0, 2**16))
    specs = []
    for _ in range(draw(st.integers(1, 6))):
        cpl = draw(st.integers(0, 2)) * ps if ps > 1 else draw(st.integers(0, 9))
        priv = draw(st.integers(1, 60))
        budget = draw(st.integers(1, cpl + priv - 1)) if cpl + priv > 1 else 1
        specs.append(
            dict(
                cpl=cpl,
                priv=priv,
                budget=budget,
                policy=draw(st.sampled_from(POLICIES)),
                sink=draw(st.integers(0, 4)),
                window=draw(st.integers(0, 3)),
                shared=draw(st.booleans()),
                share_tree=draw(st.booleans()),
                gap=draw(st.integers(0, 5)),
                step=draw(st.integers(0, 3)),
                own_from=draw(st.one_of(st.none(), st.integers(0, cpl))),
                span=draw(st.sampled_from([0, 0, 2, 8])),
            )
        )
    return ps, seed, specs


def _spec(cpl, priv, budget, policy, **kw):
    """One row of `_build` written out: no sinks, window, gaps or step, nor a prefix shared with
    the row before, unless given."""
    defaults = dict(sink=0, window=0, shared=False, share_tree=False, gap=0, step=0)
    return dict(cpl=cpl, priv=priv, budget=budget, policy=policy, **{**defaults, **kw})


def _build(ps, seed, specs):
    gen = torch.Generator().manual_seed(seed)
    pool = FakePool(num_pages=400, ps=ps, rows=len(specs) + 1, gen=gen)
    rows, tree = [], None
    for b, s in enumerate(specs):
        if tree is None or tree.numel() != s["cpl"] or not s["share_tree"]:
            tree = pool.slots(-(-s["cpl"] // ps))[: s["cpl"]]
        L = s["cpl"] + s["priv"]
        private = pool.slots(-(-s["priv"] // ps))[: s["priv"]]
        pool.view.req_to_token[b, :L] = torch.cat([tree, private]).to(torch.int32)
        gaps = torch.randint(0, s["gap"] + 1, (L,), generator=gen)
        positions = torch.cumsum(gaps + 1, 0) - 1
        span = s.get("span", 0)
        pol = SharingAware(make_policy(s["policy"], sink=s["sink"], window=s["window"], span=span))
        # Units: runs of entries joined at random, named by their first entry's position.
        joins = torch.rand(L, generator=gen) < 0.6
        units = positions[torch.where(joins, 0, torch.arange(L)).cummax(0).values]
        must = (positions < s["sink"]) | (torch.arange(L) >= L - s["window"])
        must |= torch.arange(L) < (s["cpl"] if s["shared"] else 0)
        budget = max(s["budget"], int(must.sum()))
        attn = torch.rand(L, LAYERS, H, generator=gen) if "attn" in pol.needs else None
        rows.append(
            EvictRow(
                row=b,
                length=L,
                positions=positions,
                policy=pol,
                budget=budget,
                cpl=s["cpl"],
                shared=s["shared"],
                rid=seed + b,
                step=s["step"],
                attn=attn,
                own_from=s.get("own_from"),
                units=units if span else None,
            )
        )
    return pool, rows


@settings(max_examples=150, deadline=None)
@given(batches())
def test_batched_step_equals_the_per_row_path(batch):
    ps, seed, specs = batch
    pool, rows = _build(ps, seed, specs)
    ref_pool = copy.deepcopy(pool)
    ref = [evict_row_ref(r, ref_pool.view, ref_pool.alloc) for r in rows]

    d = decide(rows, pool.view)
    copies = [
        pool.alloc(-(-c // ps) * ps) if c else torch.zeros(0, dtype=torch.int64)
        for c in (r.copies for r in d.counts)
    ]
    out = apply(d, pool.view, copies)

    freed = torch.split(out.freed, out.freed_counts)
    for b, (r, want) in enumerate(zip(rows, ref)):
        assert torch.equal(d.keep_indices(b), want.keep), f"row {b}: victims differ"
        assert d.new_length(b) == want.new_len
        assert torch.equal(
            pool.view.req_to_token[b, : want.new_len], ref_pool.view.req_to_token[b, : want.new_len]
        )
        assert torch.equal(freed[b], want.freed), f"row {b}: freed pages differ"
        assert d.counts[b].whole == want.whole and d.counts[b].copies == want.copies
        if want.whole < r.cpl:
            assert d.counts[b].depth == want.depth
    assert out.moved == sum(int(w.src.numel()) for w in ref)
    for mine, theirs in zip(
        pool.view.k_buffers + pool.view.v_buffers, ref_pool.view.k_buffers + ref_pool.view.v_buffers
    ):
        assert torch.equal(mine, theirs), "KV bytes differ"


def test_a_budget_below_the_must_keep_set_is_refused_before_anything_changes():
    pool, rows = _build(4, 0, [_spec(8, 20, 5, "streamingllm", shared=True)])
    rows[0].budget = 5  # the 8 shared tree tokens must stay
    before = pool.view.req_to_token.clone()
    with pytest.raises(ValueError, match="budget 5 is smaller than the 8 tokens"):
        decide(rows, pool.view)
    assert torch.equal(pool.view.req_to_token, before)


def test_an_attention_policy_without_statistics_is_refused():
    pool, rows = _build(1, 0, [_spec(0, 20, 5, "h2o")])
    rows[0].attn = None
    with pytest.raises(ValueError, match="needs TokenView.attn"):
        decide(rows, pool.view)


@st.composite
def keep_masks(draw):
    """Rows of a page-dense pool with explicit keep masks (the tree-owned prefix kept)."""
    ps = draw(st.sampled_from([1, 16]))
    seed = draw(st.integers(0, 2**16))
    specs = []
    for _ in range(draw(st.integers(1, 4))):
        cpl = draw(st.integers(0, 2)) * ps if ps > 1 else draw(st.integers(0, 9))
        priv = draw(st.integers(1, 70))
        specs.append((cpl, priv, draw(st.floats(0.0, 1.0))))
    return ps, seed, specs


def _keep_rows(ps, seed, specs):
    gen = torch.Generator().manual_seed(seed)
    pool = FakePool(num_pages=400, ps=ps, rows=len(specs), gen=gen)
    masks = []
    for b, (cpl, priv, p) in enumerate(specs):
        tree = pool.slots(-(-cpl // ps))[:cpl]
        private = pool.slots(-(-priv // ps))[:priv]
        pool.view.req_to_token[b, : cpl + priv] = torch.cat([tree, private]).to(torch.int32)
        mask = torch.rand(cpl + priv, generator=gen) < p
        mask[:cpl] = True
        masks.append(mask)
    return pool, masks


@settings(max_examples=60, deadline=None)
@given(keep_masks())
def test_plan_keep_equals_the_per_row_planner_for_explicit_masks(batch):
    """`plan_keep` + `apply` (the batched step for keep masks a caller chose, e.g. dropping a
    turn's recalled tokens) against `plan_eviction` applied row by row: same rows, KV bytes,
    freed pages and moves, at page sizes 1 and 16."""
    ps, seed, specs = batch
    pool, masks = _keep_rows(ps, seed, specs)
    ref_pool = copy.deepcopy(pool)
    cpl = [c for c, _, _ in specs]
    want = []
    for b, mask in enumerate(masks):
        row = ref_pool.view.req_to_token[b, : mask.numel()].to(torch.int64)
        plan = plan_eviction(row, mask.nonzero().flatten(), cpl=cpl[b], page_size=ps)
        repack_kv_ref_(ref_pool.view.k_buffers, ref_pool.view.v_buffers, plan.src, plan.dst)
        ref_pool.view.req_to_token[b, plan.row_start : plan.new_len] = plan.row_slots.to(
            torch.int32
        )
        want.append(plan)

    d = plan_keep(pool.view, list(range(len(masks))), masks, cpl)
    out = apply(d, pool.view)

    freed = torch.split(out.freed, out.freed_counts)
    for b, plan in enumerate(want):
        assert d.new_length(b) == plan.new_len
        assert torch.equal(d.keep_indices(b), masks[b].nonzero().flatten())
        assert torch.equal(
            pool.view.req_to_token[b, : plan.new_len], ref_pool.view.req_to_token[b, : plan.new_len]
        )
        assert torch.equal(freed[b], plan.freed_pages), f"row {b}: freed pages differ"
        assert d.counts[b].copies == 0 and d.counts[b].whole == cpl[b]
    assert out.moved == sum(p.num_moved for p in want)
    for mine, theirs in zip(
        pool.view.k_buffers + pool.view.v_buffers, ref_pool.view.k_buffers + ref_pool.view.v_buffers
    ):
        assert torch.equal(mine, theirs), "KV bytes differ"


@st.composite
def own_parts(draw):
    """A row of a page-dense pool: a kept shared prefix, its own prompt part (tree-owned until
    it leaves the tree), private entries; a random keep mask past the shared prefix."""
    ps = draw(st.sampled_from([1, 16]))
    return (
        ps,
        draw(st.integers(0, 2**16)),
        draw(st.integers(0, 2)) * ps,  # shared
        draw(st.integers(1, 4)) * ps,  # own
        draw(st.integers(1, 40)),  # private
        draw(st.floats(0.05, 1.0)),
    )


@settings(max_examples=60, deadline=None)
@given(own_parts())
def test_copies_packed_onto_the_own_part_hold_what_fresh_pages_would(batch):
    """`pack_onto_own`: when the row's own prompt part leaves the tree for want of free pages,
    its kept entries are packed onto the part's first pages instead of fresh ones: every kept
    entry reads the same K/V through the new row as with fresh pages, the shared prefix is not
    moved, and the row's pages plus the pages freed are exactly the pages it had (no page lost,
    none freed twice)."""
    ps, seed, shared, own_len, priv, p = batch
    gen = torch.Generator().manual_seed(seed)
    pool = FakePool(num_pages=400, ps=ps, rows=1, gen=gen)
    tree, own = (pool.slots(n // ps).long() for n in (shared, own_len))
    private = pool.slots(-(-priv // ps))[:priv]
    row = torch.cat([tree, own, private])
    pool.view.req_to_token[0, : row.numel()] = row.to(torch.int32)
    mask = torch.rand(row.numel(), generator=gen) < p
    mask[:shared] = True
    cpl = shared + own_len
    fresh_pool = copy.deepcopy(pool)
    want_kv = [buf[row[mask]] for buf in pool.view.k_buffers + pool.view.v_buffers]

    d = plan_keep(pool.view, [0], [mask], [cpl], own_from=[shared])
    assert d.own_copies == [True]
    slots, free = pack_onto_own(d, 0, own, ps)
    out = apply(d, pool.view, [own], onto_own=[True])
    assert torch.equal(slots, own) and len(out.released) == 1
    assert torch.equal(out.released[0], free)
    d_fresh = plan_keep(fresh_pool.view, [0], [mask], [cpl], own_from=[shared])
    apply(d_fresh, fresh_pool.view, [fresh_pool.alloc(-(-d_fresh.counts[0].copies // ps) * ps)])

    n = d.new_length(0)
    new_row = pool.view.req_to_token[0, :n].to(torch.int64)
    assert torch.equal(new_row[:shared], tree)
    for buf, want in zip(pool.view.k_buffers + pool.view.v_buffers, want_kv):
        assert torch.equal(buf[new_row], want)
    fresh_row = fresh_pool.view.req_to_token[0, :n].to(torch.int64)
    for mine, theirs in zip(
        pool.view.k_buffers + pool.view.v_buffers,
        fresh_pool.view.k_buffers + fresh_pool.view.v_buffers,
    ):
        assert torch.equal(mine[new_row], theirs[fresh_row])
    held = torch.unique(new_row[shared:] // ps)
    freed = torch.cat([out.freed, free])
    had = torch.unique(torch.cat([own, private]) // ps)
    assert freed.numel() == torch.unique(freed).numel(), "a page freed twice"
    assert not torch.isin(freed, held).any(), "a page freed that the row still reads"
    assert torch.equal(torch.unique(torch.cat([held, freed])), had), "a page lost"


@settings(max_examples=60, deadline=None)
@given(own_parts(), st.integers(0, 3), st.floats(0.0, 1.0))
def test_own_copies_says_whether_the_first_copy_is_in_the_own_part(batch, shared_cut, p_tree):
    """`Decision.own_copies`: every copy of a row comes from its own part exactly when the first
    kept tree-owned entry that does not stay in place (the one after the `whole` ones) lies in
    that part, whatever the shared prefix keeps (a partly kept shared page is copied too)."""
    ps, seed, shared, own_len, priv, p = batch
    gen = torch.Generator().manual_seed(seed)
    pool = FakePool(num_pages=400, ps=ps, rows=1, gen=gen)
    row = pool.slots(-(-(shared + own_len + priv) // ps)).long()[: shared + own_len + priv]
    pool.view.req_to_token[0, : row.numel()] = row.to(torch.int32)
    cpl = shared + own_len
    mask = torch.rand(row.numel(), generator=gen) < p
    mask[: min(shared, shared_cut)] = True
    mask[min(shared, shared_cut) : shared] &= torch.rand(shared - min(shared, shared_cut)) < p_tree
    d = plan_keep(pool.view, [0], [mask], [cpl], own_from=[shared])
    tree_kept = d.keep[0, :cpl].nonzero().flatten()
    whole = d.counts[0].whole
    assert d.own_copies == [whole >= tree_kept.numel() or int(tree_kept[whole]) >= shared]
    assert plan_keep(pool.view, [0], [mask], [cpl]).own_copies == [False]


@pytest.mark.parametrize("ps", [1, 16])
def test_span_adds_no_sync_no_copy_and_a_fixed_number_of_launches(ps):
    """`decide` with units: still one host copy, one host-to-device copy of the rows' metadata
    and of their positions (the units ride with them), and the span's own launches (unit ids,
    scatter-max, two scatter-adds) do not grow with the batch."""
    from helpers.dispatch_count import DeviceCounter

    def count(rows: int, span: int) -> dict:
        specs = [
            _spec(0, 40, 24, "random", sink=2, window=2, gap=1, own_from=None, span=span)
            for _ in range(rows)
        ]
        pool, evict_rows = _build(ps, 3, specs)
        with DeviceCounter() as c:
            c.mark(pool.view.req_to_token)
            for buf in pool.view.k_buffers + pool.view.v_buffers:
                c.mark(buf)
            decide(evict_rows, pool.view)
        return c.summary()

    for rows in (2, 8):
        plain, spans = count(rows, 0), count(rows, 8)
        assert spans["host_syncs"] == plain["host_syncs"] == 1, spans["sync_sites"]
        assert spans["h2d"] == plain["h2d"]
    extra = [count(rows, 8)["launches"] - count(rows, 0)["launches"] for rows in (2, 8)]
    assert extra[0] == extra[1] > 0, extra
