"""Validated KV buffer sets, cached by identity: a pool's 2 x L layer buffers are checked once.

Checking 64 layer buffers (shapes, strides, disjointness) costs hundreds of microseconds, more
than moving a few hundred tokens, so `buffer_set()` caches the result by (id(k_buffers),
id(v_buffers)); a hit needs the same tensor objects, in order, with the same data_ptr() (weak
references: the cache keeps no memory alive). A tensor reshaped in place without a new data
pointer is not noticed; `check=True` re-validates. Pairwise disjointness (the Triton kernel's
precondition) is checked at a set's first Triton use and remembered. The layer checks
themselves (`as_layer_list`, `check_layer_group`, `check_disjoint_buffers`) live here too.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from . import _checks as C

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
# K or V of every layer: a [num_slots, H, D] tensor per layer, or one [L, num_slots, H, D] tensor.
KVBuffers = Sequence[torch.Tensor] | torch.Tensor
_MAX_ENTRIES = 16
_DATA_PTR = torch.Tensor.data_ptr
_IS = operator.is_
_CALL = getattr(operator, "call", lambda f: f())  # operator.call is Python >= 3.11


@dataclass(eq=False)
class KVBufferSet:
    """The validated K and V layer buffers of one pool (all layers of a group share layout).

    Attributes:
        k_ptrs, v_ptrs: data_ptr() of every K / V layer, in layer order.
        k_shape, v_shape: (num_slots, heads, head_dim) of every K / V layer.
        k_strides, v_strides: (slot, head, dim) strides in elements, shared by the layers.
        k_dtype, v_dtype, device: as the layers.
    """

    k_ptrs: tuple[int, ...]
    v_ptrs: tuple[int, ...]
    k_shape: tuple[int, int, int]
    v_shape: tuple[int, int, int]
    k_strides: tuple[int, int, int]
    v_strides: tuple[int, int, int]
    k_dtype: torch.dtype
    v_dtype: torch.dtype
    device: torch.device
    disjoint: bool = False  # pairwise disjointness verified (first Triton use)
    launch_cache: dict = field(
        default_factory=dict
    )  # per launch-config data of the Triton launcher

    @property
    def num_slots(self) -> int:
        return self.k_shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.k_ptrs)


@dataclass(eq=False)
class _Entry:
    k_refs: tuple  # weak references to the objects passed (layer tensors, or the one 4-D tensor)
    v_refs: tuple
    k_ptrs: tuple[int, ...]  # data_ptr() of those objects
    v_ptrs: tuple[int, ...]
    bufs: KVBufferSet


_cache: dict[tuple[int, int], _Entry] = {}


def buffer_set(
    k_buffers: KVBuffers, v_buffers: KVBuffers, *, revalidate: bool = False
) -> KVBufferSet:
    """The validated buffer set of (k_buffers, v_buffers), from the cache when they are unchanged.

    Args:
        k_buffers, v_buffers: a sequence of per-layer [num_slots, H, D] tensors or one stacked
            [L, num_slots, H, D] tensor each (see `repack_kv_`).
        revalidate: ignore the cache, validate fully and refresh the entry.
    Raises ValueError / TypeError naming the offending buffer.
    """
    key = (id(k_buffers), id(v_buffers))
    entry = None if revalidate else _cache.get(key)
    if (
        entry is not None
        and _same(k_buffers, entry.k_refs, entry.k_ptrs)
        and _same(v_buffers, entry.v_refs, entry.v_ptrs)
    ):
        return entry.bufs
    bufs = validate(k_buffers, v_buffers)
    if len(_cache) >= _MAX_ENTRIES:
        _purge()
    _cache[key] = _Entry(
        _refs(k_buffers), _refs(v_buffers), _ptrs(k_buffers), _ptrs(v_buffers), bufs
    )
    return bufs


def clear_buffer_cache() -> None:
    """Forget every cached buffer set (the next call validates again)."""
    _cache.clear()


def validate(k_buffers: KVBuffers, v_buffers: KVBuffers) -> KVBufferSet:
    """Full validation of a K/V layer-buffer pair (no cache)."""
    keys = as_layer_list(k_buffers, "k_buffers")
    values = as_layer_list(v_buffers, "v_buffers")
    if len(keys) != len(values):
        raise ValueError(f"k_buffers has {len(keys)} layers but v_buffers has {len(values)}")
    check_layer_group(keys, "k_buffers", COPY_DTYPES)
    check_layer_group(values, "v_buffers", COPY_DTYPES)
    k0, v0 = keys[0], values[0]
    C.check_device(v0, "v_buffers[0]", k0.device, "k_buffers[0]")
    if v0.shape[0] != k0.shape[0]:
        raise ValueError(f"v_buffers hold {v0.shape[0]} slots but k_buffers hold {k0.shape[0]}")
    return KVBufferSet(
        k_ptrs=tuple(t.data_ptr() for t in keys),
        v_ptrs=tuple(t.data_ptr() for t in values),
        k_shape=_triple(k0.shape),
        v_shape=_triple(v0.shape),
        k_strides=_triple(k0.stride()),
        v_strides=_triple(v0.stride()),
        k_dtype=k0.dtype,
        v_dtype=v0.dtype,
        device=k0.device,
    )


def _triple(dims: Sequence[int]) -> tuple[int, int, int]:
    """The sizes or strides of a 3-D layer (checked 3-D by `check_layer_group`)."""
    a, b, c = dims
    return a, b, c


def require_disjoint(bufs: KVBufferSet, k_buffers: KVBuffers, v_buffers: KVBuffers) -> None:
    """Check once per buffer set that no two layer buffers share memory (the Triton
    precondition); marks `bufs.disjoint`."""
    if bufs.disjoint:
        return
    keys = as_layer_list(k_buffers, "k_buffers")
    values = as_layer_list(v_buffers, "v_buffers")
    check_disjoint_buffers(
        [(f"k_buffers[{i}]", t) for i, t in enumerate(keys)]
        + [(f"v_buffers[{i}]", t) for i, t in enumerate(values)]
    )
    bufs.disjoint = True


def as_layer_list(buffers: KVBuffers, name: str) -> list[torch.Tensor]:
    """The layers of `buffers`: a sequence of per-layer [num_slots, H, D] tensors, or one stacked
    [L, num_slots, H, D] tensor (unbound, views)."""
    if isinstance(buffers, torch.Tensor):
        if buffers.ndim != 4:
            raise ValueError(
                f"{name} as one tensor must be 4-D [num_layers, num_slots, H, D], "
                f"got shape {tuple(buffers.shape)}"
            )
        return list(buffers.unbind(0))
    if not isinstance(buffers, Sequence) or isinstance(buffers, (str, bytes)):
        raise TypeError(
            f"{name} must be a list/tuple of per-layer tensors or a 4-D tensor, "
            f"got {type(buffers).__name__}"
        )
    if len(buffers) == 0:
        raise ValueError(f"{name} is empty; pass one [num_slots, H, D] tensor per layer")
    return [C.check_tensor(b, f"{name}[{i}]") for i, b in enumerate(buffers)]


def check_layer_group(
    layers: list[torch.Tensor], name: str, allowed_dtypes: Collection[torch.dtype]
) -> None:
    """All layers of one group (K or V) share shape, dtype, strides and device."""
    first = layers[0]
    C.check_ndim(first, f"{name}[0]", 3, "[num_slots, H, D]")
    C.check_dtype(first, f"{name}[0]", allowed_dtypes)
    C.check_inner_contiguous(first, f"{name}[0]")
    C.check_no_self_overlap(first, f"{name}[0]")
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
                    f"{other_name} and {name} overlap in memory; "
                    "every K and V layer buffer must be distinct"
                )
        active.append((hi, name, t))


def _share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact for two views with one layout (e.g. K and V as interleaved halves of one tensor);
    otherwise conservatively True once their address spans overlap."""
    if a.shape != b.shape or a.stride() != b.stride() or a.element_size() != b.element_size():
        return True
    es = a.element_size()
    # byte offsets of a view's elements: sum(i_k * stride_k * es) + byte, nested strides
    # (non-self-overlapping)
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


def _same(obj: KVBuffers, refs: tuple, ptrs: tuple) -> bool:
    if isinstance(obj, torch.Tensor):
        return len(refs) == 1 and refs[0]() is obj and obj.data_ptr() == ptrs[0]
    try:
        return (
            len(obj) == len(refs)
            and all(map(_IS, obj, map(_CALL, refs)))
            and tuple(map(_DATA_PTR, obj)) == ptrs
        )
    except TypeError:  # not a sequence of tensors: let validation name the problem
        return False


def _refs(obj: KVBuffers) -> tuple:
    return (weakref.ref(obj),) if isinstance(obj, torch.Tensor) else tuple(map(weakref.ref, obj))


def _ptrs(obj: KVBuffers) -> tuple[int, ...]:
    return (obj.data_ptr(),) if isinstance(obj, torch.Tensor) else tuple(map(_DATA_PTR, obj))


def _purge() -> None:
    """Drop entries whose tensors are gone, then the oldest ones, to stay under the bound."""
    for key in [k for k, e in _cache.items() if any(r() is None for r in e.k_refs + e.v_refs)]:
        del _cache[key]
    while len(_cache) >= _MAX_ENTRIES:
        del _cache[next(iter(_cache))]
