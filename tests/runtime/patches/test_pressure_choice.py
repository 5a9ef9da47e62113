"""Which rows the pressure trigger compacts (`patches/step/pressure.py`), over a fake pool, tree
and batch: none while the pool holds what the rows and the queue's next request need; when it
does not, the rows furthest above their budget first, never a row within `interval` of it."""

from types import SimpleNamespace

import pytest

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.patches.runtime import new_state
from sgl_vtoken.patches.step.context import DueRow
from sgl_vtoken.patches.step.pressure import choose, due_rows

BUDGET, INTERVAL = 64, 16
CFG = EvictConfig(
    policy="streamingllm", budget=BUDGET, interval=INTERVAL, page_size=1, trigger="pressure"
)


def test_choose_takes_the_largest_surplus_first_until_the_shortfall_is_covered():
    assert choose([5, 40, 20, 40], 0) == []
    assert choose([5, 40, 20, 40], -3) == []
    assert choose([5, 40, 20, 40], 30) == [1]  # ties: the lower index first
    assert choose([5, 40, 20, 40], 41) == [1, 3]
    assert choose([5, 40, 20, 40], 85) == [1, 2, 3]
    assert choose([5, 40, 20, 40], 101) == [0, 1, 2, 3]
    assert choose([5, 40, 20, 40], 1000) == [0, 1, 2, 3]


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
    return [i for i, _ in due_rows(ctx, batch, rows, waiting, places)]


def test_no_row_is_compacted_while_the_pool_holds_what_the_rows_need():
    # Rows far above their budget, every one of them: nothing is short, nothing is evicted.
    assert _due(_ctx(free=3), [500, 900, 2000]) == []
    # Free and evictable tree slots count alike.
    assert _due(_ctx(free=1, evictable=2), [500, 900, 2000]) == []


def test_a_shortfall_compacts_the_longest_rows_first_and_no_more():
    # Three rows need three slots for their next tokens; one is free: the longest row goes.
    assert _due(_ctx(free=1), [500, 900, 2000]) == [2]


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
    assert _due(_ctx(free=100), [500, 900], waiting) == [1]  # 900 - 64 covers the 201 missing
    assert _due(_ctx(free=100), [500, 900], waiting, places=0) == []  # the batch is full
    # A request that would not fit even with every row at its budget compacts nothing.
    huge = [_req(5000, rid="w")]
    assert _due(_ctx(free=100), [500, 900], huge) == []


def test_every_waiting_request_the_batch_has_places_for_is_made_room_for_in_queue_order():
    # Two requests of 500 + a page wait: 100 free slots; the 900 row gives 836 back, the 500 row
    # 436. One waiting request needs the 900 row compacted; two need both rows.
    two = [_req(500, rid="w0"), _req(500, rid="w1")]
    assert _due(_ctx(free=100), [500, 900], two) == [0, 1]
    assert _due(_ctx(free=100), [500, 900], two, places=1) == [1]  # one place: one request
    # Queue order: a request that cannot fit stops the run, the one behind it is not admitted
    # ahead of it.
    blocked = [_req(300, rid="w0"), _req(5000, rid="w1"), _req(300, rid="w2")]
    assert _due(_ctx(free=100), [500, 900], blocked) == [1]


@pytest.mark.parametrize("trigger", ["budget", "pressure"])
def test_the_trigger_is_a_setting_with_a_checked_value(trigger):
    assert EvictConfig(policy="h2o", budget=BUDGET, trigger=trigger).trigger == trigger
    with pytest.raises(ValueError, match="trigger"):
        EvictConfig(policy="h2o", budget=BUDGET, trigger="sometimes")
