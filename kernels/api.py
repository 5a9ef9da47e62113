"""Old path of `repack_kv_`, `RopeShift` (now `repack_api.py`) and `page_indices`
(`page_index_api.py`); import them from `sgl_vtoken.kernels`. Kept only while
tests/test_layout.py names this file."""

from .page_index_api import page_indices
from .repack_api import RopeShift, repack_kv_

__all__ = ["RopeShift", "page_indices", "repack_kv_"]
