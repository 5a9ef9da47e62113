"""Reading a running SGLang server from the outside over HTTP (all GET on its base URL):

- `/server_info` (`/get_server_info` on older servers): `internal_states[0]["vtoken"]`, the
  sgl-vtoken plugin's counters and gauges (absent on servers without the plugin);
- `/v1/loads`: running and waiting requests, KV tokens in use;
- `/metrics` (servers started with `--enable-metrics`): the Prometheus counters `sglang:*`.

`Sampler` polls the first two in a background thread while a benchmark runs.
"""

from __future__ import annotations

import threading
import time

import requests

METRIC_COUNTERS = (
    "num_requests_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "cached_tokens_total",
    "num_retracted_requests_total",
    "num_aborted_requests_total",
    "scheduler_process_cpu_seconds_total",
)


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


def pool_whole(state: dict) -> bool:
    """Every KV slot of the pool is free or reclaimable from the radix cache (no slot leaked)."""
    return (
        state["pool_available_tokens"] + state["pool_evictable_tokens"]
        == state["pool_total_tokens"]
    )


def wait_pool_free(base_url: str, timeout: float = 30.0) -> dict | None:
    """Poll until `pool_whole` holds; return the last vtoken state (None without the plugin)."""
    deadline = time.monotonic() + timeout
    while True:
        st = vtoken_state(base_url, strict=True)
        if st is None or pool_whole(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.5)


def flush_cache(base_url: str, timeout: float = 60.0) -> None:
    """Empty the server's radix cache. SGLang answers 400 while requests are still in flight (a
    stream the client finished may not have left the scheduler yet): retry until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if requests.post(base_url + "/flush_cache", timeout=10).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{base_url}: /flush_cache refused for {timeout:.0f} s (requests still running?)"
            )
        time.sleep(0.5)


def loads(base_url: str) -> dict | None:
    """The first entry of /v1/loads (running, waiting requests, tokens in use); None if absent."""
    data = get_json(base_url, "/v1/loads")
    try:
        return data["loads"][0]
    except (TypeError, KeyError, IndexError):
        return None


def parse_metrics(text: str) -> dict | None:
    """Sums of the counters in METRIC_COUNTERS over all label sets of a Prometheus text page, and
    `retractions_exported` (SGLang creates the retraction counter at the first retraction; its
    gauge `num_retracted_reqs` exists from the start). None if the page has no `sglang:` series."""
    if "sglang:" not in text:
        return None
    out = {name: 0.0 for name in METRIC_COUNTERS}
    for line in text.splitlines():
        if not line.startswith("sglang:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0][len("sglang:") :]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    out["retractions_exported"] = "sglang:num_retracted_reqs" in text
    return out


def scrape_metrics(base_url: str) -> dict | None:
    """`parse_metrics` of the server's /metrics; None without /metrics."""
    try:
        r = requests.get(base_url + "/metrics", timeout=10)
    except requests.RequestException:
        return None
    return parse_metrics(r.text) if r.status_code == 200 else None


class Sampler(threading.Thread):
    """Polls /v1/loads (and the vToken gauges when `with_vtoken`) every `interval` seconds until
    stopped; `samples` holds one dict per poll, `t` in seconds after `t0` (a monotonic time)."""

    def __init__(self, base_url: str, interval: float, t0: float, with_vtoken: bool):
        super().__init__(daemon=True)
        self.base_url, self.interval, self.t0, self.with_vtoken = (
            base_url,
            interval,
            t0,
            with_vtoken,
        )
        self.samples: list[dict] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            s = {"t": round(time.monotonic() - self.t0, 3)}
            ld = loads(self.base_url)
            if ld is not None:
                s.update(
                    running=ld.get("num_running_reqs"),
                    waiting=ld.get("num_waiting_reqs"),
                    kv_used_tokens=ld.get("num_used_tokens"),
                )
            if self.with_vtoken:
                st = vtoken_state(self.base_url)
                if st is not None:
                    s.update(
                        retained_pages=st.get("retained_pages"), live_tokens=st.get("live_tokens")
                    )
            self.samples.append(s)
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)
