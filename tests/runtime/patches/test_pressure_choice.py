"""Which rows the pressure trigger compacts and how far (`patches/step/pressure.py`), over a fake
pool, tree and batch: none while the pool holds what the rows and the queue's next request need;
when it does not, the longest rows down to one level that covers the shortfall and an interval's
growth of every row, by at least an interval, never below the budget, never a row within
`interval` of it."""

from types import SimpleNamespace

import pytest
import torch

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.patches.runtime import new_state
from sgl_vtoken.patches.step.context import DueRow
from sgl_vtoken.patches.step.pressure import copy_room, due_rows, levels

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


class _Req(SimpleNamespace):
    __hash__ = object.__hash__  # a batch's requests go in sets (the ones finishing in flight)


def _req(length: int, cfg: EvictConfig = CFG, rid: str = "r"):
    req = _Req(
        kv=SimpleNamespace(kv_committed_len=length, cache_protected_len=0, holds_kv=True),
        origin_input_ids=[0] * length,
        prefix_len=0,
        sampling_params=SimpleNamespace(max_new_tokens=None),
        output_ids=[],
    )
    req.rid, req.vtoken = rid, new_state(cfg, rid, holed=False)
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


CFG16 = EvictConfig(
    policy="streamingllm", budget=BUDGET, interval=INTERVAL, page_size=16, trigger="pressure"
)


def _ctx16(free: int):
    return SimpleNamespace(**{**vars(_ctx(free)), "page_size": 16})


def _rows16(lengths, protected):
    reqs = [_req(n, CFG16, f"r{i}") for i, n in enumerate(lengths)]
    for req, cpl in zip(reqs, protected):
        req.kv.cache_protected_len = cpl
    rows = [(i, DueRow(r, r.vtoken, n)) for i, (r, n) in enumerate(zip(reqs, lengths))]
    return SimpleNamespace(reqs=reqs), rows


def test_at_page_size_16_the_pool_keeps_room_for_one_rows_copies():
    """A compaction copies the kept part of tree-owned pages into fresh pages before it frees
    any: the shortage is met while the pool still holds what one row's compaction to its budget
    copies (its budget's pages of tree-owned tokens and a page), not at the last free page."""
    batch, rows = _rows16([900, 700], [600, 32])
    room = copy_room((row for _, row in rows), 16)
    assert room == (BUDGET // 16 + 1) * 16  # the first row keeps up to its budget of its 600
    need = 2 * 16 + room  # a page for each row's next token, and the copies
    assert due_rows(_ctx16(need), batch, rows) == []
    assert [i for i, _, _ in due_rows(_ctx16(need - 1), batch, rows)] == [0]
    # Rows whose remaining tokens the pool holds never compact: no room is kept for them.
    for req in batch.reqs:
        req.sampling_params.max_new_tokens = 10
    assert due_rows(_ctx16(2 * 16 + 20), batch, rows) == []
    # Rows that own every token copy nothing: the last page is enough, as at page size 1.
    batch, rows = _rows16([900, 700], [0, 0])
    assert copy_room((row for _, row in rows), 16) == 0
    assert due_rows(_ctx16(32), batch, rows) == []
    assert copy_room((row for _, row in _rows16([900], [600])[1]), 1) == 0


def test_a_row_without_pages_for_its_copies_at_its_level_goes_to_its_budget(monkeypatch):
    """`decode.evict_batch`: a row under pressure whose compaction to its level finds no page for
    its copies is compacted to its budget in the same step (fewer copies); a row refused even
    then is put off a step, counted."""
    from sgl_vtoken.patches.core import process as process_module
    from sgl_vtoken.patches.step import decode

    monkeypatch.setattr(process_module, "_current", process_module.VTokenProcess(holed=False))
    batch, rows = _rows16([900, 700, 600], [600, 600, 600])
    lens = torch.tensor([900, 700, 600])
    batch = SimpleNamespace(
        reqs=batch.reqs, seq_lens_cpu=lens, seq_lens=lens, orig_seq_lens=lens, seq_lens_sum=0
    )
    levels_of = {0: 512, 1: 512, 2: 512}
    monkeypatch.setattr(
        decode.pressure,
        "due_rows",
        lambda ctx, b, pressed, w, p: [(i, row, levels_of[i]) for i, row in pressed],
    )
    calls = []

    def fake_evict_rows(ctx, due, keep):
        calls.append([(row.length, k) for row, k in zip(due, keep)])
        # row 0 has pages for its copies at any length, row 1 only at its budget, row 2 never
        return [
            row.length - k if row.length == 900 or (row.length == 700 and k == BUDGET) else None
            for row, k in zip(due, keep)
        ]

    monkeypatch.setattr(decode, "evict_rows", fake_evict_rows)
    counters = SimpleNamespace(pages_freed=0, deferred_evictions=0)
    ctx = SimpleNamespace(
        **{**vars(_ctx16(0)), "counters": counters, "tp_group": None},
        sample_held=lambda: None,
        sample_batch=lambda b: None,
    )
    decode.evict_batch(ctx, batch, set())
    assert calls == [[(900, 512), (700, 512), (600, 512)], [(700, BUDGET), (600, BUDGET)]]
    assert batch.seq_lens_cpu.tolist() == [512, BUDGET, 600]
    assert counters.deferred_evictions == 1  # row 2, refused at its budget too
