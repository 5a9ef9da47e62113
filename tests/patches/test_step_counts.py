"""What one decode step of 64 evicting requests asks of the device, counted on CPU
(`sgl_vtoken_tools.dispatch_count`) through the real `patches/` code on a server-shaped fake
(`fake_server`: the holed radix cache, shared prompts, stored histories, the host tier): the
scored forward reads no device value and launches one score kernel per scored layer; the
eviction reads the device once (`decide`'s copy); nothing the step allocates on the device
depends on the pool's size; and the pool stays whole (`FakeServer.check`)."""

import pytest

from sgl_vtoken_tools.step_counts import Scenario, count_step, scenarios, with_pool

LAYERS = 4  # fake_server.Shape()


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
    assert ev["host_syncs"] <= 1, ev["sync_sites"]
    assert ev["calls"].get("repack_kv_", 0) <= 1
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
    out = count_step(Scenario("h2o", 16, score_layers=(1, 3)))
    assert out["forward"]["calls"] == {"attn_scores_": LAYERS} and out["forward"]["host_syncs"] == 0
    assert out["evict"]["host_syncs"] == 1
