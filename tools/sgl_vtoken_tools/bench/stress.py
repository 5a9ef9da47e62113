"""A stress run against one server: `workers` request loops of mixed traffic
(`stress_traffic.py`) until `duration_s` has passed, then the end-of-run checks.

Checks, after the load drains: every request had an expected outcome (`EXPECTED`), some request
completed at least every `STALL_S` seconds of the load (`longest_gap`), the server
still answers /health, its log (when known) gained no Python traceback, no KV slot leaked (the
plugin's `pool_available_tokens + pool_evictable_tokens == pool_total_tokens`) and, once the
radix cache is flushed, the whole pool is free; the run evicted and aborted something.

`run_stress(cfg, emit)` passes JSON-ready records to `emit`: a `config` line, a `progress` line
every `progress_every_s`, one `unexpected` line per request with an unexpected outcome (the
first `MAX_UNEXPECTED_LINES`), a `server_down` line if the server stopped answering (the loops
stop then), and the `summary` line (returned too). `on_request` gets every request record. The summary's `load_s`
runs until the last request loop stopped: loops finish the request in flight at the deadline.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

from sgl_vtoken_tools.bench import probe
from sgl_vtoken_tools.bench.server_log import parse_log, read_from, tracebacks
from sgl_vtoken_tools.bench.stress_spec import TrafficSpec, kinds
from sgl_vtoken_tools.bench.stress_traffic import play

# SGLang's own memory checkers, on in the server a stress run starts.
MEMORY_CHECKS = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
    "SGLANG_DEBUG_MEMORY_POOL": "1",
    "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
}
# An HTTP 503 naming a page shortage is the plugin's answer to a request it has no page for
# (patches/core/shortage.py): expected of every kind, and counted apart in the summary.
EXPECTED = {
    "invalid": {"rejected"},
    "abort": {"aborted", "ok", "clipped", "unavailable"},
    "disconnect": {"aborted", "ok", "clipped", "unavailable"},
}
DEFAULT_EXPECTED = {"ok", "clipped", "unavailable"}
MAX_UNEXPECTED_LINES = 50  # the summary counts them all
STALL_S = 60.0  # a run fails if no request completes for longer than this during the load
COUNTERS = (
    "evictions",
    "evicted_tokens",
    "pages_freed",
    "tokens_moved",
    "history_hits",
    "history_tokens_reused",
    # page shortages met and what was done instead (patches/core/shortage.py)
    "deferred_evictions",
    "deferred_admissions",
    "shortage_aborts",
    "skipped_recalls",
    "recalls",
    "offloaded_tokens",
)


@dataclass
class StressConfig:
    base_url: str
    duration_s: float = 300.0
    workers: int = 8
    seed: int = 0
    traffic: TrafficSpec = field(default_factory=TrafficSpec)
    progress_every_s: float = 30.0
    drain_timeout_s: float = 300.0
    sample_interval: float = 1.0
    server_log: str | None = None  # the server's log file: checked for tracebacks

    def __post_init__(self):
        self.base_url = self.base_url.rstrip("/")
        if self.duration_s <= 0 or self.workers < 1:
            raise ValueError(
                f"duration_s must be > 0 and workers >= 1 (got {self.duration_s}, {self.workers})"
            )


def expected(rec: dict) -> bool:
    """The request's outcome is one its kind expects (or the record's own `expected`)."""
    return rec["status"] in (rec.get("expected") or EXPECTED.get(rec["kind"], DEFAULT_EXPECTED))


def longest_gap(records: list[dict], load_s: float) -> float:
    """The longest time during the load in which no request completed (its start and end
    included), from the records' completion times (`done_s`)."""
    done = sorted(r["done_s"] for r in records if "done_s" in r)
    edges = [0.0] + [d for d in done if d <= load_s] + [load_s]
    return max(b - a for a, b in zip(edges, edges[1:]))


def verdict(checks: dict) -> bool:
    """Every check passed; None marks a check that could not run (no server log) and fails nothing."""
    return all(v is not False for v in checks.values())


def tally(records: list[dict]) -> dict:
    """Requests by kind and outcome, by eviction setting, and the unexpected ones."""
    by_kind: dict[str, Counter] = {}
    for r in records:
        by_kind.setdefault(r["kind"], Counter())[r["status"]] += 1
    return {
        "requests": len(records),
        "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())},
        "by_evict": dict(sorted(Counter(r["evict"] for r in records).items())),
        "unexpected": sum(not expected(r) for r in records),
        "aborted": sum(r["status"] == "aborted" for r in records),
        "unavailable": sum(r["status"] == "unavailable" for r in records),
    }


def _workers(
    cfg: StressConfig, model: str, deadline: float, on_record, down: threading.Event
) -> list[threading.Thread]:
    """The request loops; each stops at the deadline, or as soon as the server stops answering
    (`down` set: a connection failure and a failed /health)."""
    mix = kinds(cfg.traffic)
    names, weights = list(mix), list(mix.values())

    def loop(w: int) -> None:
        rng = random.Random(f"{cfg.seed}-worker-{w}")
        n = 0
        while time.monotonic() < deadline and not down.is_set():
            kind = rng.choices(names, weights)[0]
            recs = play(kind, cfg.base_url, rng, cfg.traffic, f"stress{cfg.seed}-w{w}-{n}", model)
            for rec in recs:
                on_record(rec)
            if any(
                (r.get("error") or "").startswith("ConnectionError") for r in recs
            ) and not healthy(cfg.base_url):
                down.set()
            n += 1

    return [
        threading.Thread(target=loop, args=(w,), daemon=True, name=f"stress-{w}")
        for w in range(cfg.workers)
    ]


def wait_idle(base_url: str, timeout: float) -> bool:
    """Until /v1/loads shows no running and no waiting request; False on timeout or a dead server."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not healthy(base_url):
            return False
        ld = probe.loads(base_url)
        if ld is not None and not ld.get("num_running_reqs") and not ld.get("num_waiting_reqs"):
            return True
        time.sleep(1.0)
    return False


def healthy(base_url: str) -> bool:
    try:
        return requests.get(base_url + "/health", timeout=30).status_code == 200
    except requests.RequestException:
        return False


def run_stress(cfg: StressConfig, emit, on_request=None) -> dict:
    models = probe.get_json(cfg.base_url, "/v1/models") or {}
    model = (models.get("data") or [{}])[0].get("id", "default")
    st0 = probe.vtoken_state(cfg.base_url, strict=True)
    if st0 is None:
        raise RuntimeError(
            f"{cfg.base_url} reports no vToken state: is sgl-vtoken installed in that server?"
        )
    m0 = probe.scrape_metrics(cfg.base_url)
    log_path = Path(cfg.server_log) if cfg.server_log else None
    log_offset = log_path.stat().st_size if log_path and log_path.exists() else 0
    emit(
        {
            "kind": "config",
            **{k: v for k, v in asdict(cfg).items() if k != "traffic"},
            "traffic": asdict(cfg.traffic),
            "kinds": kinds(cfg.traffic),
            "server_config": st0.get("config"),
            "model": model,
        }
    )

    records: list[dict] = []
    unexpected = [0]
    lock = threading.Lock()
    t0 = time.monotonic()

    def on_record(rec: dict) -> None:
        with lock:
            rec["done_s"] = round(time.monotonic() - t0, 3)  # when it completed, in the run
            records.append(rec)
            unexpected[0] += not expected(rec)
            show = not expected(rec) and unexpected[0] <= MAX_UNEXPECTED_LINES
        if on_request is not None:
            on_request(rec)
        if show:
            emit({"kind": "unexpected", **rec})

    t0 = time.monotonic()  # the load starts now
    deadline = t0 + cfg.duration_s
    sampler = probe.Sampler(cfg.base_url, cfg.sample_interval, t0, with_vtoken=True)
    sampler.start()
    down = threading.Event()
    threads = _workers(cfg, model, deadline, on_record, down)
    for t in threads:
        t.start()
    next_progress = t0 + cfg.progress_every_s
    while any(t.is_alive() for t in threads):
        time.sleep(0.5)
        if time.monotonic() >= next_progress:
            next_progress += cfg.progress_every_s
            with lock:
                snapshot = tally(records)
            ld = probe.loads(cfg.base_url) or {}
            emit(
                {
                    "kind": "progress",
                    "t": round(time.monotonic() - t0, 1),
                    **snapshot,
                    "pool": _pool(probe.vtoken_state(cfg.base_url)),
                    "running": ld.get("num_running_reqs"),
                    "waiting": ld.get("num_waiting_reqs"),
                }
            )
        if time.monotonic() > deadline + cfg.traffic.timeout + 60:
            break  # a request loop hangs past its own timeout: reported as stuck workers
    load_s = time.monotonic() - t0
    if down.is_set():
        emit({"kind": "server_down", "t": round(load_s, 1)})
    drained = wait_idle(cfg.base_url, cfg.drain_timeout_s)
    sampler.stop()
    summary = _summary(
        cfg, records, threads, drained, load_s, st0, m0, sampler.samples, log_path, log_offset
    )
    emit(summary)
    return summary


def _pool(st: dict | None) -> dict | None:
    if st is None:
        return None
    return {
        k: st[k] for k in ("pool_total_tokens", "pool_available_tokens", "pool_evictable_tokens")
    }


def _summary(
    cfg, records, threads, drained, load_s, st0, m0, samples, log_path, log_offset
) -> dict:
    up = healthy(cfg.base_url)
    st1 = probe.wait_pool_free(cfg.base_url, timeout=60) if up else None
    flushed = up and requests.post(cfg.base_url + "/flush_cache", timeout=60).status_code == 200
    st2 = probe.vtoken_state(cfg.base_url, strict=True) if up else None
    m1 = probe.scrape_metrics(cfg.base_url) if up else None
    log = read_from(log_path, log_offset) if log_path else None
    t = tally(records)
    counters = {k: st1.get(k, 0) - st0.get(k, 0) for k in COUNTERS} if st1 else None
    shortages = (
        None
        if st1 is None
        else {
            k: n - (st0.get("shortages") or {}).get(k, 0)
            for k, n in (st1.get("shortages") or {}).items()
        }
    )
    retracted = None
    if m1 is not None and m0 is not None and m1.get("retractions_exported"):
        retracted = int(m1["num_retracted_requests_total"] - m0["num_retracted_requests_total"])
    elif log is not None:
        retracted = parse_log(log)["retracted_requests"]
    gap = longest_gap(records, load_s)
    checks = {
        "no_unexpected_outcomes": t["unexpected"] == 0,
        "no_stall": gap <= STALL_S,
        "workers_stopped": not any(th.is_alive() for th in threads),
        "load_drained": drained,
        "server_healthy": up,
        "no_traceback_in_log": None if log is None else not tracebacks(log),
        "pool_whole_after_drain": st1 is not None and probe.pool_whole(st1),
        "pool_free_after_flush": bool(
            flushed and st2 and st2["pool_available_tokens"] == st2["pool_total_tokens"]
        ),
        "evicted": bool(counters and counters["evicted_tokens"] > 0),
        "aborted": t["aborted"] > 0,
    }
    return {
        "kind": "summary",
        "ok": verdict(checks),
        "checks": checks,
        "load_s": round(load_s, 1),
        "longest_gap_s": round(gap, 1),
        **t,
        "counters": counters,
        "retracted_requests": retracted,
        # page shortages by the path that met them (patches/core/shortage.py PATHS)
        "shortages": {k: n for k, n in sorted((shortages or {}).items()) if n},
        "peak_running_sampled": max((s.get("running") or 0 for s in samples), default=None),
        "peak_waiting_sampled": max((s.get("waiting") or 0 for s in samples), default=None),
        "peak_running_plugin": (st1 or {}).get("peak_running_requests"),
        "pool_after_drain": _pool(st1),
        "pool_after_flush": _pool(st2),
        "tracebacks": [
            tb.splitlines()[0][:200] + " ... " + tb.splitlines()[-1] for tb in tracebacks(log)[:3]
        ]
        if log
        else [],
    }
