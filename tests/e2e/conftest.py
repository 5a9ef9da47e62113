"""Servers for end-to-end tests: started once per test session per configuration, always stopped."""

import pytest
import requests

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

    def generate_ids(self, input_ids: list[int], max_new_tokens: int, **sampling) -> dict:
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **sampling}
        return self.post("/generate", {"input_ids": input_ids, "sampling_params": params})


@pytest.fixture(scope="session")
def server_factory(tiny_model):
    """`server_factory(page_size=16, extra=(...))` -> Client; one server per distinct configuration."""
    started: dict[tuple, ServerProcess] = {}

    def get(page_size: int = 1, extra: tuple[str, ...] = ()) -> Client:
        key = (page_size, tuple(extra))
        if key not in started:
            args = cpu_server_args(tiny_model, max_total_tokens=4096, page_size=page_size)
            args += ["--dtype", "float32", "--enable-cache-report", *extra]
            started[key] = ServerProcess(args).start()
        return Client(started[key])

    yield get
    for server in started.values():
        server.stop()
