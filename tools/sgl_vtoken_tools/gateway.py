"""Start and stop SGLang's model gateway (`smg launch`, the `scale` extra) in front of running
servers (tests, benchmarks).

The gateway binds 127.0.0.1 on a free port, and so does its Prometheus listener (smg's default is
0.0.0.0:29000); its output goes to a log file; it is ready when `GET /workers` lists every worker
healthy and `GET /v1/models` names the served model; `stop()` kills its process group. No smg
import: the child runs `python -m smg launch`, and nothing in the runtime knows it exists.

    with GatewayProcess([a.base_url, b.base_url], policy="cache_aware") as gw:
        requests.post(gw.base_url + "/v1/chat/completions", json={"model": gw.model, ...})

Through the gateway the `model` field must name the servers' model (their `--served-model-name`,
by default the model path: `gw.model`); an unknown name is refused with 404 `model_not_found`.
The response header `x-smg-routed-worker-id` names the worker that served a request.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from sgl_vtoken_tools.launcher import ChildProcess, free_port

ROUTED_WORKER = "x-smg-routed-worker-id"  # response header: the URL of the worker that served it


class GatewayProcess(ChildProcess):
    """One `smg launch` over `worker_urls` with `policy`; `extra`: more smg flags."""

    def __init__(
        self,
        worker_urls: list[str],
        policy: str = "cache_aware",
        extra: tuple[str, ...] = (),
        startup_timeout: float = 60.0,
        log_path: str | Path | None = None,
    ):
        self.worker_urls = list(worker_urls)
        self.port, self.metrics_port = free_port(), free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable,
            "-m",
            "smg",
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(self.metrics_port),
            "--worker-urls",
            *self.worker_urls,
            "--policy",
            policy,
            "--log-level",
            "warn",
            *extra,
        ]
        self.policy = policy
        self.startup_timeout = startup_timeout
        self.log_path = (
            Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="smg-", suffix=".log")[1])
        )
        self.proc: subprocess.Popen | None = None
        self.model: str | None = None

    def start(self) -> GatewayProcess:
        self.spawn(self.args)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"smg exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            if self._ready():
                return self
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"smg not ready after {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def _ready(self) -> bool:
        try:
            workers = requests.get(self.base_url + "/workers", timeout=2).json().get("workers", [])
            healthy = {w["url"] for w in workers if w.get("is_healthy")}
            if not set(self.worker_urls) <= healthy:
                return False
            models = requests.get(self.base_url + "/v1/models", timeout=2).json().get("data") or []
        except (requests.RequestException, ValueError):
            return False
        self.model = models[0]["id"] if models else None
        return self.model is not None

    def stop(self) -> None:
        """Kill the gateway's process group (it holds no state worth draining)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.proc.wait(10)
