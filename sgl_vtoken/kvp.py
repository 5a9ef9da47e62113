"""KVP scorer: one small MLP per (layer, KV head) that ranks cached tokens from their K, V and age.

Moschella, Manduchi, Sener, "Learning to Evict from Key-Value Cache", arXiv:2602.10238. A scorer
reads only what the KV cache holds, so it needs no attention pass at serving time::

    features of token j, per (layer l, KV head h), with t = the newest position of the row:
    | key k_j[l, h] (post-RoPE, D) | value v_j[l, h] (D) | log1p(t - pos_j) | pos_j / (t + 1) |
    standardized with the training set's mean / std, then  s = w2 . relu(W1 x + b1) + b2

Higher score = more future attention expected (keep). Both position features are relative to
the newest token, so they mean the same on a compacted row with holes as on a full one. The
checkpoint is a safetensors file whose metadata carries the model identity (model type, layers,
KV heads, head dim) and the feature spec; loading for another model raises ``ValueError`` naming
every mismatched field. Same weights, same bytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch

FORMAT = "sgl-vtoken-kvp/1"
FEATURES = ("key", "value", "log_age", "rel_pos")


@dataclass(frozen=True)
class ModelIdentity:
    """What a scorer is tied to: the K/V layout of one model architecture."""

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelIdentity.{name} must be an integer >= 1 (got {v!r})")

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelIdentity:
        """From a Hugging Face ``config.json`` dict (``head_dim`` or hidden / attention heads)."""
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return cls(
            model_type=str(config.get("model_type", "")),
            num_layers=config["num_hidden_layers"],
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=head_dim,
        )

    def check(self, served: ModelIdentity, what: str = "checkpoint") -> None:
        """Raise ValueError naming every field where `served` differs from this identity."""
        diff = [
            f"{k}: {what} {v!r}, model {getattr(served, k)!r}"
            for k, v in asdict(self).items()
            if getattr(served, k) != v
        ]
        if diff:
            raise ValueError(f"KVP {what} is for another model ({'; '.join(diff)})")


class KVPScorer(torch.nn.Module):
    """Per-(layer, KV head) MLPs, batched as ``G = num_layers * num_kv_heads`` weight groups.

    Args:
        identity: the model the scorer belongs to.
        hidden: hidden units per MLP.
        seed: seed of the initial weights (CPU generator: same seed, same weights).
    """

    feat_mean: torch.Tensor  # [G, F] buffers: feature normalization (from the training traces)
    feat_std: torch.Tensor

    def __init__(self, identity: ModelIdentity, hidden: int = 32, seed: int = 0) -> None:
        super().__init__()
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"KVPScorer.hidden must be an integer >= 1 (got {hidden!r})")
        self.identity, self.hidden = identity, hidden
        self.extra: dict = {}  # training provenance, from the checkpoint
        g_num, f_num = identity.num_layers * identity.num_kv_heads, 2 * identity.head_dim + 2
        gen = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(g_num, f_num, hidden, generator=gen) / f_num**0.5)
        self.b1 = torch.nn.Parameter(torch.zeros(g_num, hidden))
        self.w2 = torch.nn.Parameter(torch.randn(g_num, hidden, generator=gen) / hidden**0.5)
        self.b2 = torch.nn.Parameter(torch.zeros(g_num))
        self.register_buffer("feat_mean", torch.zeros(g_num, f_num))
        self.register_buffer("feat_std", torch.ones(g_num, f_num))

    def features(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Raw features ``[..., n, G, F]`` float32 of ``keys``/``values`` ``[..., n, L, H, D]`` and
        ``positions`` ``[..., n]`` (ascending; the newest token is ``positions[..., -1]``)."""
        idt = self.identity
        expect = (idt.num_layers, idt.num_kv_heads, idt.head_dim)
        for name, t in (("keys", keys), ("values", values)):
            if tuple(t.shape[-3:]) != expect:
                raise ValueError(
                    f"KVP scorer for {idt} got {name} of shape {tuple(t.shape)}; "
                    f"expected [n, {idt.num_layers}, {idt.num_kv_heads}, {idt.head_dim}]"
                )
        pos = positions.to(torch.float32)
        t = pos[..., -1:]
        age = torch.log1p((t - pos).clamp_min(0.0))
        rel = pos / (t + 1.0)
        g_num = idt.num_layers * idt.num_kv_heads
        k = keys.to(torch.float32).flatten(-3, -2)  # [..., n, G, D]
        v = values.to(torch.float32).flatten(-3, -2)
        extra = torch.stack([age, rel], dim=-1).unsqueeze(-2).expand(*k.shape[:-1], 2)
        assert k.shape[-2] == g_num, f"{k.shape=} {g_num=}"
        return torch.cat([k, v, extra], dim=-1)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Scores ``[..., n, G]`` of raw features ``[..., n, G, F]``."""
        x = (x - self.feat_mean) / self.feat_std
        h = torch.relu(torch.einsum("...gf,gfk->...gk", x, self.w1) + self.b1)
        return (h * self.w2).sum(-1) + self.b2

    def forward(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """``[n, L, H]`` float32 scores (higher = keep) of one row; newest = ``positions[-1]``."""
        s = self.forward_features(self.features(keys, values, positions))
        return s.view(*s.shape[:-1], self.identity.num_layers, self.identity.num_kv_heads)


def save_checkpoint(scorer: KVPScorer, path: str | Path, extra: dict | None = None) -> Path:
    """Write `scorer` as safetensors with its identity in the metadata; deterministic bytes."""
    from safetensors.torch import save_file

    tensors = {
        k: v.detach().to(torch.float32).contiguous().clone() for k, v in scorer.state_dict().items()
    }
    # One metadata key: safetensors writes a multi-key metadata map in no fixed order.
    meta = {
        "format": FORMAT,
        "identity": asdict(scorer.identity),
        "features": list(FEATURES),
        "hidden": scorer.hidden,
        "extra": extra or {},
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"kvp": json.dumps(meta, sort_keys=True)})
    return path


def load_checkpoint(path: str | Path, expect: ModelIdentity | None = None) -> KVPScorer:
    """The scorer stored at `path`, in eval mode; if `expect` is given, its identity must match.

    Raises:
        ValueError: missing, unreadable or malformed file (the message names ``checkpoint`` and
            the path), or a checkpoint for another model than `expect` (naming the fields).
    """
    from safetensors import safe_open

    where = f"KVP checkpoint {str(path)!r}"
    if not os.path.isfile(path):
        raise ValueError(f"{where}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("kvp", "{}")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated / foreign files
        raise ValueError(f"{where}: not a readable safetensors file ({e})") from None
    try:
        meta = json.loads(raw)
        assert isinstance(meta, dict)
    except (ValueError, AssertionError):
        raise ValueError(f"{where}: malformed metadata (not a JSON object)") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{where}: format {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        features = tuple(meta["features"])
        identity = ModelIdentity(**meta["identity"])
        scorer = KVPScorer(identity, hidden=int(meta["hidden"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: malformed metadata ({e})") from None
    if features != FEATURES:
        raise ValueError(
            f"{where}: features {list(features)}, this version computes {list(FEATURES)}"
        )
    try:
        scorer.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{where}: tensors do not match the metadata ({e})") from None
    scorer.extra = meta.get("extra", {})
    if expect is not None:
        identity.check(expect)
    return scorer.eval().requires_grad_(False)


def load_scorer(path: str | Path) -> KVPScorer:
    """:func:`load_checkpoint`, cached per process by (absolute path, size, mtime)."""
    p = os.path.abspath(path)
    try:
        st = os.stat(p)
        key = (st.st_size, st.st_mtime_ns)
    except OSError:
        key = None
    return _load_cached(p, key) if key else load_checkpoint(path)


@lru_cache(maxsize=8)
def _load_cached(path: str, key: tuple) -> KVPScorer:
    return load_checkpoint(path)
