"""A benchmark cell's server, shared by the server benchmarks (`python -m sgl_vtoken_tools chat`,
`agent`, `ladder`, `joint`): one CPU server per cell, started on a free 127.0.0.1 port and always
stopped, or a running server whose cells are per-request settings.

    resolve_model(name)          smollm2 (built into .cache/smollm2 when missing), tiny or a folder
    cell_spec(spec, remote)      a `--cells` entry: a cell name or ``name=flags`` of a launched
                                 server; ``name=JSON`` (per-request kv_evict) or a name on a
                                 running one
    launch(model, name, flags)   a started `ServerProcess` for a cell (flags None: stock SGLang
                                 without the plugin, checked either way)
    cell_server(...)             (base url, log path, per-request kv_evict) of a cell, launched or
                                 the running one
    served_model(url)            the model name a server answers to
    Plays(remote).play(url, log) one measured play: cache flushed, vToken state before and after,
                                 the log lines it wrote
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from sgl_vtoken_tools.bench.server_cells import CELLS, cell_flags

REPO = Path(__file__).resolve().parents[3]
# SGLang 0.5.23 aborts a streamed request's id 2 s after its stream ended if the id is in flight
# again (`create_abort_task`); a margin for a busy event loop on shared cores.
RID_REUSE_GAP_S = 5.0


def resolve_model(name: str) -> str:
    """smollm2 (built into .cache/smollm2), tiny (the random-weight tiny Llama, .cache/tiny-llama)
    or a Hugging Face folder."""
    if name == "tiny":
        from sgl_vtoken_tools.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model(REPO / ".cache" / "tiny-llama"))
    from sgl_vtoken_tools.models import MODELS, ensure_model

    if name in MODELS and not Path(name).exists():
        return str(ensure_model(name, REPO / ".cache" / name))
    return name


def cell_spec(
    spec: str, remote: bool, cells: dict[str, list[str] | None] = CELLS
) -> tuple[str, object]:
    """A `--cells` entry. Launched servers: a name of `cells` or ``name=flags`` (shell words); a
    running server (`remote`): ``name=JSON`` (per-request kv_evict) or a name (its own flags).
    A bad entry is a ValueError."""
    name, eq, value = spec.partition("=")
    if remote:
        return (name, json.loads(value)) if eq else (name, None)
    return cell_flags(spec, cells)


@contextmanager
def launch(
    model: str,
    name: str,
    flags: list[str] | None,
    pool: int,
    page_size: int = 1,
    server_args: list[str] | tuple[str, ...] = (),
    threads: int = 2,
):
    """Yields a started `ServerProcess` of cell `name`: the CPU flags on a `pool`-token KV pool,
    fp32, SGLang's cache report and a decode record every step, `server_args`, then the cell's
    `flags` (None: stock SGLang, the plugin left out through `baseline.baseline_env`);
    `OMP_NUM_THREADS` = `threads`. Raises RuntimeError when the plugin is loaded where it must
    not be, or missing where it must be. The server stops when the block ends."""
    from sgl_vtoken_tools.bench.baseline import baseline_env, plugin_in_server
    from sgl_vtoken_tools.launcher import ServerProcess, cpu_server_args

    base = cpu_server_args(model, pool, page_size) + [
        "--dtype",
        "float32",
        "--enable-cache-report",
        "--decode-log-interval",
        "1",
        *server_args,
    ]
    env = {"OMP_NUM_THREADS": str(threads)}
    with ExitStack() as stack:
        if flags is None:
            env.update(stack.enter_context(baseline_env()))
        server = stack.enter_context(ServerProcess(base + (flags or []), env=env))
        if plugin_in_server(server) != (flags is not None):
            raise RuntimeError(
                f"cell {name!r}: sgl-vtoken is {'' if flags is None else 'not '}loaded in its "
                "server (stock must run without it, every other cell with it)"
            )
        yield server


@contextmanager
def cell_server(
    model: str,
    name: str,
    flags,
    pool: int,
    page_size: int = 1,
    server_args: list[str] | tuple[str, ...] = (),
    threads: int = 2,
    base_url: str | None = None,
    server_log: str | None = None,
):
    """Yields ``(base url, log path or None, per-request kv_evict)`` of a cell: a server
    `launch`ed for it (kv_evict None: the server's flags), or with `base_url` that running server
    and its `server_log`, `flags` being the per-request object (`cell_spec` with `remote`)."""
    if base_url:
        yield base_url.rstrip("/"), server_log, flags
        return
    with launch(model, name, flags, pool, page_size, server_args, threads) as server:
        yield server.base_url, str(server.log_path), None


def served_model(url: str) -> str:
    """The model name the server at `url` answers to (its first `/v1/models` entry)."""
    from sgl_vtoken_tools.bench import probe

    served = (probe.get_json(url, "/v1/models") or {}).get("data") or [{}]
    return served[0].get("id", "default")


class Window:
    """What one play changed on a server: its vToken state `before` and `after` (None without
    the plugin) and the `log` text it wrote (None without a log file)."""

    def __init__(self, url: str, log_path: str | None):
        from sgl_vtoken_tools.bench import probe

        self.url, self.log_path = url, log_path
        self.start = Path(log_path).stat().st_size if log_path else 0
        self.before = probe.vtoken_state(url)
        self.after: dict | None = None
        self.log: str | None = None

    def end(self) -> None:
        from sgl_vtoken_tools.bench import probe
        from sgl_vtoken_tools.bench.server_log import read_from

        self.after = probe.vtoken_state(self.url)
        self.log = read_from(self.log_path, self.start) if self.log_path else None

    def evicted(self) -> int | None:
        """Tokens the server evicted during the play; None without the plugin."""
        if self.before is None or self.after is None:
            return None
        return self.after.get("evicted_tokens", 0) - self.before.get("evicted_tokens", 0)


class Plays:
    """Measured plays on cells' servers, one after another. On a running server (`remote`) every
    cell reuses the same request ids, so a play first waits out SGLang's abort window after the
    previous one, the first one too: a run just before this one may have sent the same ids."""

    def __init__(self, remote: bool):
        self.remote, self.ended = remote, time.monotonic()

    @contextmanager
    def play(self, url: str, log_path: str | None):
        """Yields the play's `Window`: the server's cache flushed, its state and log end noted;
        the state and the log text again when the block ends."""
        from sgl_vtoken_tools.bench import probe

        if self.remote:
            time.sleep(max(0.0, self.ended + RID_REUSE_GAP_S - time.monotonic()))
        probe.flush_cache(url)
        window = Window(url, log_path)
        yield window
        self.ended = time.monotonic()
        window.end()
