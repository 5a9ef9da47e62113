"""SGLang's multi-turn chat benchmark through SGLang's model gateway (smg) to evicting replicas,
one routing policy per route, against one replica alone on the same workload.

A route is one way the conversations reach the servers: straight to the first replica (the
reference), or through a fresh `smg launch --policy P` over every replica. Before each route every
replica's radix cache is flushed, so each route starts cold; around it each replica's Prometheus
counters are read. `python -m sglang.bench_serving --backend sglang-oai-chat --dataset-name
generated-shared-prefix --gsp-num-turns N` plays the conversations (each turn re-sends the whole
history as chat messages); with `manual`, bench_serving's `--gsp-send-routing-key` sends the
`X-SMG-Routing-Key` header, one key per group of conversations (bench_serving has no key per
conversation), which smg pins to a worker.

One JSON line per route: bench_serving's figures, and per replica and in all the requests, prompt
tokens, `cached_tokens` (logical prompt tokens not prefilled: the shared system prompt and the
stored histories) and prefilled tokens; `hit_rate` = cached / prompt tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sgl_vtoken_tools.bench.multiturn import Workload, bench_serving
from sgl_vtoken_tools.bench.probe import flush_cache, scrape_metrics
from sgl_vtoken_tools.gateway import GatewayProcess
from sgl_vtoken_tools.launcher import ServerProcess, cpu_server_args

KEEP = (
    "completed",
    "duration",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "mean_tpot_ms",
    "total_input_tokens",
    "total_output_tokens",
)


@dataclass(frozen=True)
class Route:
    """`policy` None: straight to the first replica; else smg with that policy and `smg_flags`."""

    label: str
    policy: str | None = None
    smg_flags: tuple[str, ...] = field(default_factory=tuple)

    @property
    def routing_key(self) -> bool:
        return self.policy == "manual"


def routes(policies: list[str], smg_flags: tuple[str, ...] = ()) -> list[Route]:
    """The one-replica reference, then one route per smg policy (each gateway with `smg_flags`)."""
    return [Route("one replica")] + [Route(f"smg {p}", p, tuple(smg_flags)) for p in policies]


def start_replicas(
    model: str, n: int, pool: int, page_size: int, flags: tuple[str, ...]
) -> list[ServerProcess]:
    """`n` CPU servers of one configuration, with metrics and the cache report, one OpenMP thread
    each; stopped again if one fails to start."""
    args = cpu_server_args(model, max_total_tokens=pool, page_size=page_size) + [
        "--enable-metrics",
        "--enable-cache-report",
        *flags,
    ]
    servers = []
    try:
        for _ in range(n):
            servers.append(ServerProcess(args, env={"OMP_NUM_THREADS": "1"}).start())
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


COUNTERS = {
    "requests": "num_requests_total",
    "prompt": "prompt_tokens_total",
    "cached": "cached_tokens_total",
}


def replica_figures(before: dict, after: dict) -> dict:
    d = {key: int(after[name] - before[name]) for key, name in COUNTERS.items()}
    return {**d, "prefilled": d["prompt"] - d["cached"]}


def run_route(route: Route, replicas: list[ServerProcess], model: str, work: Workload) -> dict:
    """Flush every replica, play `work` along `route`, return the route's JSON line."""
    urls = [s.base_url for s in replicas]
    for url in urls:
        flush_cache(url)
    before = [scrape_metrics(url) for url in urls]
    if route.policy is None:
        result = bench_serving(urls[0], model, model, work, routing_key=False)
    else:
        with GatewayProcess(urls, policy=route.policy, extra=route.smg_flags) as gw:
            result = bench_serving(gw.base_url, gw.model, model, work, route.routing_key)
    per = [replica_figures(b, scrape_metrics(url)) for b, url in zip(before, urls)]
    total = {key: sum(p[key] for p in per) for key in per[0]}
    return {
        "route": route.label,
        "policy": route.policy,
        "smg_flags": list(route.smg_flags),
        "replicas": len(urls),
        "workload": work.__dict__,
        **{k: result.get(k) for k in KEEP},
        **total,
        "hit_rate": round(total["cached"] / max(total["prompt"], 1), 4),
        "per_replica": per,
    }
