"""Forced page shortages: a server that refuses the pages the plugin asks for on behalf of
requests whose id starts with a chosen prefix, so tests and stress runs meet every shortage path
on purpose (the plugin's answers to a shortage: docs/design/step.md, "Page shortages").

Injected from outside the plugin. `server_env(prefix)` is the environment of such a server: a
`sitecustomize` on its PYTHONPATH calls `install()` in each of its processes, which patches,
as the plugin's modules are imported,

    patches/cache/pool.alloc          every page the plugin takes: None for a refused request
    patches/core/shortage.Shortages   `note`: a refused request's shortage tallied as
                                      ``forced:<path>``, apart from those real pressure meets

An id ``<prefix><kind>-...`` (`KINDS`) is refused pages of that kind only; any other id that
starts with the prefix, pages of every kind.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ENV_VAR = "VTOKEN_FORCED_SHORTAGE"
POOL = "sgl_vtoken.patches.cache.pool"
SHORTAGE = "sgl_vtoken.patches.core.shortage"
_SITE = "from sgl_vtoken_tools.forced_shortage import install\n\ninstall()\n"


def refused(rid: str, prefix: str, kind: str | None = None) -> bool:
    """Whether request `rid` is refused pages of `kind` (None: whether it is refused any)."""
    from sgl_vtoken.patches.core.shortage import KINDS  # not at start-up: no torch there

    if not rid.startswith(prefix):
        return False
    named = [k for k in KINDS if rid.startswith(f"{prefix}{k}-")]
    return kind is None or not named or named[0] == kind


def refusing_alloc(alloc: Callable, prefix: str) -> Callable:
    """`pool.alloc` that gives no pages to the requests `refused` them."""

    def forced_alloc(tree, n, req=None, kind="copies"):
        if req is not None and refused(str(req.rid), prefix, kind):
            return None
        return alloc(tree, n, req, kind)

    return forced_alloc


def tallying_note(note: Callable, prefix: str) -> Callable:
    """`Shortages.note` that tallies a refused request's shortage as ``forced:<path>``."""

    def forced_note(self, kind, rid, detail=None):
        note(self, kind, rid, detail)
        if refused(str(rid), prefix):
            path = f"{kind}:{detail}" if detail else kind
            self.met[path] -= 1
            if not self.met[path]:
                del self.met[path]
            self.met["forced:" + path] += 1

    return forced_note


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `patches[name](module)` right after module `name` is executed, before any module
    that imports it can read its names."""

    def __init__(self, patches: dict[str, Callable]):
        self.patches = patches

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        patch, run = self.patches.pop(name), spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _patch_pool(prefix: str, module) -> None:
    module.alloc = refusing_alloc(module.alloc, prefix)


def _patch_shortages(prefix: str, module) -> None:
    module.Shortages.note = tallying_note(module.Shortages.note, prefix)


def install() -> None:
    """Refuse pages in this process as `ENV_VAR` names (nothing when it is unset)."""
    prefix = os.environ.get(ENV_VAR)
    if not prefix:
        return
    patches = {
        POOL: lambda m: _patch_pool(prefix, m),
        SHORTAGE: lambda m: _patch_shortages(prefix, m),
    }
    for name in [n for n in patches if n in sys.modules]:
        patches.pop(name)(sys.modules[name])
    if patches:
        sys.meta_path.insert(0, _AfterImport(patches))


def server_env(prefix: str) -> dict[str, str]:
    """The environment entries of a server that refuses pages to requests of id `prefix...`:
    `ENV_VAR` and a PYTHONPATH whose `sitecustomize` calls `install`."""
    site = Path(tempfile.gettempdir()) / "sgl-vtoken-forced-shortage"
    site.mkdir(exist_ok=True)
    target = site / "sitecustomize.py"
    if not target.exists() or target.read_text() != _SITE:
        part = site / f".sitecustomize.{os.getpid()}"
        part.write_text(_SITE)
        part.replace(target)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {ENV_VAR: prefix, "PYTHONPATH": path}
