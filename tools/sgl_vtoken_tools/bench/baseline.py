"""The baseline of overhead A/B runs (`python -m sgl_vtoken_tools eviction --part overhead`): SGLang on CPU
*without* the sgl-vtoken plugin, and the process-level measurements both servers share.

- `baseline_plugin_whitelist`: `SGLANG_PLUGINS` that loads every other installed general plugin
  (or none), so the A/B differs by sgl-vtoken alone;
- `baseline_env`: both of the above as a server environment (the shim in a temporary folder);
- `SHIM_SOURCE`: a `sitecustomize.py`, put on the baseline's `PYTHONPATH`, that applies only the
  plugin's CPU fix (`rotary_embedding.base._is_cpu = True`) and prints one `SHIM_MARK` line per
  patched process (`shim_applications` counts them in the log);
- `plugin_in_server`: whether a server's scheduler runs the plugin;
- `group_cpu_seconds`, `thread_env`: server CPU time from /proc and its OpenMP thread count.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

PLUGIN_ENTRY_POINT = "sgl_vtoken"  # name in the sglang.srt.plugins entry-point group
SHIM_MARK = "[bench_eviction shim]"

# Written into a temporary directory put on PYTHONPATH of the baseline server only. Every Python
# process of the server (launcher, scheduler, detokenizer) runs it at start-up.
SHIM_SOURCE = (
    '''\
"""Written by sgl_vtoken_tools.bench.baseline: SGLang on CPU *without* the sgl-vtoken plugin.

Applies only the CPU fix of sgl-vtoken's patches/cpu.py: right after
sglang.srt.layers.rotary_embedding.base executes, set its `_is_cpu = True` so RoPE takes the
native torch path instead of importing vllm. Nothing else.
"""
import importlib.abc
import os
import sys

_TARGET = "sglang.srt.layers.rotary_embedding.base"


class _RopeCpuFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            module._is_cpu = True
            sys.stderr.write(f"%s {_TARGET}._is_cpu = True (pid {os.getpid()})\\n" )
            sys.stderr.flush()

        spec.loader.exec_module = exec_module  # a fresh loader instance per find_spec
        return spec


sys.meta_path.insert(0, _RopeCpuFinder())
'''
    % SHIM_MARK
)


def shim_applications(text: str) -> int:
    """Processes in which the baseline shim set `_is_cpu` (one stderr line each)."""
    return sum(line.startswith(SHIM_MARK) or f" {SHIM_MARK} " in line for line in text.splitlines())


def baseline_plugin_whitelist(mode: str) -> str:
    """`SGLANG_PLUGINS` for the baseline: every other installed general plugin ("others", so the
    A/B differs by sgl-vtoken alone), or none at all ("none": `__none__` matches no plugin)."""
    import importlib.metadata

    if mode == "none":
        return "__none__"
    names = sorted(
        {ep.name for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
        - {PLUGIN_ENTRY_POINT}
    )
    return ",".join(names) or "__none__"


@contextmanager
def baseline_env(mode: str = "others"):
    """Yields the environment of a server without sgl-vtoken: `SGLANG_PLUGINS` =
    `baseline_plugin_whitelist(mode)` and the shim's folder first on `PYTHONPATH` (the folder
    lives until the block ends)."""
    with tempfile.TemporaryDirectory(prefix="vtoken-baseline-shim-") as shim:
        (Path(shim) / "sitecustomize.py").write_text(SHIM_SOURCE)
        yield {
            "SGLANG_PLUGINS": baseline_plugin_whitelist(mode),
            "PYTHONPATH": os.pathsep.join(p for p in (shim, os.environ.get("PYTHONPATH", "")) if p),
        }


def plugin_in_server(server) -> bool:
    """Whether the server's scheduler runs the plugin (it adds "vtoken" to /get_server_info)."""
    import requests

    info = requests.get(server.base_url + "/get_server_info", timeout=30).json()
    return any("vtoken" in state for state in info.get("internal_states", []))


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of the live processes in process group `pgid` (a server's
    launcher, scheduler, detokenizer). Less exposed to other load than wall time, as long as no
    thread spin-waits (see `--server-threads`)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[
            stat.rfind(")") + 2 :
        ].split()  # state ppid pgrp session ... utime(11) stime(12)
        if int(rest[2]) == pgid:
            total += int(rest[11]) + int(rest[12])
    return total / tick


def thread_env(args) -> dict[str, str]:
    """Server environment for `--server-threads`: torch's intra-op threads (OpenMP)."""
    return {"OMP_NUM_THREADS": str(args.server_threads)} if args.server_threads else {}
