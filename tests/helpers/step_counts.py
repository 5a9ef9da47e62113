"""One decode step of a batch of evicting requests, its device work counted (`dispatch_count`)
on a server-shaped fake (`fake_server`): the scored forward that reaches the trigger, then the
eviction hook.

    counts = count_step(Scenario("h2o", page_size=16, history=True, offload=True))
    counts["forward"], counts["evict"]        # DeviceCounter.summary() of each

How the batch gets there (uncounted): requests come in groups of `group` sharing a two-page
system prompt; the first of each group is admitted and evicts first (its prompt enters the
radix tree), then the others match it, and evict. Every row then sits at `budget`; it decodes
`interval - 1` tokens, and the counted step decodes the last one (forward) and evicts (hook).
With `history` that first turn decodes on, evicts again, decodes one token and finishes (its
compacted row of `budget + 1` stored as a history), and the second turn's prompt (the first
turn's ids, then a message of `interval - 3` tokens) continues from the stored view, one token
short of the trigger: the counted eviction is the one that
drops most of the view (and releases what only the row reached). Rows differ in content but all
trigger together, which is what a batch under steady traffic looks like at its worst.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from helpers.dispatch_count import DeviceCounter, count_calls
from helpers.fake_server import FakeServer, Shape
from sgl_vtoken.config import EvictConfig

WINDOW = {"h2o": 16, "scissorhands": 16}


@dataclass(frozen=True)
class Scenario:
    policy: str
    page_size: int
    history: bool = False
    offload: bool = False
    batch: int = 64
    pool_tokens: int = 65536
    budget: int = 64
    interval: int = 16
    group: int = 4
    score_layers: tuple | None = (
        None  # every other request scores only these layers (the rest: all)
    )
    reclaim: str = "vtoken"
    span: int = 0  # span-aware keeping (the fake tokenizer's units)

    def config(self, mixed: bool = False) -> EvictConfig:
        keys = dict(
            policy=self.policy,
            budget=self.budget,
            sink=4,
            window=WINDOW.get(self.policy, 0),
            interval=self.interval,
            page_size=self.page_size,
            reclaim=self.reclaim,
            span=self.span,
        )
        if self.offload:
            keys.update(offload=True, host_tokens=1 << 20)
        # every layer scored (the most launches a step can take), or the mixed requests' own
        keys.update(score_layers=list(self.score_layers) if mixed and self.score_layers else "all")
        return EvictConfig.from_dict(keys)


def build(sc: Scenario, shape: Shape = Shape()) -> tuple[FakeServer, list]:
    """The server and its batch, every row one decode short of its trigger."""
    server = FakeServer(
        shape,
        pool_tokens=sc.pool_tokens,
        page_size=sc.page_size,
        max_reqs=sc.batch + 8,
        host_tokens=1 << 20 if sc.offload else 0,
    )
    g = torch.Generator().manual_seed(0)
    system = [
        torch.randint(1000, 2000, (2 * 16,), generator=g).tolist()
        for _ in range(-(-sc.batch // sc.group))
    ]
    prompts = [
        system[i // sc.group]
        + torch.randint(2000, 30_000, (sc.budget + sc.interval,), generator=g).tolist()
        for i in range(sc.batch)
    ]
    reqs = _start(server, sc, prompts, "t1")
    if sc.history:  # the first turn decodes past its prompt, evicts, decodes a token and ends
        _decode(server, reqs, sc.interval)
        server.evict(reqs)
        server.decode(reqs)
        logical = []
        for req in reqs:
            server.finish(req)
            logical.append(list(req.vtoken.prompt.logical_ids(req)))
        message = [
            torch.randint(2000, 30_000, (sc.interval - 3,), generator=g).tolist() for _ in reqs
        ]
        reqs = [
            server.admit(sc.config(mixed=i % 2 == 1), ids + m, f"t2-{i}")
            for i, (ids, m) in enumerate(zip(logical, message))
        ]
    else:
        _decode(server, reqs, sc.interval - 1)
    server.decode(reqs, forward=False)
    return server, reqs


def count_step(sc: Scenario, shape: Shape = Shape()) -> dict:
    """``{"forward": ..., "evict": ...}``: the counted decode forward and eviction of `sc`."""
    import sgl_vtoken.decode_scores as decode_scores
    import sgl_vtoken.step_apply as step
    from sgl_vtoken.patches.core.process import process, use
    from sgl_vtoken.patches.step import scores

    previous = process()
    try:
        server, reqs = build(sc, shape)
        out = {}
        with count_calls(decode_scores, "attn_scores_"), count_calls(step, "repack_kv_"):
            with DeviceCounter() as c:
                server.forward(reqs)
            out["forward"] = c.summary()
            before = [r.kv.kv_committed_len for r in reqs]
            released = _count_history_frees(server.cache)
            with DeviceCounter() as c:
                server.evict(reqs)
            out["evict"] = c.summary()
        out["evicted_rows"] = sum(r.kv.kv_committed_len < n for r, n in zip(reqs, before))
        out["history_freed"] = sum(released)  # slots (page size 1) or pages freed from stored views
        server.check(reqs)
        out["scored_layers"] = shape.layers if "attn" in reqs[0].vtoken.policy.needs else 0
        scores.clear()
        return out
    finally:
        use(previous)


def _count_history_frees(cache) -> list[int]:
    """What the cache's `release_dropped` / `release_unused_pages` free from now on (a list the
    calls append to)."""
    freed = []
    for name in ("release_dropped", "release_unused_pages"):
        real = getattr(cache, name)
        setattr(cache, name, lambda *a, real=real: freed.append(real(*a)) or freed[-1])
    return freed


def _start(server: FakeServer, sc: Scenario, prompts: list, turn: str) -> list:
    """Admit every prompt, the first of each group first; each evicts once (down to `budget`)."""
    reqs = [None] * len(prompts)
    for first in (True, False):
        for i, ids in enumerate(prompts):
            if (i % sc.group == 0) == first:
                reqs[i] = server.admit(sc.config(mixed=i % 2 == 1), ids, f"{turn}-{i}")
        server.evict([r for r in reqs if r is not None])
    return reqs


def _decode(server: FakeServer, reqs: list, steps: int) -> None:
    for _ in range(steps):
        server.evict(reqs)
        server.decode(reqs)


def scenarios(**kw) -> list[Scenario]:
    """Every policy at page sizes 1 and 16, without and with histories and offload."""
    from sgl_vtoken.policies import POLICIES

    out = []
    for policy in sorted(POLICIES):
        for ps in (1, 16):
            for history, offload in ((False, False), (True, False), (True, True)):
                out.append(Scenario(policy, ps, history=history, offload=offload, **kw))
    return out


def with_pool(sc: Scenario, pool_tokens: int) -> Scenario:
    return replace(sc, pool_tokens=pool_tokens)
