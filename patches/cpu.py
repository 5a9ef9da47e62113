"""CPU serving: make SGLang's generic torch path work under `--device cpu`.

SGLang 0.5.23 treats a host as "cpu" only with `SGLANG_USE_CPU_ENGINE=1` (which needs a CPU build
of `sgl_kernel` that PyPI does not ship). Without it, `RotaryEmbedding.__init__` takes the
fallback-kernel branch and imports `vllm._custom_ops` (`rotary_embedding/base.py:122-141`). The
module global `_is_cpu` is read only by that guard (and nowhere else in the module), so setting
it makes RoPE use `forward_native`. Applied only when the scheduler is built with `device == "cpu"`:
GPU processes are never touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sglang.srt.layers.rotary_embedding.base as rope_base

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs


def before_scheduler_init(
    self: object, server_args: ServerArgs, *args: object, **kwargs: object
) -> None:
    """BEFORE `Scheduler.__init__`: the model (and its RoPE) is built inside it."""
    if getattr(server_args, "device", None) == "cpu":
        rope_base._is_cpu = True
