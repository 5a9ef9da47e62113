"""Attention policies under decode CUDA graphs, the capture stubbed on CPU (SGLang captures no
decode graph there): the hooks around SGLang's graph runner capture every layer's scoring on
static buffers, load each batch's rows before the replay and hand the scores to the requests'
staged blocks after it, equal to the eager forward's; a batch whose rows the buffers cannot hold
runs eagerly, counted."""

import math
from types import SimpleNamespace

import pytest
import torch

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.decode_scores import DecodeScoring
from sgl_vtoken.graph_scores import GraphScoring
from sgl_vtoken.patches import graphs
from sgl_vtoken.patches.core.process import VTokenProcess, process, use
from sgl_vtoken.patches.step import scores

LAYERS, HQ, HKV, DIM, SLOTS = 3, 4, 2, 8, 64
BUDGET, INTERVAL = 12, 4  # bound 17 at page size 1


class Pool:
    """The pool's key buffers, as `get_token_to_kv_pool()` gives them."""

    def __init__(self, g):
        self.layer_num, self.head_num = LAYERS, HKV
        self.k = [torch.randn(SLOTS, HKV, DIM, generator=g) for _ in range(LAYERS)]

    def get_key_buffer(self, layer):
        return self.k[layer]


LAYER_OBJS = [
    SimpleNamespace(
        layer_id=i, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=DIM, scaling=DIM**-0.5
    )
    for i in range(LAYERS)
]


@pytest.fixture
def setup(monkeypatch):
    g = torch.Generator().manual_seed(0)
    pool = Pool(g)
    req_to_token = torch.randperm(6 * 32, generator=g).view(6, 32) % SLOTS
    monkeypatch.setattr(scores, "get_token_to_kv_pool", lambda: pool)
    monkeypatch.setattr(
        graphs,
        "server_config",
        lambda: EvictConfig(policy="h2o", budget=BUDGET, interval=INTERVAL),
    )
    previous = use(VTokenProcess())
    runner = SimpleNamespace(
        max_bs=4,
        bs=0,
        ragged_verify_mode=False,
        model_runner=SimpleNamespace(
            token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=req_to_token)
        ),
    )
    yield runner, pool, req_to_token, g
    use(previous)


def _forward(q_by_layer, fb=None):
    """The model's attention layers as the scoring sees them (attention itself stubbed)."""
    for layer, q in zip(LAYER_OBJS, q_by_layer):
        scores.around_radix_attention_forward(lambda *a, **kw: None, layer, q, None, None, fb)


class StubGraph:
    """A CUDA graph on CPU: capture records the score launches, replay runs them again on the
    same tensors (the static query buffers SGLang's replay fills)."""

    def __init__(self, monkeypatch):
        self.launches, self.recording = [], False
        self.real = real = GraphScoring.score

        def score(g, *args):
            if self.recording:
                self.launches.append((g, args, g.bs))
            real(g, *args)

        monkeypatch.setattr(GraphScoring, "score", score)

    def capture(self, runner, size, static_q):
        def capture_forward(runner, size):
            self.recording = True
            _forward(static_q)
            self.recording = False

        graphs.around_capture_one_shape(capture_forward, runner, size)

    def replay(self):
        for g, args, bs in self.launches:
            g.bs = bs
            self.real(g, *args)


def _plan(req_to_token, q_rows, rows, lengths, layers):
    """`scores.prepare` of a decode forward: the eager plan, its blocks staged."""
    decode = DecodeScoring(q_rows, rows, lengths, layers, LAYERS, HKV, "cpu")
    process().scoring = scores.Scored(decode, [], req_to_token)
    return decode


def test_a_replayed_forward_scores_like_the_eager_one(setup, monkeypatch):
    runner, pool, req_to_token, g = setup
    stub = StubGraph(monkeypatch)
    static_q = [torch.zeros(4, HQ * DIM) for _ in range(LAYERS)]
    stub.capture(runner, 4, static_q)
    assert process().scoring is None  # the capture's plan does not outlive it
    gs = runner.vtoken_graph_scoring
    assert (gs.max_bs, gs.bound) == (4, BUDGET + INTERVAL + 1)
    assert len(stub.launches) == LAYERS  # one captured launch per layer

    batch = ([0, 2], [1, 4], [17, 5], [None, (1, 2)])  # lanes 0 and 2 of 3; 17 = the bound
    q = [torch.randn(3, HQ * DIM, generator=g) for _ in range(LAYERS)]
    eager = _plan(req_to_token, *batch)
    _forward(q)
    fb = SimpleNamespace(batch_size=3)

    replayed = _plan(req_to_token, *batch)
    assert graphs.around_can_run_graph(lambda r, fb: True, runner, fb)

    def execute(runner, fb):
        def load_batch(runner, fb):
            runner.bs = 4  # SGLang pads the batch to the captured size
            for s, x in zip(static_q, q):
                s[:3].copy_(x)

        graphs.around_load_batch(load_batch, runner, fb)
        stub.replay()

    graphs.around_execute(execute, runner, fb)
    torch.testing.assert_close(replayed.buf, eager.buf, rtol=1e-5, atol=1e-6)
    assert replayed.buf[:17].abs().sum() > 0 and replayed.buf[17:, 0].abs().sum() == 0
    assert process().counters.graph_eager_steps == 0


def test_rows_beyond_the_bound_and_servers_without_an_attention_policy_run_eagerly(
    setup, monkeypatch
):
    runner, pool, req_to_token, g = setup
    fb = SimpleNamespace(batch_size=1)
    _plan(req_to_token, [0], [1], [BUDGET + INTERVAL + 2], [None])
    assert not graphs.around_can_run_graph(lambda r, fb: True, runner, fb)
    assert process().counters.graph_eager_steps == 1
    assert not graphs.around_can_run_graph(lambda r, fb: False, runner, fb)  # SGLang's own no
    assert process().counters.graph_eager_steps == 1
    process().scoring = None  # nothing scored: SGLang decides alone
    assert graphs.around_can_run_graph(lambda r, fb: True, runner, fb)

    no_attention = EvictConfig(policy="streamingllm", budget=BUDGET, interval=INTERVAL)
    for n, server in enumerate([EvictConfig(), no_attention], start=2):
        monkeypatch.setattr(graphs, "server_config", lambda server=server: server)
        process().scoring = None  # start-up: graphs are captured before any request
        bare = SimpleNamespace(**{k: v for k, v in vars(runner).items() if k != graphs.ATTR})
        captured = []
        graphs.around_capture_one_shape(
            lambda r, size, captured=captured: captured.append(process().scoring), bare, 2
        )
        assert captured == [None] and getattr(bare, graphs.ATTR) is None  # SGLang's graphs only
        _plan(req_to_token, [0], [1], [3], [None])  # a request asking h2o for itself
        assert not graphs.around_can_run_graph(lambda r, fb: True, bare, fb)
        assert process().counters.graph_eager_steps == n


def test_the_buffers_are_sized_by_the_largest_batch_and_the_bound():
    gs = GraphScoring(256, 288, 32, 8, "cpu")
    assert gs.nbytes() == 257 * 8 + 256 * 288 * 8 + 256 * 288 * 32 * 8 * 4
    assert math.isclose(gs.nbytes() / 1e6, 76.1, abs_tol=0.1)  # docs/design/step.md's 8B figure
