"""Which rows the pressure trigger compacts and how far (`patches/step/pressure.py`), over a fake
pool, tree and batch: none while the pool holds what the rows and the queue's next request need;
when it does not, the longest rows down to one level that covers the shortfall and an interval's
growth of every row, by at least an interval, never below the budget, never a row within
`interval` of it."""

from types import SimpleNamespace

import pytest

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.patches.runtime import new_state
from sgl_vtoken.patches.step.context import DueRow
from sgl_vtoken.patches.step.pressure import due_rows, levels

BUDGET, INTERVAL = 64, 16
CFG = EvictConfig(
    policy="streamingllm", budget=BUDGET, interval=INTERVAL, page_size=1, trigger="pressure"
)


def test_levels_take_the_longest_rows_down_to_one_level_that_covers_the_shortfall():
    lengths, floors, iv = [900, 600, 340], [64, 64, 64], [16, 16, 16]
    assert levels(lengths, floors, iv, 0, 1) == []
    assert levels(lengths, floors, iv, -3, 1) == []
    # 500 short: A and B go down to 500 (400 + 100), C stays whole.
    assert levels(lengths, floors, iv, 500, 1) == [500, 500, None]
    # The highest level that covers: 502 would free 496.
    assert levels(lengths, floors, iv, 498, 1) == [501, 501, None]
    # A row just above the level still gives its interval: B (600) at level 590 goes to 584.
    assert levels(lengths, floors, iv, 320, 1) == [590, 584, None]
    # Short of more than every row gives at its floor: each goes to its floor.
    assert levels(lengths, floors, iv, 10_000, 1) == [64, 64, 64]
    # Never below a row's own floor.
    assert levels([900, 600], [64, 560], iv, 900, 1) == [64, 560]


def test_levels_are_whole_pages():
    # Page size 16: the level 500 rounds down to 496; every target is a page boundary.
    assert levels([900, 600, 340], [64, 64, 64], [16, 16, 16], 500, 16) == [496, 496, None]
    # 520 is above the level 512 and gives its interval: 504, rounded down to 496.
    assert levels([900, 520], [64, 64], [16, 16], 380, 16) == [512, 496]


def _req(length: int, cfg: EvictConfig = CFG, rid: str = "r"):
    req = SimpleNamespace(
        kv=SimpleNamespace(kv_committed_len=length, cache_protected_len=0, holds_kv=True),
        origin_input_ids=[0] * length,
        prefix_len=0,
    )
    req.vtoken = new_state(cfg, rid, holed=False)
    return req


def _ctx(free: int, evictable: int = 0):
    return SimpleNamespace(
        page_size=1,
        allocator=SimpleNamespace(available_size=lambda: free),
        tree=SimpleNamespace(evictable_size=lambda: evictable),
    )


def _due(ctx, lengths, waiting=(), places=8):
    reqs = [_req(n, rid=f"r{i}") for i, n in enumerate(lengths)]
    batch = SimpleNamespace(reqs=reqs)
    rows = [(i, DueRow(r, r.vtoken, n)) for i, (r, n) in enumerate(zip(reqs, lengths))]
    return [i for i, _, _ in due_rows(ctx, batch, rows, waiting, places)]


def _targets(ctx, lengths, waiting=(), places=8):
    reqs = [_req(n, rid=f"r{i}") for i, n in enumerate(lengths)]
    batch = SimpleNamespace(reqs=reqs)
    rows = [(i, DueRow(r, r.vtoken, n)) for i, (r, n) in enumerate(zip(reqs, lengths))]
    return {i: t for i, _, t in due_rows(ctx, batch, rows, waiting, places)}


def test_no_row_is_compacted_while_the_pool_holds_what_the_rows_need():
    # Rows far above their budget, every one of them: nothing is short, nothing is evicted.
    assert _due(_ctx(free=3), [500, 900, 2000]) == []
    # Free and evictable tree slots count alike.
    assert _due(_ctx(free=1, evictable=2), [500, 900, 2000]) == []


def test_a_shortfall_compacts_the_longest_rows_first_and_no_more():
    # Three rows need three slots for their next tokens; one is free: 2 short, plus an interval
    # of growth for each of the three rows (48): the longest row gives 50, the others keep all.
    assert _targets(_ctx(free=1), [500, 900, 2000]) == {2: 1950}
    # A waiting request of 1,500 (+ a page) with 100 free: 1,404 + 48 short; the two longest
    # rows go down to one level (2,900 - 2 x 724 = 1,452), the shortest keeps every token.
    waiting = [_req(1500, rid="w")]
    assert _targets(_ctx(free=100), [500, 900, 2000], waiting) == {1: 724, 2: 724}


def test_rows_within_interval_of_their_budget_are_never_chosen():
    # Short of everything, but only the row at budget + interval is a candidate.
    lengths = [BUDGET + INTERVAL - 1, BUDGET + INTERVAL, BUDGET]
    assert _due(_ctx(free=0), lengths) == [1]
    assert _due(_ctx(free=0), [BUDGET, BUDGET + 3]) == []


def test_a_row_below_its_decode_peak_keeps_its_reservation():
    # A short row reserves its growth to its decode peak (budget + interval + page), as admission
    # did: the long row is compacted to keep that room.
    short = 10
    peak = CFG.decode_peak
    free = 2 + (peak - short) - 1  # one slot short of both rows' next token and the reservation
    assert _due(_ctx(free=free), [short, 700]) == [1]
    assert _due(_ctx(free=free + 1), [short, 700]) == []


def test_the_next_waiting_request_is_made_room_for_when_it_can_fit():
    waiting = [_req(300, rid="w")]  # asks 300 + a page (its prompt is past its decode peak)
    assert _targets(_ctx(free=100), [500, 900], waiting) == {1: 665}  # 203 short + 32
    assert _due(_ctx(free=100), [500, 900], waiting, places=0) == []  # the batch is full
    # A request that would not fit even with every row at its budget compacts nothing.
    huge = [_req(5000, rid="w")]
    assert _due(_ctx(free=100), [500, 900], huge) == []


def test_every_waiting_request_the_batch_has_places_for_is_made_room_for_in_queue_order():
    # Two requests of 500 + a page wait: 100 free slots; the 900 row can give 836 back, the 500
    # row 436. Both requests need both rows far down; one needs them half as far.
    two = [_req(500, rid="w0"), _req(500, rid="w1")]
    assert _targets(_ctx(free=100), [500, 900], two) == {0: 232, 1: 232}  # 904 + 32 short
    # one place: one request (403 + 32 short)
    assert _targets(_ctx(free=100), [500, 900], two, places=1) == {0: 482, 1: 482}
    # Queue order: a request that cannot fit stops the run, the one behind it is not admitted
    # ahead of it.
    blocked = [_req(300, rid="w0"), _req(5000, rid="w1"), _req(300, rid="w2")]
    assert _due(_ctx(free=100), [500, 900], blocked) == [1]


@pytest.mark.parametrize("trigger", ["budget", "pressure"])
def test_the_trigger_is_a_setting_with_a_checked_value(trigger):
    assert EvictConfig(policy="h2o", budget=BUDGET, trigger=trigger).trigger == trigger
    with pytest.raises(ValueError, match="trigger"):
        EvictConfig(policy="h2o", budget=BUDGET, trigger="sometimes")
