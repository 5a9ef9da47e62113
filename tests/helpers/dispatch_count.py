"""What a piece of runtime code asks of the device, counted on CPU tensors.

On a CPU, device tensors and host tensors are the same kind of tensor, and a device-to-host
copy costs nothing. `DeviceCounter` tells them apart by provenance: the tensors `mark` names
(the pool's K/V buffers, the slot table, what the allocator hands out) are the device's, and so
is everything computed from them, everything made with an explicit ``device=`` and everything
moved with ``.to(device)`` (a host copy is spelled ``.cpu()``, ``.tolist()`` or a ``copy_`` into a
host tensor). While it counts (a `TorchFunctionMode` and a `TorchDispatchMode`):

    syncs       reading a device value on the host: ``.item()``, ``.tolist()``, ``int()``,
                ``bool()``, ``float()``, ``.cpu()``, ``.numpy()``, a blocking ``copy_`` to the
                host, and ops whose output size depends on device values (``nonzero``,
                boolean-mask indexing, ``unique``, ``masked_select``, ``repeat_interleave``
                without ``output_size``); each with the runtime line that asked for it
    launches    device ops that are not views (one kernel each on a GPU)
    allocs      bytes of every new device tensor (outputs that alias no input)
    h2d, d2h    host-to-device moves; asynchronous device-to-host copies
    calls       the kernels wrapped by `count_calls` (counted once, their insides not)

Code that stands in for SGLang (`fake_pool`) runs inside `quiet()`, uncounted.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from contextlib import contextmanager, nullcontext

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_ACTIVE: DeviceCounter | None = None
_RUNTIME = ("sgl_vtoken/", "patches/", "kernels/", "sglang/")
_HOST_READS = {
    "tolist",
    "cpu",
    "numpy",
    "__array__",
}  # no dispatch on CPU; `.item()`, `int()`, ... do
_FACTORIES = {
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "tensor",
    "rand",
    "randn",
    "randint",
    "randperm",
    "linspace",
    "as_tensor",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
}
_INDEXING = ("aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default")
_READS = {
    "aten._local_scalar_dense.default": "item",
    "aten.equal.default": "equal",
    "aten.is_nonzero.default": "bool",
    "aten.nonzero.default": "nonzero",
    "aten._unique2.default": "unique",
    "aten.unique_dim.default": "unique",
    "aten.unique_consecutive.default": "unique",
    "aten.masked_select.default": "masked_select",
}


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class DeviceCounter:
    """Counts of one run (see the module docstring); use `with counter:` around the code."""

    def __init__(self) -> None:
        self._dev: dict[int, weakref.ref] = {}
        self._quiet = 0
        self._device_call = 0
        self.syncs: list[tuple[str, str]] = []
        self.allocs: list[int] = []
        self.launches = self.h2d = self.d2h = 0
        self.calls: Counter = Counter()

    # --- provenance ---------------------------------------------------------------------------
    def mark(self, *tensors):
        """The device's tensors from now on; returns the first."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and not self.is_device(t):
                key = id(t)
                self._dev[key] = weakref.ref(t, lambda _, key=key: self._dev.pop(key, None))
        return tensors[0] if tensors else None

    def is_device(self, t) -> bool:
        ref = self._dev.get(id(t))
        return ref is not None and ref() is t

    def _any_device(self, tree) -> bool:
        return any(self.is_device(t) for t in _tensors(tree))

    # --- results ------------------------------------------------------------------------------
    def summary(self) -> dict:
        return dict(
            host_syncs=len(self.syncs),
            launches=self.launches,
            allocs=len(self.allocs),
            alloc_bytes=sum(self.allocs),
            max_alloc_bytes=max(self.allocs, default=0),
            h2d=self.h2d,
            d2h_async=self.d2h,
            calls=dict(self.calls),
            sync_sites=dict(Counter(f"{kind} {site}" for kind, site in self.syncs)),
        )

    def _sync(self, kind: str) -> None:
        self.syncs.append((kind, _site()))

    # --- modes --------------------------------------------------------------------------------
    def __enter__(self) -> DeviceCounter:
        global _ACTIVE
        assert _ACTIVE is None, "counters do not nest"
        _ACTIVE = self
        self._modes = (_Functions(self), _Dispatch(self))
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        for m in reversed(self._modes):
            m.__exit__(*exc)
        _ACTIVE = None


class _Functions(TorchFunctionMode):
    def __init__(self, c: DeviceCounter):
        super().__init__()
        self.c = c

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        if c._quiet:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        on_device = c._any_device((args, kwargs))
        moved = name in ("to", "cuda") and (
            any(isinstance(a, (torch.device, str)) for a in args[1:])
            or "device" in kwargs
            or any(isinstance(a, torch.Tensor) and c.is_device(a) for a in args[1:])
        )
        made = name in _FACTORIES and kwargs.get("device") is not None
        if on_device and name in _HOST_READS:
            c._sync(name)
        if moved and not on_device:
            c.h2d += 1
        c._device_call += on_device or moved or made
        try:
            out = func(*args, **kwargs)
        finally:
            c._device_call -= on_device or moved or made
        if out is (args[0] if args else None) and (moved or name == "cpu"):
            c._quiet += (
                1  # a no-op move on CPU returns its input: give the other side its own tensor
            )
            try:
                with torch._C.DisableTorchFunction():
                    out = out.view_as(out)
            finally:
                c._quiet -= 1
        if moved or made:
            c.mark(*_tensors(out))
        return out


class _Dispatch(TorchDispatchMode):
    def __init__(self, c: DeviceCounter):
        super().__init__()
        self.c = c

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        out = func(*args, **kwargs)
        if c._quiet:
            return out
        inputs = _tensors((args, kwargs))
        key = str(func)
        if key == "aten.copy_.default" and c.is_device(args[1]) and not c.is_device(args[0]):
            if kwargs.get("non_blocking", args[2] if len(args) > 2 else False):
                c.d2h += 1
            else:
                c._sync("copy_ to host")
            return out
        if not (c._device_call or any(c.is_device(t) for t in inputs)):
            return out
        if key in _READS:
            c._sync(_READS[key])
            if key == "aten._local_scalar_dense.default":
                return out
        elif key in _INDEXING and any(t is not None and t.dtype == torch.bool for t in args[1]):
            c._sync("boolean mask")
        elif key == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None:
            c._sync("repeat_interleave")
        outs = _tensors(out)
        if not func.is_view:
            c.launches += 1
            ptrs = {t.untyped_storage().data_ptr() for t in inputs}
            c.allocs += [
                t.untyped_storage().nbytes()
                for t in outs
                if t.untyped_storage().data_ptr() not in ptrs
            ]
        c.mark(*outs)
        return out


def _site() -> str:
    """``file:line`` of the innermost runtime frame (project or SGLang) that asked."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename.replace("\\", "/")
        hit = next((p for p in _RUNTIME if f"/{p}" in path), None)
        if hit and "/tests/helpers/" not in path and "/torch/" not in path:
            return path[path.index(f"/{hit}") + 1 :] + f":{f.f_lineno}"
        f = f.f_back
    return "?"


def quiet():
    """Uncounted while in it (the stand-ins for SGLang's own objects); a no-op when nothing counts."""
    c = _ACTIVE
    if c is None:
        return nullcontext()
    return _Quiet(c)


class _Quiet:
    def __init__(self, c: DeviceCounter):
        self.c = c

    def __enter__(self):
        self.c._quiet += 1

    def __exit__(self, *exc):
        self.c._quiet -= 1


def mark(*tensors):
    """`DeviceCounter.mark` on the active counter (identity when nothing counts); returns the first."""
    return _ACTIVE.mark(*tensors) if _ACTIVE is not None else (tensors[0] if tensors else None)


@contextmanager
def count_calls(module, *names: str):
    """Count calls of `module.<name>` (a kernel entry point as the module imported it) as one
    each, its insides uncounted; restored on exit."""
    real = {n: getattr(module, n) for n in names}

    def wrap(n):
        def counted(*args, **kwargs):
            c = _ACTIVE
            if c is None or c._quiet:
                return real[n](*args, **kwargs)
            c.calls[n] += 1
            c.launches += 1
            with quiet():
                return real[n](*args, **kwargs)

        return counted

    for n in names:
        setattr(module, n, wrap(n))
    try:
        yield
    finally:
        for n, f in real.items():
            setattr(module, n, f)
