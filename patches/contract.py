"""The contract between sgl-vtoken and the pinned SGLang: version and hooked signatures.

A version bump that renames, moves or re-signs a hooked symbol must fail loudly here (and in
`tests/patches/test_contract.py`), not silently run stock SGLang.
"""

import inspect
import pkgutil
from importlib.metadata import version

from .plugin import HOOKS

SGLANG_VERSION = "0.5.23"

# Parameter names each hooked target must have, in order (self/cls included).
EXPECTED_PARAMS = {
    "sglang.srt.server_args.ServerArgs.add_cli_args": ("parser",),
    "sglang.srt.server_args.ServerArgs.from_cli_args": ("cls", "args"),
    "sglang.srt.managers.scheduler.Scheduler.__init__": ("self", "server_args", "port_args"),
}
# Module globals we set (module path, attribute).
EXPECTED_GLOBALS = (("sglang.srt.layers.rotary_embedding.base", "_is_cpu"),)


def _resolve_unwrapped(target: str):
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    raw = owner.__dict__.get(attr, getattr(owner, attr)) if isinstance(owner, type) else getattr(owner, attr)
    if isinstance(raw, (classmethod, staticmethod)):
        raw = raw.__func__
    return inspect.unwrap(raw)


def check_contract() -> list[str]:
    """Every mismatch between the installed SGLang and what the plugin hooks, as messages."""
    problems = []
    installed = version("sglang")
    if installed != SGLANG_VERSION:
        problems.append(f"sgl-vtoken needs sglang=={SGLANG_VERSION}, found {installed}")
    for target, _hook, _type in HOOKS:
        expected = EXPECTED_PARAMS.get(target)
        if expected is None:
            problems.append(f"{target}: hooked but has no expected signature in contract.py")
            continue
        try:
            fn = _resolve_unwrapped(target)
        except (ImportError, AttributeError) as e:
            problems.append(f"{target}: not found ({e})")
            continue
        params = tuple(inspect.signature(fn).parameters)
        if params[: len(expected)] != expected:
            problems.append(f"{target}: expected parameters {expected}, found {params}")
    for module, name in EXPECTED_GLOBALS:
        if not hasattr(pkgutil.resolve_name(module), name):
            problems.append(f"{module}.{name}: module global not found")
    return problems
