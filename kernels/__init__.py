"""KV-cache kernels for sgl-vtoken (installed as `sgl_vtoken.kernels`).

Each operation is one public function that runs Triton on CUDA tensors and a pure-torch reference
on CPU tensors (`impl=` overrides). Per operation (repack, page_index, attn_scores): `<op>_api.py`
holds the function (checks, dispatch), `<op>.py` its Triton kernel and launcher, and
`reference.py` the torch oracles of all three; `buffer_set.py` validates and caches a pool's
layer buffers, `_checks.py` holds the shared argument checks. Importing this package needs only
torch; Triton is imported on the first Triton call (set TRITON_INTERPRET=1 before that to run
Triton on CPU tensors).
"""

from .attn_scores_api import attn_scores_
from .buffer_set import clear_buffer_cache
from .page_index_api import page_indices
from .reference import attn_lse_ref, attn_scores_ref_, page_indices_ref, repack_kv_ref_
from .repack_api import RopeShift, repack_kv_

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
