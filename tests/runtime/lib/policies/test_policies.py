"""Behaviour of each policy on hand-made rows, with exact expected indices."""

import math

import pytest
import torch

from sgl_vtoken.policies import aggregate, make_policy, top_budget
from sgl_vtoken.rng import hash_u01_py, stable_id
from sgl_vtoken.types import TokenView


def test_streamingllm_keeps_sinks_and_the_last_budget_minus_sink():
    view = TokenView(positions=torch.arange(100))
    keep = make_policy("streamingllm", sink=4).keep(view, 20)
    assert keep.tolist() == [0, 1, 2, 3] + list(range(84, 100))


def test_streamingllm_on_an_already_compacted_row_uses_positions_for_sinks():
    # row holds positions 0..3 (sinks) then 50..59: sinks are found by position, not row index
    view = TokenView(positions=torch.tensor([0, 1, 2, 3] + list(range(50, 60))))
    keep = make_policy("streamingllm", sink=4).keep(view, 8)
    assert keep.tolist() == [0, 1, 2, 3, 10, 11, 12, 13]


def test_random_matches_pure_python_replay():
    seed, rid, step = 11, stable_id("req-42"), 5
    positions = list(range(0, 300, 3))
    view = TokenView(positions=torch.tensor(positions), rid=rid, step=step)
    keep = make_policy("random", seed=seed, sink=0).keep(view, 30)
    # an external reference needs only integers: hash each position, keep the 30 largest
    scores = [hash_u01_py(p, seed, rid, step) for p in positions]
    ranked = sorted(range(len(positions)), key=lambda i: (scores[i], i), reverse=True)[:30]
    assert keep.tolist() == sorted(ranked)


def test_stable_id_is_stable():
    assert stable_id("abc") == stable_id("abc") != stable_id("abd")
    assert 0 <= stable_id("abc") < 2**32


def test_knorm_keeps_low_norm_keys():
    norms = torch.tensor([5.0, 1.0, 4.0, 0.5, 3.0, 2.0])
    keys = torch.zeros(6, 1, 1, 2)
    keys[:, 0, 0, 0] = norms
    view = TokenView(positions=torch.arange(6), keys=keys)
    keep = make_policy("knorm", sink=0).keep(view, 3)
    assert keep.tolist() == [1, 3, 5]  # norms 1.0, 0.5, 2.0


def test_knorm_aggregation_sum_vs_max():
    # token 0: head norms (1, 10) sum 11 / min 1 ; token 1: (5, 5) sum 10 / min 5
    keys = torch.zeros(2, 1, 2, 1)
    keys[0, 0, :, 0] = torch.tensor([1.0, 10.0])
    keys[1, 0, :, 0] = torch.tensor([5.0, 5.0])
    view = TokenView(positions=torch.arange(2), keys=keys)
    assert make_policy("knorm", sink=0, aggregation="sum").keep(view, 1).tolist() == [1]
    assert make_policy("knorm", sink=0, aggregation="max").keep(view, 1).tolist() == [0]


def test_h2o_keeps_heavy_hitters_and_window():
    attn = torch.tensor([0.1, 0.9, 0.05, 0.8, 0.2, 0.01, 0.02, 0.03]).view(8, 1, 1)
    view = TokenView(positions=torch.arange(8), attn=attn)
    keep = make_policy("h2o", sink=0, window=2, pool=1).keep(view, 4)  # the paper's: no pooling
    assert keep.tolist() == [1, 3, 6, 7]


def test_attention_policy_defaults_pool_five_and_h2o_takes_the_max():
    """The defaults the held-out document questions were scored with (docs/RESULTS.md, "Defaults
    that keep answers"): scores pooled over 5 row neighbours, H2O's the max over layers and heads."""
    assert [make_policy(n).pool for n in ("h2o", "tova", "scissorhands")] == [5, 5, 5]
    assert make_policy("h2o").aggregation == "max"
    assert make_policy("tova").aggregation == make_policy("scissorhands").aggregation == "sum"
    # one head marks token 1, four others spread evenly: max keeps 1, sum the evenly attended 3
    attn = torch.tensor([[0.0] * 5, [0.9, 0, 0, 0, 0], [0.0] * 5, [0.0, 0.3, 0.3, 0.3, 0.3]]).view(
        4, 1, 5
    )
    view = TokenView(positions=torch.arange(4), attn=attn)
    assert make_policy("h2o", sink=0, pool=1).keep(view, 1).tolist() == [1]
    assert make_policy("h2o", sink=0, pool=1, aggregation="sum").keep(view, 1).tolist() == [3]


def test_pool_keeps_the_neighbours_of_a_marked_span():
    """pool=3 averages each score with its row neighbours: the two tokens beside the 0.9 peak
    (a number's other digits) outrank two isolated 0.3 tokens."""
    attn = torch.tensor([0.0, 0.3, 0.0, 0.05, 0.9, 0.05, 0.0, 0.3, 0.0, 0.0]).view(10, 1, 1)
    view = TokenView(positions=torch.arange(10), attn=attn)
    assert make_policy("h2o", sink=0, pool=1).keep(view, 3).tolist() == [1, 4, 7]
    assert make_policy("h2o", sink=0, pool=3).keep(view, 3).tolist() == [3, 4, 5]
    for bad in (0, 2, True, 1.0):
        with pytest.raises(ValueError, match="pool must be an odd integer"):
            make_policy("tova", pool=bad)


def test_tova_and_h2o_rank_by_the_same_statistic_shape():
    attn = torch.tensor([[0.3, 0.0], [0.0, 0.35], [0.2, 0.2], [0.1, 0.1]]).view(4, 1, 2)
    view = TokenView(positions=torch.arange(4), attn=attn)
    # sum: 0.3, 0.35, 0.4, 0.2 -> keep 1, 2 ; max: 0.3, 0.35, 0.2, 0.1 -> keep 0, 1
    assert make_policy("tova", sink=0, pool=1, aggregation="sum").keep(view, 2).tolist() == [1, 2]
    assert make_policy("tova", sink=0, pool=1, aggregation="max").keep(view, 2).tolist() == [0, 1]


def test_scissorhands_drops_persistently_unimportant_tokens():
    pol = make_policy("scissorhands", sink=0, window=1, history=4, pool=1)
    acc = pol.new_accumulator()
    # 4 keys; 4 queries over all of them; uniform share = 0.25; key 2 is low 4 times, key 0 twice
    probs = torch.tensor(
        [[0.1, 0.4, 0.1, 0.4], [0.3, 0.4, 0.1, 0.2], [0.2, 0.5, 0.1, 0.2], [0.3, 0.3, 0.2, 0.2]]
    ).view(4, 4, 1, 1)
    acc.update(probs)
    assert acc.stats.flatten().tolist() == [-2.0, 0.0, -4.0, -3.0]
    view = TokenView(positions=torch.arange(4), attn=acc.stats)
    assert pol.keep(view, 3).tolist() == [0, 1, 3]  # key 3 is in the window


def test_ties_keep_the_more_recent_token():
    assert top_budget(torch.zeros(6, dtype=torch.float64), 2).tolist() == [4, 5]
    assert top_budget(torch.tensor([1.0, math.nan, 1.0, 0.0]), 2).tolist() == [0, 2]


def test_aggregate_rejects_unknown():
    with pytest.raises(ValueError, match=r"aggregation must be one of \['sum', 'max'\]"):
        aggregate(torch.zeros(3, 2), "mean")


def test_policy_validates_fields():
    with pytest.raises(ValueError, match=r"StreamingLLM.window must be an integer >= 0"):
        make_policy("streamingllm", window=-1)
    with pytest.raises(ValueError, match=r"H2O.aggregation must be one of"):
        make_policy("h2o", aggregation="mean")


def test_protected_beyond_budget_is_an_error():
    view = TokenView(positions=torch.arange(30))
    with pytest.raises(ValueError, match=r"budget 10 is smaller than the 14 tokens"):
        make_policy("streamingllm", sink=4, window=10).keep(view, 10)


def test_short_rows_are_kept_whole():
    view = TokenView(positions=torch.arange(5), attn=torch.zeros(5, 1, 1))
    assert make_policy("streamingllm").keep(view, 8).tolist() == [0, 1, 2, 3, 4]
    assert make_policy("h2o").keep(view, 5).tolist() == [0, 1, 2, 3, 4]
