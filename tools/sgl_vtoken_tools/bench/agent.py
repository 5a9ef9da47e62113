"""One run of the multi-turn agent benchmark against one running server, as JSON lines.

`run_benchmark(cfg, out)` builds the workload (`workload.py`), plays every session in its own
thread (`agent_client.py`) while a `probe.Sampler` polls the server, reads the server's counters
before and after and the log it wrote meanwhile, and writes to `out`: one `config` line, one
`request` line per request, one `sample` line per server sample, one `turn` line per turn and a
final `summary` line (`agent_summary.py` defines its figures).
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sgl_vtoken_tools.bench import probe
from sgl_vtoken_tools.bench.agent_client import run_session
from sgl_vtoken_tools.bench.agent_summary import run_summary, summarize
from sgl_vtoken_tools.bench.server_log import parse_log, read_from
from sgl_vtoken_tools.bench.tokenizer import TokenFitter
from sgl_vtoken_tools.bench.workload import WorkloadSpec, build_workload


@dataclass
class AgentConfig:
    """The client side of a run; the server's flags are the server's business."""

    base_url: str
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    model: str | None = None  # API model name (None: the first of /v1/models)
    max_concurrency: int = 0  # sessions in flight at once (0: no limit)
    reply_tokens: int = 64  # every reply exactly this long (max_tokens + ignore_eos)
    think_time: float = 0.0  # seconds between a reply and the next turn
    tool_role: str = "tool"  # role of tool outputs: "tool" or "user"
    temperature: float = 0.0
    ignore_eos: bool = True  # an SGLang extension; off for other servers
    kv_evict: dict | None = None  # per-request `custom_params.kv_evict` (None: server's flags)
    rid_prefix: str | None = (
        None  # fixed request ids "{prefix}-s{session}-t{turn}" (None: server's)
    )
    server_log: str | None = None  # the server's log file, read for decode batches and retractions
    page_size: int | None = None  # for pages-in-use figures (None: from the server)
    sample_interval: float = 0.5  # seconds between server samples (0: none)
    write_samples: bool = True  # `sample` lines in the output
    request_timeout: float = 600.0
    label: str | None = None  # carried into the turn and summary lines

    def __post_init__(self):
        self.base_url = self.base_url.rstrip("/")
        if self.tool_role not in ("tool", "user"):
            raise ValueError(f"tool_role must be 'tool' or 'user' (got {self.tool_role!r})")
        if self.reply_tokens < 1:
            raise ValueError(f"reply_tokens must be >= 1 (got {self.reply_tokens})")


def _config_line(
    cfg: AgentConfig, exact: bool, system_tokens: int | None, st0: dict | None, sessions
) -> dict:
    w = cfg.workload
    return {
        "kind": "config",
        "base_url": cfg.base_url,
        "model": cfg.model,
        **{k: v for k, v in asdict(w).items() if k != "rate"},
        "rate": None if math.isinf(w.rate) else w.rate,
        "max_concurrency": cfg.max_concurrency,
        "system_tokens_actual": system_tokens,
        "reply_tokens": cfg.reply_tokens,
        "think_time": cfg.think_time,
        "tool_role": cfg.tool_role,
        "kv_evict": cfg.kv_evict,
        "rid_prefix": cfg.rid_prefix,
        "exact_token_lengths": exact,
        "server_vtoken_config": (st0 or {}).get("config"),
        "label": cfg.label,
        "session_starts": [round(s.start, 3) for s in sessions],
    }


def run_benchmark(cfg: AgentConfig, out=None, progress: bool = True) -> dict:
    """Run the whole benchmark; write JSON lines to `out` (a text file object, or None) and
    return {"summary", "turns", "requests", "samples"}."""
    if cfg.model is None:
        models = probe.get_json(cfg.base_url, "/v1/models") or {}
        cfg.model = (models.get("data") or [{}])[0].get("id", "default")
    emit = (
        (lambda rec: out.write(json.dumps(rec) + "\n")) if out is not None else (lambda rec: None)
    )

    fitter = TokenFitter(cfg.base_url, cfg.model)
    work = build_workload(cfg.workload, fitter)
    info0 = probe.server_info(cfg.base_url) or {}
    st0 = probe.vtoken_state(cfg.base_url, info0)
    server_cfg = (st0 or {}).get("config") or {}
    evicting = (cfg.kv_evict or {}).get("policy", server_cfg.get("policy", "none")) not in (
        None,
        "none",
    )
    emit(_config_line(cfg, fitter.exact, work.system_tokens, st0, work.sessions))

    log_path = Path(cfg.server_log) if cfg.server_log else None
    log_offset = log_path.stat().st_size if log_path and log_path.exists() else 0
    m0 = probe.scrape_metrics(cfg.base_url)
    t0 = time.monotonic()
    sampler = (
        probe.Sampler(cfg.base_url, cfg.sample_interval, t0, evicting)
        if cfg.sample_interval > 0
        else None
    )
    if sampler:
        sampler.start()
    recs = _play(cfg, work, t0, progress)
    duration = time.monotonic() - t0
    if sampler:
        sampler.stop()
    m1 = probe.scrape_metrics(cfg.base_url)
    st1 = probe.vtoken_state(cfg.base_url)

    recs.sort(key=lambda r: (r["t_start"], r["session"], r["turn"]))
    for r in recs:
        emit({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()})
    samples = sampler.samples if sampler else []
    if cfg.write_samples:
        for s in samples:
            emit({"kind": "sample", **s})
    turns = []
    for turn in range(1, cfg.workload.turns + 1):
        t = {
            "kind": "turn",
            "label": cfg.label,
            "turn": turn,
            **summarize([r for r in recs if r["turn"] == turn]),
        }
        turns.append(t)
        emit(t)

    log = parse_log(read_from(log_path, log_offset)) if log_path and log_path.exists() else None
    budget = (cfg.kv_evict or {}).get("budget") or server_cfg.get("budget")
    summary = {
        "kind": "summary",
        "label": cfg.label,
        "system_prompt_tokens": work.system_tokens,
        **run_summary(
            recs,
            duration,
            samples,
            cfg.page_size or info0.get("page_size"),
            log,
            (m0, m1),
            (st0, st1),
            budget,
            evicting,
        ),
    }
    emit(summary)
    if out is not None:
        out.flush()
    return {"summary": summary, "turns": turns, "requests": recs, "samples": samples}


def _play(cfg: AgentConfig, work, t0: float, progress: bool) -> list[dict]:
    """Every session in its own thread; the request records of all of them."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=len(work.sessions) * cfg.workload.turns,
            desc=cfg.label or "agent",
            unit="req",
            file=sys.stderr,
            leave=False,
        )
    lock = threading.Lock()

    def on_done(rec):
        with lock:
            if bar is not None:
                bar.update(1)

    recs: list[dict] = []
    slots = threading.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    with ThreadPoolExecutor(max_workers=max(1, len(work.sessions))) as pool:
        futures = [
            pool.submit(run_session, s, work.system, cfg, t0, on_done, slots) for s in work.sessions
        ]
        for f in futures:
            recs.extend(f.result())
    if bar is not None:
        bar.close()
    return recs
