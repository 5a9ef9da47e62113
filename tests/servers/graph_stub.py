"""Test-only: a CPU server whose decode scoring runs what a decode CUDA graph captures.

SGLang captures no decode graph on CPU, so `patches/graphs.py`'s hooks never run there. With
`VTOKEN_TEST_GRAPH_STUB=<log path>` the test launcher (`fork_launch.py`) installs this stand-in: each
decode forward's batch is loaded into a `GraphScoring` padded to a power of two (what
`graphs.around_load_batch` does before a replay), every attention layer scores every lane on the
static buffers (the launches a graph captures, here run in the forward) instead of the eager
launch, and after the last layer the scores go to the requests' staged blocks (what
`graphs.around_execute` does after the replay). A batch that does not fit is scored eagerly and
counted in `graph_eager_steps`, as `graphs.around_can_run_graph` does. Each forward scored so
appends ``<batch size> <lanes>`` to the log, so a test sees the stand-in ran.
"""

import torch

from sgl_vtoken.graph_scores import GraphScoring
from sgl_vtoken.patches.core.process import process
from sgl_vtoken.patches.step import scores

ENV = "VTOKEN_TEST_GRAPH_STUB"
MAX_BS, BOUND = 8, 256  # lanes and row entries of the stand-in's buffers


def install(log: str) -> None:
    """Wrap `scores.prepare` and `scores.collect` (both called through the module)."""
    prepare, collect = scores.prepare, scores.collect
    state: dict = {}

    def stub_prepare(forward_batch, scored, model_runner):
        prepare(forward_batch, scored, model_runner)
        plan, state["active"] = process().scoring, None
        if plan is None or plan.decode is None:
            return
        if "graph" not in state:
            pool = model_runner.token_to_kv_pool
            state["graph"] = GraphScoring(
                MAX_BS, BOUND, pool.layer_num, pool.head_num, pool.get_key_buffer(0).device
            )
        graph, bs = state["graph"], forward_batch.batch_size
        lanes = 1 << max(bs - 1, 0).bit_length()  # the captured size a replay pads to
        if not graph.fits(plan.decode, lanes):
            process().counters.graph_eager_steps += 1
            return
        graph.load(plan.decode, lanes, plan.req_to_token)
        state["active"] = (plan.decode, lanes)
        with open(log, "a") as f:
            f.write(f"{bs} {lanes}\n")

    @torch.no_grad()
    def stub_collect(layer, q, forward_batch, scored, pool):
        active = state.get("active")
        if active is None or scored.decode is not active[0]:
            return collect(layer, q, forward_batch, scored, pool)
        decode, lanes = active
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        static_q = torch.zeros(lanes, *q.shape[1:], dtype=q.dtype, device=q.device)
        static_q[: q.shape[0]] = q  # the graph's query buffer: padding lanes hold zeros
        graph = state["graph"]
        graph.score(layer.layer_id, static_q, pool.get_key_buffer(layer.layer_id), layer.scaling)
        if layer.layer_id == pool.layer_num - 1:
            graph.unload(decode)

    scores.prepare, scores.collect = stub_prepare, stub_collect
