"""Start and stop an SGLang server in a child process (tests, demo, benchmarks).

The server binds 127.0.0.1 on a free port, its output goes to a log file, readiness is a
`GET /health` that answers 200 (503 until warm-up is done), and `stop()` ends the whole process
group, so no scheduler or detokenizer outlives it. No sglang import here: the child runs
`python -m sglang.launch_server`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

# Variables of the parent that must not leak into a server: the launcher publishes its own
# settings, and servers never run Triton under the interpreter.
_SCRUBBED_ENV = ("VTOKEN_CONFIG", "TRITON_INTERPRET")


_BIND_ERROR = "error while attempting to bind on address"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_server_args(
    model_path: str | Path, max_total_tokens: int = 4096, page_size: int = 1
) -> list[str]:
    """The flags every CPU server needs: torch-native attention, a capped KV pool, and an idle
    scheduler that sleeps (a busy-polling idle server takes a core from the others)."""
    return [
        "--model-path",
        str(model_path),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--max-total-tokens",
        str(max_total_tokens),
        "--page-size",
        str(page_size),
        "--sleep-on-idle",
    ]


def evict_args(
    policy: str, budget, interval=None, sink=None, window=None, config=None
) -> list[str]:
    """The plugin's flags: `--kv-evict` `policy` and its budget, then those given of its sinks,
    window, interval and `--kv-evict-config` (a dict as JSON, a string as it is)."""
    flags = ["--kv-evict", policy, "--kv-budget", str(budget)]
    for flag, value in (
        ("--kv-sink", sink),
        ("--kv-window", window),
        ("--kv-evict-interval", interval),
    ):
        flags += [flag, str(value)] if value is not None else []
    if config is not None:
        flags += ["--kv-evict-config", config if isinstance(config, str) else json.dumps(config)]
    return flags


class ChildProcess:
    """A child process in its own session (`proc`), its output in the file `log_path`; a context
    manager around `start()` and `stop()`, which subclasses define."""

    proc: subprocess.Popen | None
    log_path: Path

    def spawn(self, args: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                args,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerProcess(ChildProcess):
    """One SGLang HTTP server. Use as a context manager, or call `start()` and `stop()`."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        startup_timeout: float = 240.0,
        log_path: str | Path | None = None,
        entry: tuple[str, ...] = ("-m", "sglang.launch_server"),
    ):
        """`entry`: how the interpreter runs the launcher (default SGLang's own; tests pass a
        script that runs it with forked children)."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, *entry, *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
        self.env.update(env or {})
        self.startup_timeout = startup_timeout
        self.log_path = (
            Path(log_path)
            if log_path
            else Path(tempfile.mkstemp(prefix="sglang-", suffix=".log")[1])
        )
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    def start(self, attempts: int = 3) -> ServerProcess:
        """Launch and wait for /health. The port is free when chosen, but another process (SGLang's
        own internal ports included) may take it before the HTTP server binds it; SGLang then
        logs the bind error and keeps running without answering: relaunch on a new port, up to
        `attempts` launches in all."""
        t0 = time.monotonic()
        for attempt in range(attempts):
            self.spawn(self.args, self.env)
            while time.monotonic() - t0 < self.startup_timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited with code {self.proc.returncode} during start-up:\n"
                        f"{self.log_tail()}"
                    )
                if self.healthy():
                    self.startup_seconds = time.monotonic() - t0
                    return self
                if _BIND_ERROR in self.log_text() and attempt + 1 < attempts:
                    self.stop()
                    self._set_port(free_port())
                    break
                time.sleep(0.5)
            else:
                break
        self.stop()
        raise TimeoutError(
            f"server not healthy after {self.startup_timeout:.0f} s:\n{self.log_tail()}"
        )

    def _set_port(self, port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.args[self.args.index("--port") + 1] = str(port)

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def stop(self, timeout: float = 20.0, kill: bool = False) -> None:
        """Terminate the server's process group; kill it if it does not exit in `timeout` s.
        `kill`: SIGKILL at once (a test server with nothing left to drain: SGLang's own shutdown
        takes about 5 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        steps = (
            ((signal.SIGKILL, 5.0),) if kill else ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0))
        )
        for sig, wait in steps:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # Children that left the group (none expected) would be orphans: reap the group for sure.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
