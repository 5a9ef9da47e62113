"""Validated KV buffer sets, cached by identity: a pool's 2 x L layer buffers are checked once.

`repack_kv_` is called with the same pool at every eviction (SGLang's `k_buffer` / `v_buffer`
lists). Checking 64 buffers (shapes, strides, pairwise disjointness) costs hundreds of
microseconds of Python, far more than moving a few hundred tokens, so the result is cached:

    key    (id(k_buffers), id(v_buffers))            the containers as passed (lists or 4-D tensors)
    hit    the same tensor objects, in order, with the same data_ptr() each (a few us for 64)
    miss   full validation, then a new entry (weak references: the cache keeps no memory alive)

A tensor changed in place in shape or strides without a new data pointer (`as_strided_`,
shrinking `resize_`) is not noticed; `check=True` re-validates from scratch and refreshes the
entry. Pairwise disjointness (needed only by the Triton kernel, which writes buffers from
concurrent programs) is checked at the first Triton use of the set and remembered.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field

import torch

from . import _checks as C

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


def buffer_set(k_buffers, v_buffers, *, revalidate: bool = False) -> KVBufferSet:
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


def validate(k_buffers, v_buffers) -> KVBufferSet:
    """Full validation of a K/V layer-buffer pair (no cache)."""
    keys = C.as_layer_list(k_buffers, "k_buffers")
    values = C.as_layer_list(v_buffers, "v_buffers")
    if len(keys) != len(values):
        raise ValueError(f"k_buffers has {len(keys)} layers but v_buffers has {len(values)}")
    C.check_layer_group(keys, "k_buffers", C.COPY_DTYPES)
    C.check_layer_group(values, "v_buffers", C.COPY_DTYPES)
    k0, v0 = keys[0], values[0]
    C.check_device(v0, "v_buffers[0]", k0.device, "k_buffers[0]")
    if v0.shape[0] != k0.shape[0]:
        raise ValueError(f"v_buffers hold {v0.shape[0]} slots but k_buffers hold {k0.shape[0]}")
    return KVBufferSet(
        k_ptrs=tuple(t.data_ptr() for t in keys),
        v_ptrs=tuple(t.data_ptr() for t in values),
        k_shape=tuple(k0.shape),
        v_shape=tuple(v0.shape),
        k_strides=tuple(k0.stride()),
        v_strides=tuple(v0.stride()),
        k_dtype=k0.dtype,
        v_dtype=v0.dtype,
        device=k0.device,
    )


def require_disjoint(bufs: KVBufferSet, k_buffers, v_buffers) -> None:
    """Check once per buffer set that no two layer buffers share memory (the Triton precondition)."""
    if bufs.disjoint:
        return
    keys = C.as_layer_list(k_buffers, "k_buffers")
    values = C.as_layer_list(v_buffers, "v_buffers")
    C.check_disjoint_buffers(
        [(f"k_buffers[{i}]", t) for i, t in enumerate(keys)]
        + [(f"v_buffers[{i}]", t) for i, t in enumerate(values)]
    )
    bufs.disjoint = True


def _same(obj, refs: tuple, ptrs: tuple) -> bool:
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


def _refs(obj) -> tuple:
    return (weakref.ref(obj),) if isinstance(obj, torch.Tensor) else tuple(map(weakref.ref, obj))


def _ptrs(obj) -> tuple[int, ...]:
    return (obj.data_ptr(),) if isinstance(obj, torch.Tensor) else tuple(map(_DATA_PTR, obj))


def _purge() -> None:
    """Drop entries whose tensors are gone, then the oldest ones, to stay under the bound."""
    for key in [k for k, e in _cache.items() if any(r() is None for r in e.k_refs + e.v_refs)]:
        del _cache[key]
    while len(_cache) >= _MAX_ENTRIES:
        del _cache[next(iter(_cache))]
