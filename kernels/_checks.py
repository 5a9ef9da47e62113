"""Argument checks and dispatch helpers shared by the public kernel functions.

Every error is a ValueError (or TypeError for a wrong Python type) that names the argument and
says what is allowed, so a caller can fix the call without reading the kernel.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch

IMPLS = ("triton", "torch")
INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Repacking copies raw bytes, so any of these storage dtypes works (SGLang stores fp8 KV as uint8).
COPY_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint8,
    torch.int8,
)


def names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def resolve_impl(impl: str | None, device: torch.device) -> str:
    """`impl=None` picks Triton for CUDA tensors and the torch reference otherwise."""
    if impl is None:
        return "triton" if device.type == "cuda" else "torch"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None (auto), got {impl!r}")
    return impl


def triton_module(name: str):
    """The Triton launcher module `sgl_vtoken.kernels.<name>`, imported on first use (so that
    importing the package needs only torch; TRITON_INTERPRET is read at that import)."""
    mod = _TRITON_MODULES.get(name)
    if mod is None:
        mod = _TRITON_MODULES[name] = importlib.import_module(f"{__package__}.{name}")
    return mod


_TRITON_MODULES: dict = {}


def interpreted(kernel, device: torch.device, module: str) -> bool:
    """Whether `kernel` (a Triton JIT function of `sgl_vtoken.kernels.<module>`) runs in the
    interpreter. CPU tensors need it: raises ValueError when they would reach a compiled kernel."""
    interp = type(kernel).__name__ == "InterpretedFunction"
    if device.type == "cpu" and not interp:
        raise ValueError(
            "impl='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before "
            f"sgl_vtoken.kernels.{module} is first imported, or use impl='torch'"
        )
    return interp


def check_tensor(t, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_dtype(t: torch.Tensor, name: str, allowed) -> None:
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
    t, name: str, device: torch.device, ref_name: str, numel: int | None = None
) -> None:
    check_tensor(t, name)
    check_ndim(t, name, 1, "[n]")
    check_dtype(t, name, INDEX_DTYPES)
    check_device(t, name, device, ref_name)
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} entries, expected {numel}")


def index_pair_ok(src, dst, device: torch.device) -> bool:
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


def as_layer_list(buffers, name: str) -> list[torch.Tensor]:
    """A sequence of per-layer [num_slots, H, D] tensors, or one stacked [L, num_slots, H, D] tensor."""
    if isinstance(buffers, torch.Tensor):
        if buffers.ndim != 4:
            raise ValueError(
                f"{name} as one tensor must be 4-D [num_layers, num_slots, H, D], got shape {tuple(buffers.shape)}"
            )
        return list(buffers.unbind(0))
    if not isinstance(buffers, Sequence) or isinstance(buffers, (str, bytes)):
        raise TypeError(
            f"{name} must be a list/tuple of per-layer tensors or a 4-D tensor, got {type(buffers).__name__}"
        )
    if len(buffers) == 0:
        raise ValueError(f"{name} is empty; pass one [num_slots, H, D] tensor per layer")
    return [check_tensor(b, f"{name}[{i}]") for i, b in enumerate(buffers)]


def check_layer_group(layers: list[torch.Tensor], name: str, allowed_dtypes) -> None:
    """All layers of one group (K or V) share shape, dtype, strides and device."""
    first = layers[0]
    check_ndim(first, f"{name}[0]", 3, "[num_slots, H, D]")
    check_dtype(first, f"{name}[0]", allowed_dtypes)
    check_inner_contiguous(first, f"{name}[0]")
    check_no_self_overlap(first, f"{name}[0]")
    for i, t in enumerate(layers[1:], start=1):
        for what, a, b in (
            ("shape", tuple(t.shape), tuple(first.shape)),
            ("dtype", t.dtype, first.dtype),
            ("strides", t.stride(), first.stride()),
            ("device", t.device, first.device),
        ):
            if a != b:
                raise ValueError(
                    f"{name}[{i}] has {what} {a} but {name}[0] has {b}; all layers must match"
                )


def check_disjoint_buffers(named: list[tuple[str, torch.Tensor]]) -> None:
    """No two buffers may share memory: the kernel writes them from different programs at once."""
    spans = []
    for name, t in named:
        if t.numel() == 0:
            continue
        lo = t.data_ptr()
        hi = lo + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
        spans.append((lo, hi, name, t))
    spans.sort(key=lambda x: x[0])
    active: list[
        tuple[int, str, torch.Tensor]
    ] = []  # buffers whose span reaches past the current start
    for lo, hi, name, t in spans:
        active = [a for a in active if a[0] > lo]
        for _, other_name, other in active:
            if _share_bytes(other, t):
                raise ValueError(
                    f"{other_name} and {name} overlap in memory; every K and V layer buffer must be distinct"
                )
        active.append((hi, name, t))


def _share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact for two views with one layout (e.g. K and V as interleaved halves of one tensor);
    otherwise conservatively True once their address spans overlap."""
    if a.shape != b.shape or a.stride() != b.stride() or a.element_size() != b.element_size():
        return True
    es = a.element_size()
    # byte offsets of a view's elements: sum(i_k * stride_k * es) + byte, nested (non-self-overlapping)
    dims = sorted(((s * es, n) for s, n in zip(a.stride(), a.shape) if n > 1), reverse=True) + [
        (1, es)
    ]
    return _in_difference_set(abs(b.data_ptr() - a.data_ptr()), dims)


def _in_difference_set(delta: int, dims: list[tuple[int, int]]) -> bool:
    # Is delta = sum(c_k * stride_k) with |c_k| < size_k?  With nested strides the lower dims span
    # less than one stride of the current dim, so only two coefficients are possible per level.
    if not dims:
        return delta == 0
    (stride, size), rest = dims[0], dims[1:]
    c = delta // stride
    return any(
        abs(cc) < size and _in_difference_set(delta - cc * stride, rest) for cc in (c, c + 1)
    )


def check_moves(src: torch.Tensor, dst: torch.Tensor, num_slots: int) -> None:
    """Check the in-place repack precondition (syncs with the device; for debug mode and tests).

    Requires 0 <= src, dst < num_slots, no slot written twice, and no move reading a slot that an
    EARLIER move in the list writes:  src[i] not in {dst[j] : j < i}.  A move may read a slot that
    a later move writes (that is the compaction pattern) and may have src == dst.
    """
    n = src.numel()
    if n == 0:
        return
    s, d = src.long(), dst.long()
    for name, t in (("src", s), ("dst", d)):
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= num_slots:
            raise ValueError(f"{name} holds slot ids in [{lo}, {hi}], outside [0, {num_slots})")
    if torch.unique(d).numel() != n:
        raise ValueError(
            "dst repeats a slot: each destination slot may be written by one move only"
        )
    writer = torch.full((num_slots,), n, dtype=torch.long, device=d.device)
    writer[d] = torch.arange(n, device=d.device)
    bad = writer[s] < torch.arange(n, device=s.device)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        j = int(writer[s[i]])
        raise ValueError(
            f"move {i} reads slot {int(s[i])}, which the earlier move {j} overwrites: in-place repack needs every "
            "move that reads a destination slot to come before the move that writes it (e.g. compaction in row order)"
        )
