"""Servers for end-to-end tests: started once per test session per configuration, always stopped;
the tiny model's Hugging Face reference. Shared by the plugin's end-to-end tests
(tests/runtime/e2e) and the benchmarks' (tests/tools/e2e), which use the same servers: a pytest
plugin of tests/conftest.py (`pytest_plugins`), so each fixture exists once per session, and a
module the tests import their constants and helpers from (`from servers import BENCH_FLAGS`).
Every session loads it, the GPU check's kernel tests too: it imports nothing at module level but
pytest, torch and `sgl_vtoken_tools.forced_shortage` (the standard library only)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from sgl_vtoken_tools import forced_shortage

if TYPE_CHECKING:
    from sgl_vtoken_tools.launcher import ServerProcess


class Client:
    """Thin HTTP client bound to one server."""

    def __init__(self, server: ServerProcess):
        self.server = server
        self.base_url = server.base_url

    def post(self, path: str, payload: dict, timeout: float = 120.0) -> dict:
        import requests

        r = requests.post(self.base_url + path, json=payload, timeout=timeout)
        assert r.status_code == 200, f"{path} -> {r.status_code}: {r.text[:500]}"
        return r.json()

    def get(self, path: str, timeout: float = 30.0) -> dict:
        import requests

        r = requests.get(self.base_url + path, timeout=timeout)
        assert r.status_code == 200, f"{path} -> {r.status_code}: {r.text[:500]}"
        return r.json()

    def openai(self):
        """An OpenAI client of the server's `/v1` API."""
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="none")

    def chat(self, messages: list[dict], max_tokens: int, kv_evict: dict | None = None, **more):
        """A greedy `/v1/chat/completions` of `messages` through the OpenAI client; `kv_evict`
        rides in ``extra_body`` as ``custom_params.kv_evict`` (None: none sent); `more` e.g.
        ``stream=True``."""
        if kv_evict is not None:
            more["extra_body"] = {"custom_params": {"kv_evict": kv_evict}}
        return self.openai().chat.completions.create(
            model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, **more
        )

    def vtoken_state(self) -> dict:
        return self.get("/get_server_info")["internal_states"][0]["vtoken"]

    def generate_ids(self, input_ids: list[int], max_new_tokens: int, **sampling) -> dict:
        params = {
            "temperature": 0.0,
            "max_new_tokens": max_new_tokens,
            "ignore_eos": True,
            **sampling,
        }
        return self.post("/generate", {"input_ids": input_ids, "sampling_params": params})


def wait_pool_free(client: Client, timeout: float = 30.0) -> dict:
    """Poll until every KV slot is free or reclaimable again; return the last state."""
    deadline = time.monotonic() + timeout
    while True:
        st = client.vtoken_state()
        if st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]:
            return st
        if time.monotonic() > deadline:
            return st
        time.sleep(0.5)


def evict_flags(
    policy: str,
    budget: int,
    *,
    sink: int | None = None,
    interval: int | None = None,
    config: dict | None = None,
) -> tuple[str, ...]:
    """A server's eviction flags: `--kv-evict` and `--kv-budget`, then `--kv-sink`,
    `--kv-evict-interval` and `--kv-evict-config` (as JSON) where given, always in this order (the
    flags are part of a server's configuration: the same settings name the same server)."""
    flags = ("--kv-evict", policy, "--kv-budget", str(budget))
    if sink is not None:
        flags += ("--kv-sink", str(sink))
    if interval is not None:
        flags += ("--kv-evict-interval", str(interval))
    if config is not None:
        flags += ("--kv-evict-config", json.dumps(config))
    return flags


def kept_floor(policy: str, budget: int) -> int:
    """The fewest tokens an eviction of `policy` keeps at `budget`: the budget, less up to
    ``span - 1`` where the policy keeps words whole (span 8, the attention policies' default)."""
    from sgl_vtoken.config import EvictConfig

    return budget - max(EvictConfig(policy=policy, budget=budget).span - 1, 0)


def shortages_met(before: dict, after: dict) -> dict:
    """The page shortages met between two `vtoken_state()` readings, by path (patches/core/shortage.py)."""
    b = before.get("shortages") or {}
    return {
        k: n - b.get(k, 0) for k, n in (after.get("shortages") or {}).items() if n - b.get(k, 0)
    }


# Requests whose id starts with SHORTAGE get no page the plugin asks for
# (sgl_vtoken_tools/forced_shortage.py).
SHORTAGE = "shortage-"
# SGLang's own memory checkers, on in every test server unless a test asks otherwise; and the
# page refusal for SHORTAGE requests.
MEMORY_CHECKS = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
    "SGLANG_DEBUG_MEMORY_POOL": "1",
    "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
    **forced_shortage.server_env(SHORTAGE),
}
# The StreamingLLM server of the bench tests, the capacity tests and the gateway's replica a
# (budget 64 unless a request asks for another, interval 16, page size 16): one configuration,
# started once.
BENCH_FLAGS = (
    "--kv-evict",
    "streamingllm",
    "--kv-budget",
    "64",
    "--kv-evict-interval",
    "16",
    "--enable-metrics",
    "--decode-log-interval",
    "1",
)
# What a server's environment holds unless a test asks otherwise (the start-up summary prints
# the rest: two starts with the same flags differ there).
DEFAULT_ENV = {**MEMORY_CHECKS, "OMP_NUM_THREADS": "1"}
MAX_ALIVE = (
    2  # servers one test process keeps (each takes ~3 GB on CPU); the least recently used goes
)
# Test servers fork SGLang's scheduler and detokenizer from the launcher
# (tests/servers/fork_launch.py, ~15 s less per start). The stock page-1 server (no flags: what a
# user gets from a plain `launch_server` with the plugin installed) runs SGLang's own spawn path,
# as in production.
FORK_ENTRY = (str(Path(__file__).with_name("fork_launch.py")),)
SPAWN_ENTRY = ("-m", "sglang.launch_server")


@pytest.fixture(scope="session")
def server_factory(tiny_model, startup_log):
    """`server_factory(page_size=16, extra=(...), env={...}, pool=4096, model=None, spawn=False)` -> Client.

    One server per distinct configuration (model: the tiny model unless a path is given), started
    on first use with one OpenMP thread (two test processes and their servers share two cores);
    the least recently used one is stopped when more than `MAX_ALIVE` would run. All are stopped
    at the end of the session; `server_factory.stop(client)` stops one earlier. A stop kills the
    process group at once (no test reads a server after it stops; SGLang's own shutdown takes
    ~5 s). `spawn=True` (and the stock page-1 configuration) starts it through `python -m
    sglang.launch_server` itself (children spawned, as in production) instead of the forking
    test launcher. Each start's seconds go to `startup_log`.
    """
    from sgl_vtoken_tools.launcher import ServerProcess, cpu_server_args

    started: dict[tuple, ServerProcess] = {}

    def get(
        page_size: int = 1,
        extra: tuple[str, ...] = (),
        env: dict | None = None,
        pool: int = 4096,
        model=None,
        spawn: bool = False,
    ) -> Client:
        spawn = spawn or (
            page_size == 1 and not extra and env is None and pool == 4096 and model is None
        )
        env = {**(MEMORY_CHECKS if env is None else env), "OMP_NUM_THREADS": "1"}
        model = tiny_model if model is None else model
        key = (str(model), page_size, tuple(extra), tuple(sorted(env.items())), pool, spawn)
        if key in started:
            started[key] = started.pop(key)  # most recently used last
        else:
            while len(started) >= MAX_ALIVE:
                started.pop(next(iter(started))).stop(kill=True)
            args = cpu_server_args(model, max_total_tokens=pool, page_size=page_size)
            args += ["--dtype", "float32", "--enable-cache-report", *extra]
            server = ServerProcess(
                args, env=env, entry=SPAWN_ENTRY if spawn else FORK_ENTRY
            ).start()
            beyond = {k: v for k, v in env.items() if DEFAULT_ENV.get(k) != v}
            beyond |= {f"-{k}": "" for k in DEFAULT_ENV if k not in env}  # checks turned off
            startup_log(server, Path(model).name, page_size, extra, spawn, pool=pool, env=beyond)
            started[key] = server
        return Client(started[key])

    def stop(client: Client) -> None:
        for key, server in list(started.items()):
            if server is client.server:
                started.pop(key).stop(kill=True)

    get.stop = stop
    yield get
    for server in started.values():
        server.stop(kill=True)


def own_server(server_factory, page_size: int, extra: tuple[str, ...], pool: int, model):
    """For a module's own server fixture (`yield from own_server(...)`), a configuration no other
    module starts: a server of `model` (SGLang's checkers on, one OpenMP thread), stopped at the
    fixture's teardown."""
    client = server_factory(
        page_size=page_size, extra=extra, env=DEFAULT_ENV, pool=pool, model=model
    )
    yield client
    server_factory.stop(client)


def eager_model(path):
    """The model at `path` in Hugging Face, fp32, with eager attention (the masked reference reads
    its attention probabilities)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="session")
def hf_eager(tiny_model):
    """The tiny model in Hugging Face with eager attention, loaded once per session."""
    return eager_model(tiny_model)
