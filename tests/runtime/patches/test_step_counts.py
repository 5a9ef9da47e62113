"""What one decode step of 64 evicting requests asks of the device, counted on CPU
(`helpers.dispatch_count`) through the real `patches/` code on a server-shaped fake
(`helpers.fake_server`: the holed radix cache, shared prompts, stored histories, the host tier):
the scored forward reads no device value, launches one score kernel per scored layer and makes
exactly the tensors its shapes give (one score buffer sized by the batch's rows: the 17 device
ops and 0.50 MB docs/RESULTS.md quotes); the eviction reads the device once (`decide`'s copy),
scores nothing and repacks once when survivors move; nothing the step allocates on the device
depends on the pool's size; and the pool stays whole (`FakeServer.check`)."""

import pytest
from helpers.fake_server import Shape
from helpers.step_counts import Scenario, count_step, scenarios, with_pool

SHAPE = Shape()
LAYERS = SHAPE.layers  # 4; 2 KV heads, 4 query heads, head dim 16, float32
F32, I64, I32 = 4, 8, 4  # bytes; the slot table (`req_to_token`) is int32, as in SGLang


def scored_forward(sc: Scenario) -> dict:
    """The device work of a decode forward in which every request scores every layer, from the
    shapes (`sgl_vtoken/decode_scores.py`). Every row is at its trigger, so its query sees
    n = budget + interval keys (80); the batch's rows hold nnz = batch * n entries (5120)."""
    b, n = sc.batch, sc.budget + sc.interval
    nnz = b * n
    # one score buffer for the batch: [nnz, layers, kv_heads] float32 (RESULTS: "one buffer per
    # forward, sized by the batch's rows"), 163,840 bytes: the largest allocation
    buffer = nnz * LAYERS * SHAPE.kv_heads * F32
    # the requests' slots, gathered once (one group: everyone scores every layer): arange(batch),
    # then six int64 vectors of nnz entries (the owner of each entry, the repeat's index gather,
    # arange(nnz), the owner's offset, the column, the owner's row) and the slots read from the
    # int32 slot table
    gather = b * I64 + 6 * nnz * I64 + nnz * I32
    # per layer, the batch's decode queries taken for the launch: [batch, q_heads, head_dim]
    queries = LAYERS * b * SHAPE.q_heads * SHAPE.head_dim * F32
    return dict(
        host_syncs=0,
        # the buffer's zeroing, the gather's 8 ops, a query take and a score launch per layer: 17
        launches=1 + 8 + 2 * LAYERS,
        allocs=1 + 8 + LAYERS,  # every op but the score launches makes a tensor: 13
        alloc_bytes=buffer + gather + queries,  # 496,128 (RESULTS: 0.50 MB at either pool size)
        max_alloc_bytes=buffer,
        h2d=2,  # the key counts, and the group's host lists in one copy
        d2h_async=0,
        calls={"attn_scores_": LAYERS},  # one score launch per scored layer, for all 64 rows
    )


def repacks(sc: Scenario) -> int:
    """Repack launches of the eviction: one for the whole batch when survivors move. At page size
    1 every slot is a page, so freeing a victim's slot leaves nothing to compact; StreamingLLM
    with an interval of one page drops whole pages; every other policy at page size 16 leaves
    holes in pages it keeps, and the compaction moves survivors of all rows in one launch."""
    return int(sc.page_size > 1 and sc.policy != "streamingllm")


@pytest.mark.parametrize(
    "sc",
    scenarios(),
    ids=lambda sc: (
        f"{sc.policy}-ps{sc.page_size}"
        f"{'-history' if sc.history else ''}{'-offload' if sc.offload else ''}"
    ),
)
def test_a_batch_64_step_syncs_once_and_scores_once_per_layer(sc):
    out = count_step(sc)
    fwd, ev = out["forward"], out["evict"]
    assert out["evicted_rows"] == sc.batch
    assert fwd["host_syncs"] == 0, fwd["sync_sites"]
    assert fwd["calls"].get("attn_scores_", 0) == out["scored_layers"]
    assert out["scored_layers"] == (LAYERS if sc.policy in ("h2o", "tova", "scissorhands") else 0)
    if out["scored_layers"]:
        assert {k: fwd[k] for k in scored_forward(sc)} == scored_forward(sc)
    else:  # nothing to score: the forward asks nothing of the device
        assert (fwd["launches"], fwd["allocs"], fwd["h2d"], fwd["calls"]) == (0, 0, 0, {})
    assert ev["host_syncs"] == 1, ev["sync_sites"]  # `decide`'s one copy
    # the eviction reads the forward's statistics (no score launch); one repack iff survivors move
    assert ev["calls"] == ({"repack_kv_": 1} if repacks(sc) else {})
    if sc.offload:
        assert ev["d2h_async"] == 2  # K and V, all rows at once
    if sc.history and sc.policy != "streamingllm":  # it drops old prompt tokens, not the view's
        assert out["history_freed"] > 0  # the release paths ran


@pytest.mark.parametrize(
    "policy", ["h2o", "tova", "scissorhands", "random", "knorm", "streamingllm"]
)
@pytest.mark.parametrize("page_size", [1, 16])
def test_nothing_the_step_allocates_grows_with_the_pool(policy, page_size):
    """The same step on a pool of 64K and of 1M tokens allocates the same device tensors, none
    as large as a float per slot of the pool."""
    sc = Scenario(policy, page_size, history=True, offload=True)
    small, large = (count_step(with_pool(sc, n)) for n in (1 << 16, 1 << 20))
    for part in ("forward", "evict"):
        for key in ("allocs", "alloc_bytes", "max_alloc_bytes", "launches", "host_syncs"):
            assert small[part][key] == large[part][key], (part, key)
        assert large[part]["max_alloc_bytes"] < 4 * (1 << 20)


def test_requests_scoring_different_layers_still_take_one_launch_per_layer():
    """Every other request scores only layers 1 and 3."""
    sc = Scenario("h2o", 16, score_layers=(1, 3))
    out = count_step(sc)
    fwd = out["forward"]
    assert fwd["calls"] == {"attn_scores_": LAYERS} and fwd["host_syncs"] == 0
    # still one buffer for the batch (the largest allocation); two sets of scoring requests
    # (everyone for layers 1 and 3, half the batch for 0 and 2): one host list copy each, and
    # the key counts
    assert fwd["max_alloc_bytes"] == scored_forward(sc)["max_alloc_bytes"]
    assert fwd["h2d"] == 1 + 2
    assert out["evict"]["host_syncs"] == 1


@pytest.mark.parametrize("page_size", [1, 16])
def test_span_aware_keeping_adds_no_sync_and_no_repack(page_size):
    """With `span` (units read from the fake server's tokenizer through the real hook), the
    eviction still reads the device once and repacks in one launch."""
    sc = Scenario("h2o", page_size, history=True, offload=True, span=8)
    ev = count_step(sc)["evict"]
    assert ev["host_syncs"] == 1, ev["sync_sites"]
    assert ev["calls"] == ({"repack_kv_": 1} if repacks(sc) else {})
