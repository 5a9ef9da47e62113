"""Prometheus gauges of the vToken counters on `/metrics` (with SGLang's `--enable-metrics`).

Created in the scheduler process after SGLang has set `PROMETHEUS_MULTIPROC_DIR` (Scheduler
`__init__`), with `multiprocess_mode="mostrecent"` like SGLang's own gauges, so the HTTP
process's `/metrics` exports them. Names: `sglang:vtoken_<counter>` for every field of
`VTokenCounters` (cumulative counts since start-up, and the last step's gauges), and for the host
tier's figures of `HOST_HELP` when the server has a host store.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from ..core.counters import VTokenCounters

if TYPE_CHECKING:
    from ..core.sglang_types import Scheduler

HELP = {
    "evictions": "Evictions performed (one per request per eviction step).",
    "evicted_tokens": "Tokens evicted from requests' KV caches.",
    "pages_freed": "KV pages (slots at page size 1) returned to the pool by eviction.",
    "tokens_moved": "Tokens whose K/V was moved by in-place compaction.",
    "bytes_moved": "Bytes of K/V moved by in-place compaction.",
    "bytes_per_token": "Bytes of K and V of one token, all layers.",
    "running_evicting_requests": "Running requests under eviction.",
    "live_tokens": "Live KV tokens of running evicting requests.",
    "retained_pages": "KV pages held by running evicting requests.",
    "fragmentation": "1 - live tokens / (retained pages * page size) of running evicting requests.",
    "naive_excess_pages": (
        "--kv-reclaim naive: pages held beyond Naive-Evict's own footprint "
        "(copies of shared tokens)."
    ),
    "peak_running_requests": "Largest decode batch seen.",
    "peak_retained_pages": "Most KV pages held by evicting requests at once.",
    "peak_pool_held_tokens": (
        "Most KV pool slots held at once: request rows and locked "
        "radix-cache nodes (not reclaimable)."
    ),
    "history_hits": "Finished requests that continued from a stored compacted history.",
    "history_tokens_reused": "Logical history tokens those requests did not prefill again.",
    "deferred_evictions": (
        "Decode evictions put off to a later step: no free KV page for the "
        "copies of kept cached tokens."
    ),
    "deferred_admissions": (
        "Admissions put off a round: no free KV page for a stored view's last "
        "page or a retracted row."
    ),
    "shortage_aborts": (
        "Requests ended with HTTP 503: no free KV page for what they needed, and none would come."
    ),
    "graph_eager_steps": (
        "Scored decode steps run eagerly instead of in the decode CUDA graph: a scored row "
        "longer than the graph's scoring buffers hold, or no buffers (the server's policy "
        "reads no attention)."
    ),
}


HOST_HELP = {
    "host_tokens_held": "Tokens whose K/V the host store holds.",
    "host_bytes_held": "Bytes of K/V the host store holds.",
    "offloaded_tokens": "Evicted tokens copied to the host store.",
    "offload_dropped_tokens": "Evicted tokens the host store's cap left out.",
    "recalled_tokens": "Tokens recalled from the host store into requests' rows.",
    "host_histories_held": "Stored histories held in host memory.",
    "host_histories_stored": "Stored histories moved or written to host memory.",
    "host_histories_restored": "Host histories restored to the device for a next turn.",
    "host_histories_dropped": "Histories the host store's cap dropped.",
    "host_bytes_to_host": "Bytes of stored histories' K/V copied to host memory.",
    "host_bytes_to_device": "Bytes of host histories' K/V copied back to the device.",
}


class PrometheusExport:
    """One `sglang:vtoken_*` gauge per counter, labelled like SGLang's (tp_rank, ...)."""

    def __init__(self, labels: dict) -> None:
        from prometheus_client import Gauge  # after PROMETHEUS_MULTIPROC_DIR is set

        self.labels = {k: str(v) for k, v in labels.items()}
        self.gauges = {
            f.name: Gauge(
                name=f"sglang:vtoken_{f.name}",
                documentation=HELP[f.name],
                labelnames=list(self.labels),
                multiprocess_mode="mostrecent",
            )
            for f in fields(VTokenCounters)
        }
        self.host = {
            name: Gauge(
                name=f"sglang:vtoken_{name}",
                documentation=text,
                labelnames=list(self.labels),
                multiprocess_mode="mostrecent",
            )
            for name, text in HOST_HELP.items()
        }

    def publish(self, counters: VTokenCounters, host: dict | None = None) -> None:
        """Set the gauges to `counters` and, given the host tier's figures (`host`), to those."""
        values = [(self.gauges[n], getattr(counters, n)) for n in self.gauges]
        values += [(self.host[n], host[n]) for n in self.host] if host is not None else []
        for gauge, value in values:
            (gauge.labels(**self.labels) if self.labels else gauge).set(value)


def maybe_create(scheduler: Scheduler) -> PrometheusExport | None:
    reporter = getattr(scheduler, "metrics_reporter", None)
    if reporter is None or not getattr(reporter, "enable_metrics", False):
        return None
    collector = getattr(reporter, "metrics_collector", None)
    return PrometheusExport(getattr(collector, "labels", None) or {})
