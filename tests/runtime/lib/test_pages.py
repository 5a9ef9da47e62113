"""Page allocator and page arithmetic on tiny pools."""

import pytest
import torch

from sgl_vtoken.pages import (
    PageAllocator,
    fragmentation,
    is_dense,
    num_pages,
    page_utilization,
    row_pages,
)


def test_allocator_hands_out_pages_lowest_first_and_recycles():
    a = PageAllocator(num_pages=4, page_size=2)
    assert a.alloc(2) == [1, 2] and a.num_free == 2
    a.free([1])
    assert a.alloc(3) == [3, 4, 1]
    a.check_integrity()
    assert not a.can_alloc(1)
    with pytest.raises(MemoryError, match="need 1 pages, 0 free of 4"):
        a.alloc(1)
    with pytest.raises(ValueError, match="not allocated"):
        a.free([1, 1])


def test_append_slots_continues_the_cursor_page():
    a = PageAllocator(num_pages=8, page_size=4)
    first = a.append_slots(None, 6)
    assert first == [4, 5, 6, 7, 8, 9]  # pages 1, 2
    assert a.append_slots(9, 3) == [10, 11, 12]  # rest of page 2, then page 3
    assert a.num_used == 3


def test_row_pages_in_allocation_order_with_cursor():
    slots = torch.tensor([20, 22, 8, 9, 36])
    assert row_pages(slots, 4).tolist() == [5, 2, 9]
    assert row_pages(slots[:3], 4, cursor=37).tolist() == [5, 2, 9]


def test_is_dense():
    assert is_dense(torch.tensor([8, 9, 10, 11, 20, 21]), 4)
    assert not is_dense(torch.tensor([8, 9, 11]), 4)  # offset 2 holds slot offset 3
    assert not is_dense(torch.tensor([8, 9, 10, 11, 21]), 4)  # page 5 starts at offset 1


def test_fragmentation_and_trigger():
    # page 2 holds 4/4 live, page 5 holds 1/4: F = 1 - (1 + 0.25) / 2 = 0.375
    live = torch.tensor([8, 9, 10, 11, 20])
    assert page_utilization(live, 4).tolist() == [1.0, 0.25]
    assert fragmentation(live, 4) == pytest.approx(0.375)
    assert fragmentation(live, 4, held_pages=torch.tensor([2, 5, 6])) == pytest.approx(1 - 1.25 / 3)
    assert num_pages(45, 16) == 3 and num_pages(0, 16) == 0
