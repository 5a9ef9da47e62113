"""Attention policies under decode CUDA graphs: the scoring captured on static buffers.

SGLang's decode graph runner captures one forward per batch size and replays it; the score
launches of `scores.collect` are captured with it, on one `GraphScoring` per runner
(`sgl_vtoken/graph_scores.py`; rows bounded by the server's budget + interval + page_size):

    capture_one_shape  AROUND  the capture forward scores every lane on the static buffers
    can_run_graph      AROUND  a batch with a scored row beyond the bound runs eagerly
                               (counted: `graph_eager_steps`)
    load_batch         AROUND  after SGLang's static inputs, the scored rows' CSR (outside)
    execute            AROUND  after the replay, the scores into the requests' staged blocks

Prefill, recall scoring and the eviction step itself stay eager. A server whose own policy reads
no attention gets no buffers and captures no scoring (its graphs stay SGLang's); a request that
asks an attention policy there runs its decode steps eagerly (counted).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sgl_vtoken.graph_scores import GraphScoring
from sgl_vtoken.policies import POLICIES

from .core.process import process
from .surface.server_args import server_config

if TYPE_CHECKING:
    from sgl_vtoken.decode_scores import DecodeScoring

    from .core.sglang_types import DecodeGraphRunner, ForwardBatch

ATTR = "vtoken_graph_scoring"


def _graph(runner: DecodeGraphRunner) -> GraphScoring | None:
    """The runner's static scoring buffers (made at its first capture), or None."""
    if not hasattr(runner, ATTR):
        cfg = server_config()
        graph = None
        if cfg.enabled and cfg.budget is not None and "attn" in POLICIES[cfg.policy].needs:
            pool = runner.model_runner.token_to_kv_pool
            graph = GraphScoring(
                runner.max_bs,
                cfg.budget + cfg.interval + cfg.page_size,
                pool.layer_num,
                pool.head_num,
                pool.get_key_buffer(0).device,
            )
        setattr(runner, ATTR, graph)
    return getattr(runner, ATTR)


def _decode() -> DecodeScoring | None:
    """The eager plan of the decode forward about to run (`scores.prepare`), or None."""
    scored = process().scoring
    return None if scored is None else scored.decode


def around_capture_one_shape(
    original: Callable[..., object],
    runner: DecodeGraphRunner,
    size: int,
    *args: object,
    **kwargs: object,
) -> object:
    """AROUND `DecodeCudaGraphRunner.capture_one_shape`: capture the scoring with the forward."""
    graph = _graph(runner)
    if graph is None or runner.ragged_verify_mode:
        return original(runner, size, *args, **kwargs)
    from .step.scores import Scored

    proc = process()
    previous = proc.scoring
    graph.capture(size)
    proc.scoring = Scored(None, [], runner.model_runner.req_to_token_pool.req_to_token, graph)
    try:
        return original(runner, size, *args, **kwargs)
    finally:
        proc.scoring = previous


def around_can_run_graph(
    original: Callable[[DecodeGraphRunner, ForwardBatch], bool],
    runner: DecodeGraphRunner,
    forward_batch: ForwardBatch,
) -> bool:
    """AROUND `can_run_graph`: a scored batch the buffers cannot hold runs eagerly."""
    ok = original(runner, forward_batch)
    decode = _decode()
    if ok and decode is not None:
        graph = _graph(runner)
        if graph is None or not graph.fits(decode, forward_batch.batch_size):
            process().counters.graph_eager_steps += 1
            return False
    return ok


def _after_replay(
    stage: Callable[[DecodeGraphRunner, DecodeScoring, GraphScoring], None],
) -> Callable[..., object]:
    """The AROUND hook of a replay stage (`load_batch`, `execute`): SGLang's stage, then, when the
    batch replayed is a scored decode batch, ``stage(runner, plan, buffers)``."""

    def around(
        original: Callable[..., object],
        runner: DecodeGraphRunner,
        forward_batch: ForwardBatch,
        *args: object,
        **kwargs: object,
    ) -> object:
        out = original(runner, forward_batch, *args, **kwargs)
        decode = _decode()
        if decode is not None:
            graph = _graph(runner)
            assert graph is not None, "can_run_graph lets no scored batch in without buffers"
            stage(runner, decode, graph)
        return out

    around.__doc__ = stage.__doc__
    return around


def _load(runner: DecodeGraphRunner, decode: DecodeScoring, graph: GraphScoring) -> None:
    """AROUND `load_batch`: the scored rows' CSR into the static buffers, for the padded batch."""
    scored = process().scoring
    assert scored is not None, "a replayed scored batch has its plan"
    graph.load(decode, runner.bs, scored.req_to_token)


def _unload(runner: DecodeGraphRunner, decode: DecodeScoring, graph: GraphScoring) -> None:
    """AROUND `execute` (the replay): the scores into the staged blocks."""
    graph.unload(decode)


around_load_batch = _after_replay(_load)
around_execute = _after_replay(_unload)
