"""The launcher's relaunch on a port taken between choosing and binding it, against a stand-in
server: a script that logs what SGLang's HTTP server logs when it cannot bind (the event loop's
error, after which SGLang keeps running without answering) and otherwise answers /health."""

import asyncio
import socket
import sys

import pytest

from sgl_vtoken_tools import launcher
from sgl_vtoken_tools.launcher import _BIND_ERROR, ServerProcess

STAND_IN = r"""
import asyncio, http.server, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
try:
    srv = http.server.HTTPServer(("127.0.0.1", port), type("H", (http.server.BaseHTTPRequestHandler,), {
        "do_GET": lambda self: (self.send_response(200), self.end_headers()),
        "log_message": lambda self, *a: None}))
except OSError:
    async def bind():
        await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", port)
    try:
        asyncio.run(bind())
    except OSError as e:
        print(e, flush=True)
    time.sleep(3600)
srv.serve_forever()
"""


@pytest.fixture
def taken_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def stand_in(tmp_path, port: int, startup_timeout: float) -> ServerProcess:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    server = ServerProcess([], startup_timeout=startup_timeout)
    server.args = [sys.executable, str(script), "--port", "0"]
    server._set_port(port)
    return server


def test_the_event_loop_reports_a_taken_port_with_the_message_the_launcher_waits_for(taken_port):
    async def bind():
        await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", taken_port)

    with pytest.raises(OSError, match=_BIND_ERROR):
        asyncio.run(bind())


def test_a_server_whose_port_is_taken_before_it_binds_relaunches_on_another(tmp_path, taken_port):
    server = stand_in(tmp_path, taken_port, startup_timeout=60)
    with server:
        assert server.port != taken_port and server.healthy()
    assert server.proc.poll() is not None


def test_a_server_that_never_binds_stops_after_its_attempts(tmp_path, taken_port, monkeypatch):
    monkeypatch.setattr(launcher, "free_port", lambda: taken_port)  # every relaunch meets it too
    server = stand_in(tmp_path, taken_port, startup_timeout=8)
    with pytest.raises(TimeoutError, match="not healthy"):
        server.start(attempts=2)
    assert server.proc.poll() is not None
    assert server.log_text().count(_BIND_ERROR) == 1  # the log of the second launch
