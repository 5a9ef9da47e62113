"""Reading a running SGLang server from the outside: its HTTP endpoints and its log file.

HTTP (all GET, on the server's base URL):
- `/server_info` (`/get_server_info` on older servers): `internal_states[0]["vtoken"]`, the
  sgl-vtoken plugin's counters and gauges (absent on servers without the plugin);
- `/v1/loads`: running and waiting requests, KV tokens in use;
- `/metrics` (servers started with `--enable-metrics`): the Prometheus counters `sglang:*`.

Log (the text the server's scheduler writes, e.g. the file `ServerProcess` keeps): decode batch
records ("Decode batch, #running-req: N"), retraction records ("KV cache pool is full. Retract
requests. #retracted_reqs: N") and failure lines.

Used by scripts/bench_agent.py and scripts/bench_eviction.py.
"""

from __future__ import annotations

import re
import threading
import time

import requests

# sglang/srt/managers/scheduler_components/metrics_reporter.py: "Decode batch[ [iter]], #running-req: N, ..."
DECODE_RE = re.compile(r"Decode batch(?: \[\d+\])?, #running-req: (\d+)")
RETRACT_LINE = "KV cache pool is full. Retract requests."
RETRACTED_RE = re.compile(r"#retracted_reqs: (\d+)")
METRIC_COUNTERS = ("num_requests_total", "prompt_tokens_total", "generation_tokens_total",
                   "cached_tokens_total", "num_retracted_requests_total", "num_aborted_requests_total",
                   "scheduler_process_cpu_seconds_total")


# ----------------------------------------------------------------------------- log text


def peak_running_from_log(text: str) -> int | None:
    """Largest N over "Decode batch, #running-req: N" lines; None if there is no such line."""
    values = [int(m.group(1)) for m in DECODE_RE.finditer(text)]
    return max(values) if values else None


def count_retractions(text: str) -> int:
    """Lines that contain "KV cache pool is full. Retract requests." (one per retraction event)."""
    return sum(RETRACT_LINE in line for line in text.splitlines())


def retracted_requests(text: str) -> int:
    """Sum of `#retracted_reqs: N` over the retraction lines (requests retracted, with repeats)."""
    total = 0
    for line in text.splitlines():
        if RETRACT_LINE in line:
            m = RETRACTED_RE.search(line)
            total += int(m.group(1)) if m else 0
    return total


def error_lines(text: str, limit: int = 10) -> list[str]:
    """Lines that look like failures (tracebacks, ERROR records, exceptions), at most `limit`."""
    keys = ("Traceback", " ERROR ", "Error:", "Exception")
    hits = [line.strip() for line in text.splitlines() if any(k in line for k in keys)]
    return hits[:limit]


def parse_log(text: str) -> dict:
    """Peak running requests (0 without decode lines), decode steps, retraction events and requests."""
    running = [int(m.group(1)) for m in DECODE_RE.finditer(text)]
    return {"peak_running_requests": max(running, default=0), "decode_steps": len(running),
            "retraction_events": count_retractions(text), "retracted_requests": retracted_requests(text)}


# ----------------------------------------------------------------------------- HTTP


def get_json(base_url: str, path: str, timeout: float = 10.0):
    """GET `path` as JSON; None on a connection error, a non-200 answer or a body that is not JSON."""
    try:
        r = requests.get(base_url + path, timeout=timeout)
        return r.json() if r.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None


def server_info(base_url: str, strict: bool = False) -> dict | None:
    """/server_info, else /get_server_info; None if neither answers. `strict`: /get_server_info
    only (30 s timeout), and an HTTP or connection error raises."""
    if strict:
        r = requests.get(base_url + "/get_server_info", timeout=30)
        r.raise_for_status()
        return r.json()
    return get_json(base_url, "/server_info") or get_json(base_url, "/get_server_info")


def vtoken_state(base_url: str, info: dict | None = None, strict: bool = False) -> dict | None:
    """The plugin's state `internal_states[0]["vtoken"]` of `info` (default: fetched with
    `server_info(base_url, strict)`); None when the server has no such entry."""
    info = server_info(base_url, strict) if info is None else info
    try:
        return info["internal_states"][0]["vtoken"]
    except (TypeError, KeyError, IndexError):
        return None


def wait_pool_free(base_url: str, timeout: float = 30.0) -> dict | None:
    """Poll until every KV slot is free or reclaimable again; return the last vtoken state."""
    deadline = time.monotonic() + timeout
    while True:
        st = vtoken_state(base_url, strict=True)
        if st is None or st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]:
            return st
        if time.monotonic() > deadline:
            return st
        time.sleep(0.5)


def loads(base_url: str) -> dict | None:
    """The first entry of /v1/loads (running, waiting requests, tokens in use); None if absent."""
    data = get_json(base_url, "/v1/loads")
    try:
        return data["loads"][0]
    except (TypeError, KeyError, IndexError):
        return None


def scrape_metrics(base_url: str) -> dict | None:
    """Sums of the counters in METRIC_COUNTERS over all label sets; None without /metrics."""
    try:
        r = requests.get(base_url + "/metrics", timeout=10)
    except requests.RequestException:
        return None
    if r.status_code != 200 or "sglang:" not in r.text:
        return None
    out = {name: 0.0 for name in METRIC_COUNTERS}
    for line in r.text.splitlines():
        if not line.startswith("sglang:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0][len("sglang:"):]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    # The retraction counter is created at the first retraction; its gauge exists from the start.
    out["retractions_exported"] = "sglang:num_retracted_reqs" in r.text
    return out


class Sampler(threading.Thread):
    """Polls /v1/loads and the vToken gauges every `interval` seconds until stopped."""

    def __init__(self, base_url: str, interval: float, t0: float, with_vtoken: bool):
        super().__init__(daemon=True)
        self.base_url, self.interval, self.t0, self.with_vtoken = base_url, interval, t0, with_vtoken
        self.samples: list[dict] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            s = {"t": round(time.monotonic() - self.t0, 3)}
            ld = loads(self.base_url)
            if ld is not None:
                s.update(running=ld.get("num_running_reqs"), waiting=ld.get("num_waiting_reqs"),
                         kv_used_tokens=ld.get("num_used_tokens"))
            if self.with_vtoken:
                st = vtoken_state(self.base_url)
                if st is not None:
                    s.update(retained_pages=st.get("retained_pages"), live_tokens=st.get("live_tokens"))
            self.samples.append(s)
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)
