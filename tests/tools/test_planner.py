"""Repack planner on tiny rows with exact slot and page ids."""

import pytest
import torch
from helpers.step_ref import plan_eviction

T = lambda *xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731

# ps 4, cpl 0; held pages 5, 7, 2, 9 (tail holds 2 tokens)
ROW = T(20, 21, 22, 23, 28, 29, 30, 31, 8, 9, 10, 11, 36, 37)
KEEP = T(0, 2, 8, 9, 10, 11, 12, 13)  # page 7 fully evicted, page 5 half


def test_vtoken_shift_then_compact():
    p = plan_eviction(ROW, KEEP, page_size=4)
    # shift drops page 7 (row rewrite, no move); compaction packs P5 P2 P9 into P5 P2
    assert p.src.tolist() == [22, 8, 9, 10, 11, 36, 37]
    assert p.dst.tolist() == [21, 22, 23, 8, 9, 10, 11]
    assert (p.row_start, p.row_slots.tolist()) == (4, [8, 9, 10, 11])
    assert (p.old_len, p.new_len, p.num_evicted) == (14, 8, 6)
    assert p.freed_pages.tolist() == [7, 9]
    assert p.freed_slots.tolist() == [28, 29, 30, 31, 36, 37, 38, 39]
    assert p.dense


def test_vtoken_pure_compaction_keeps_row_entries_and_frees_tail_pages():
    p = plan_eviction(ROW, KEEP, page_size=4, shift_dead_pages=False)
    # k-th kept token -> old slot of row position k; the row only shrinks
    assert p.dst.tolist() == [21, 22, 23, 28, 29, 30, 31]
    assert p.row_slots.numel() == 0 and p.row_start == p.new_len == 8
    assert p.freed_pages.tolist() == [2, 9]  # exactly the tail pages of the page list


def test_naive_frees_only_fully_dead_pages():
    p = plan_eviction(ROW, KEEP, page_size=4, reclaim="naive")
    assert p.num_moved == 0 and not p.dense
    assert p.freed_pages.tolist() == [7]
    assert (p.row_start, p.row_slots.tolist()) == (1, [22, 8, 9, 10, 11, 36, 37])


def test_naive_frees_a_dead_tail_page_too():
    row = T(20, 21, 22, 23, 36, 37)  # page 9 holds 2 tokens, both evicted
    p = plan_eviction(row, T(0, 1, 2, 3), page_size=4, reclaim="naive")
    assert p.freed_pages.tolist() == [9] and p.row_slots.numel() == 0 and p.new_len == 4


def test_page_size_one_frees_slots_without_moves():
    row = T(7, 3, 9, 4, 8)
    p = plan_eviction(row, T(0, 3, 4), page_size=1)
    assert p.num_moved == 0
    assert p.freed_pages.tolist() == [3, 9]
    assert (p.row_start, p.row_slots.tolist(), p.new_len) == (1, [4, 8], 3)
    naive = plan_eviction(row, T(0, 3, 4), page_size=1, reclaim="naive")
    assert naive.freed_pages.tolist() == [3, 9] and naive.row_slots.tolist() == [4, 8]


def test_streamingllm_whole_page_eviction_moves_nothing():
    # cpl 4 (tree page 1), private pages 5 6 7 8 9; evict the first two private pages whole
    row = torch.cat([T(4, 5, 6, 7), torch.arange(20, 40)])
    keep = torch.cat([torch.arange(4), torch.arange(12, 24)])
    p = plan_eviction(row, keep, cpl=4, page_size=4)
    assert p.num_moved == 0
    assert p.freed_pages.tolist() == [5, 6]
    assert (p.row_start, p.row_slots.tolist()) == (4, list(range(28, 40)))


def test_tree_owned_rows_are_never_dropped():
    row = torch.arange(8, 16)
    with pytest.raises(ValueError, match=r"keep must include every tree-owned row \[0, 4\)"):
        plan_eviction(row, T(0, 1, 5, 6), cpl=4, page_size=4)
    with pytest.raises(ValueError, match="cpl must be a multiple of page_size=4"):
        plan_eviction(row, torch.arange(8), cpl=2, page_size=4)
    with pytest.raises(ValueError, match="strictly ascending"):
        plan_eviction(row, T(0, 1, 2, 3, 6, 5), cpl=4, page_size=4)
    with pytest.raises(ValueError, match=r"reclaim must be one of \['vtoken', 'naive'\]"):
        plan_eviction(row, torch.arange(8), reclaim="eager")


def test_keep_everything_is_a_no_op():
    p = plan_eviction(ROW, torch.arange(14), page_size=4)
    assert p.num_moved == 0 and p.num_freed_pages == 0 and p.row_slots.numel() == 0
    assert p.new_len == 14


def test_tree_owned_victims_leave_the_view_only():
    """drop_tree_rows: kept tree-owned slots stay a row prefix; tree victims are neither freed
    nor moved; the private plan frees exactly the private victims."""
    from helpers.step_ref import drop_tree_rows

    row = torch.tensor([10, 11, 12, 13, 20, 21, 22])
    keep = torch.tensor([0, 2, 4, 6])  # cpl = 4: t0 t2 kept, t1 t3 dropped
    view, keep2, cpl2 = drop_tree_rows(row, keep, cpl=4)
    assert view.tolist() == [10, 12, 20, 21, 22] and keep2.tolist() == [0, 1, 2, 4] and cpl2 == 2
    plan = plan_eviction(view, keep2, cpl=cpl2, page_size=1)
    assert plan.freed_pages.tolist() == [21] and plan.num_moved == 0
    new_row = torch.cat([view[: plan.row_start], plan.row_slots])
    assert new_row.tolist() == [10, 12, 20, 22]


def test_split_tree_pages_keeps_whole_pages_and_copies_the_rest():
    """The docstring's example: T0 kept whole, T1 dropped, T2 partial, so T2's and T3's kept
    tokens are copied; nothing of a shared page is referenced partially."""
    from helpers.step_ref import split_tree_pages

    keep = torch.tensor([0, 1, 2, 3, 9, 10, 12, 13, 14, 15, 16, 18])  # page 4; 16+ private
    split = split_tree_pages(keep, cpl=16, page_size=4)
    assert split.whole.tolist() == [0, 1, 2, 3]
    assert split.copy.tolist() == [9, 10, 12, 13, 14, 15]
    assert split.dropped == 6
    everything = split_tree_pages(torch.arange(20), cpl=16, page_size=4)
    assert everything.whole.tolist() == list(range(16)) and everything.copy.numel() == 0
    assert everything.dropped == 0
    with pytest.raises(ValueError, match="multiple of page_size"):
        split_tree_pages(keep, cpl=6, page_size=4)
