"""KV-cache kernels for sgl-vtoken (installed as `sgl_vtoken.kernels`).

Each operation is one function that runs Triton on CUDA tensors and a pure-torch reference on CPU
tensors (`impl=` overrides). Importing this package needs only torch; Triton is imported on the
first Triton call (set TRITON_INTERPRET=1 before that to run Triton on CPU tensors).
"""

from .api import RopeShift, page_indices, repack_kv_
from .buffer_set import clear_buffer_cache
from .reference import attn_lse_ref, attn_scores_ref_, page_indices_ref, repack_kv_ref_
from .scores_api import attn_scores_

__all__ = [
    "RopeShift",
    "attn_lse_ref",
    "attn_scores_",
    "attn_scores_ref_",
    "clear_buffer_cache",
    "page_indices",
    "page_indices_ref",
    "repack_kv_",
    "repack_kv_ref_",
]
