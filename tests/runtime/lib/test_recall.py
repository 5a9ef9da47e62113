"""Recall scoring (`sgl_vtoken.recall`) against a direct computation, and its selection rule."""

import pytest
import torch

from sgl_vtoken.recall import candidate_mass, dedupe, pick, split


def test_candidate_mass_is_the_joint_softmax_mass_of_the_candidates():
    g = torch.Generator().manual_seed(0)
    nq, hq, hkv, d, n, c = 3, 4, 2, 8, 7, 5
    q, row, cand = (torch.randn(*s, generator=g) for s in ((nq, hq, d), (n, hkv, d), (c, hkv, d)))
    lengths = torch.tensor([5, 6, 7])
    got = candidate_mass(q, row, lengths, cand, 0.3)
    want = torch.zeros(c)
    for j in range(nq):
        for h in range(hq):
            keys = torch.cat([row[: lengths[j], h // 2], cand[:, h // 2]])
            p = torch.softmax(keys @ q[j, h] * 0.3, dim=0)
            want += p[lengths[j] :]
    torch.testing.assert_close(got, want)


def test_pick_takes_the_best_and_breaks_ties_towards_the_later_position():
    scores = torch.tensor([0.5, 0.9, 0.5, 0.1, 0.5])
    assert pick(scores, 2).tolist() == [1, 4]
    assert pick(scores, 9).tolist() == [0, 1, 2, 3, 4]


def test_pooled_pick_brings_the_neighbours_of_a_peak():
    scores = torch.tensor([0.0, 0.0, 0.1, 1.0, 0.1, 0.0, 0.0, 0.3, 0.0])
    assert pick(scores, 3).tolist() == [3, 4, 7]
    assert pick(scores, 3, pool=3).tolist() == [2, 3, 4]


def test_gap_pick_takes_the_holes_between_picked_candidates_within_k():
    scores = torch.tensor([0.0, 1.0, 0.9, 0.0, 0.0, 0.0, 0.8, 0.7, 0.0, 0.0, 0.0, 0.0, 0.0, 0.6])
    assert pick(scores, 4).tolist() == [1, 2, 6, 7]
    # 3-5 is a hole of 3 candidates between 2 and 6: taken at gap 3, not at gap 2
    assert pick(scores, 7, gap=3).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert pick(scores, 5, gap=2).tolist() == [1, 2, 6, 7, 13]
    # with k 5, 6 and its hole would overflow: passed over; 7, 13, then 12 (ties: the later) fill k
    assert pick(scores, 5, gap=3).tolist() == [1, 2, 7, 12, 13]
    assert pick(scores, 20, gap=3).tolist() == list(range(14))
    # no gap: the plain top k
    assert pick(scores, 5, gap=0).tolist() == pick(scores, 5).tolist() == [1, 2, 6, 7, 13]


def test_a_later_round_fills_the_holes_next_to_what_the_earlier_rounds_recalled():
    """Round 1 recalled positions 10 and 14 (a number's first and last digits); round 2's best
    candidate is 12: with gap 8 it comes back with 11 and 13, the digits between, so the number
    is whole. Without the earlier rounds as neighbours the hole stays open and the quota goes to
    position 20 instead."""
    positions = torch.tensor([2, 11, 12, 13, 20])
    scores = torch.tensor([0.5, 0.0, 1.0, 0.0, 0.6])
    recalled = torch.tensor([10, 14])
    assert pick(scores, 3, gap=8, positions=positions, recalled=recalled).tolist() == [1, 2, 3]
    assert pick(scores, 3, gap=8).tolist() == [2, 3, 4]
    # the earlier rounds' tokens are not counted in k; 12 with its holes would overflow k 1 or 2:
    # passed over, as within one round
    assert pick(scores, 1, gap=8, positions=positions, recalled=recalled).tolist() == [4]
    assert pick(scores, 2, gap=8, positions=positions, recalled=recalled).tolist() == [0, 4]


def test_dedupe_keeps_each_position_below_the_depth_once_and_not_the_views():
    positions = torch.tensor([9, 3, 5, 3, 12, 7])
    idx = dedupe(positions, below=10, exclude=torch.tensor([7]))
    assert positions[idx].tolist() == [3, 5, 9] and idx.tolist() == [1, 2, 0]


@pytest.mark.parametrize(
    "prefix,total,page_size,expected",
    [
        (
            10,
            40,
            1,
            (39, 23),
        ),  # page 1: the first chunk stops one token short, the window goes back
        (64, 110, 16, (96, 80)),  # page 16: the last boundary before the end; one page recomputed
        (70, 110, 16, (96, 80)),  # a view ending inside a page
        (90, 110, 16, (96, 90)),  # the recomputed part never reaches into the view
        (96, 100, 16, None),  # no page boundary after the view before the last token
        (10, 11, 1, None),  # one new token: nothing to cut
    ],
)
def test_split_cuts_before_the_last_page_and_recomputes_the_window(
    prefix, total, page_size, expected
):
    assert split(prefix, total, 16, page_size) == expected


def test_round_quotas_add_up_to_recall_and_rounds_are_capped_by_it():
    from sgl_vtoken.recall import round_quota, turn_rounds

    done, quotas = 0, []
    for r in range(turn_rounds(8, 3)):
        quotas.append(round_quota(8, 3, done, r == 2))
        done += quotas[-1]
    assert quotas == [2, 2, 4]
    assert turn_rounds(3, 4) == 3 and [round_quota(3, 4, d, d == 2) for d in range(3)] == [1, 1, 1]
    assert (
        round_quota(8, 3, 3, True) == 5
    )  # an earlier round that took fewer leaves more to the last
