"""PrefillScoring: a prefill batch's observation windows, one score launch per scored layer,
against an explicit causal softmax of each request's window over its row."""

import math

import pytest
import torch

import sgl_vtoken.prefill_scores as ps
from sgl_vtoken.prefill_scores import PrefillScoring

LAYERS, HQ, HKV, DIM, SLOTS = 3, 4, 2, 8, 96


def _expected(window, keys, scale):
    """``[nq, n, HKV]``: window query j sees the first n - nq + 1 + j keys (causal), its
    probabilities summed per KV head's group; zero past its keys."""
    nq, n = window.shape[0], keys.shape[0]
    logits = torch.einsum("qhd,nhd->qhn", window, keys.repeat_interleave(HQ // HKV, 1)) * scale
    seen = torch.arange(n)[None, :] < torch.arange(n - nq + 1, n + 1)[:, None]
    p = torch.softmax(logits.masked_fill(~seen[:, None, :], float("-inf")), dim=-1)
    return p.view(nq, HKV, HQ // HKV, n).sum(2).transpose(1, 2)


@pytest.mark.parametrize("batched", [True, False])
def test_batch_windows_equal_each_request_alone(monkeypatch, batched):
    """Three requests in one extend forward (12 + 7 + 20 queries; windows of 4, 7 and 5 queries;
    rows of 30, 7 and 20 keys: the first continues a prefix), one scoring only layer 1: one
    launch per layer (batched, the GPU path; the CPU path: one softmax per request), and each
    block holds exactly its request's causal window probabilities."""
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(SLOTS, HKV, DIM, generator=g) for _ in range(LAYERS)]
    q = [torch.randn(12 + 7 + 20, HQ, DIM, generator=g) for _ in range(LAYERS)]
    req_to_token = torch.randperm(SLOTS, generator=g)[:90].view(3, 30).to(torch.int32)
    calls = []
    real = ps.attn_scores_
    monkeypatch.setattr(ps, "attn_scores_", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    first, queries, rows, lengths = [8, 12, 34], [4, 7, 5], [2, 0, 1], [30, 7, 20]
    layers = [None, (1,), None]
    scoring = PrefillScoring(first, queries, rows, lengths, layers, LAYERS, HKV, "cpu", batched)
    scale = 1 / math.sqrt(DIM)
    for layer in range(LAYERS):
        scoring.score(layer, q[layer], k[layer], req_to_token, scale)
    assert len(calls) == (LAYERS if batched else 0)  # one launch per layer for the whole batch
    for j in range(3):
        block, counts = scoring.block(j)
        nq, n = queries[j], lengths[j]
        assert block.shape == (nq, n, LAYERS, HKV)
        assert counts.tolist() == list(range(n - nq + 1, n + 1))
        for layer in range(LAYERS):
            slots = req_to_token[rows[j], :n].long()
            want = _expected(q[layer][first[j] : first[j] + nq], k[layer][slots], scale)
            if layers[j] is not None and layer not in layers[j]:
                want = torch.zeros_like(want)
            torch.testing.assert_close(block[:, :, layer], want, rtol=1e-5, atol=1e-6)


def test_layers_nobody_scores_launch_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(ps, "attn_scores_", lambda *a, **kw: calls.append(1))
    scoring = PrefillScoring([0], [2], [0], [5], [(2,)], LAYERS, HKV, "cpu", batched=True)
    assert not PrefillScoring([0], [2], [0], [5], [None], LAYERS, HKV, "cpu").batched
    assert [scoring.scores(x) for x in range(LAYERS)] == [False, False, True]
    scoring.score(0, torch.zeros(2, HQ, DIM), torch.zeros(8, HKV, DIM), torch.zeros(1, 8), 1.0)
    assert calls == [] and scoring.buf.shape == (10, LAYERS, HKV)
