"""Test-only SGLang launcher: SGLang's real `launch_server`, with its scheduler and detokenizer
forked from this process instead of spawned.

    python tests/servers/fork_launch.py <sglang.launch_server flags>

SGLang forces the `spawn` start method (`sglang/srt/entrypoints/engine.py`), so each child
imports SGLang, torch and the plugin again: 15-20 s per server on two cores. Forked children
inherit this process's imports (and the plugin's hooks, registered once here) and run the same
code. OpenMP is pinned to one thread before torch is imported, so no thread pool exists at fork
time. Product servers keep the spawn path; one test server configuration keeps it too.
"""

import os
import runpy
import sys

os.environ["OMP_NUM_THREADS"] = "1"

import multiprocessing as mp  # noqa: E402

_set_start_method = mp.set_start_method


def _fork(method=None, force=False):
    _set_start_method("fork", force=True)


mp.set_start_method = _fork

# What the scheduler and detokenizer processes import first, imported once here.
import sglang.srt.managers.detokenizer_manager  # noqa: E402,F401
import sglang.srt.managers.scheduler  # noqa: E402,F401
import sglang.srt.models.llama  # noqa: E402,F401

if os.environ.get("VTOKEN_TEST_GRAPH_STUB"):  # decode scoring as a CUDA graph runs it
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import graph_stub  # noqa: E402

    graph_stub.install(os.environ["VTOKEN_TEST_GRAPH_STUB"])

if __name__ == "__main__":
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
