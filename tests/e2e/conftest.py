"""Servers for end-to-end tests: started once per test session per configuration, always stopped;
the tiny model's Hugging Face reference and KVP checkpoint, shared by every file."""

import pytest
import requests
import torch

from sgl_vtoken.launcher import ServerProcess, cpu_server_args


class Client:
    """Thin HTTP client bound to one server."""

    def __init__(self, server: ServerProcess):
        self.server = server
        self.base_url = server.base_url

    def post(self, path: str, payload: dict, timeout: float = 120.0) -> dict:
        r = requests.post(self.base_url + path, json=payload, timeout=timeout)
        assert r.status_code == 200, f"{path} -> {r.status_code}: {r.text[:500]}"
        return r.json()

    def get(self, path: str, timeout: float = 30.0) -> dict:
        r = requests.get(self.base_url + path, timeout=timeout)
        assert r.status_code == 200, f"{path} -> {r.status_code}: {r.text[:500]}"
        return r.json()

    def vtoken_state(self) -> dict:
        return self.get("/get_server_info")["internal_states"][0]["vtoken"]

    def generate_ids(self, input_ids: list[int], max_new_tokens: int, **sampling) -> dict:
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **sampling}
        return self.post("/generate", {"input_ids": input_ids, "sampling_params": params})


# SGLang's own memory checkers, on in every test server unless a test asks otherwise.
MEMORY_CHECKS = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
    "SGLANG_DEBUG_MEMORY_POOL": "1",
    "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
}
MAX_ALIVE = 2  # each CPU server takes ~3 GB: keep the most recently used ones only
# besides the stock servers (tiny model, no extra flags, default checks and pool), which test
# files far apart share: they stay up for the whole session (a start costs about a minute)


@pytest.fixture(scope="session")
def server_factory(tiny_model):
    """`server_factory(page_size=16, extra=(...), env={...}, pool=4096, model=None)` -> Client.

    One server per distinct configuration (model: the tiny model unless a path is given), started
    on first use; the least recently used one is stopped when more than `MAX_ALIVE` would run
    (stock servers not counted). All are stopped at the end of the session;
    `server_factory.stop(client)` stops one earlier.
    """
    started: dict[tuple, ServerProcess] = {}
    stock: dict[tuple, ServerProcess] = {}

    def get(page_size: int = 1, extra: tuple[str, ...] = (), env: dict | None = None,
            pool: int = 4096, model=None) -> Client:
        env = MEMORY_CHECKS if env is None else env
        model = tiny_model if model is None else model
        key = (str(model), page_size, tuple(extra), tuple(sorted(env.items())), pool)
        servers = stock if (model, tuple(extra), env, pool) == (tiny_model, (), MEMORY_CHECKS, 4096) else started
        if key in servers:
            servers[key] = servers.pop(key)  # most recently used last
        else:
            while servers is started and len(started) >= MAX_ALIVE:
                started.pop(next(iter(started))).stop()
            args = cpu_server_args(model, max_total_tokens=pool, page_size=page_size)
            args += ["--dtype", "float32", "--enable-cache-report", *extra]
            servers[key] = ServerProcess(args, env=env).start()
        return Client(servers[key])

    def stop(client: Client) -> None:
        for servers in (started, stock):
            for key, server in list(servers.items()):
                if server is client.server:
                    servers.pop(key).stop()

    get.stop = stop
    yield get
    for server in [*started.values(), *stock.values()]:
        server.stop()


@pytest.fixture(scope="session")
def hf_eager(tiny_model):
    """The tiny model in Hugging Face with eager attention (the masked reference reads its
    probabilities), loaded once per session."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def kvp_checkpoint(hf_eager, tmp_path_factory):
    """A KVP scorer trained in seconds on traces of the random-weight tiny model (exactness does
    not need a good scorer, only the same one on both sides)."""
    from sgl_vtoken.kvp import KVPScorer, save_checkpoint
    from sgl_vtoken.kvp_traces import collect
    from sgl_vtoken.kvp_train import train

    seqs = torch.randint(10, 2000, (4, 128), generator=torch.Generator().manual_seed(900))
    tr = collect(hf_eager, seqs, torch.tensor([48, 64, 80]), horizon=32, meta={})
    scorer = KVPScorer(tr.identity, hidden=16, seed=0)
    train(scorer, tr, steps=30, seed=0, batch=4)
    return str(save_checkpoint(scorer, tmp_path_factory.mktemp("kvp") / "kvp.safetensors"))
