"""Counter-based hashing: reproducible per-token random numbers from (seed, request, step,
position).

A seeded policy's choice must be replayable by an external reference (for example a Hugging Face
oracle masking the same victims), on any device and batch shape. So there is no generator state:
each token's number is a pure function of integers, computed with 32-bit integer mixing in int64
arithmetic (every product stays below 2**63, so no overflow on CPU or GPU).
"""

from __future__ import annotations

import hashlib

import torch

_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # odd multiplier < 2**27: x * _MIX < 2**59 for 32-bit x


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = (((x >> 16) ^ x) * _MIX) & _M32
    x = (((x >> 16) ^ x) * _MIX) & _M32
    return (x >> 16) ^ x


def mix32_py(x: int) -> int:
    """Pure-Python twin of the tensor mixer (for references outside torch)."""
    x = (((x >> 16) ^ x) * _MIX) & _M32
    x = (((x >> 16) ^ x) * _MIX) & _M32
    return (x >> 16) ^ x


def hash_u32(positions: torch.Tensor, *keys: int | torch.Tensor) -> torch.Tensor:
    """int64 values in ``[0, 2**32)``: a hash of (keys..., position) per token, shaped like
    `positions`. A key is an int or an int64 tensor that broadcasts against `positions` (a
    batch of rows: ``[B, 1]`` request ids against ``[B, n]`` positions), same values either way."""
    h = positions.to(torch.int64) & _M32
    h = _mix32(h)
    for k in keys:
        h = _mix32(h ^ ((k.to(torch.int64) if torch.is_tensor(k) else int(k)) & _M32))
    return h


def hash_u01(positions: torch.Tensor, *keys: int | torch.Tensor) -> torch.Tensor:
    """float64 uniform in ``[0, 1)`` shaped like `positions`, reproducible from (keys...,
    position)."""
    return hash_u32(positions, *keys).to(torch.float64) / 2.0**32


def hash_u01_py(position: int, *keys: int) -> float:
    h = mix32_py(position & _M32)
    for k in keys:
        h = mix32_py(h ^ (int(k) & _M32))
    return h / 2.0**32


def stable_id(text: str) -> int:
    """A 32-bit request identity from a request id string, stable across processes and runs
    (unlike ``hash()``, which is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")
