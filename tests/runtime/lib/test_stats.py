"""Accumulators that feed attention policies, with exact values."""

import pytest
import torch

from sgl_vtoken.stats import (
    AttentionSum,
    LastAttention,
    LowImportanceCount,
    low_importance_count,
    low_importance_update,
)


def test_attention_sum_grows_with_the_row_and_follows_evictions():
    acc = AttentionSum()
    acc.update(torch.tensor([0.5, 0.5]).view(2, 1, 1))  # one query, 2 keys
    acc.update(torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]]).view(2, 3, 1, 1))
    assert acc.stats.flatten().tolist() == pytest.approx([0.8, 0.9, 1.3])
    acc.select(torch.tensor([0, 2]))
    assert acc.stats.flatten().tolist() == pytest.approx([0.8, 1.3])
    acc.check_integrity()
    with pytest.raises(ValueError, match="probs cover 1 tokens but the row has 2"):
        acc.update(torch.ones(1, 1, 1))


def test_last_attention_is_the_newest_query():
    acc = LastAttention()
    acc.update(torch.tensor([[1.0, 0.0], [0.25, 0.75]]).view(2, 2, 1, 1))
    assert acc.stats.flatten().tolist() == [0.25, 0.75]


def test_low_importance_register_counts_the_last_history_queries():
    # 3 keys; threshold 1/3 share; query lengths 1, 2, 3 (causal block)
    probs = torch.tensor([[1.0, 0.0, 0.0], [0.9, 0.1, 0.0], [0.2, 0.7, 0.1]]).view(3, 3, 1, 1)
    bits = low_importance_update(
        torch.zeros(3, 1, 1, dtype=torch.int64), probs, history=2, lengths=torch.tensor([1, 2, 3])
    )
    # only queries 2 and 3 count: key0 low at q3 (0.2 < 1/3); key1 low at q2 (0.1 < 1/2); key2 q3
    assert bits.flatten().tolist() == [0b01, 0b10, 0b01]
    assert low_importance_count(bits, 2).flatten().tolist() == [1, 1, 1]
    # one more query where nothing is low pushes the oldest bit out of the 2-query window
    bits = low_importance_update(bits, torch.full((1, 3, 1, 1), 1 / 3), history=2)
    assert bits.flatten().tolist() == [0b10, 0b00, 0b10]


def test_low_importance_class_validates_and_reports_minus_count():
    with pytest.raises(ValueError, match=r"history must be an integer in \[1, 62\]"):
        LowImportanceCount(history=63)
    acc = LowImportanceCount(history=62)
    for _ in range(70):  # more than the window
        acc.update(torch.tensor([0.9, 0.1]).view(2, 1, 1))
    assert acc.stats.flatten().tolist() == [0.0, -62.0]
    acc.check_integrity()


def test_scissorhands_counts_only_the_layers_a_query_scored():
    """A layer left out of `score_layers` arrives as zeros: it is not a low-importance step, its
    statistic is NaN, and `aggregate` leaves it out (sum and max)."""
    from sgl_vtoken.policies.base import aggregate

    acc = LowImportanceCount(history=4, threshold=1.0)
    probs = torch.zeros(2, 3, 2, 1)  # 2 queries, 3 keys, layer 0 scored, layer 1 not
    probs[:, :, 0, 0] = torch.tensor([[0.8, 0.1, 0.1], [0.6, 0.3, 0.1]])
    acc.update(probs)
    stats = acc.stats
    assert stats[:, 1].isnan().all() and not stats[:, 0].isnan().any()
    assert stats[:, 0, 0].tolist() == [0.0, -2.0, -2.0]  # below 1/3 twice: keys 1 and 2
    assert aggregate(stats, "sum").tolist() == [0.0, -2.0, -2.0]
    assert aggregate(stats, "max").tolist() == [0.0, -2.0, -2.0]
