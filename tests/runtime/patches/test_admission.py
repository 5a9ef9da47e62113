"""Admission near the pool's size, on SGLang's own `PrefillAdder` over a fake pool and tree (no
server): the state a chat server livelocked in (2048-token pool, page size 16, nothing running,
every slot free or evictable, the head of the queue refused at every pass)."""

from array import array

import pytest
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.mem_cache.prefill_budget import PrefillBudget
from sglang.srt.sampling.sampling_params import SamplingParams

from sgl_vtoken.config import EvictConfig, Prefill
from sgl_vtoken.patches.runtime import new_state
from sgl_vtoken.patches.step.admission import adder_class

POOL, PAGE = 2048, 16


class Pool:
    """`available` free slots of a `POOL`-slot paged pool."""

    page_size, size, device = PAGE, POOL, "cpu"

    def __init__(self, available: int):
        self.available = available

    def available_size(self) -> int:
        return self.available

    def create_prefill_budget(self, tree, *, num_mixed_decode_tokens=0):
        return PrefillBudget(self, tree, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def request_slot_reserve(self, *, has_req_pool_slot, prefill_tokens=0) -> int:
        return 0


class Node:
    def __init__(self, tokens: int):
        self.tokens = tokens


class Tree:
    """`evictable` cached slots; locking a matched prefix (a `Node`) makes them protected."""

    buffer_pipeline = None

    def __init__(self, evictable: int):
        self.evictable, self.protected = evictable, 0

    def evictable_size(self) -> int:
        return self.evictable

    def protected_size(self) -> int:
        return self.protected

    def lock(self, node):
        n = node.tokens if node is not None else 0
        self.evictable, self.protected = self.evictable - n, self.protected + n
        return node

    def unlock(self, node):
        n = node.tokens if node is not None else 0
        self.evictable, self.protected = self.evictable + n, self.protected - n

    def supports_mamba(self):
        return False

    def supports_prefix_sharing(self):
        return True

    def finish_storage_prefetch_admission(self, *args, **kwargs):
        pass

    def discard_storage_prefetch_accounting(self, *args, **kwargs):
        pass


class Running:
    def __init__(self, reqs):
        self.reqs = reqs

    def is_empty(self):
        return not self.reqs

    def batch_size(self):
        return len(self.reqs)


@pytest.fixture(autouse=True)
def published():
    """SGLang's admission reads the published server config and the TP rank."""
    from sglang.srt.runtime_context import get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu"), role="scheduler")
    get_parallel().override_permanently(tp_rank=0)
    yield
    reset_context()


def request(n: int, cfg: EvictConfig | None, *, max_new: int = 128, prefix: int = 0) -> Req:
    """A fresh `n`-token prompt whose first `prefix` tokens are cached (under the holed cache)."""
    req = Req(
        f"r{n}",
        "",
        array("q", (10 + i % 1000 for i in range(n))),
        SamplingParams(max_new_tokens=max_new),
    )
    if cfg is not None:
        req.vtoken = new_state(cfg, req.rid, holed=True)
    req.refresh_fill_ids()
    req.prefix_len, req.last_node = prefix, Node(prefix) if prefix else None
    return req


def adder(base=PrefillAdder, *, available=64, evictable=POOL - 64, running=()):
    """An adder of the scheduler's first pass: `chunked_prefill_size` 4096, no overlap."""
    return base(PAGE, Tree(evictable), Pool(available), Running(list(running)), 0.5, 16384, 4096)


def streaming(**kw) -> EvictConfig:
    return EvictConfig(policy="streamingllm", budget=128, interval=16, page_size=PAGE, **kw)


def test_sglang_itself_never_admits_a_prompt_within_a_page_of_an_idle_pool():
    """Stock SGLang (no eviction): a prompt of 2032..2041 tokens passes its input check (< pool - 6)
    and gets max_new_tokens 0, but `extend + 0 + page_size < free + evictable` never holds, even on
    an idle pool: refused at every pass, first in line for ever (docs/upstream-admission-livelock.md).
    The plugin's adder finishes it with HTTP 400 instead, eviction or not."""
    for n in (2032, 2041):
        a, req = adder(PrefillAdder), request(n, None, max_new=0)
        assert (
            a.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
            == AddReqResult.NO_TOKEN
        )
        assert not a.can_run_list and req.to_finish is None and len(req.origin_input_ids) == n
        a, req = adder(adder_class(PrefillAdder)), request(n, None, max_new=0)
        assert (
            a.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
            == AddReqResult.NO_TOKEN
        )
        assert isinstance(req.to_finish, FINISH_ABORT) and req.to_finish.status_code == 400
        assert "can never be scheduled" in req.to_finish.message
    a, req = adder(), request(2031, None, max_new=0)
    a.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert a.can_run_list == [req]


@pytest.mark.parametrize("n,prefix", [(2032, 0), (2037, 16), (2041, 176)])
def test_a_prompt_evicted_during_prefill_is_admitted_on_an_idle_pool(n, prefix):
    """The chat server's livelock: a 2037-token prompt, 16 tokens cached, prefill_chunk 64, budget
    128, on an idle pool (64 free, 1984 evictable). It never holds more than budget + chunk = 192
    tokens, yet SGLang checked its whole prompt (2021 + 0 + 16 >= 2048 - 16) and refused it at
    every pass. It now asks at most what the idle pool offers: admitted, its first chunk ending at
    the prefill peak."""
    cfg = streaming(prefill=Prefill(chunk=64))
    a, req = adder(adder_class(PrefillAdder)), request(n, cfg, prefix=prefix)
    a.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert a.can_run_list == [req] and a.new_chunked_req is req and req.to_finish is None
    assert req.extend_end == cfg.prefill_peak
    stock = adder()  # SGLang's own check on the same request: the whole prompt must fit
    assert (
        stock.add_one_req(
            request(n, cfg, prefix=prefix), has_chunked_req=False, truncation_align_size=None
        )
        == AddReqResult.NO_TOKEN
        and not stock.can_run_list
    )


def test_an_evicting_request_that_never_fits_is_refused_instead_of_blocking_the_queue():
    """Without eviction during prefill a 2032-token prompt is prefilled whole: with a page of
    alignment it needs more than the pool, so it can never be admitted. On an idle pool it is
    finished with HTTP 400 (SGLang then serves its one-token stand-in and reports the error)
    instead of being refused at every pass ahead of every other request."""
    a, req = adder(adder_class(PrefillAdder)), request(2032, streaming())
    assert (
        a.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
        == AddReqResult.NO_TOKEN
    )
    assert isinstance(req.to_finish, FINISH_ABORT) and req.to_finish.status_code == 400
    assert "can never be scheduled" in req.to_finish.message and list(req.origin_input_ids) == [0]
    fits = request(2031, streaming())  # a page of alignment left: admitted, prefilled whole
    a = adder(adder_class(PrefillAdder))
    a.add_one_req(fits, has_chunked_req=False, truncation_align_size=None)
    assert a.can_run_list == [fits] and a.new_chunked_req is None and fits.to_finish is None


@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.parametrize("state", ["running", "held", "admitted", "chunked"])
def test_a_refused_request_waits_while_memory_can_still_come_free(state, chunk):
    """Refused while something runs, holds slots (here one page, or 848 with a prompt whose chunk
    would fit), was admitted this pass or is being prefilled in chunks: memory may come free, so
    it waits in line as before, with or without eviction during prefill."""
    other = request(100, None)
    a = adder(
        adder_class(PrefillAdder),
        running=[other] if state == "running" else (),
        available=64 - 16 * (state == "held"),
        evictable=POOL - 64 - 832 * (state == "held"),
    )
    if state == "admitted":
        a.add_one_req(other, has_chunked_req=False, truncation_align_size=None)
        assert a.can_run_list == [other]
    req = request(2032, streaming(prefill=Prefill(chunk=chunk)))
    if state == "chunked" and chunk:  # SGLang carries one chunked request at a time
        assert (
            a.add_one_req(req, has_chunked_req=True, truncation_align_size=None)
            == AddReqResult.OTHER
        )
    else:
        assert (
            a.add_one_req(req, has_chunked_req=state == "chunked", truncation_align_size=None)
            == AddReqResult.NO_TOKEN
        )
    assert not a.can_run_list[1 if state == "admitted" else 0 :]
    assert req.to_finish is None and len(req.origin_input_ids) == 2032
