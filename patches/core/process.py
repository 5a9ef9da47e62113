"""The one object sgl-vtoken keeps per scheduler process: `process()`.

Started by `runtime.after_scheduler_init` (`start`) and also held as `scheduler.vtoken`. Hooks
that SGLang calls without the scheduler in reach (`Req.__init__`, `ForwardBatch.init_new`,
`RadixAttention.forward`, the radix cache's methods) read it through `process()`; a process
without a scheduler (the launcher, the tokenizer manager) sees an inert default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .counters import VTokenCounters
from .shortage import Shortages

if TYPE_CHECKING:
    from sgl_vtoken.decode_scores import DecodeScoring
    from sgl_vtoken.graph_scores import GraphScoring
    from sgl_vtoken.prefill_scores import PrefillScoring


class MetricsPart(Protocol):
    """`metrics`, a `surface/metrics.PrometheusExport`."""

    def publish(self, counters: VTokenCounters, host: dict | None = None) -> None: ...


class ScoringPart(Protocol):
    """`scoring`, a `step/scores.Scored`."""

    decode: DecodeScoring | None
    recall: list
    req_to_token: torch.Tensor
    graph: GraphScoring | None
    window: PrefillScoring | None


@dataclass
class VTokenProcess:
    """What one scheduler process keeps for sgl-vtoken; each field has one owning module.

    Attributes:
        holed: the holed radix cache serves this process (`cache/radix.py`'s `tree_mode`).
        context_len: the served model's context length (0 without a scheduler): the input limit
            of a request evicted during prefill (`step/admission.py`).
        counters: server-wide counters (`/get_server_info`, Prometheus).
        shortages: shortages of free pages met.
        tier: the host tier (`cache/host_tier.py`), None when no request offloads.
        step: what the eviction step uses of the scheduler (`step/context.py`), made at the
            first eviction.
        metrics: the Prometheus export (`surface/metrics.py`), None when metrics are off.
        scoring: what the forward about to run scores (`step/scores.py`), None: nothing.
    """

    holed: bool = False
    context_len: int = 0
    counters: VTokenCounters = field(default_factory=VTokenCounters)
    shortages: Shortages = field(default_factory=Shortages)
    # Defined in layers above this one (which import it), so typed `Any` or by a Protocol of what
    # the modules use of them here:
    tier: Any = None  # cache/host_tier.HostTier
    step: Any = None  # step/context.StepContext
    metrics: MetricsPart | None = None
    scoring: ScoringPart | None = None


# The process object, replaced by `start`; the only module-level state of the plugin.
_current = VTokenProcess()


def process() -> VTokenProcess:
    """This process's object (an inert default until a scheduler starts)."""
    return _current


def start(holed: bool = False, tier: Any = None, context_len: int = 0) -> VTokenProcess:
    """A fresh process object for a scheduler that starts now: fresh counters and shortages."""
    global _current
    _current = VTokenProcess(
        holed=holed,
        context_len=context_len,
        tier=tier,
    )
    return _current


def use(proc: VTokenProcess) -> VTokenProcess:
    """Install `proc` as this process's object; returns the one it replaces (tools and tests
    that stand in for a scheduler put it back when they are done)."""
    global _current
    previous, _current = _current, proc
    return previous
