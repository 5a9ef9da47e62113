"""DecodeScoring: a decode batch's attention probabilities, one score launch per layer, against an
explicit softmax of each request's query over its row."""

import math

import pytest
import torch

import sgl_vtoken.decode_scores as ds
from sgl_vtoken.decode_scores import DecodeScoring
from sgl_vtoken.recall import window_probs

LAYERS, HQ, HKV, DIM, SLOTS = 3, 4, 2, 8, 64


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(SLOTS, HKV, DIM, generator=g) for _ in range(LAYERS)]
    q = [torch.randn(5, HQ, DIM, generator=g) for _ in range(LAYERS)]  # 5 requests in the forward
    req_to_token = torch.zeros(6, 32, dtype=torch.int32)
    shared = torch.randperm(SLOTS, generator=g)[:10]
    req_to_token[1, :10] = shared  # rows 1 and 4 share their first 7 slots
    req_to_token[4, :7] = shared[:7]
    req_to_token[4, 7:12] = torch.arange(50, 55)
    req_to_token[2, :3] = torch.tensor([60, 61, 62])
    return k, q, req_to_token


def _expected(q, k, req_to_token, row, n, scale):
    """``[n, HKV]`` probabilities of one query over its row, summed per KV head's group."""
    p = window_probs(q[None], k[req_to_token[row, :n].long()], torch.tensor([n]), scale)[
        0
    ]  # [HQ, n]
    return p.view(HKV, HQ // HKV, n).sum(1).t()


@pytest.mark.parametrize("offer_lse", [False, True])
def test_batch_scores_equal_each_request_alone(offer_lse, monkeypatch):
    """Three scored requests (forward rows 0, 2, 3 of 5; rows 1 and 4 of the slot table share
    slots), one of them scoring only layer 2: one launch per layer, and each request's block
    holds exactly its own probabilities (zero in layers it does not score)."""
    k, q, req_to_token = _setup()
    calls = []
    real = ds.attn_scores_
    monkeypatch.setattr(
        ds, "attn_scores_", lambda *a, **kw: calls.append(kw["lse"] is not None) or real(*a, **kw)
    )
    q_rows, rows, lengths, layers = [0, 2, 3], [1, 4, 2], [10, 12, 3], [None, None, (2,)]
    scoring = DecodeScoring(q_rows, rows, lengths, layers, LAYERS, HKV, "cpu")
    scale = 1 / math.sqrt(DIM)
    for layer in range(LAYERS):
        assert scoring.scores(layer)
        if offer_lse:  # what FlashInfer returns (base 2), for every query of the forward
            lse = torch.stack(
                [
                    torch.logsumexp(
                        scale
                        * (
                            k[layer][req_to_token[r, :n].long()].repeat_interleave(2, 1)
                            * q[layer][i][None]
                        ).sum(-1),
                        0,
                    )
                    if i in q_rows
                    else torch.zeros(HQ)
                    for i, (r, n) in enumerate(zip([1, 0, 4, 2, 0], [10, 1, 12, 3, 1]))
                ]
            ) / math.log(2)
            scoring.offer_lse(layer, lse, "log2")
        scoring.score(layer, q[layer], k[layer], req_to_token, scale)
    assert calls == [offer_lse] * LAYERS  # one launch per layer
    for j, (i, row, n, ls) in enumerate(zip(q_rows, rows, lengths, layers)):
        block, counts = scoring.block(j)
        assert block.shape == (1, n, LAYERS, HKV) and counts.tolist() == [n]
        for layer in range(LAYERS):
            want = _expected(q[layer][i], k[layer], req_to_token, row, n, scale)
            if ls is not None and layer not in ls:
                want = torch.zeros_like(want)
            torch.testing.assert_close(block[0, :, layer], want, rtol=1e-5, atol=1e-6)


def test_the_buffer_is_sized_by_the_rows():
    scoring = DecodeScoring([0, 1], [0, 1], [7, 9], [None, None], LAYERS, HKV, "cpu")
    assert scoring.buf.shape == (16, LAYERS, HKV)
    assert not DecodeScoring([0], [0], [4], [(1,)], LAYERS, HKV, "cpu").scores(0)
