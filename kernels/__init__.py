"""KV-cache kernels for sgl-vtoken (installed as `sgl_vtoken.kernels`).

Each operation is one function that runs Triton on CUDA tensors and a pure-torch reference on CPU
tensors (`impl=` overrides). Importing this package needs only torch; Triton is imported on the
first Triton call (set TRITON_INTERPRET=1 before that to run Triton on CPU tensors).
"""

from .api import RopeShift, page_indices, repack_kv_
from .reference import page_indices_ref, repack_kv_ref_

__all__ = [
    "RopeShift",
    "page_indices",
    "page_indices_ref",
    "repack_kv_",
    "repack_kv_ref_",
]
