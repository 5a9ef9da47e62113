"""GraphScoring: decode scoring on static buffers (what a CUDA graph captures) equals the eager
DecodeScoring, and the captured part allocates nothing, reads nothing on the host and launches
on the same shapes and addresses whatever the batch holds."""

import math

import pytest
import torch
from helpers import dispatch_count as dc

import sgl_vtoken.graph_scores as gs
from sgl_vtoken.decode_scores import DecodeScoring
from sgl_vtoken.graph_scores import GraphScoring

LAYERS, HQ, HKV, DIM, SLOTS, BOUND = 3, 4, 2, 8, 64, 16
SCALE = 1 / math.sqrt(DIM)


def _pool(seed=0):
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(SLOTS, HKV, DIM, generator=g) for _ in range(LAYERS)]
    req_to_token = torch.randperm(6 * 32, generator=g).view(6, 32) % SLOTS
    return k, req_to_token, g


def _eager(batch, q, k, req_to_token):
    decode = DecodeScoring(*batch, LAYERS, HKV, "cpu")
    for layer in range(LAYERS):
        decode.score(layer, q[layer], k[layer], req_to_token, SCALE)
    return decode


def _replay(graph, batch, bs, q, k, req_to_token):
    """What a replay does: load outside the graph, the captured launches, unload."""
    decode = DecodeScoring(*batch, LAYERS, HKV, "cpu")
    graph.load(decode, bs, req_to_token)
    for layer in range(LAYERS):
        graph.score(layer, q[layer], k[layer], SCALE)
    graph.unload(decode)
    return decode


BATCHES = [  # (q_rows, rows, lengths, layers) of a forward of `bs` lanes
    (8, ([0, 2, 3], [1, 4, 2], [10, 12, 3], [None, None, (2,)])),
    (8, ([5], [0], [16], [(0, 1)])),  # one lane at the bound, the rest padding
    (4, ([0, 1, 2, 3], [3, 3, 5, 1], [1, 7, 16, 2], [None] * 4)),
]


@pytest.mark.parametrize("bs,batch", BATCHES)
def test_a_replay_equals_eager_scoring(bs, batch):
    """Lanes not scored and padding lanes get nothing; each request's block is what the eager
    path computes, zero in the layers it does not score."""
    k, req_to_token, g = _pool()
    q = [torch.randn(bs, HQ, DIM, generator=g) for _ in range(LAYERS)]
    graph = GraphScoring(8, BOUND, LAYERS, HKV, "cpu")
    graph.capture(bs)
    want = _eager(batch, q, k, req_to_token)
    got = _replay(graph, batch, bs, q, k, req_to_token)
    torch.testing.assert_close(got.buf, want.buf, rtol=1e-5, atol=1e-6)
    for j in range(len(batch[0])):
        torch.testing.assert_close(got.block(j)[0], want.block(j)[0], rtol=1e-5, atol=1e-6)


def test_batches_that_do_not_fit_are_named():
    graph = GraphScoring(4, BOUND, LAYERS, HKV, "cpu")
    long_row = DecodeScoring([0], [0], [BOUND + 1], [None], LAYERS, HKV, "cpu")
    assert not graph.fits(long_row, 1) and not graph.fits(
        DecodeScoring([0], [0], [3], [None], LAYERS, HKV, "cpu"), 5
    )
    with pytest.raises(ValueError, match="does not fit"):
        graph.load(long_row, 1, torch.zeros(1, 32, dtype=torch.int64))
    with pytest.raises(ValueError, match="bs must be in"):
        graph.capture(5)
    with pytest.raises(ValueError, match="bound"):
        GraphScoring(4, 0, LAYERS, HKV, "cpu")


def _batches(bs, g):
    """Two batches of `bs` lanes with different scored lanes and rows (lengths 1..BOUND)."""
    out = []
    for every in (2, 3):
        lanes = [b for b in range(bs) if b % every == 0]
        lengths = torch.randint(1, BOUND + 1, (len(lanes),), generator=g).tolist()
        rows = [b % 6 for b in lanes]
        out.append((lanes, rows, lengths, [None] * len(lanes)))
    return out


@pytest.mark.parametrize("bs", [1, 8, 64])
def test_the_captured_scoring_is_static(bs):
    """The part a graph captures, counted on CPU with the kernel standing for its launch: no
    allocation, no host read, one launch per layer, and the same argument shapes and addresses
    for two batches of different rows (what a replay needs); and each replay equals eager."""
    k, req_to_token, g = _pool()
    q = [torch.randn(bs, HQ, DIM, generator=g) for _ in range(LAYERS)]
    graph = GraphScoring(64, BOUND, LAYERS, HKV, "cpu")
    graph.capture(bs)
    batches = _batches(bs, g)
    seen = []

    def launch(*args, **kwargs):
        seen.append(tuple((tuple(a.shape), a.data_ptr()) for a in args if torch.is_tensor(a)))

    counts = []
    for batch in batches:
        graph.load(DecodeScoring(*batch, LAYERS, HKV, "cpu"), bs, req_to_token)
        with dc.count_calls(gs, "attn_scores_"), dc.DeviceCounter() as c:
            c.mark(graph.indptr, graph.kv_indices, graph.buf, *k, *q)
            for layer in range(LAYERS):
                graph.score(layer, q[layer], k[layer], SCALE)
        counts.append((c.allocs, c.syncs, c.h2d, c.calls))
        got = DecodeScoring(*batch, LAYERS, HKV, "cpu")
        graph.load(got, bs, req_to_token)
        for layer in range(LAYERS):
            graph.score(layer, q[layer], k[layer], SCALE)
        graph.unload(got)
        want = _eager(batch, q, k, req_to_token)
        torch.testing.assert_close(got.buf, want.buf, rtol=1e-5, atol=1e-6)
    real = gs.attn_scores_
    try:
        gs.attn_scores_ = launch
        for batch in batches:
            graph.load(DecodeScoring(*batch, LAYERS, HKV, "cpu"), bs, req_to_token)
            for layer in range(LAYERS):
                graph.score(layer, q[layer], k[layer], SCALE)
    finally:
        gs.attn_scores_ = real
    assert counts == [([], [], 0, {"attn_scores_": LAYERS})] * 2
    assert seen[:LAYERS] == seen[LAYERS:]  # same shapes and addresses, layer by layer


@pytest.mark.gpu
def test_a_cuda_graph_replays_the_scoring_equal_to_eager():
    """On a GPU: every layer's launch captured in one `torch.cuda.CUDAGraph`, replayed for two
    batches of different rows, equal to the eager scoring each time."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    k = [torch.randn(SLOTS, HKV, DIM, device=dev, generator=g) for _ in range(LAYERS)]
    req_to_token = torch.randint(0, SLOTS, (6, 32), device=dev, generator=g)
    bs = 8
    q = [torch.zeros(bs, HQ, DIM, device=dev) for _ in range(LAYERS)]
    graph = GraphScoring(8, BOUND, LAYERS, HKV, dev)
    graph.capture(bs)
    for layer in range(LAYERS):  # warm-up: compiles outside the capture
        graph.score(layer, q[layer], k[layer], SCALE)
    torch.cuda.synchronize()
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        for layer in range(LAYERS):
            graph.score(layer, q[layer], k[layer], SCALE)
    for _, batch in BATCHES[:2]:
        for x in q:
            x.copy_(torch.randn(bs, HQ, DIM, device=dev, generator=g))
        want = DecodeScoring(*batch, LAYERS, HKV, dev)
        for layer in range(LAYERS):
            want.score(layer, q[layer], k[layer], req_to_token, SCALE)
        got = DecodeScoring(*batch, LAYERS, HKV, dev)
        graph.load(got, bs, req_to_token)
        cuda_graph.replay()
        graph.unload(got)
        torch.testing.assert_close(got.buf, want.buf, rtol=1e-4, atol=1e-5)
