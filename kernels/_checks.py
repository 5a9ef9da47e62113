"""Argument checks and dispatch helpers shared by the three public kernel functions.

Every error is a ValueError (or TypeError for a wrong Python type) that names the argument and
says what is allowed, so a caller can fix the call without reading the kernel.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Iterable
from types import ModuleType

import torch

IMPLS = ("triton", "torch")
INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def resolve_impl(impl: str | None, device: torch.device) -> str:
    """`impl=None` picks Triton for CUDA tensors and the torch reference otherwise."""
    if impl is None:
        return "triton" if device.type == "cuda" else "torch"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None (auto), got {impl!r}")
    return impl


def triton_module(name: str) -> ModuleType:
    """The Triton launcher module `sgl_vtoken.kernels.<name>`, imported on first use (so that
    importing the package needs only torch; TRITON_INTERPRET is read at that import)."""
    mod = _TRITON_MODULES.get(name)
    if mod is None:
        mod = _TRITON_MODULES[name] = importlib.import_module(f"{__package__}.{name}")
    return mod


_TRITON_MODULES: dict[str, ModuleType] = {}


def interpreted(kernel: object, device: torch.device, module: str) -> bool:
    """Whether `kernel` (a Triton JIT function of `sgl_vtoken.kernels.<module>`) runs in the
    interpreter. CPU tensors need it: raises ValueError when they would reach a compiled kernel."""
    interp = type(kernel).__name__ == "InterpretedFunction"
    if device.type == "cpu" and not interp:
        raise ValueError(
            "impl='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            f"before sgl_vtoken.kernels.{module} is first imported, or use impl='torch'"
        )
    return interp


def check_tensor(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_dtype(t: torch.Tensor, name: str, allowed: Collection[torch.dtype]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name} has dtype {t.dtype}; allowed: {names(allowed)}")


def check_ndim(t: torch.Tensor, name: str, ndim: int, shape_doc: str) -> None:
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {shape_doc}, got shape {tuple(t.shape)}")


def check_device(t: torch.Tensor, name: str, device: torch.device, ref_name: str) -> None:
    if t.device != device:
        raise ValueError(
            f"{name} is on {t.device} but {ref_name} is on {device}; put them on one device"
        )


def check_index_vector(
    t: torch.Tensor, name: str, device: torch.device, ref_name: str, numel: int | None = None
) -> None:
    check_tensor(t, name)
    check_ndim(t, name, 1, "[n]")
    check_dtype(t, name, INDEX_DTYPES)
    check_device(t, name, device, ref_name)
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} entries, expected {numel}")


def index_pair_ok(src: object, dst: object, device: torch.device) -> bool:
    """Fast path of the move-list checks (attributes only, no sync): both are fine 1-D index
    vectors of one length on `device`. When False, the detailed checks name the problem."""
    return (
        isinstance(src, torch.Tensor)
        and isinstance(dst, torch.Tensor)
        and src.ndim == 1
        and dst.ndim == 1
        and src.dtype in INDEX_DTYPES
        and dst.dtype in INDEX_DTYPES
        and src.device == device
        and dst.device == device
        and src.shape == dst.shape
    )


def check_inner_contiguous(t: torch.Tensor, name: str) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}"
        )


def check_no_self_overlap(t: torch.Tensor, name: str) -> None:
    """Distinct indices must address distinct elements (no stride-0 or interleaved dims)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1)
    extent = 1
    for stride, size in dims:
        if stride < extent:
            raise ValueError(
                f"{name} has overlapping strides {t.stride()} for shape {tuple(t.shape)}: "
                "distinct elements must not share memory"
            )
        extent = stride * (size - 1) + extent
