"""An HF attention function that also reports the attention probabilities of the last queries.

The fast masked reference needs, per forward, the probabilities the server's score side-pass
computes (`patches/step/scores.py`): those of the last `num` queries over every key the layer saw,
summed over the query heads of each KV head. Eager attention materializes the whole
``[heads, q, k]`` matrix (18 GB for a 4K-token SmolLM2 prompt); this function runs SDPA for the
output and recomputes only the probed rows. It is registered with transformers under
:data:`NAME`; a model built with ``attn_implementation=NAME`` behaves as with ``"sdpa"`` until a
:class:`Probe` is active.
"""

from __future__ import annotations

import threading

import torch

NAME = "vtoken_probe"
_local = threading.local()


class Probe:
    """Collect ``[num, k, hkv]`` probabilities per layer while active (a context manager).

    ``blocks()`` returns ``[num, k, layers, hkv]`` float32, query j of the `num` last ones
    over the `k` keys of the forward (keys beyond its causal limit have probability 0).
    """

    def __init__(self, num: int) -> None:
        if num < 1:
            raise ValueError(f"Probe.num must be >= 1 (got {num})")
        self.num = num
        self.layers: dict[int, torch.Tensor] = {}

    def __enter__(self) -> Probe:
        _local.probe = self
        return self

    def __exit__(self, *exc) -> None:
        _local.probe = None

    def block(self) -> torch.Tensor:
        if not self.layers:
            raise RuntimeError(
                f"no layer ran through {NAME!r}: load the model with "
                f"sgl_vtoken_tools.quality.fastref.load_model"
            )
        return torch.stack([self.layers[i] for i in sorted(self.layers)], dim=2)


def probe_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """SDPA attention, plus the probed rows' probabilities when a :class:`Probe` is active.

    Shapes (HF convention): query ``[1, hq, q, d]``, key/value ``[1, hkv, k, d]`` (not repeated
    for GQA), attention_mask ``[1, 1, q, k]`` additive float, bool (True = attend) or None (causal).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    probe = getattr(_local, "probe", None)
    if probe is not None:
        probe.layers[module.layer_idx] = _probs(query, key, attention_mask, scaling, probe.num)
    return out


@torch.no_grad()
def _probs(query, key, mask, scaling, num) -> torch.Tensor:
    hq, q, d = query.shape[1:]
    hkv, k = key.shape[1], key.shape[2]
    num = min(num, q)
    g = hq // hkv
    scale = d**-0.5 if scaling is None else scaling
    qs = query[0, :, q - num :].float().view(hkv, g, num, d)  # [hkv, g, num, d]
    logits = torch.einsum("hgqd,hkd->hgqk", qs, key[0].float()) * scale  # [hkv, g, num, k]
    if mask is not None and mask.dtype == torch.bool:  # True = attend
        logits = logits.masked_fill(~mask[0, 0, q - num :], float("-inf"))
    elif mask is not None:
        logits = logits + mask[0, 0, q - num :].float()
    else:  # causal: query i of the q new ones sees keys < k - q + i + 1
        limit = torch.arange(k - num + 1, k + 1)
        logits = logits.masked_fill(torch.arange(k)[None, :] >= limit[:, None], float("-inf"))
    p = torch.softmax(logits, dim=-1).sum(dim=1)  # [hkv, num, k]
    return p.permute(1, 2, 0).contiguous()  # [num, k, hkv]


def register() -> str:
    """Register :func:`probe_attention` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, probe_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
